//! The communicator handle: calls, waiting with a timeout, abort, teardown.

use std::ffi::{c_char, CStr};
use std::sync::MutexGuard;
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

    /// Enqueues one NCCL call on candle's stream via `f(comm, stream)`, then
    /// waits for it when `wait` (see the module docs on timeouts).
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
        if wait {
            self.wait(op, &mut raw)?;
        }
        Ok(())
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
            let mut state = sys::ncclResult_t::ncclSuccess;
            // SAFETY: `raw.comm` is a live communicator (not yet aborted:
            // `failed` is None under the lock); `state` is a valid out-pointer.
            let r = unsafe { sys::ncclCommGetAsyncError(raw.comm, &mut state) };
            let bad = [r, state].into_iter().find(|s| {
                !matches!(
                    s,
                    sys::ncclResult_t::ncclSuccess | sys::ncclResult_t::ncclInProgress
                )
            });
            if let Some(code) = bad {
                let message = nccl_message(&result::NcclError(code), raw.comm);
                self.abort(raw, format!("ncclCommGetAsyncError: {message}"));
                return Err(self.nccl_err(op, "ncclCommGetAsyncError", message));
            }
            let waited = start.elapsed();
            if waited >= self.config.timeout {
                self.abort(raw, format!("{op} timed out after {waited:?}"));
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

    /// Aborts the communicator (unblocking its kernels) and poisons it.
    fn abort(&self, raw: &mut RawComm, cause: String) {
        // SAFETY: `raw.comm` is live and, with `failed` set below, never
        // used again (Drop skips failed communicators).
        let _ = unsafe { result::comm_abort(raw.comm) };
        raw.failed = Some(cause);
    }
}

impl Drop for NcclCommunicator {
    fn drop(&mut self) {
        let (comm, failed) = {
            let raw = self.comm.get_mut().unwrap_or_else(|p| p.into_inner());
            (raw.comm, raw.failed.is_some())
        };
        if failed {
            return;
        }
        // Let enqueued collectives finish (bounded by the timeout, which
        // aborts) before tearing down; abort rather than destroy, as cudarc
        // does, so that a vanished peer cannot block the exit.
        let mut raw = RawComm { comm, failed: None };
        let _ = self.wait("drop", &mut raw);
        if raw.failed.is_none() {
            // SAFETY: the communicator is live and unused from here on.
            let _ = unsafe { result::comm_abort(raw.comm) };
        }
    }
}
