//! Collectives between GPU processes through NCCL (PyTorch's `nccl` backend).
//!
//! One [`NcclCommunicator`] per process owns one NCCL communicator on one
//! CUDA device. Rank 0 creates the NCCL unique id and publishes it through
//! the [`TcpStore`]; every rank then waits at a store barrier (bounded by
//! the timeout) before `ncclCommInitRank`, which itself has no timeout and
//! would otherwise hang on a missing peer.
//!
//! # Tensors and buffers
//!
//! Collectives on CUDA tensors run in place on the tensor's storage, on
//! candle's stream of the device, so they are ordered with every candle op
//! without extra synchronisation. Tensors must be contiguous
//! ([`Error::RequiresContiguous`] names the op) and on the communicator's
//! device. The host-buffer methods of [`Communicator`] (and with them
//! `barrier`, the byte and object helpers, and CPU tensors) are staged
//! through device memory: copy in, collective, copy out.
//!
//! `Mean` uses NCCL's `ncclAvg` (sum, then divide, in the element type).
//! `Max`/`Min` follow NCCL for NaN, which may differ from the TCP backend
//! (where a NaN loses against a number).
//!
//! # Timeouts
//!
//! NCCL calls only enqueue work; a missing peer shows as a kernel that never
//! finishes. With [`NcclConfig::blocking_wait`] (the default) every call
//! waits for its work by polling a CUDA event and `ncclCommGetAsyncError`;
//! past the timeout it calls `ncclCommAbort` and returns
//! [`Error::NcclTimeout`] naming the op, and later calls return
//! [`Error::Poisoned`]. Without it, tensor collectives return once enqueued
//! (overlapping with compute, like PyTorch's default) and a failure surfaces
//! as an error of a later call; only host-buffer calls, which must wait
//! anyway, are bounded then.
//!
//! # Threads
//!
//! An NCCL communicator may be used from any thread but not from two at
//! once. The handle is therefore `Send` (see `RawComm`) and lives in a
//! `Mutex`, which makes the communicator `Sync` without any claim beyond
//! that; the collectives of one process are serialised.
#![allow(unsafe_code)]

use std::ffi::{c_char, CStr};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use candle_core::backend::BackendStorage;
use candle_core::cuda::{CudaDevice, CudaStorageSlice};
use candle_core::{DType, Device, Storage, Tensor};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DeviceRepr, SyncOnDrop, ValidAsZeroBits};
use cudarc::nccl::{result, sys};

use crate::buffer::{with_buffer, with_buffer_pair, Buffer, BufferMut};
use crate::communicator::{check_pair, check_rank, check_reduce_buffer, Longer};
use crate::process::DEFAULT_TIMEOUT;
use crate::{tensor, Communicator, Error, ReduceOp, Result, TcpStore};

/// Options of an [`NcclCommunicator`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NcclConfig {
    /// How long a call may wait for its collective (and init for the peers).
    pub timeout: Duration,
    /// Wait for every collective to finish, so that the timeout applies to
    /// tensor collectives too (see the module docs).
    pub blocking_wait: bool,
}

impl Default for NcclConfig {
    fn default() -> Self {
        Self {
            timeout: DEFAULT_TIMEOUT,
            blocking_wait: true,
        }
    }
}

impl NcclConfig {
    /// Sets the timeout.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Sets whether calls wait for their collective.
    pub fn with_blocking_wait(mut self, blocking_wait: bool) -> Self {
        self.blocking_wait = blocking_wait;
        self
    }
}

/// An NCCL communicator handle and whether it failed.
struct RawComm {
    comm: sys::ncclComm_t,
    failed: Option<String>,
}

// SAFETY: an NCCL communicator is not bound to the thread that created it;
// NCCL only forbids concurrent calls on one communicator, which the `Mutex`
// around `RawComm` rules out. No `Sync` is claimed.
unsafe impl Send for RawComm {}

/// Communicators created by this process so far: all ranks create theirs
/// in the same order, so the count names the store keys of the next one.
static GENERATION: AtomicUsize = AtomicUsize::new(0);

