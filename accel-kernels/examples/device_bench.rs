//! Bandwidth of the fused CUDA kernels against the device's limits.
//!
//! For each size (f32 elements per tensor, spread over a list of tensors),
//! measures the median of several synchronised repetitions of:
//! - `memcpy_dtod`: a device-to-device copy of the f32 source (the practical
//!   ceiling, measured in the same run);
//! - `cast_into` f32 -> bf16, bf16 -> f32, f32 -> f16, and candle's own
//!   `to_dtype` f32 -> bf16 (one launch per tensor, allocating);
//! - `unscale_and_check` (includes reading the flag back), `scale_in_place`,
//!   `add_in_place` bf16 -> f32 and `adamw_step` with f32 gradients.
//!
//! Bandwidth counts bytes read plus bytes written. Each entry reports GB/s,
//! the fraction of the theoretical peak (2 x memory clock x bus width, from
//! the device attributes) and of the measured memcpy, for one call followed
//! by a synchronisation (`us`: the host's per-call costs show), and under
//! `pipelined` for calls enqueued back to back with one synchronisation at
//! the end, as a training step issues them (the host runs ahead, and what
//! is left is the device's time). `sizes` runs with the
//! memory pool `cuda_device` sets up (freed memory kept for the process);
//! `sizes_driver_default_pool` repeats the large sizes first, with the
//! driver's default pool (freed memory released at each synchronisation).
//! Run: `cargo run --release -p accel-kernels --features cuda --example device_bench`.

use std::time::Instant;

use accel_kernels::{
    adamw_step, add_in_place, cast_into, scale_in_place, unscale_and_check, AdamWParams,
};
use anyhow::{Context, Result};
use candle_core::cuda::cudarc::driver::sys::CUdevice_attribute as Attr;
use candle_core::{DType, Device, Tensor};
use serde_json::{json, Value};

/// One measured operation: name, bytes moved per element, and the work.
type Op<'a> = (&'static str, f64, Box<dyn FnMut() -> Result<()> + 'a>);

/// Tensors per list: the kernels are multi-tensor, so lists are measured.
const TENSORS: usize = 8;

/// Calls per pipelined measurement.
const PIPELINED: usize = 10;

/// The median of `v` (not empty).
fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Median seconds of `reps` runs of `f`, each followed by a device sync, and
/// the median host time of the call alone (enqueueing: building the launch
/// tables, locking and fencing the tensors, launching), which the device
/// waits behind.
fn median_secs(dev: &Device, reps: usize, mut f: impl FnMut() -> Result<()>) -> Result<(f64, f64)> {
    f()?;
    dev.synchronize()?;
    let (mut t, mut q) = (Vec::with_capacity(reps), Vec::with_capacity(reps));
    for _ in 0..reps {
        let start = Instant::now();
        f()?;
        q.push(start.elapsed().as_secs_f64());
        dev.synchronize()?;
        t.push(start.elapsed().as_secs_f64());
    }
    Ok((median(t), median(q)))
}

/// Median seconds per call of `reps` runs of [`PIPELINED`] calls of `f`
/// enqueued back to back, with one device sync per run.
fn pipelined_secs(dev: &Device, reps: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    f()?;
    dev.synchronize()?;
    let mut t = Vec::with_capacity(reps);
    for _ in 0..reps {
        let start = Instant::now();
        for _ in 0..PIPELINED {
            f()?;
        }
        dev.synchronize()?;
        t.push(start.elapsed().as_secs_f64() / PIPELINED as f64);
    }
    Ok(median(t))
}

fn list(dev: &Device, n: usize, tensors: usize, dtype: DType) -> Result<Vec<Tensor>> {
    (0..tensors)
        .map(|i| {
            let t = Tensor::rand(-1f32, 1f32, n / tensors, dev)?.affine(1.0, i as f64)?;
            Ok(t.to_dtype(dtype)?)
        })
        .collect()
}

fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

