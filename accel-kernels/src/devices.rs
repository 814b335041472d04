//! One candle `Device` per CUDA ordinal for the whole process.
//!
//! `Device::new_cuda(i)` makes a *new* device each call (its own context
//! handle and stream), and candle compares devices by identity: a tensor
//! loaded on one `cuda:0` and a hook executing on another `cuda:0` would be
//! copied GPU -> host -> GPU, and work on the two would not be ordered on one
//! stream. Loading, hooks, dispatch, the Accelerator and NCCL therefore all
//! ask here, and share the first device made for each ordinal.

use std::sync::{Mutex, OnceLock};

use candle_core::Device;

static CUDA: OnceLock<Mutex<Vec<Option<Device>>>> = OnceLock::new();

/// The process's device for CUDA ordinal `ordinal`, made on first use.
///
/// # Errors
/// candle's, when the ordinal does not exist or this build lacks CUDA.
pub fn cuda_device(ordinal: usize) -> candle_core::Result<Device> {
    let mut devices = CUDA
        .get_or_init(Mutex::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    if let Some(Some(d)) = devices.get(ordinal) {
        return Ok(d.clone());
    }
    let d = Device::new_cuda(ordinal)?;
    if devices.len() <= ordinal {
        devices.resize(ordinal + 1, None);
    }
    devices[ordinal] = Some(d.clone());
    Ok(d)
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
