//! The fused CUDA kernels against candle's CUDA `to_dtype` (casts, bit for
//! bit) and against the CPU path (the other ops, bit for bit on NaN-free
//! data). Every test is ignored by default (no GPU on the CPU CI), and
//! `scripts/gpu_check.sh` runs them with `--include-ignored`; run that way
//! without a CUDA device they fail rather than pass.

use accel_kernels::{
    adamw_step, add_in_place, cast_into, cast_tensors, clamp_in_place, has_non_finite, max_abs,
    scale_in_place, sgd_step, sum_of_squares, unscale_and_check, AdamWParams, Result, SgdParams,
};
use candle_core::{DType, Device, Tensor};
use half::{bf16, f16};

/// `cuda:0`; a test that asked for a GPU and finds none fails (these tests
/// are ignored by default, so a CPU run never counts them as passed).
fn cuda(test: &str) -> Device {
    accel_kernels::cuda_device(0)
        .unwrap_or_else(|e| panic!("{test}: needs a CUDA device (build with --features cuda): {e}"))
}

/// Deterministic pseudo-random u32s.
fn random_bits(n: usize, seed: u64) -> Vec<u32> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 16) as u32
        })
        .collect()
}

/// Pseudo-random finite f32 values in [-scale, scale).
fn randn(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    random_bits(n, seed)
        .into_iter()
        .map(|b| ((b >> 8) as f32 / (1u32 << 24) as f32 * 2.0 - 1.0) * scale)
        .collect()
}

/// f32 values covering every class: zeros, subnormals, normals, the
/// largest finite values, ties at bf16/f16 rounding, infinities, NaNs with
/// payloads of both signs and quietness, then random bit patterns.
fn special_f32(random: usize) -> Vec<f32> {
    let mut bits: Vec<u32> = vec![
        0x0000_0000,
        0x8000_0000,
        0x0000_0001,
        0x8000_0001,
        0x007F_FFFF,
        0x0080_0000,
        0x3F80_0000,
        0x3F80_8000,
        0x3F81_8000,
        0x3F80_7FFF,
        0x3F80_8001,
        0x7F7F_FFFF,
        0xFF7F_FFFF,
        0x7F7F_8000,
        0x477F_E000,
        0x477F_F000,
        0x3880_0000,
        0x3300_0000,
        0x7F80_0000,
        0xFF80_0000,
        0x7FC0_0000,
        0xFFC0_0000,
        0x7F80_0001,
        0x7FBF_FFFF,
        0xFF80_0001,
        0x7FFF_FFFF,
        0x7FA0_1234,
    ];
    bits.extend(random_bits(random, 7));
    bits.into_iter().map(f32::from_bits).collect()
}

fn bits(t: &Tensor) -> Result<Vec<u32>> {
    let t = t.flatten_all()?.to_device(&Device::Cpu)?;
    Ok(match t.dtype() {
        DType::F32 => t.to_vec1::<f32>()?.iter().map(|v| v.to_bits()).collect(),
        DType::BF16 => t
            .to_vec1::<bf16>()?
            .iter()
            .map(|v| v.to_bits() as u32)
            .collect(),
        DType::F16 => t
            .to_vec1::<f16>()?
            .iter()
            .map(|v| v.to_bits() as u32)
            .collect(),
        d => panic!("unexpected dtype {d:?}"),
    })
}

/// Asserts equal bits, reporting the first difference.
fn assert_bits_eq(what: &str, got: &[u32], want: &[u32]) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    if let Some(i) = (0..got.len()).find(|&i| got[i] != want[i]) {
        let diffs = (0..got.len()).filter(|&i| got[i] != want[i]).count();
        panic!(
            "{what}: {diffs} elements differ; first at {i}: got {:#x}, want {:#x}",
            got[i], want[i]
        );
    }
}

/// Every bf16 and f16 bit pattern, as a tensor of that dtype on `dev`.
fn all_patterns(dtype: DType, dev: &Device) -> Result<Tensor> {
    let raw: Vec<u16> = (0..=u16::MAX).collect();
    Ok(match dtype {
        DType::BF16 => {
            Tensor::from_vec(raw.into_iter().map(bf16::from_bits).collect(), 65536, dev)?
        }
        _ => Tensor::from_vec(raw.into_iter().map(f16::from_bits).collect(), 65536, dev)?,
    })
}

