//! The device memory pool: freed memory stays with the process.
//!
//! cudarc allocates every candle tensor and every launch table with
//! `cuMemAllocAsync` from the device's current memory pool, whose release
//! threshold is 0 by default: at each synchronisation the driver hands all
//! freed memory back, and the next allocations map fresh physical pages.
//! On an H200 that added a steady ~170 µs to each fused op on a 2^28-element
//! list in some processes (the same op ran at 57-62% of the device memcpy
//! there, 79-86% in others), and a candle op that allocates its output (such
//! as `to_dtype`) paid it on every call. PyTorch's caching allocator keeps
//! freed blocks for reuse; [`crate::cuda_device`] does the same by raising
//! the pool's release threshold to "never" when it makes a device.
//! [`empty_cache`] gives the reserved memory back, like
//! `torch.cuda.empty_cache()`.

use candle_core::Device;

use super::compile::{cuda_of, WrapDriver};
use super::launch::{pool_used_high, reset_pool_used_high, set_release_threshold, trim_pool};
use crate::Result;

/// Whether memory freed on `device` stays reserved for the process (`true`,
/// the setting of every device [`crate::cuda_device`] makes) or goes back to
/// the driver at each synchronisation (`false`, the driver's default).
/// A no-op where the device has no memory pools (cudarc then allocates with
/// plain `cuMemAlloc`, which has no such release).
///
/// # Errors
/// [`crate::Error::Cuda`] from the driver, [`crate::Error::InvalidArgument`] for a
/// non-CUDA device.
pub fn retain_freed_memory(device: &Device, retain: bool) -> Result<()> {
    let dev = cuda_of("retain_freed_memory", device)?;
    let ctx = dev.cuda_stream().context().clone();
    if !ctx.has_async_alloc() {
        return Ok(());
    }
    set_release_threshold(&ctx, if retain { u64::MAX } else { 0 })
}

/// Hands the memory the pool of `device` holds beyond what live tensors use
/// back to the driver (for other processes, or before a large allocation
/// outside the pool), as `torch.cuda.empty_cache()` does. Synchronises the
/// device first, so that memory freed by queued work is included.
///
/// # Errors
/// [`crate::Error::Cuda`] from the driver, [`crate::Error::InvalidArgument`] for a
/// non-CUDA device.
pub fn empty_cache(device: &Device) -> Result<()> {
    let dev = cuda_of("empty_cache", device)?;
    let ctx = dev.cuda_stream().context().clone();
    if !ctx.has_async_alloc() {
        return Ok(());
    }
    device.synchronize()?;
    trim_pool(&ctx)
}

/// Free and total memory of `device` in bytes, as the driver reports them
/// (`torch.cuda.mem_get_info()`). Memory the pool keeps for the process
/// counts as used.
///
/// # Errors
/// [`crate::Error::Cuda`] from the driver, [`crate::Error::InvalidArgument`] for a
/// non-CUDA device.
pub fn mem_get_info(device: &Device) -> Result<(usize, usize)> {
    let dev = cuda_of("mem_get_info", device)?;
    let ctx = dev.cuda_stream().context().clone();
    ctx.mem_get_info().w("mem_get_info", "cuMemGetInfo")
}

/// The most memory live tensors of `device` held at once since the device
/// was made or since [`reset_peak_memory_stats`], in bytes: the high-water
/// mark of the device's memory pool, from which cudarc allocates every
/// candle tensor (`torch.cuda.max_memory_allocated()`). `None` where the
/// device has no memory pools (plain `cuMemAlloc` keeps no such mark).
///
/// # Errors
/// [`crate::Error::Cuda`] from the driver, [`crate::Error::InvalidArgument`] for a
/// non-CUDA device.
pub fn max_memory_allocated(device: &Device) -> Result<Option<u64>> {
    let dev = cuda_of("max_memory_allocated", device)?;
    let ctx = dev.cuda_stream().context().clone();
    if !ctx.has_async_alloc() {
        return Ok(None);
    }
    // Frees still queued on the stream count until they run.
    device.synchronize()?;
    pool_used_high(&ctx).map(Some)
}

/// Starts [`max_memory_allocated`]'s mark again from the memory in use now
/// (`torch.cuda.reset_peak_memory_stats()`). Synchronises the device first.
///
/// # Errors
/// As [`max_memory_allocated`].
pub fn reset_peak_memory_stats(device: &Device) -> Result<()> {
    let dev = cuda_of("reset_peak_memory_stats", device)?;
    let ctx = dev.cuda_stream().context().clone();
    if !ctx.has_async_alloc() {
        return Ok(());
    }
    device.synchronize()?;
    reset_pool_used_high(&ctx)
}

/// The device's name as the driver reports it (`torch.cuda.get_device_name()`).
///
/// # Errors
/// [`crate::Error::Cuda`] from the driver, [`crate::Error::InvalidArgument`] for a
/// non-CUDA device.
pub fn device_name(device: &Device) -> Result<String> {
    let dev = cuda_of("device_name", device)?;
    let ctx = dev.cuda_stream().context().clone();
    ctx.name().w("device_name", "cuDeviceGetName")
}
