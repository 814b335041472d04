//! Cross entropy with HF's ignored targets, and the fused lm_head + loss.

use candle_core::{bail, DType, Device, Result, Tensor};

use super::linear::composed_linear;
use super::softmax::composed_log_softmax_last_dim;
use super::{fused, fused_cuda};
use crate::kernels;

/// HF's `ignore_index` for i64 targets.
const IGNORE_I64: i64 = -100;

/// Whether CUDA logits take the kernels of `loss.cu`. Off until a GPU run of
/// `scripts/gpu_check.sh` has passed `cuda_cross_entropy_...` (below); the
/// kernels compile in CI but have never run.
const CUDA_CROSS_ENTROPY_CHECKED: bool = false;

/// Whether CUDA tensors take the row-chunked `linear_cross_entropy`
/// (`kernels/loss_chunked.rs`: tensor ops, at most 64 MiB of logits at
/// once) instead of the composed path that materialises all of them. The
/// same code is tested on the CPU against the fused kernel; off until a GPU
/// run of `scripts/gpu_check.sh` has passed `cuda_linear_cross_entropy_...`.
const CUDA_LINEAR_CROSS_ENTROPY_CHECKED: bool = false;

/// Mean cross entropy of `logits [.., classes]` against class ids
/// `targets [..]`, over the positions whose target is not ignored (i64
/// `-100` as in HF/PyTorch, or u32 `u32::MAX`). The loss is an f32 scalar
/// for f32/f16/bf16 logits (f64 for f64; a bf16 log-sum-exp is too coarse to train
/// on); it is 0, with zero gradients, when every target is ignored.
pub fn cross_entropy(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    let (logits, targets) = flatten(logits, targets)?;
    if fused(&logits) {
        kernels::cross_entropy(&logits, &cpu_targets(&targets)?)
    } else if CUDA_CROSS_ENTROPY_CHECKED && fused_cuda(&logits) {
        kernels::cross_entropy(&logits.to_dtype(DType::F32)?, &device_targets(&targets)?)
    } else {
        composed_cross_entropy(&logits, &targets)
    }
}

/// `cross_entropy(x @ w^T, targets)` for `x [.., d]` and `w [classes, d]`
/// (a tied or untied lm_head), without the logits entering the autograd
/// graph on CPU: the fused op keeps them privately and turns them into
/// their gradient in place, saving a `[n, vocab]` gradient accumulator.
pub fn linear_cross_entropy(x: &Tensor, w: &Tensor, targets: &Tensor) -> Result<Tensor> {
    let (x, targets) = flatten(x, targets)?;
    if fused(&x) && x.dtype() == w.dtype() {
        kernels::linear_cross_entropy(&x, w, &cpu_targets(&targets)?)
    } else if CUDA_LINEAR_CROSS_ENTROPY_CHECKED && fused_cuda(&x) && x.dtype() == w.dtype() {
        let targets = device_targets(&targets)?;
        kernels::chunked_linear_cross_entropy(&x, w, &targets, kernels::LOGITS_BUDGET)
    } else {
        composed_linear_cross_entropy(&x, w, &targets)
    }
}

/// Targets as u32 on their own device, i64 `-100` mapped to `u32::MAX` by
/// tensor ops (no host read; an out-of-range class makes the CUDA loss NaN).
fn device_targets(targets: &Tensor) -> Result<Tensor> {
    match targets.dtype() {
        DType::U32 => Ok(targets.clone()),
        DType::I64 => {
            let ignored = targets.lt(0i64)?;
            let max = Tensor::full(u32::MAX, targets.shape(), targets.device())?;
            ignored.where_cond(&max, &targets.to_dtype(DType::U32)?)
        }
        other => bail!("cross_entropy: targets must be u32 or i64, got {other:?}"),
    }
}

/// `[.., c]` and `[..]` as `[n, c]` and `[n]`.
fn flatten(logits: &Tensor, targets: &Tensor) -> Result<(Tensor, Tensor)> {
    let Some((&c, lead)) = logits.dims().split_last() else {
        bail!("cross_entropy: logits must have a class dimension")
    };
    if lead != targets.dims() {
        bail!(
            "cross_entropy: logits {:?} need targets {lead:?}, got {:?}",
            logits.dims(),
            targets.dims()
        )
    }
    if logits.rank() == 2 {
        return Ok((logits.clone(), targets.clone()));
    }
    let n = targets.elem_count();
    Ok((logits.reshape((n, c))?, targets.reshape(n)?))
}

