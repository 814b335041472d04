//! Collectives between GPU processes through NCCL (PyTorch's `nccl` backend).
//!
//! One [`NcclCommunicator`] per process owns one NCCL communicator on one
//! CUDA device. Rank 0 creates the NCCL unique id and publishes it through
//! the [`TcpStore`]; every rank then waits at a store barrier (bounded by
//! the timeout) before `ncclCommInitRank`, which itself has no timeout and
//! would otherwise hang on a missing peer.
//!
//! # Streams
//!
//! Each communicator runs its collectives on a stream of its own, created
//! on the device's context at connect (never a per-thread stream: candle
//! 0.11 gives every host thread its own, so a per-thread handle would mean
//! another stream on each thread, and a drop on another thread would wait
//! for the wrong work). Collectives are ordered against candle's work,
//! on whatever thread it runs, by cudarc's per-allocation events, which the
//! devices of [`accel_kernels::cuda_device`] keep switched on: a tensor
//! collective takes the tensor's address through a *write* guard (in place)
//! or a read guard (inputs), so the NCCL stream first waits for the
//! tensor's last write (and, for a written tensor, its last reads), and the
//! guard records the NCCL stream's event after the call. A candle op that
//! later reads the result waits for that event on the GPU, not on the host:
//! the bucket all-reduces of DDP run on the NCCL stream while the compute
//! stream goes on, as far as the data dependences allow. Tensors must come
//! from `accel_kernels::cuda_device` (a device made by `Device::new_cuda`
//! elsewhere has event tracking off and is not ordered).
//!
//! # Tensors and buffers
//!
//! Collectives on CUDA tensors run in place on the tensor's storage.
//! Tensors must be contiguous ([`Error::RequiresContiguous`] names the op)
//! and on the communicator's device. The host-buffer methods of
//! [`Communicator`](crate::Communicator) (and with them `barrier`, the byte
//! and object helpers, and CPU tensors) are staged through device memory:
//! copy in, collective, copy out, and always wait.
//!
//! `Mean` uses NCCL's `ncclAvg` (sum, then divide, in the element type).
//! `Max`/`Min` follow NCCL for NaN, which may differ from the TCP backend
//! (where a NaN loses against a number).
//!
//! # Timeouts
//!
//! NCCL calls only enqueue work; a missing peer shows as a kernel that never
//! finishes. By default (as PyTorch) tensor collectives return once
//! enqueued and a watchdog thread (`watchdog.rs`) bounds each of them by
//! the timeout: past it, or on an NCCL error, it aborts the communicator
//! (so nothing waiting on the stream hangs), and the next call returns
//! [`Error::Poisoned`] naming the collective that timed out. With
//! [`NcclConfig::blocking_wait`] every call instead waits for its work by
//! polling an event and `ncclCommGetAsyncError`, and returns
//! [`Error::NcclTimeout`] itself. Host-buffer calls always wait.
//!
//! # Threads
//!
//! An NCCL communicator may be used from any thread but not from two at
//! once. The handle is therefore `Send` (see `RawComm`) and lives in a
//! `Mutex` (shared with the watchdog), which makes the communicator `Sync`
//! without any claim beyond that; the collectives of one process are
//! serialised.
#![allow(unsafe_code)]

mod collectives;
mod comm;
mod watchdog;

use std::ffi::c_char;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use candle_core::cuda::CudaDevice;
use candle_core::Device;
use cudarc::driver::CudaStream;
use cudarc::nccl::{result, sys};

use self::comm::{nccl_message, RawComm};
use crate::communicator::check_rank;
use crate::process::DEFAULT_TIMEOUT;
use crate::{Error, Result, TcpStore};

/// Options of an [`NcclCommunicator`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NcclConfig {
    /// How long a call may wait for its collective (and init for the peers).
    pub timeout: Duration,
    /// Wait on the host for every collective to finish (PyTorch's
    /// `TORCH_NCCL_BLOCKING_WAIT=1`); by default tensor collectives return
    /// once enqueued and a watchdog bounds them (see the module docs).
    pub blocking_wait: bool,
}

impl Default for NcclConfig {
    fn default() -> Self {
        Self {
            timeout: DEFAULT_TIMEOUT,
            blocking_wait: false,
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

/// Communicators created by this process so far: all ranks create theirs
/// in the same order, so the count names the store keys of the next one.
static GENERATION: AtomicUsize = AtomicUsize::new(0);

/// A [`Communicator`](crate::Communicator) over NCCL on one CUDA device.
pub struct NcclCommunicator {
    rank: usize,
    world: usize,
    device: CudaDevice,
    /// The communicator's own stream (see the module docs).
    stream: Arc<CudaStream>,
    config: NcclConfig,
    comm: Arc<Mutex<RawComm>>,
    /// Bounds non-blocking collectives; `None` with `blocking_wait`.
    watchdog: Option<watchdog::Watchdog>,
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

/// Whether this build has the NCCL backend.
pub(crate) const NCCL_COMPILED: bool = true;

/// The CUDA device NCCL uses for `local_rank`: `cuda:local_rank`.
pub(crate) fn nccl_device(local_rank: usize) -> Result<Device> {
    Ok(accel_kernels::cuda_device(local_rank)?)
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
        // Rank 0's own write-once key: no other process can hand out an id.
        let key = format!("{}0/nccl/{generation}/id", crate::rendezvous::OWNED_PREFIX);
        let store = match store {
            Some(s) => Some(s),
            None if world == 1 => None,
            None => return Err(fail("rendezvous", "a world above 1 needs the store".into())),
        };
        let id = if rank == 0 {
            let id = result::get_uniqueid()
                .map_err(|e| fail("ncclGetUniqueId", nccl_message(&e, std::ptr::null_mut())))?;
            if let Some(store) = store {
                store.claim_rank(0)?;
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
        let ctx = dev.cuda_stream().context().clone();
        ctx.bind_to_thread()
            .map_err(|e| fail("cuCtxSetCurrent", format!("{e:?}")))?;
        let stream = ctx
            .new_stream()
            .map_err(|e| fail("cuStreamCreate", format!("{e:?}")))?;
        let mut comm: sys::ncclComm_t = std::ptr::null_mut();
        // SAFETY: `comm` is a valid out-pointer; rank and world were checked
        // (`rank < world`, both small); the device's context is current, so
        // NCCL binds the communicator to that device.
        unsafe { result::comm_init_rank(&mut comm, world as i32, id, rank as i32) }
            .map_err(|e| fail("ncclCommInitRank", nccl_message(&e, std::ptr::null_mut())))?;
        let comm = Arc::new(Mutex::new(RawComm { comm, failed: None }));
        let watchdog = (!config.blocking_wait)
            .then(|| watchdog::Watchdog::start(comm.clone(), ctx, config.timeout));
        Ok(Self {
            rank,
            world,
            device: dev.clone(),
            stream,
            config,
            comm,
            watchdog,
        })
    }

    /// The device the communicator runs on.
    pub fn device(&self) -> Device {
        Device::Cuda(self.device.clone())
    }
}
