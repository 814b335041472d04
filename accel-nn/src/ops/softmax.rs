//! Softmax and log-softmax with a backward on every device.
//!
//! candle 0.11's `softmax_last_dim` is a custom op without backward, so a
//! model using it trains nothing before it. These are fused on CPU and
//! composed elsewhere.

use candle_core::shape::Dim;
use candle_core::{DType, Result, Tensor, D};

use super::{fused, fused_cuda, upcast};
use crate::kernels;

/// Softmax over `dim` (any dimension: others are moved last and back).
pub fn softmax<Di: Dim>(x: &Tensor, dim: Di) -> Result<Tensor> {
    along(x, dim, softmax_last_dim)
}

/// Whether CUDA tensors take the row kernels of `softmax.cu`. Off until a
/// GPU run of `scripts/gpu_check.sh` has passed `cuda_softmax_...` (below);
/// the kernels compile in CI but have never run.
const CUDA_SOFTMAX_CHECKED: bool = false;

/// Softmax over the last dimension, differentiable (unlike candle-nn's).
pub fn softmax_last_dim(x: &Tensor) -> Result<Tensor> {
    if fused(x) {
        kernels::softmax_last_dim(x)
    } else if CUDA_SOFTMAX_CHECKED && fused_cuda(x) {
        kernels::softmax_last_dim(&x.to_dtype(DType::F32)?)?.to_dtype(x.dtype())
    } else {
        composed_softmax_last_dim(x)
    }
}

/// Log-softmax over `dim`: the stable way to get log-probabilities (a
/// `log` of a softmax underflows to `-inf`).
pub fn log_softmax<Di: Dim>(x: &Tensor, dim: Di) -> Result<Tensor> {
    along(x, dim, |x| {
        if fused(x) {
            kernels::log_softmax_last_dim(x)
        } else if CUDA_SOFTMAX_CHECKED && fused_cuda(x) {
            kernels::log_softmax_last_dim(&x.to_dtype(DType::F32)?)?.to_dtype(x.dtype())
        } else {
            composed_log_softmax_last_dim(x)
        }
    })
}

/// Applies a last-dimension op along `dim` by transposing there and back.
fn along<Di: Dim>(x: &Tensor, dim: Di, f: impl Fn(&Tensor) -> Result<Tensor>) -> Result<Tensor> {
    let dim = dim.to_index(x.shape(), "softmax")?;
    let last = x.rank() - 1;
    if dim == last {
        return f(x);
    }
    f(&x.transpose(dim, last)?.contiguous()?)?.transpose(dim, last)
}

/// Composed softmax over the last dimension, in f32 for half inputs.
pub fn composed_softmax_last_dim(x: &Tensor) -> Result<Tensor> {
    let dtype = x.dtype();
    let x = upcast(x)?;
    let max = x.max_keepdim(D::Minus1)?.detach();
    let e = x.broadcast_sub(&max)?.exp()?;
    e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?.to_dtype(dtype)
}