#[test]
#[ignore = "needs a CUDA GPU (run scripts/gpu_check.sh)"]
fn every_half_pattern_casts_like_candle() -> Result<()> {
    let dev = cuda("every_half_pattern_casts_like_candle");
    for from in [DType::BF16, DType::F16] {
        let t = all_patterns(from, &dev)?;
        for to in [DType::F32, DType::BF16, DType::F16] {
            if to == from {
                continue;
            }
            let want = bits(&t.to_dtype(to)?)?;
            let got = bits(&cast_tensors(std::slice::from_ref(&t), to)?[0])?;
            assert_bits_eq(&format!("{from:?} -> {to:?}"), &got, &want);
            let dst = Tensor::zeros(65536, to, &dev)?;
            cast_into(std::slice::from_ref(&t), std::slice::from_ref(&dst))?;
            assert_bits_eq(
                &format!("cast_into {from:?} -> {to:?}"),
                &bits(&dst)?,
                &want,
            );
        }
    }
    Ok(())
}

#[test]
#[ignore = "needs a CUDA GPU (run scripts/gpu_check.sh)"]
fn f32_specials_and_random_patterns_cast_like_candle() -> Result<()> {
    let dev = cuda("f32_specials_and_random_patterns_cast_like_candle");
    let v = special_f32(1 << 20);
    let t = Tensor::from_vec(v.clone(), v.len(), &dev)?;
    for to in [DType::BF16, DType::F16] {
        let want = bits(&t.to_dtype(to)?)?;
        let got = bits(&cast_tensors(std::slice::from_ref(&t), to)?[0])?;
        assert_bits_eq(&format!("f32 -> {to:?}"), &got, &want);
    }
    Ok(())
}

#[test]
#[ignore = "needs a CUDA GPU (run scripts/gpu_check.sh)"]
fn lists_with_odd_sizes_and_offsets_use_every_path() -> Result<()> {
    let dev = cuda("lists_with_odd_sizes_and_offsets_use_every_path");
    // Sizes around the vector width and the chunk lengths (4 Ki here), and views that
    // start one element in (misaligned: scalar path).
    let sizes = [0usize, 1, 3, 4, 5, 4097, 65536, 65537, 3 * 65536 + 5];
    let base = Tensor::from_vec(randn(4 * 65536, 1, 100.0), 4 * 65536, &dev)?;
    let mut src = Vec::new();
    for (i, &n) in sizes.iter().enumerate() {
        src.push(base.narrow(0, i % 2, n)?);
    }
    for to in [DType::BF16, DType::F16] {
        let outs = cast_tensors(&src, to)?;
        let dst: Vec<Tensor> = sizes
            .iter()
            .map(|&n| Ok(Tensor::zeros(n + 1, to, &dev)?.narrow(0, 1, n)?))
            .collect::<Result<_>>()?;
        cast_into(&src, &dst)?;
        for ((s, o), d) in src.iter().zip(&outs).zip(&dst) {
            // candle's CUDA `to_dtype` launches an empty grid for an empty tensor, which the
            // driver refuses (CUDA_ERROR_INVALID_VALUE); the reference of nothing is nothing.
            let want = if s.elem_count() == 0 {
                Vec::new()
            } else {
                bits(&s.to_dtype(to)?)?
            };
            assert_bits_eq("cast_tensors", &bits(o)?, &want);
            assert_bits_eq("cast_into (offset destination)", &bits(d)?, &want);
        }
    }
    Ok(())
}

/// A list of f32, bf16 and f16 tensors with the same values on `dev`.
fn mixed_list(dev: &Device, n: usize, seed: u64) -> Result<Vec<Tensor>> {
    let mut out = Vec::new();
    for (i, dtype) in [DType::F32, DType::BF16, DType::F16, DType::F32]
        .into_iter()
        .enumerate()
    {
        let v = randn(n + i * 7, seed + i as u64, 4.0);
        out.push(Tensor::from_vec(v, n + i * 7, dev)?.to_dtype(dtype)?);
    }
    Ok(out)
}