/// A [`Communicator`] over NCCL on one CUDA device.
pub struct NcclCommunicator {
    rank: usize,
    world: usize,
    device: CudaDevice,
    stream: Arc<CudaStream>,
    config: NcclConfig,
    comm: Mutex<RawComm>,
}

impl std::fmt::Debug for NcclCommunicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclCommunicator")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .field("device", &self.device)
            .finish()
    }
}

/// NCCL's description of `e`, plus the communicator's last error detail.
fn nccl_message(e: &result::NcclError, comm: sys::ncclComm_t) -> String {
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

/// The CUDA device NCCL uses for `local_rank` under [`crate::Backend::Auto`]:
/// `cuda:local_rank` when that device exists.
pub(crate) fn nccl_device(local_rank: usize) -> Option<Device> {
    let count = cudarc::driver::CudaContext::device_count().ok()?;
    if local_rank >= count.max(0) as usize {
        return None;
    }
    Device::new_cuda(local_rank).ok()
}

/// The NCCL element type of a dtype.
fn nccl_dtype(op: &'static str, dtype: DType) -> Result<sys::ncclDataType_t> {
    use sys::ncclDataType_t::*;
    Ok(match dtype {
        DType::F32 => ncclFloat32,
        DType::F64 => ncclFloat64,
        DType::BF16 => ncclBfloat16,
        DType::F16 => ncclFloat16,
        DType::U32 => ncclUint32,
        DType::I64 => ncclInt64,
        DType::U8 => ncclUint8,
        dtype => return Err(Error::UnsupportedDType { op, dtype }),
    })
}

/// The NCCL reduction of a [`ReduceOp`].
fn nccl_op(op: ReduceOp) -> sys::ncclRedOp_t {
    use sys::ncclRedOp_t::*;
    match op {
        ReduceOp::Sum => ncclSum,
        ReduceOp::Mean => ncclAvg,
        ReduceOp::Max => ncclMax,
        ReduceOp::Min => ncclMin,
        ReduceOp::Product => ncclProd,
    }
}

/// The device address of a CUDA storage's allocation, and candle's event
/// guard to drop once the work using it is enqueued.
fn storage_ptr<'a>(
    op: &'static str,
    storage: &'a Storage,
    stream: &'a CudaStream,
) -> Result<(u64, SyncOnDrop<'a>)> {
    let Storage::Cuda(cs) = storage else {
        return Err(Error::DeviceMismatch {
            op,
            expected: "a CUDA device".into(),
            got: "the CPU".into(),
        });
    };
    Ok(match &cs.slice {
        CudaStorageSlice::F32(s) => s.device_ptr(stream),
        CudaStorageSlice::F64(s) => s.device_ptr(stream),
        CudaStorageSlice::BF16(s) => s.device_ptr(stream),
        CudaStorageSlice::F16(s) => s.device_ptr(stream),
        CudaStorageSlice::U32(s) => s.device_ptr(stream),
        CudaStorageSlice::I64(s) => s.device_ptr(stream),
        CudaStorageSlice::U8(s) => s.device_ptr(stream),
        _ => {
            return Err(Error::UnsupportedDType {
                op,
                dtype: cs.dtype(),
            })
        }
    })
}

