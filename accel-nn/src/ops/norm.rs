//! Layer norm and RMS norm with a backward for the input, weight and bias.
//!
//! candle 0.11's `candle_nn::ops::{layer_norm, rms_norm}` have no backward
//! (and `candle_nn::LayerNorm::forward` dispatches to them), which is how a
//! candle-transformers BERT ends up with no gradients at all. Statistics are
//! computed in f32 for half inputs: a bf16 variance keeps almost no bits.

use candle_core::{Result, Tensor, D};

use super::{fused, upcast};
use crate::kernels;

/// `(x - mean) / sqrt(var + eps) * w [+ b]` over the last dimension
/// (PyTorch `layer_norm` with the biased variance).
pub fn layer_norm(x: &Tensor, w: &Tensor, b: Option<&Tensor>, eps: f64) -> Result<Tensor> {
    if fused(x) {
        kernels::layer_norm(x, w, b, eps)
    } else {
        composed_layer_norm(x, w, b, eps)
    }
}

/// `x / sqrt(mean(x^2) + eps) * w` over the last dimension (Llama's RMSNorm).
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    if fused(x) {
        kernels::rms_norm(x, w, eps)
    } else {
        composed_rms_norm(x, w, eps)
    }
}

/// Composed layer norm: statistics in f32 for half inputs, the affine part
/// in the input dtype's compute type, result in the input dtype.
pub fn composed_layer_norm(x: &Tensor, w: &Tensor, b: Option<&Tensor>, eps: f64) -> Result<Tensor> {
    let dtype = x.dtype();
    let x = upcast(x)?;
    let mean = x.mean_keepdim(D::Minus1)?;
    let centred = x.broadcast_sub(&mean)?;
    let var = centred.sqr()?.mean_keepdim(D::Minus1)?;
    let y = centred
        .broadcast_div(&(var + eps)?.sqrt()?)?
        .broadcast_mul(&w.to_dtype(x.dtype())?)?;
    let y = match b {
        Some(b) => y.broadcast_add(&b.to_dtype(x.dtype())?)?,
        None => y,
    };
    y.to_dtype(dtype)
}

/// Composed RMS norm, computed like [`composed_layer_norm`].
pub fn composed_rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    let dtype = x.dtype();
    let x = upcast(x)?;
    let ms = x.sqr()?.mean_keepdim(D::Minus1)?;
    x.broadcast_div(&(ms + eps)?.sqrt()?)?
        .broadcast_mul(&w.to_dtype(x.dtype())?)?
        .to_dtype(dtype)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::testing::*;

    #[test]
    fn layer_norm_matches_composed_and_finite_differences() -> Result<()> {
        let shapes = [vec![2, 5, 24], vec![24], vec![24]];
        check_op(
            &shapes,
            4,
            &|xs| layer_norm(&xs[0], &xs[1], Some(&xs[2]), 1e-5),
            &|xs| composed_layer_norm(&xs[0], &xs[1], Some(&xs[2]), 1e-5),
        )?;
        check_op(
            &shapes[..2],
            5,
            &|xs| layer_norm(&xs[0], &xs[1], None, 1e-5),
            &|xs| composed_layer_norm(&xs[0], &xs[1], None, 1e-5),
        )
    }

    #[test]
    fn rms_norm_matches_composed_and_finite_differences() -> Result<()> {
        check_op(
            &[vec![3, 4, 16], vec![16]],
            6,
            &|xs| rms_norm(&xs[0], &xs[1], 1e-6),
            &|xs| composed_rms_norm(&xs[0], &xs[1], 1e-6),
        )
    }

    #[test]
    fn norms_agree_with_candle_nn_forward() -> Result<()> {
        let (x, w, b) = (
            randn(&[7, 32], 1, 3.0)?,
            randn(&[32], 2, 1.0)?,
            randn(&[32], 3, 1.0)?,
        );
        let want = candle_nn::ops::layer_norm(&x, &w, &b, 1e-5)?;
        assert_close(
            &layer_norm(&x, &w, Some(&b), 1e-5)?,
            &want,
            1e-5,
            "layer_norm",
        )?;
        let want = candle_nn::ops::rms_norm(&x, &w, 1e-5)?;
        assert_close(&rms_norm(&x, &w, 1e-5)?, &want, 1e-5, "rms_norm")
    }
}