fn bench_size(dev: &Device, n: usize, tensors: usize, peak: f64, reps: usize) -> Result<Value> {
    let stream = dev.as_cuda_device()?.cuda_stream();
    let src_f32 = list(dev, n, tensors, DType::F32)?;
    let src_bf16 = list(dev, n, tensors, DType::BF16)?;
    let dst_bf16 = list(dev, n, tensors, DType::BF16)?;
    let dst_f16 = list(dev, n, tensors, DType::F16)?;
    let dst_f32 = list(dev, n, tensors, DType::F32)?;
    let m = list(dev, n, tensors, DType::F32)?;
    let v = list(dev, n, tensors, DType::F32)?
        .iter()
        .map(|t| t.sqr())
        .collect::<candle_core::Result<Vec<_>>>()?;
    let per = n / tensors;
    let a = stream.alloc_zeros::<f32>(per)?;
    let mut b = stream.alloc_zeros::<f32>(per)?;
    let total = (per * tensors) as f64;

    // (name, bytes moved per element, median seconds, median enqueue
    // seconds, median pipelined seconds)
    let mut entries: Vec<(&str, f64, f64, f64, f64)> = Vec::new();
    let mut copy = || {
        for _ in 0..tensors {
            stream.memcpy_dtod(&a, &mut b)?;
        }
        Ok(())
    };
    let (memcpy, memcpy_q) = median_secs(dev, reps, &mut copy)?;
    let memcpy_p = pipelined_secs(dev, reps, &mut copy)?;
    entries.push(("memcpy_dtod_f32", 8.0, memcpy, memcpy_q, memcpy_p));
    let hp = AdamWParams::default();
    let mut step = 0u64;
    let ops: Vec<Op<'_>> = vec![
        (
            "cast_into_f32_bf16",
            6.0,
            Box::new(|| Ok(cast_into(&src_f32, &dst_bf16)?)),
        ),
        (
            "cast_into_bf16_f32",
            6.0,
            Box::new(|| Ok(cast_into(&src_bf16, &dst_f32)?)),
        ),
        (
            "cast_into_f32_f16",
            6.0,
            Box::new(|| Ok(cast_into(&src_f32, &dst_f16)?)),
        ),
        (
            "candle_to_dtype_f32_bf16",
            6.0,
            Box::new(|| {
                for t in &src_f32 {
                    t.to_dtype(DType::BF16)?;
                }
                Ok(())
            }),
        ),
        (
            "unscale_and_check_f32",
            8.0,
            Box::new(|| Ok(unscale_and_check(&dst_f32, 1.0 / 1024.0).map(|_| ())?)),
        ),
        (
            "scale_in_place_f32",
            8.0,
            Box::new(|| Ok(scale_in_place(&dst_f32, 1.0)?)),
        ),
        (
            "add_in_place_bf16_f32",
            10.0,
            Box::new(|| Ok(add_in_place(&dst_f32, &src_bf16)?)),
        ),
        (
            "adamw_step_f32",
            28.0,
            Box::new(|| {
                step += 1;
                Ok(adamw_step(&dst_f32, &src_f32, &m, &v, step, &hp)?)
            }),
        ),
    ];
    for (name, bytes, mut f) in ops {
        let (secs, enqueue) = median_secs(dev, reps, &mut f)?;
        let pipelined = pipelined_secs(dev, reps, &mut f)?;
        entries.push((name, bytes, secs, enqueue, pipelined));
    }
    let memcpy_gbs = total * 8.0 / memcpy / 1e9;
    let memcpy_p_gbs = total * 8.0 / memcpy_p / 1e9;
    let ops: serde_json::Map<String, Value> = entries
        .into_iter()
        .map(|(name, bytes, secs, enqueue, pipelined)| {
            let gbs = total * bytes / secs / 1e9;
            let p_gbs = total * bytes / pipelined / 1e9;
            let v = json!({
                "us": round3(secs * 1e6),
                "enqueue_us": round3(enqueue * 1e6),
                "gb_per_s": round3(gbs),
                "of_peak": round3(gbs / peak),
                "of_memcpy": round3(gbs / memcpy_gbs),
                "pipelined": {
                    "us": round3(pipelined * 1e6),
                    "gb_per_s": round3(p_gbs),
                    "of_peak": round3(p_gbs / peak),
                    "of_memcpy": round3(p_gbs / memcpy_p_gbs),
                },
            });
            (name.to_string(), v)
        })
        .collect();
    Ok(json!({ "elements": per * tensors, "tensors": tensors, "ops": ops }))
}

fn main() -> Result<()> {
    let dev = accel_kernels::cuda_device(0).context("no CUDA device")?;
    let cuda = dev.as_cuda_device()?;
    let ctx = cuda.cuda_stream().context().clone();
    let clock_khz = ctx.attribute(Attr::CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE)? as f64;
    let bus_bits = ctx.attribute(Attr::CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH)? as f64;
    // Double data rate: two transfers per clock.
    let peak_gbs = 2.0 * clock_khz * 1e3 * bus_bits / 8.0 / 1e9;
    let t0 = Instant::now();
    accel_kernels::cuda::precompile(&dev)?;
    let compile_ms = t0.elapsed().as_secs_f64() * 1e3;
    // The driver's default pool (freed memory released at each synchronisation) against the
    // setting `cuda_device` makes (freed memory kept), in one process, on the large sizes.
    accel_kernels::cuda::retain_freed_memory(&dev, false)?;
    let mut driver_default = Vec::new();
    for (n, reps) in [(1 << 26, 10), (1 << 28, 5)] {
        driver_default.push(bench_size(&dev, n, TENSORS, peak_gbs, reps)?);
    }
    accel_kernels::cuda::retain_freed_memory(&dev, true)?;
    let mut sizes = Vec::new();
    for (n, reps) in [(1 << 20, 50), (1 << 24, 20), (1 << 26, 10), (1 << 28, 5)] {
        sizes.push(bench_size(&dev, n, TENSORS, peak_gbs, reps)?);
    }
    // A model-like list: 512 tensors of 2^15 elements, eight launches of 64.
    let many_tensors = bench_size(&dev, 1 << 24, 512, peak_gbs, 20)?;
    let (major, minor) = ctx.compute_capability()?;
    let out = json!({
        "device": ctx.name()?,
        "compute_capability": format!("{major}.{minor}"),
        "memory_clock_mhz": clock_khz / 1e3,
        "bus_width_bits": bus_bits,
        "theoretical_peak_gb_per_s": round3(peak_gbs),
        "nvrtc_compile_and_load_ms": round3(compile_ms),
        "sizes": sizes,
        "many_tensors": many_tensors,
        "sizes_driver_default_pool": driver_default,
    });
    println!("{out}");
    Ok(())
}