fn to_cpu(ts: &[Tensor]) -> Result<Vec<Tensor>> {
    Ok(ts
        .iter()
        .map(|t| t.to_device(&Device::Cpu))
        .collect::<candle_core::Result<_>>()?)
}

fn assert_lists_eq(what: &str, got: &[Tensor], want: &[Tensor]) -> Result<()> {
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert_bits_eq(&format!("{what}[{i}]"), &bits(g)?, &bits(w)?);
    }
    Ok(())
}

#[test]
#[ignore = "needs a CUDA GPU (run scripts/gpu_check.sh)"]
fn unscale_flags_injected_inf_and_nan_and_scales_like_the_cpu() -> Result<()> {
    let dev = cuda("unscale_flags_injected_inf_and_nan_and_scales_like_the_cpu");
    let gpu = mixed_list(&dev, 70_001, 3)?;
    let cpu = to_cpu(&gpu)?;
    assert!(!unscale_and_check(&gpu, 1.0 / 1024.0)?);
    assert!(!unscale_and_check(&cpu, 1.0 / 1024.0)?);
    assert_lists_eq("unscaled", &gpu, &cpu)?;
    assert!(!has_non_finite(&gpu)?);
    for (i, bad) in [f32::INFINITY, f32::NAN, f32::NEG_INFINITY]
        .into_iter()
        .enumerate()
    {
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let clean = Tensor::from_vec(randn(1000, 9, 1.0), 1000, &dev)?.to_dtype(dtype)?;
            let poisoned = Tensor::cat(
                &[
                    &clean.narrow(0, 0, 500 + i)?,
                    &Tensor::new(&[bad], &dev)?.to_dtype(dtype)?,
                    &clean.narrow(0, 501 + i, 499 - i)?,
                ],
                0,
            )?;
            let list = vec![clean.clone(), poisoned];
            assert!(has_non_finite(&list)?, "{bad} in {dtype:?}");
            assert!(unscale_and_check(&list, 0.5)?, "{bad} in {dtype:?}");
            assert!(!unscale_and_check(&list[..1], 1.0)?, "clean {dtype:?}");
        }
    }
    Ok(())
}

#[test]
#[ignore = "needs a CUDA GPU (run scripts/gpu_check.sh)"]
fn in_place_ops_match_the_cpu_path_bit_for_bit() -> Result<()> {
    let dev = cuda("in_place_ops_match_the_cpu_path_bit_for_bit");
    let gpu = mixed_list(&dev, 65_539, 11)?;
    let cpu = to_cpu(&gpu)?;
    scale_in_place(&gpu, 0.37)?;
    scale_in_place(&cpu, 0.37)?;
    assert_lists_eq("scale", &gpu, &cpu)?;
    clamp_in_place(&gpu, -0.5, 0.75)?;
    clamp_in_place(&cpu, -0.5, 0.75)?;
    assert_lists_eq("clamp", &gpu, &cpu)?;

    let dst_gpu: Vec<Tensor> = gpu
        .iter()
        .map(|t| {
            Ok(Tensor::from_vec(
                randn(t.elem_count(), 5, 1.0),
                t.shape(),
                &dev,
            )?)
        })
        .collect::<Result<_>>()?;
    let dst_cpu = to_cpu(&dst_gpu)?;
    add_in_place(&dst_gpu, &gpu)?;
    add_in_place(&dst_cpu, &cpu)?;
    assert_lists_eq("add", &dst_gpu, &dst_cpu)?;
    Ok(())
}