/// CPU u32 targets with ignored positions as `u32::MAX`, as the kernels
/// take them.
fn cpu_targets(targets: &Tensor) -> Result<Tensor> {
    match targets.dtype() {
        DType::U32 => targets.to_device(&Device::Cpu),
        DType::I64 => {
            let v = targets.to_vec1::<i64>()?;
            let mapped = v
                .iter()
                .map(|&t| match t {
                    IGNORE_I64 => Ok(u32::MAX),
                    t if (0..u32::MAX as i64).contains(&t) => Ok(t as u32),
                    t => bail!("cross_entropy: target {t} is neither a class id nor -100"),
                })
                .collect::<Result<Vec<u32>>>()?;
            Tensor::from_vec(mapped, v.len(), &Device::Cpu)
        }
        other => bail!("cross_entropy: targets must be u32 or i64, got {other:?}"),
    }
}

/// Composed cross entropy on `[n, c]` logits: log-softmax in f32, gather,
/// masked mean.
pub fn composed_cross_entropy(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    let (logits, targets) = flatten(logits, targets)?;
    let compute = if logits.dtype() == DType::F64 {
        DType::F64
    } else {
        DType::F32
    };
    let logp = composed_log_softmax_last_dim(&logits.to_dtype(compute)?)?;
    let ignored = match targets.dtype() {
        DType::U32 => targets.eq(u32::MAX as f64)?,
        DType::I64 => targets.eq(IGNORE_I64 as f64)?,
        other => bail!("cross_entropy: targets must be u32 or i64, got {other:?}"),
    };
    let safe = ignored.where_cond(&targets.zeros_like()?, &targets)?;
    let picked = logp.gather(&safe.unsqueeze(1)?, 1)?.squeeze(1)?;
    let valid = ignored.eq(0.0)?.to_dtype(compute)?;
    let count = valid.sum_all()?.clamp(1f32, f32::MAX)?;
    (picked * valid)?.sum_all()?.neg()?.div(&count)
}