impl NcclCommunicator {
    /// Joins the NCCL communicator of `world` ranks on `device` (a CUDA
    /// device, usually `cuda:LOCAL_RANK`). A world of one needs no store;
    /// larger worlds exchange the NCCL id through `store`.
    ///
    /// # Errors
    /// Store errors and timeouts while waiting for the peers,
    /// [`Error::Nccl`] when NCCL refuses, [`Error::DeviceMismatch`] for a
    /// non-CUDA device.
    pub fn connect(
        store: Option<&TcpStore>,
        rank: usize,
        world: usize,
        device: &Device,
        config: NcclConfig,
    ) -> Result<Self> {
        const OP: &str = "nccl_init";
        check_rank(OP, rank, world)?;
        let Device::Cuda(dev) = device else {
            return Err(Error::DeviceMismatch {
                op: OP,
                expected: "a CUDA device".into(),
                got: format!("{:?}", device.location()),
            });
        };
        let fail = |call, message| Error::Nccl {
            op: OP,
            rank,
            world,
            call,
            message,
        };
        let generation = GENERATION.fetch_add(1, Ordering::SeqCst);
        let key = format!("accel/nccl/{generation}/id");
        let store = match store {
            Some(s) => Some(s),
            None if world == 1 => None,
            None => return Err(fail("rendezvous", "a world above 1 needs the store".into())),
        };
        let id = if rank == 0 {
            let id = result::get_uniqueid()
                .map_err(|e| fail("ncclGetUniqueId", nccl_message(&e, std::ptr::null_mut())))?;
            if let Some(store) = store {
                let bytes: Vec<u8> = id.internal.iter().map(|&c| c as u8).collect();
                store.set(&key, &bytes)?;
            }
            id
        } else {
            let store = store.expect("checked above");
            store.wait(&[&key])?;
            let bytes = store.get(&key)?;
            if bytes.len() != 128 {
                return Err(fail("rendezvous", format!("id of {} bytes", bytes.len())));
            }
            let mut internal = [0 as c_char; 128];
            for (d, s) in internal.iter_mut().zip(&bytes) {
                *d = *s as c_char;
            }
            sys::ncclUniqueId { internal }
        };
        if let Some(store) = store {
            // Everyone present and holding the id: only then is the
            // untimed `ncclCommInitRank` safe to enter.
            store.barrier(&format!("accel/nccl/{generation}/init"), rank, world)?;
        }
        let stream = dev.cuda_stream();
        stream
            .context()
            .bind_to_thread()
            .map_err(|e| fail("cuCtxSetCurrent", format!("{e:?}")))?;
        let mut comm: sys::ncclComm_t = std::ptr::null_mut();
        // SAFETY: `comm` is a valid out-pointer; rank and world were checked
        // (`rank < world`, both small); the device's context is current, so
        // NCCL binds the communicator to that device.
        unsafe { result::comm_init_rank(&mut comm, world as i32, id, rank as i32) }
            .map_err(|e| fail("ncclCommInitRank", nccl_message(&e, std::ptr::null_mut())))?;
        Ok(Self {
            rank,
            world,
            device: dev.clone(),
            stream,
            config,
            comm: Mutex::new(RawComm { comm, failed: None }),
        })
    }

    /// The device the communicator runs on.
    pub fn device(&self) -> Device {
        Device::Cuda(self.device.clone())
    }

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