#[test]
#[ignore = "needs a CUDA GPU (run scripts/gpu_check.sh)"]
fn optimizer_steps_match_the_cpu_path_bit_for_bit() -> Result<()> {
    let dev = cuda("optimizer_steps_match_the_cpu_path_bit_for_bit");
    let grads = mixed_list(&dev, 65_541, 21)?;
    let f32_like = |seed: u64, scale: f32| -> Result<Vec<Tensor>> {
        grads
            .iter()
            .enumerate()
            .map(|(i, g)| {
                let v = randn(g.elem_count(), seed + i as u64, scale);
                Ok(Tensor::from_vec(v, g.shape(), &dev)?)
            })
            .collect()
    };
    let (p, m) = (f32_like(100, 1.0)?, f32_like(200, 0.1)?);
    let v: Vec<Tensor> = f32_like(300, 0.1)?
        .iter()
        .map(|t| Ok(t.sqr()?))
        .collect::<Result<_>>()?;
    let (pc, mc, vc, gc) = (to_cpu(&p)?, to_cpu(&m)?, to_cpu(&v)?, to_cpu(&grads)?);
    let hp = AdamWParams::default();
    for step in 1..=3 {
        adamw_step(&p, &grads, &m, &v, step, &hp)?;
        adamw_step(&pc, &gc, &mc, &vc, step, &hp)?;
    }
    assert_lists_eq("adamw params", &p, &pc)?;
    assert_lists_eq("adamw exp_avg", &m, &mc)?;
    assert_lists_eq("adamw exp_avg_sq", &v, &vc)?;

    let bufs = f32_like(400, 1.0)?;
    let bufs_c = to_cpu(&bufs)?;
    let hp = SgdParams {
        lr: 0.01,
        momentum: 0.9,
        weight_decay: 1e-4,
        dampening: 0.0,
        nesterov: true,
    };
    for step in 1..=2 {
        sgd_step(&p, &grads, Some(&bufs), step, &hp)?;
        sgd_step(&pc, &gc, Some(&bufs_c), step, &hp)?;
    }
    sgd_step(&p, &grads, None, 1, &SgdParams::default())?;
    sgd_step(&pc, &gc, None, 1, &SgdParams::default())?;
    assert_lists_eq("sgd params", &p, &pc)?;
    assert_lists_eq("sgd momentum", &bufs, &bufs_c)?;
    Ok(())
}

#[test]
#[ignore = "needs a CUDA GPU (run scripts/gpu_check.sh)"]
fn reductions_match_the_cpu_path() -> Result<()> {
    let dev = cuda("reductions_match_the_cpu_path");
    let gpu = mixed_list(&dev, 300_007, 31)?;
    let cpu = to_cpu(&gpu)?;
    let (g, c) = (sum_of_squares(&gpu)?, sum_of_squares(&cpu)?);
    assert!((g - c).abs() <= 1e-12 * c, "sum_of_squares {g} vs {c}");
    assert_eq!(
        sum_of_squares(&gpu)?.to_bits(),
        g.to_bits(),
        "not reproducible"
    );
    assert_eq!(max_abs(&gpu)?, max_abs(&cpu)?);
    assert_eq!(sum_of_squares(&gpu[..0])?, 0.0);
    let nan = Tensor::new(&[1f32, f32::NAN, 3.0], &dev)?.to_dtype(DType::BF16)?;
    assert!(max_abs(&[gpu[0].clone(), nan])?.is_nan());
    Ok(())
}

/// 210 tensors, 70 of each float dtype (more than the 64 one launch takes), of lengths
/// from 0 to a few thousand, the values of tensor i scaled by `1 + i / 8`.
fn long_list(dev: &Device, seed: u64) -> Result<Vec<Tensor>> {
    let dtypes = [DType::F32, DType::BF16, DType::F16];
    (0..210)
        .map(|i| {
            if i % 17 == 0 {
                // Made directly: candle's CUDA `to_dtype` refuses empty tensors.
                return Ok(Tensor::zeros(0, dtypes[i % 3], dev)?);
            }
            let n = (i * 131) % 3000 + i % 5;
            let v = randn(n, seed + i as u64, 1.0 + i as f32 / 8.0);
            Ok(Tensor::from_vec(v, n, dev)?.to_dtype(dtypes[i % 3])?)
        })
        .collect()
}

