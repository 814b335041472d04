//! The `--device` names of the benchmarks (`bench_train`, `profile_gpt`).

use anyhow::Result;
use candle_core::Device;

/// The device behind a `--device` name: `cpu`; `cuda` (cuda:0 through
/// `accel_kernels::cuda_device`, cudarc's per-allocation event tracking on,
/// see docs/design/stream-model.md); or `cuda-untracked`, a diagnostic:
/// candle's own `Device::new_cuda(0)`, whose context has one stream, so
/// cudarc tracks no events (unsafe once work crosses streams or threads),
/// with the same memory pool setting, so only the tracking differs.
pub fn device_named(name: &str) -> Result<Device> {
    Ok(match name {
        "cpu" => Device::Cpu,
        "cuda" => accel_core::kernels::cuda_device(0)?,
        "cuda-untracked" => {
            let dev = Device::new_cuda(0)?;
            accel_core::kernels::cuda::retain_freed_memory(&dev, true)?;
            dev
        }
        other => anyhow::bail!("--device {other:?}: expected cpu, cuda or cuda-untracked"),
    })
}