    fn nccl_err(&self, op: &'static str, call: &'static str, message: String) -> Error {
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
    fn run(
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

    /// Checks a tensor for an in-place device collective.
    fn check_tensor(&self, op: &'static str, t: &Tensor, reduce: Option<ReduceOp>) -> Result<()> {
        if !t.device().same_device(&self.device()) {
            return Err(Error::DeviceMismatch {
                op,
                expected: format!("{:?}", self.device().location()),
                got: format!("{:?}", t.device().location()),
            });
        }
        if !t.is_contiguous() {
            return Err(Error::RequiresContiguous { op });
        }
        nccl_dtype(op, t.dtype())?;
        if reduce == Some(ReduceOp::Mean) && !t.dtype().is_float() {
            return Err(Error::UnsupportedReduce {
                op,
                reduce: ReduceOp::Mean,
                dtype: t.dtype(),
            });
        }
        Ok(())
    }

    /// Runs a collective reading `input` and writing `output` (CUDA tensors,
    /// checked), as `f(send, recv, comm, stream)` on their first elements.
    fn tensor_call(
        &self,
        op: &'static str,
        call: &'static str,
        input: &Tensor,
        output: &Tensor,
        f: impl FnOnce(
            u64,
            u64,
            sys::ncclComm_t,
            sys::cudaStream_t,
        ) -> std::result::Result<result::NcclStatus, result::NcclError>,
    ) -> Result<()> {
        let addr = |t: &Tensor, base: u64| {
            let start = t.layout().start_offset() * t.dtype().size_in_bytes();
            base + start as u64
        };
        let (gi, _) = input.storage_and_layout();
        let (pi, _ri) = storage_ptr(op, &gi, &self.stream)?;
        let send = addr(input, pi);
        if input.id() == output.id() {
            return self.run(op, call, self.config.blocking_wait, |c, s| {
                f(send, send, c, s)
            });
        }
        let (go, _) = output.storage_and_layout();
        let (po, _ro) = storage_ptr(op, &go, &self.stream)?;
        let recv = addr(output, po);
        self.run(op, call, self.config.blocking_wait, |c, s| {
            f(send, recv, c, s)
        })
    }

    /// Copies `host` to the device, runs `f(ptr, comm, stream)` on the copy,
    /// waits, and copies the result back when `back`.
    fn staged<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        op: &'static str,
        call: &'static str,
        host: &mut [T],
        back: bool,
        f: impl FnOnce(
            u64,
            sys::ncclComm_t,
            sys::cudaStream_t,
        ) -> std::result::Result<result::NcclStatus, result::NcclError>,
    ) -> Result<()> {
        let copy_err =
            |e: cudarc::driver::DriverError| self.nccl_err(op, "memcpy", format!("{e:?}"));
        let dev: CudaSlice<T> = self.stream.clone_htod(&*host).map_err(copy_err)?;
        {
            let (ptr, _rec) = dev.device_ptr(&self.stream);
            self.run(op, call, true, |c, s| f(ptr, c, s))?;
        }
        if back {
            self.stream.memcpy_dtoh(&dev, host).map_err(copy_err)?;
            self.stream.synchronize().map_err(copy_err)?;
        }
        Ok(())
    }

    /// As [`staged`](Self::staged) with a separate device output of
    /// `out.len()` elements: `f(send, recv, comm, stream)`.
    fn staged_pair<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        op: &'static str,
        call: &'static str,
        input: &[T],
        out: &mut [T],
        f: impl FnOnce(
            u64,
            u64,
            sys::ncclComm_t,
            sys::cudaStream_t,
        ) -> std::result::Result<result::NcclStatus, result::NcclError>,
    ) -> Result<()> {
        let copy_err =
            |e: cudarc::driver::DriverError| self.nccl_err(op, "memcpy", format!("{e:?}"));
        let src: CudaSlice<T> = self.stream.clone_htod(input).map_err(copy_err)?;
        let dst: CudaSlice<T> = self.stream.alloc_zeros(out.len()).map_err(copy_err)?;
        {
            let (s_ptr, _rs) = src.device_ptr(&self.stream);
            let (d_ptr, _rd) = dst.device_ptr(&self.stream);
            self.run(op, call, true, |c, s| f(s_ptr, d_ptr, c, s))?;
        }
        self.stream.memcpy_dtoh(&dst, out).map_err(copy_err)?;
        self.stream.synchronize().map_err(copy_err)
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

/// Type-erased device pointer, as NCCL takes it.
fn vp(p: u64) -> *mut std::ffi::c_void {
    p as usize as *mut std::ffi::c_void
}

// The NCCL calls below share one safety argument, referred to as "the NCCL
// call note": the pointers come from `storage_ptr` / `staged*` and point to
// device allocations that stay alive and locked (storage read guards, or
// owned `CudaSlice`s) until the call is enqueued and, for staged buffers,
// completed; the counts are the element counts of those allocations
// (checked pairwise by `check_pair`, or by construction of the output);
// the NCCL dtype is the element type's; `comm` and `stream` are the live
// communicator (`run` holds its lock) and candle's stream of its device.

impl Communicator for NcclCommunicator {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn all_reduce(&self, buf: BufferMut<'_>, op: ReduceOp) -> Result<()> {
        const OP: &str = "all_reduce";
        check_reduce_buffer(OP, &buf.as_buffer(), op)?;
        let dt = nccl_dtype(OP, buf.as_buffer().dtype())?;
        with_buffer!(BufferMut, buf, b => {
            let n = b.len();
            self.staged(OP, "ncclAllReduce", b, true, |p, c, s| {
                // SAFETY: the NCCL call note.
                unsafe { result::all_reduce(vp(p), vp(p), n, dt, nccl_op(op), c, s) }
            })
        })
    }

    fn all_gather(&self, input: Buffer<'_>, output: BufferMut<'_>) -> Result<()> {
        const OP: &str = "all_gather";
        check_pair(OP, &input, &output, self.world, Longer::Output)?;
        let dt = nccl_dtype(OP, input.dtype())?;
        let n = input.len();
        let (i_dtype, o_dtype) = (input.dtype(), output.as_buffer().dtype());
        with_buffer_pair!(input, output, (i, o) => {
            self.staged_pair(OP, "ncclAllGather", i, o, |src, dst, c, s| {
                // SAFETY: the NCCL call note.
                unsafe { result::all_gather(vp(src), vp(dst), n, dt, c, s) }
            })
        }, Err(Error::DTypeMismatch { op: OP, input: i_dtype, output: o_dtype }))
    }

    fn reduce_scatter(&self, input: Buffer<'_>, output: BufferMut<'_>, op: ReduceOp) -> Result<()> {
        const OP: &str = "reduce_scatter";
        check_pair(OP, &input, &output, self.world, Longer::Input)?;
        check_reduce_buffer(OP, &input, op)?;
        let dt = nccl_dtype(OP, input.dtype())?;
        let n = output.as_buffer().len();
        let (i_dtype, o_dtype) = (input.dtype(), output.as_buffer().dtype());
        with_buffer_pair!(input, output, (i, o) => {
            self.staged_pair(OP, "ncclReduceScatter", i, o, |src, dst, c, s| {
                // SAFETY: the NCCL call note.
                unsafe { result::reduce_scatter(vp(src), vp(dst), n, dt, nccl_op(op), c, s) }
            })
        }, Err(Error::DTypeMismatch { op: OP, input: i_dtype, output: o_dtype }))
    }

    fn broadcast(&self, buf: BufferMut<'_>, root: usize) -> Result<()> {
        const OP: &str = "broadcast";
        check_rank(OP, root, self.world)?;
        let dt = nccl_dtype(OP, buf.as_buffer().dtype())?;
        with_buffer!(BufferMut, buf, b => {
            let n = b.len();
            self.staged(OP, "ncclBroadcast", b, true, |p, c, s| {
                // SAFETY: the NCCL call note.
                unsafe { result::broadcast(vp(p), vp(p), n, dt, root as i32, c, s) }
            })
        })
    }

    fn send(&self, buf: Buffer<'_>, dst: usize) -> Result<()> {
        const OP: &str = "send";
        check_rank(OP, dst, self.world)?;
        let dt = nccl_dtype(OP, buf.dtype())?;
        with_buffer!(Buffer, buf, b => {
            let n = b.len();
            let mut copy = b.to_vec();
            self.staged(OP, "ncclSend", &mut copy, false, |p, c, s| {
                // SAFETY: the NCCL call note.
                unsafe { result::send(vp(p), n, dt, dst as i32, c, s) }
            })
        })
    }

    fn recv(&self, buf: BufferMut<'_>, src: usize) -> Result<()> {
        const OP: &str = "recv";
        check_rank(OP, src, self.world)?;
        let dt = nccl_dtype(OP, buf.as_buffer().dtype())?;
        with_buffer!(BufferMut, buf, b => {
            let n = b.len();
            self.staged(OP, "ncclRecv", b, true, |p, c, s| {
                // SAFETY: the NCCL call note.
                unsafe { result::recv(vp(p), n, dt, src as i32, c, s) }
            })
        })
    }

    fn all_reduce_tensor(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor> {
        const OP: &str = "all_reduce_tensor";
        if t.device().is_cpu() {
            return tensor::all_reduce(self, t, op);
        }
        self.check_tensor(OP, t, Some(op))?;
        let out = Tensor::zeros(t.shape(), t.dtype(), t.device())?;
        let (n, dt) = (t.elem_count(), nccl_dtype(OP, t.dtype())?);
        self.tensor_call(OP, "ncclAllReduce", t, &out, |src, dst, c, s| {
            // SAFETY: the NCCL call note.
            unsafe { result::all_reduce(vp(src), vp(dst), n, dt, nccl_op(op), c, s) }
        })?;
        Ok(out)
    }

    fn all_reduce_tensor_inplace(&self, t: &Tensor, op: ReduceOp) -> Result<()> {
        const OP: &str = "all_reduce_tensor_inplace";
        if t.device().is_cpu() {
            return tensor::all_reduce_inplace(self, t, op);
        }
        self.check_tensor(OP, t, Some(op))?;
        let (n, dt) = (t.elem_count(), nccl_dtype(OP, t.dtype())?);
        self.tensor_call(OP, "ncclAllReduce", t, t, |src, dst, c, s| {
            // SAFETY: the NCCL call note; in place is allowed by NCCL.
            unsafe { result::all_reduce(vp(src), vp(dst), n, dt, nccl_op(op), c, s) }
        })
    }

    fn broadcast_tensor(&self, t: &Tensor, root: usize) -> Result<Tensor> {
        const OP: &str = "broadcast_tensor";
        if t.device().is_cpu() {
            return tensor::broadcast(self, t, root);
        }
        check_rank(OP, root, self.world)?;
        self.check_tensor(OP, t, None)?;
        let out = Tensor::zeros(t.shape(), t.dtype(), t.device())?;
        let (n, dt) = (t.elem_count(), nccl_dtype(OP, t.dtype())?);
        self.tensor_call(OP, "ncclBroadcast", t, &out, |src, dst, c, s| {
            // SAFETY: the NCCL call note.
            unsafe { result::broadcast(vp(src), vp(dst), n, dt, root as i32, c, s) }
        })?;
        Ok(out)
    }

    fn all_gather_tensor(&self, t: &Tensor) -> Result<Tensor> {
        const OP: &str = "all_gather_tensor";
        if t.device().is_cpu() {
            return tensor::all_gather(self, t);
        }
        self.check_tensor(OP, t, None)?;
        let mut dims = t.dims().to_vec();
        match dims.first_mut() {
            Some(d0) => *d0 *= self.world,
            None => dims.push(self.world),
        }
        let out = Tensor::zeros(dims, t.dtype(), t.device())?;
        let (n, dt) = (t.elem_count(), nccl_dtype(OP, t.dtype())?);
        self.tensor_call(OP, "ncclAllGather", t, &out, |src, dst, c, s| {
            // SAFETY: the NCCL call note; `out` holds `n * world` elements.
            unsafe { result::all_gather(vp(src), vp(dst), n, dt, c, s) }
        })?;
        Ok(out)
    }

    fn reduce_scatter_tensor(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor> {
        const OP: &str = "reduce_scatter_tensor";
        if t.device().is_cpu() {
            return tensor::reduce_scatter(self, t, op);
        }
        self.check_tensor(OP, t, Some(op))?;
        let mut dims = t.dims().to_vec();
        match dims.first_mut() {
            Some(d0) if *d0 % self.world == 0 => *d0 /= self.world,
            _ => {
                return Err(Error::BadShape {
                    op: OP,
                    reason: format!(
                        "dimension 0 of shape {:?} must divide by the world size {}",
                        t.dims(),
                        self.world
                    ),
                })
            }
        }
        let out = Tensor::zeros(dims, t.dtype(), t.device())?;
        let (n, dt) = (out.elem_count(), nccl_dtype(OP, t.dtype())?);
        self.tensor_call(OP, "ncclReduceScatter", t, &out, |src, dst, c, s| {
            // SAFETY: the NCCL call note; `t` holds `n * world` elements.
            unsafe { result::reduce_scatter(vp(src), vp(dst), n, dt, nccl_op(op), c, s) }
        })?;
        Ok(out)
    }
}