#[test]
#[ignore = "needs a CUDA GPU (run scripts/gpu_check.sh)"]
fn lists_longer_than_one_launch_match_the_cpu_path() -> Result<()> {
    let dev = cuda("lists_longer_than_one_launch_match_the_cpu_path");
    let gpu = long_list(&dev, 41)?;
    let cpu = to_cpu(&gpu)?;
    // Casts: every tensor of every launch, against candle.
    for to in [DType::F32, DType::BF16] {
        let outs = cast_tensors(&gpu, to)?;
        for (i, (o, s)) in outs.iter().zip(&gpu).enumerate() {
            let want = if s.elem_count() == 0 {
                Vec::new()
            } else {
                bits(&s.to_dtype(to)?)?
            };
            assert_bits_eq(&format!("cast_tensors[{i}] to {to:?}"), &bits(o)?, &want);
        }
    }
    // Reductions: the partials of later launches land in their own slots.
    let (g, c) = (sum_of_squares(&gpu)?, sum_of_squares(&cpu)?);
    assert!((g - c).abs() <= 1e-12 * c, "sum_of_squares {g} vs {c}");
    assert_eq!(max_abs(&gpu)?, max_abs(&cpu)?);
    // In place and optimizer ops, bit for bit.
    assert!(!unscale_and_check(&gpu, 0.25)?);
    assert!(!unscale_and_check(&cpu, 0.25)?);
    assert_lists_eq("unscale", &gpu, &cpu)?;
    // f32 state shaped like the list, made on the host (`square`d for exp_avg_sq): candle's
    // CUDA ops refuse empty tensors, so those are made on the device as zeros.
    let f32_like = |seed: u64, square: bool| -> Result<Vec<Tensor>> {
        gpu.iter()
            .enumerate()
            .map(|(i, g)| {
                let n = g.elem_count();
                if n == 0 {
                    return Ok(Tensor::zeros(0, DType::F32, &dev)?);
                }
                let mut v = randn(n, seed + i as u64, 0.5);
                if square {
                    v.iter_mut().for_each(|x| *x *= *x);
                }
                Ok(Tensor::from_vec(v, n, &dev)?)
            })
            .collect()
    };
    let (p, m, v) = (
        f32_like(500, false)?,
        f32_like(600, false)?,
        f32_like(700, true)?,
    );
    let (pc, mc, vc) = (to_cpu(&p)?, to_cpu(&m)?, to_cpu(&v)?);
    add_in_place(&p, &gpu)?;
    add_in_place(&pc, &cpu)?;
    assert_lists_eq("add", &p, &pc)?;
    let hp = AdamWParams::default();
    adamw_step(&p, &gpu, &m, &v, 1, &hp)?;
    adamw_step(&pc, &cpu, &mc, &vc, 1, &hp)?;
    assert_lists_eq("adamw params", &p, &pc)?;
    assert_lists_eq("adamw exp_avg_sq", &v, &vc)?;
    // A non-finite value in the last tensor (in the second launch of its dtype) is seen.
    let last = gpu.len() - 1;
    let n = gpu[last].elem_count();
    let mut poisoned = gpu.clone();
    poisoned[last] = Tensor::cat(
        &[
            &gpu[last].narrow(0, 0, n - 1)?,
            &Tensor::new(&[f32::INFINITY], &dev)?.to_dtype(gpu[last].dtype())?,
        ],
        0,
    )?;
    assert!(has_non_finite(&poisoned)?);
    assert!(unscale_and_check(&poisoned, 1.0)?);
    Ok(())
}

#[test]
#[ignore = "needs a CUDA GPU (run scripts/gpu_check.sh)"]
fn written_tensors_sharing_storage_are_refused() -> Result<()> {
    let dev = cuda("written_tensors_sharing_storage_are_refused");
    let a = Tensor::from_vec(randn(64, 3, 1.0), 64, &dev)?;
    let b = Tensor::from_vec(randn(64, 4, 1.0), 64, &dev)?;
    let is_aliased = |r: Result<()>| matches!(r, Err(accel_kernels::Error::AliasedStorage { .. }));
    // A clone, two views of one buffer, a written tensor read as well.
    assert!(is_aliased(scale_in_place(&[a.clone(), a.clone()], 2.0)));
    let views = [a.narrow(0, 0, 32)?, a.narrow(0, 32, 32)?];
    assert!(is_aliased(scale_in_place(&views, 2.0)));
    let whole = a.narrow(0, 0, 64)?;
    assert!(is_aliased(add_in_place(
        std::slice::from_ref(&a),
        std::slice::from_ref(&whole)
    )));
    // Distinct storages pass, and one storage read twice too.
    add_in_place(std::slice::from_ref(&b), std::slice::from_ref(&a))?;
    assert!(!has_non_finite(&[a.clone(), a.clone(), b])?);
    let keys = [&a, &views[0], &views[1]].map(accel_kernels::storage_key);
    assert!(keys[0].is_some() && keys.iter().all(|k| *k == keys[0]));
    Ok(())
}