/// Composed log-softmax over the last dimension, in f32 for half inputs.
pub fn composed_log_softmax_last_dim(x: &Tensor) -> Result<Tensor> {
    let dtype = x.dtype();
    let x = upcast(x)?;
    let max = x.max_keepdim(D::Minus1)?.detach();
    let shifted = x.broadcast_sub(&max)?;
    let lse = shifted.exp()?.sum_keepdim(D::Minus1)?.log()?;
    shifted.broadcast_sub(&lse)?.to_dtype(dtype)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::testing::*;

    /// The row kernels of `softmax.cu` against the CPU kernel, forward and
    /// gradient, softmax and log-softmax, on rows narrower and wider than a
    /// warp and more rows than one block holds, with large logits (the max
    /// shift matters). What must pass before `CUDA_SOFTMAX_CHECKED`.
    #[test]
    #[ignore = "needs a CUDA GPU (run scripts/gpu_check.sh)"]
    fn cuda_softmax_matches_the_cpu_kernel_and_its_gradient() -> Result<()> {
        let gpu = accel_kernels::cuda_device(0)
            .unwrap_or_else(|e| panic!("needs a CUDA device (build with --features cuda): {e}"));
        let cpu = candle_core::Device::Cpu;
        for (k, (rows, d)) in [(3usize, 7usize), (130, 256), (2, 5000)]
            .into_iter()
            .enumerate()
        {
            let x = randn(&[rows, d], 90 + k as u64, 30.0)?;
            let g = randn(&[rows, d], 95 + k as u64, 1.0)?;
            for log in [false, true] {
                let run = |dev: &candle_core::Device| -> Result<(Tensor, Tensor)> {
                    let v = candle_core::Var::from_tensor(&x.to_device(dev)?)?;
                    let y = match log {
                        true => kernels::log_softmax_last_dim(v.as_tensor())?,
                        false => kernels::softmax_last_dim(v.as_tensor())?,
                    };
                    let grads = (&y * g.to_device(dev)?)?.sum_all()?.backward()?;
                    let dx = grads.get(&v).expect("a gradient").to_device(&cpu)?;
                    Ok((y.to_device(&cpu)?, dx))
                };
                let ((y, dx), (gy, gdx)) = (run(&cpu)?, run(&gpu)?);
                let what = format!("log {log} [{rows}, {d}]");
                assert_close(&gy, &y, 1e-5, &format!("{what} forward"))?;
                // Against the size of the gradient's terms, not its largest entry: with
                // logits of std 30 a row is nearly one-hot and its gradient nearly 0, so a
                // rounding of `g` alone is a large part of it (scripts/cuda_emulate/rows_check.cpp
                // measured 1.2e-5 of the largest entry for f32 sums in another order).
                let dot = |a: &Tensor| a.sum_keepdim(1).and_then(|s| s.abs());
                let terms = if log {
                    (g.abs()? + y.exp()?.broadcast_mul(&dot(&g)?)?)?
                } else {
                    y.abs()?
                        .broadcast_mul(&g.abs()?.broadcast_add(&dot(&(&g * &y)?)?)?)?
                };
                let scale = terms.max_all()?.to_scalar::<f32>()?;
                let err = (&gdx - &dx)?.abs()?.max_all()?.to_scalar::<f32>()? / scale;
                assert!(
                    err <= 1e-5,
                    "{what} gradient: error {err:e} of the terms' size"
                );
            }
        }
        Ok(())
    }

    #[test]
    fn softmax_matches_composed_and_finite_differences_in_every_dtype() -> Result<()> {
        for (dims, dim) in [(vec![3, 5, 7], 2usize), (vec![4, 6, 3], 1)] {
            check_op(
                std::slice::from_ref(&dims),
                1,
                &|xs| softmax(&xs[0], dim),
                &|xs| {
                    let x = xs[0].transpose(dim, 2)?;
                    composed_softmax_last_dim(&x)?.transpose(dim, 2)
                },
            )?;
            check_op(
                std::slice::from_ref(&dims),
                2,
                &|xs| log_softmax(&xs[0], dim),
                &|xs| {
                    let x = xs[0].transpose(dim, 2)?;
                    composed_log_softmax_last_dim(&x)?.transpose(dim, 2)
                },
            )?;
        }
        Ok(())
    }

    #[test]
    fn softmax_agrees_with_candle_nn_forward() -> Result<()> {
        let x = randn(&[4, 9], 3, 2.0)?;
        let want = candle_nn::ops::softmax_last_dim(&x)?;
        assert_close(&softmax_last_dim(&x)?, &want, 1e-6, "softmax")?;
        let want = candle_nn::ops::log_softmax(&x, 1)?;
        assert_close(&log_softmax(&x, 1)?, &want, 1e-6, "log_softmax")
    }
}
