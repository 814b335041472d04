//! The watchdog of non-blocking NCCL calls: a thread that bounds every
//! enqueued collective by the timeout, as PyTorch's NCCL watchdog does.
//!
//! A call that does not wait records an event on the communicator's stream
//! after its collective and hands it here. The thread polls the oldest
//! event (they complete in stream order) and `ncclCommGetAsyncError`; when
//! one is older than the timeout, or NCCL reports an error, it aborts the
//! communicator. Aborting makes the stuck NCCL kernels return, so nothing
//! that waits on the stream (a candle op reading a reduced gradient, a host
//! copy) hangs, and the communicator is poisoned: the next call on this
//! rank fails naming the collective that timed out.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use cudarc::driver::{CudaContext, CudaEvent};

use super::comm::{async_error, RawComm};

/// One enqueued collective that nobody waits for.
struct Pending {
    op: &'static str,
    done: CudaEvent,
    since: Instant,
}

/// The queue of pending collectives and the thread that watches it.
pub(super) struct Watchdog {
    pending: Arc<Mutex<VecDeque<Pending>>>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Watchdog {
    /// Starts watching the collectives of `comm` (on a context of `ctx`).
    pub(super) fn start(
        comm: Arc<Mutex<RawComm>>,
        ctx: Arc<CudaContext>,
        timeout: Duration,
    ) -> Self {
        let pending: Arc<Mutex<VecDeque<Pending>>> = Arc::default();
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let (pending, stop) = (pending.clone(), stop.clone());
            std::thread::Builder::new()
                .name("accel-nccl-watchdog".into())
                .spawn(move || watch(&comm, &ctx, &pending, &stop, timeout))
                .ok()
        };
        Self {
            pending,
            stop,
            thread,
        }
    }

    /// Watches the collective `op` whose completion `done` records.
    pub(super) fn track(&self, op: &'static str, done: CudaEvent) {
        self.pending
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push_back(Pending {
                op,
                done,
                since: Instant::now(),
            });
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The thread: polls until stopped.
fn watch(
    comm: &Mutex<RawComm>,
    ctx: &CudaContext,
    pending: &Mutex<VecDeque<Pending>>,
    stop: &AtomicBool,
    timeout: Duration,
) {
    // Event queries need the context current on this thread.
    let _ = ctx.bind_to_thread();
    let mut pause = Duration::from_micros(50);
    while !stop.load(Ordering::SeqCst) {
        let verdict = check(pending, timeout);
        let busy = !pending.lock().unwrap_or_else(|p| p.into_inner()).is_empty();
        let cause = match verdict {
            Some(cause) => Some(cause),
            None if busy => {
                let raw = comm.lock().unwrap_or_else(|p| p.into_inner());
                match raw.failed {
                    Some(_) => None,
                    None => async_error(raw.comm).map(|m| format!("ncclCommGetAsyncError: {m}")),
                }
            }
            None => None,
        };
        if let Some(cause) = cause {
            let mut raw = comm.lock().unwrap_or_else(|p| p.into_inner());
            raw.abort(cause);
            pending.lock().unwrap_or_else(|p| p.into_inner()).clear();
        }
        pause = if busy {
            Duration::from_micros(50)
        } else {
            (pause * 2).min(Duration::from_millis(5))
        };
        std::thread::sleep(pause);
    }
}

/// Drops the finished collectives at the front; the cause of failure when
/// the oldest unfinished one has run past the timeout.
fn check(pending: &Mutex<VecDeque<Pending>>, timeout: Duration) -> Option<String> {
    let mut q = pending.lock().unwrap_or_else(|p| p.into_inner());
    while let Some(front) = q.front() {
        match front.done.try_is_complete() {
            Ok(true) => {
                q.pop_front();
            }
            Ok(false) => {
                let waited = front.since.elapsed();
                return (waited >= timeout).then(|| {
                    format!(
                        "{} timed out after {waited:?} (watchdog; a peer never joined it)",
                        front.op
                    )
                });
            }
            Err(e) => return Some(format!("{}: cuEventQuery: {e:?}", front.op)),
        }
    }
    None
}