#[test]
#[ignore = "needs a CUDA GPU (run scripts/gpu_check.sh)"]
fn precompile_loads_every_kernel() -> Result<()> {
    let dev = cuda("precompile_loads_every_kernel");
    accel_kernels::cuda::precompile(&dev)
}

/// NVRTC alone (no GPU needed, but `libnvrtc` must load): every source
/// compiles for the architectures the kernels are written for.
#[test]
#[ignore = "needs libnvrtc; run with --ignored where it is installed"]
fn nvrtc_compiles_every_source() -> Result<()> {
    for arch in ["sm_75", "sm_80", "sm_90"] {
        for (name, ptx) in accel_kernels::cuda::compile_sources(arch)? {
            assert!(ptx.contains(".entry"), "{name} for {arch} has no kernels");
        }
    }
    Ok(())
}

/// A kernel's write is seen by a candle op on another host thread (another
/// per-thread stream) without any host synchronisation in between: the
/// write fence records the tensor's write event after the kernel, and the
/// reader's stream waits for it. The tensor is large enough that a reader
/// not ordered behind the kernel would see (part of) the old values.
#[test]
#[ignore = "needs a CUDA GPU (run scripts/gpu_check.sh)"]
fn a_kernel_write_is_ordered_before_a_read_on_another_thread() -> Result<()> {
    let dev = cuda("a_kernel_write_is_ordered_before_a_read_on_another_thread");
    let n = 1 << 26;
    for round in 0..4 {
        let t = Tensor::ones(n, DType::F32, &dev)?;
        scale_in_place(std::slice::from_ref(&t), 3.0)?;
        let seen = std::thread::scope(|s| {
            // The smallest element: 1.0 if any was read before the kernel.
            s.spawn(|| t.min(0)?.to_scalar::<f32>())
                .join()
                .expect("reader thread")
        })?;
        assert_eq!(seen, 3.0, "round {round}");
    }
    Ok(())
}

#[test]
#[ignore = "needs a CUDA GPU (run scripts/gpu_check.sh)"]
fn freed_memory_stays_reserved_until_empty_cache() -> Result<()> {
    let dev = cuda("freed_memory_stays_reserved_until_empty_cache");
    let free = || -> Result<usize> { Ok(accel_kernels::cuda::mem_get_info(&dev)?.0) };
    const GIB: usize = 1 << 30;
    accel_kernels::cuda::empty_cache(&dev)?;
    let before = free()?;
    {
        let t = Tensor::zeros(GIB / 4, DType::F32, &dev)?;
        dev.synchronize()?;
        assert!(free()? + GIB / 2 < before, "the 1 GiB tensor is allocated");
        drop(t);
    }
    dev.synchronize()?;
    assert!(
        free()? + GIB / 2 < before,
        "the freed GiB stays with the process across a synchronisation"
    );
    accel_kernels::cuda::empty_cache(&dev)?;
    assert!(free()? + GIB / 4 > before, "empty_cache gives it back");
    // The driver's default: released at the next synchronisation.
    accel_kernels::cuda::retain_freed_memory(&dev, false)?;
    drop(Tensor::zeros(GIB / 4, DType::F32, &dev)?);
    dev.synchronize()?;
    assert!(free()? + GIB / 4 > before, "released without empty_cache");
    accel_kernels::cuda::retain_freed_memory(&dev, true)?;
    Ok(())
}
