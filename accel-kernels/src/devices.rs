//! One candle `Device` per CUDA ordinal for the whole process.
//!
//! `Device::new_cuda(i)` makes a *new* device each call (its own context
//! handle and stream), and candle compares devices by identity: a tensor
//! loaded on one `cuda:0` and a hook executing on another `cuda:0` would be
//! copied GPU -> host -> GPU, and work on the two would not be ordered on one
//! stream. Loading, hooks, dispatch, the Accelerator and NCCL therefore all
//! ask here, and share the first device made for each ordinal.
//!
//! # Stream ordering
//!
//! candle 0.11 runs each host thread's work on that thread's own stream,
//! and cudarc orders work across streams with per-allocation events only
//! while its context has more than one stream ("multi-stream mode"). With
//! just candle's per-thread streams, nothing orders a tensor written by one
//! thread against its reading by another (or by NCCL's stream), and a
//! tensor freed on one thread may be released while another thread's
//! stream still reads it. So each device made here opens one side stream
//! at once, before any tensor of it exists, and keeps it for the life of
//! the process: every allocation then carries read/write events, candle's
//! ops and ours wait on them, and frees wait for the last use.
//!
//! # Memory
//!
//! Each device made here keeps freed memory reserved for the process (the
//! memory pool's release threshold is raised; see
//! `accel_kernels::cuda::retain_freed_memory` and `empty_cache`).

use std::sync::{Mutex, OnceLock};

use candle_core::Device;

/// A device and, with CUDA, the side stream that keeps its context in
/// multi-stream mode (never used for work; dropping it would switch the
/// tracking off again).
#[derive(Clone)]
struct Slot {
    device: Device,
    #[cfg(feature = "cuda")]
    _side: std::sync::Arc<cudarc::driver::CudaStream>,
}

static CUDA: OnceLock<Mutex<Vec<Option<Slot>>>> = OnceLock::new();

/// The process's device for CUDA ordinal `ordinal`, made on first use.
///
/// # Errors
/// candle's, when the ordinal does not exist or this build lacks CUDA.
pub fn cuda_device(ordinal: usize) -> candle_core::Result<Device> {
    let mut devices = CUDA
        .get_or_init(Mutex::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    if let Some(Some(slot)) = devices.get(ordinal) {
        return Ok(slot.device.clone());
    }
    let device = Device::new_cuda(ordinal)?;
    // Freed memory stays with the process, as with PyTorch's caching
    // allocator (see `cuda::retain_freed_memory`).
    #[cfg(feature = "cuda")]
    crate::cuda::retain_freed_memory(&device, true).map_err(candle_core::Error::wrap)?;
    let slot = Slot {
        #[cfg(feature = "cuda")]
        _side: side_stream(&device)?,
        device: device.clone(),
    };
    if devices.len() <= ordinal {
        devices.resize(ordinal + 1, None);
    }
    devices[ordinal] = Some(slot);
    Ok(device)
}

/// Opens the side stream of a fresh CUDA device (see the module docs).
#[cfg(feature = "cuda")]
fn side_stream(device: &Device) -> candle_core::Result<std::sync::Arc<cudarc::driver::CudaStream>> {
    let cuda = device.as_cuda_device()?;
    let stream = cuda
        .cuda_stream()
        .context()
        .new_stream()
        .map_err(candle_core::Error::wrap)?;
    debug_assert!(cuda
        .cuda_stream()
        .context()
        .is_managing_stream_synchronization());
    Ok(stream)
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_missing_ordinal_is_an_error_not_a_device() {
        // Without CUDA (this build or this machine) every ordinal errors.
        if !candle_core::utils::cuda_is_available() {
            assert!(super::cuda_device(0).is_err());
        }
        assert!(super::cuda_device(4096).is_err());
    }
}
