//! The communicator handle: calls, waiting with a timeout, abort, teardown.

use std::ffi::{c_char, CStr};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use cudarc::nccl::{result, sys};

use super::NcclCommunicator;
use crate::{Error, Result};

/// An NCCL communicator handle and whether it failed.
pub(super) struct RawComm {
    pub(super) comm: sys::ncclComm_t,
    pub(super) failed: Option<String>,
}

// SAFETY: an NCCL communicator is not bound to the thread that created it;
// NCCL only forbids concurrent calls on one communicator, which the `Mutex`
// around `RawComm` rules out. No `Sync` is claimed.
unsafe impl Send for RawComm {}

impl RawComm {
    /// Aborts the communicator (unblocking its kernels) and poisons it;
    /// does nothing to one already failed.
    pub(super) fn abort(&mut self, cause: String) {
        if self.failed.is_some() {
            return;
        }
        // SAFETY: `self.comm` is live (`failed` is None) and, with `failed`
        // set below, never used again (Drop skips failed communicators).
        let _ = unsafe { result::comm_abort(self.comm) };
        self.failed = Some(cause);
    }
}

/// The asynchronous error NCCL reports for `comm`, if any.
pub(super) fn async_error(comm: sys::ncclComm_t) -> Option<String> {
    let mut state = sys::ncclResult_t::ncclSuccess;
    // SAFETY: `comm` is a live communicator (callers hold its lock and
    // checked it has not failed); `state` is a valid out-pointer.
    let r = unsafe { sys::ncclCommGetAsyncError(comm, &mut state) };
    [r, state]
        .into_iter()
        .find(|s| {
            !matches!(
                s,
                sys::ncclResult_t::ncclSuccess | sys::ncclResult_t::ncclInProgress
            )
        })
        .map(|code| nccl_message(&result::NcclError(code), comm))
}

/// NCCL's description of `e`, plus the communicator's last error detail.
pub(super) fn nccl_message(e: &result::NcclError, comm: sys::ncclComm_t) -> String {
    // SAFETY: both return pointers to static or communicator-owned C
    // strings (never freed by us); a null pointer is checked.
    let text = |p: *const c_char| unsafe {
        if p.is_null() {
            String::new()
        } else {
            CStr::from_ptr(p).to_string_lossy().into_owned()
        }
    };
    // SAFETY: any result code is accepted; `comm` may be null.
    let (what, last) = unsafe { (sys::ncclGetErrorString(e.0), sys::ncclGetLastError(comm)) };
    let (what, last) = (text(what), text(last));
    if last.is_empty() {
        format!("{:?}: {what}", e.0)
    } else {
        format!("{:?}: {what} ({last})", e.0)
    }
}

impl NcclCommunicator {
    fn lock(&self, op: &'static str) -> Result<MutexGuard<'_, RawComm>> {
        let guard = self.comm.lock().unwrap_or_else(|p| p.into_inner());
        match &guard.failed {
            Some(cause) => Err(Error::Poisoned {
                op,
                cause: cause.clone(),
            }),
            None => Ok(guard),
        }
    }

    pub(super) fn nccl_err(&self, op: &'static str, call: &'static str, message: String) -> Error {
        Error::Nccl {
            op,
            rank: self.rank,
            world: self.world,
            call,
            message,
        }
    }

    /// Enqueues one NCCL call on the communicator's stream via
    /// `f(comm, stream)`; then waits for it when `wait`, or hands it to the
    /// watchdog (see the module docs on timeouts).
    pub(super) fn run(
        &self,
        op: &'static str,
        call: &'static str,
        wait: bool,
        f: impl FnOnce(
            sys::ncclComm_t,
            sys::cudaStream_t,
        ) -> std::result::Result<result::NcclStatus, result::NcclError>,
    ) -> Result<()> {
        let mut raw = self.lock(op)?;
        self.stream
            .context()
            .bind_to_thread()
            .map_err(|e| self.nccl_err(op, "cuCtxSetCurrent", format!("{e:?}")))?;
        if let Err(e) = f(raw.comm, self.stream.cu_stream() as sys::cudaStream_t) {
            let message = nccl_message(&e, raw.comm);
            raw.failed = Some(format!("{call}: {message}"));
            return Err(self.nccl_err(op, call, message));
        }
        match (&self.watchdog, wait) {
            (Some(dog), false) => {
                let done = self
                    .stream
                    .record_event(None)
                    .map_err(|e| self.nccl_err(op, "cuEventRecord", format!("{e:?}")))?;
                dog.track(op, done);
                Ok(())
            }
            _ => self.wait(op, &mut raw),
        }
    }

    /// Polls until the stream's work so far is done, NCCL reports an error,
    /// or the timeout passes (then aborts the communicator).
    fn wait(&self, op: &'static str, raw: &mut RawComm) -> Result<()> {
        let event = self
            .stream
            .record_event(None)
            .map_err(|e| self.nccl_err(op, "cuEventRecord", format!("{e:?}")))?;
        let start = Instant::now();
        let mut pause = Duration::from_micros(20);
        loop {
            match event.try_is_complete() {
                Ok(true) => return Ok(()),
                Ok(false) => {}
                Err(e) => return Err(self.nccl_err(op, "cuEventQuery", format!("{e:?}"))),
            }
            if let Some(message) = async_error(raw.comm) {
                raw.abort(format!("ncclCommGetAsyncError: {message}"));
                return Err(self.nccl_err(op, "ncclCommGetAsyncError", message));
            }
            let waited = start.elapsed();
            if waited >= self.config.timeout {
                raw.abort(format!("{op} timed out after {waited:?}"));
                return Err(Error::NcclTimeout {
                    op,
                    rank: self.rank,
                    world: self.world,
                    waited,
                });
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(5));
        }
    }
}

impl Drop for NcclCommunicator {
    /// Safe on any thread: the communicator's stream is its own (not a
    /// per-thread stream), so waiting here waits for exactly its work; the
    /// buffers it used carry its events, so their frees wait too.
    fn drop(&mut self) {
        // The watchdog first: it must not abort behind our back below.
        drop(self.watchdog.take());
        let raw: &Mutex<RawComm> = &self.comm;
        let mut raw = raw.lock().unwrap_or_else(|p| p.into_inner());
        if raw.failed.is_some() {
            return;
        }
        // Let enqueued collectives finish (bounded by the timeout, which
        // aborts) before tearing down; abort rather than destroy, as cudarc
        // does, so that a vanished peer cannot block the exit.
        let _ = self.wait("drop", &mut raw);
        raw.abort("dropped".into());
    }
}