/// Composed fused-linear cross entropy: the logits are materialised.
pub fn composed_linear_cross_entropy(x: &Tensor, w: &Tensor, targets: &Tensor) -> Result<Tensor> {
    composed_cross_entropy(&composed_linear(x, w, None, None)?, targets)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::testing::*;

    /// The kernels of `loss.cu` against the CPU kernel: the loss and the
    /// logits' gradient, with ignored rows, a batch whose rows are all
    /// ignored (loss 0, gradient 0), a wide vocabulary and more rows than a
    /// block sums in its first pass; i64 targets through `device_targets`.
    /// What must pass before `CUDA_CROSS_ENTROPY_CHECKED`.
    #[test]
    #[ignore = "needs a CUDA GPU (run scripts/gpu_check.sh)"]
    fn cuda_cross_entropy_matches_the_cpu_kernel_and_its_gradient() -> Result<()> {
        let gpu = accel_kernels::cuda_device(0)
            .unwrap_or_else(|e| panic!("needs a CUDA device (build with --features cuda): {e}"));
        let cpu = Device::Cpu;
        for (k, (n, c)) in [(6usize, 7usize), (2100, 50), (3, 50257)]
            .into_iter()
            .enumerate()
        {
            let x = randn(&[n, c], 200 + k as u64, 4.0)?;
            let ids: Vec<i64> = (0..n)
                .map(|i| {
                    if i % 5 == 3 {
                        IGNORE_I64
                    } else {
                        ((i * 7919) % c) as i64
                    }
                })
                .collect();
            let all_ignored = vec![IGNORE_I64; n];
            for (what, ids) in [("some ignored", &ids), ("all ignored", &all_ignored)] {
                let t = Tensor::new(ids.as_slice(), &cpu)?;
                let run = |dev: &Device| -> Result<(f32, Tensor)> {
                    let v = candle_core::Var::from_tensor(&x.to_device(dev)?)?;
                    let loss = match dev.is_cuda() {
                        true => kernels::cross_entropy(
                            v.as_tensor(),
                            &device_targets(&t.to_device(dev)?)?,
                        )?,
                        false => kernels::cross_entropy(v.as_tensor(), &cpu_targets(&t)?)?,
                    };
                    let grads = (&loss * 3.0)?.backward()?;
                    let dx = grads.get(&v).expect("a gradient").to_device(&cpu)?;
                    Ok((loss.to_device(&cpu)?.to_scalar::<f32>()?, dx))
                };
                let ((want, dx), (got, gdx)) = (run(&cpu)?, run(&gpu)?);
                let tol = 1e-5 * want.abs().max(1.0);
                assert!(
                    (got - want).abs() <= tol,
                    "[{n}, {c}] {what}: loss {got} against {want}"
                );
                if what == "all ignored" {
                    assert_eq!(got, 0.0);
                    assert_eq!(gdx.abs()?.sum_all()?.to_scalar::<f32>()?, 0.0);
                } else {
                    assert_close(&gdx, &dx, 1e-5, &format!("[{n}, {c}] gradient"))?;
                }
            }
        }
        Ok(())
    }

    /// The row-chunked lm head and loss on CUDA against the fused CPU
    /// kernel, f32 and bf16, at GPT-2 small's vocabulary with a budget that
    /// makes several chunks and ignored rows. What must pass before
    /// `CUDA_LINEAR_CROSS_ENTROPY_CHECKED`.
    #[test]
    #[ignore = "needs a CUDA GPU (run scripts/gpu_check.sh)"]
    fn cuda_linear_cross_entropy_matches_the_cpu_kernel_and_its_gradients() -> Result<()> {
        let gpu = accel_kernels::cuda_device(0)
            .unwrap_or_else(|e| panic!("needs a CUDA device (build with --features cuda): {e}"));
        let cpu = Device::Cpu;
        let (n, d, c) = (300, 64, 50257);
        let x = randn(&[n, d], 400, 1.0)?;
        let w = randn(&[c, d], 401, 0.2)?;
        let ids: Vec<i64> = (0..n)
            .map(|i| {
                if i % 9 == 4 {
                    IGNORE_I64
                } else {
                    ((i * 7919) % c) as i64
                }
            })
            .collect();
        let t = Tensor::new(ids.as_slice(), &cpu)?;
        for (dtype, tol) in [(DType::F32, 1e-5), (DType::BF16, 2e-2)] {
            let run = |dev: &Device| -> Result<(f32, Tensor, Tensor)> {
                let xv = candle_core::Var::from_tensor(&x.to_dtype(dtype)?.to_device(dev)?)?;
                let wv = candle_core::Var::from_tensor(&w.to_dtype(dtype)?.to_device(dev)?)?;
                let loss = match dev.is_cuda() {
                    true => kernels::chunked_linear_cross_entropy(
                        xv.as_tensor(),
                        wv.as_tensor(),
                        &device_targets(&t.to_device(dev)?)?,
                        40 * c,
                    )?,
                    false => kernels::linear_cross_entropy(
                        xv.as_tensor(),
                        wv.as_tensor(),
                        &cpu_targets(&t)?,
                    )?,
                };
                let g = loss.backward()?;
                let grad = |v: &candle_core::Var| -> Result<Tensor> {
                    g.get(v.as_tensor())
                        .expect("a gradient")
                        .to_dtype(DType::F32)?
                        .to_device(&cpu)
                };
                Ok((
                    loss.to_device(&cpu)?.to_scalar::<f32>()?,
                    grad(&xv)?,
                    grad(&wv)?,
                ))
            };
            let (want, got) = (run(&cpu)?, run(&gpu)?);
            let rel = (got.0 - want.0).abs() / want.0.abs();
            assert!(
                rel <= tol as f32,
                "{dtype:?}: loss {} against {}",
                got.0,
                want.0
            );
            assert_close(&got.1, &want.1, tol, &format!("{dtype:?}: dx"))?;
            assert_close(&got.2, &want.2, tol, &format!("{dtype:?}: dw"))?;
        }
        Ok(())
    }

    fn targets_u32() -> Result<Tensor> {
        Tensor::new(&[[0u32, 5, u32::MAX], [3, u32::MAX, 6]], &Device::Cpu)
    }

    #[test]
    fn cross_entropy_matches_composed_and_finite_differences_with_ignored_targets() -> Result<()> {
        let t = targets_u32()?;
        check_op(
            &[vec![2, 3, 7]],
            80,
            &|xs| cross_entropy(&xs[0], &t),
            &|xs| composed_cross_entropy(&xs[0], &t),
        )?;
        let t64 = Tensor::new(&[[0i64, 5, -100], [3, -100, 6]], &Device::Cpu)?;
        check_op(
            &[vec![2, 3, 7]],
            81,
            &|xs| cross_entropy(&xs[0], &t64),
            &|xs| composed_cross_entropy(&xs[0], &t64),
        )?;
        check_op(
            &[vec![2, 3, 5], vec![7, 5]],
            82,
            &|xs| linear_cross_entropy(&xs[0], &xs[1], &t),
            &|xs| composed_linear_cross_entropy(&xs[0], &xs[1], &t),
        )
    }

    #[test]
    fn cross_entropy_agrees_with_candle_nn_on_unignored_targets() -> Result<()> {
        let x = randn(&[5, 9], 1, 2.0)?;
        let t = Tensor::new(&[1u32, 0, 8, 4, 4], &Device::Cpu)?;
        let want = candle_nn::loss::cross_entropy(&x, &t)?;
        assert_close(&cross_entropy(&x, &t)?, &want, 1e-6, "fused")?;
        assert_close(&composed_cross_entropy(&x, &t)?, &want, 1e-6, "composed")?;
        // Ignoring a row is the same as dropping it.
        let t2 = Tensor::new(&[1u32, u32::MAX, 8, 4, 4], &Device::Cpu)?;
        let idx = Tensor::new(&[0u32, 2, 3, 4], &Device::Cpu)?;
        let want =
            candle_nn::loss::cross_entropy(&x.index_select(&idx, 0)?, &t.index_select(&idx, 0)?)?;
        assert_close(&cross_entropy(&x, &t2)?, &want, 1e-6, "ignored")
    }

    #[test]
    fn all_ignored_gives_zero_and_bad_targets_are_refused() -> Result<()> {
        let x = candle_core::Var::from_tensor(&randn(&[2, 4], 1, 1.0)?)?;
        let t = Tensor::new(&[-100i64, -100], &Device::Cpu)?;
        let loss = cross_entropy(&x, &t)?;
        assert_eq!(loss.to_scalar::<f32>()?, 0.0);
        let g = loss.backward()?;
        assert_eq!(
            g.get(x.as_tensor())
                .unwrap()
                .abs()?
                .sum_all()?
                .to_scalar::<f32>()?,
            0.0
        );
        assert!(cross_entropy(&x, &Tensor::new(&[4u32, 0], &Device::Cpu)?).is_err());
        assert!(cross_entropy(&x, &Tensor::new(&[-1i64, 0], &Device::Cpu)?).is_err());
        Ok(())
    }

    #[test]
    fn bf16_linear_cross_entropy_matches_f32_on_the_same_values() -> Result<()> {
        // bf16 products where the CPU has them; the reference is the
        // composed f32 loss on the very same values.
        let bf = |shape: &[usize], seed| -> Result<candle_core::Var> {
            candle_core::Var::from_tensor(&randn(shape, seed, 1.0)?.to_dtype(DType::BF16)?)
        };
        let (x, w) = (bf(&[300, 70], 11)?, bf(&[90, 70], 12)?);
        let up = |v: &candle_core::Var| -> Result<candle_core::Var> {
            candle_core::Var::from_tensor(&v.to_dtype(DType::F32)?)
        };
        let (x32, w32) = (up(&x)?, up(&w)?);
        let t: Vec<u32> = (0..300u32).map(|i| (i * 7) % 90).collect();
        let t = Tensor::new(t.as_slice(), &Device::Cpu)?;
        let loss = linear_cross_entropy(&x, &w, &t)?;
        let loss32 = composed_linear_cross_entropy(&x32, &w32, &t)?;
        let (a, b) = (loss.to_scalar::<f32>()?, loss32.to_scalar::<f32>()?);
        assert!((a - b).abs() <= 1e-5 * b.abs(), "loss {a} vs {b}");
        let (grads, grads32) = (loss.backward()?, loss32.backward()?);
        for (v, v32) in [(&x, &x32), (&w, &w32)] {
            let g = grads.get(v.as_tensor()).unwrap().to_dtype(DType::F32)?;
            let e = grads32.get(v32.as_tensor()).unwrap();
            let err = (&g - e)?.abs()?.max_all()?.to_scalar::<f32>()?;
            let scale = e.abs()?.max_all()?.to_scalar::<f32>()?;
            // A bf16 gradient, from the logits' gradient rounded to bf16.
            assert!(err <= 1.6e-2 * scale, "max error {err} at scale {scale}");
        }
        Ok(())
    }

    #[test]
    fn linear_cross_entropy_supports_a_second_backward() -> Result<()> {
        let (x, w) = (
            candle_core::Var::from_tensor(&randn(&[9, 8], 8, 1.0)?)?,
            candle_core::Var::from_tensor(&randn(&[21, 8], 9, 1.0)?)?,
        );
        let t = Tensor::new(&[0u32, 5, 20, 3, 3, 7, 19, 1, 0], &Device::Cpu)?;
        let fused = linear_cross_entropy(&x, &w, &t)?;
        let want = composed_linear_cross_entropy(&x, &w, &t)?.backward()?;
        // The first backward consumes the saved logits; the second recomputes them.
        for _ in 0..2 {
            let got = fused.backward()?;
            for v in [&x, &w] {
                let (g, e) = (
                    got.get(v.as_tensor()).unwrap(),
                    want.get(v.as_tensor()).unwrap(),
                );
                assert_close(g, e, 1e-5, "gradient")?;
            }
        }
        Ok(())
    }
}
