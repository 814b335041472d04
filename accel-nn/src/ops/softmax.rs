//! Softmax and log-softmax with a backward on every device.
//!
//! candle 0.11's `softmax_last_dim` is a custom op without backward, so a
//! model using it trains nothing before it. These are fused on CPU and
//! composed elsewhere.

use candle_core::shape::Dim;
use candle_core::{Result, Tensor, D};

use super::{fused, upcast};
use crate::kernels;

/// Softmax over `dim` (any dimension: others are moved last and back).
pub fn softmax<Di: Dim>(x: &Tensor, dim: Di) -> Result<Tensor> {
    along(x, dim, softmax_last_dim)
}

/// Softmax over the last dimension, differentiable (unlike candle-nn's).
pub fn softmax_last_dim(x: &Tensor) -> Result<Tensor> {
    if fused(x) {
        kernels::softmax_last_dim(x)
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
