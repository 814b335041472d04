//! Rotary position embeddings with a backward, fused on CPU.
//!
//! cos/sin tables are `[t, d/2]` (candle's `rotary_emb` convention; HF
//! duplicates them to `[t, d]`); [`crate::layers::RotaryEmbedding`] builds
//! them. They are treated as constants: no gradient flows into them on the
//! fused path.

use candle_core::{bail, Result, Tensor, D};

use super::{fused, upcast};
use crate::kernels;

/// Rotates `x [b, h, t, d]` in HF Llama's `rotate_half` convention: the
/// pairs are `(i, i + d/2)`.
pub fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    if fused(x) {
        kernels::rope(x, cos, sin, false)
    } else {
        composed_rope(x, cos, sin, false)
    }
}

/// Rotates `x [b, h, t, d]` with interleaved pairs `(2i, 2i + 1)` (GPT-J,
/// the original RoFormer).
pub fn rope_interleaved(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    if fused(x) {
        kernels::rope(x, cos, sin, true)
    } else {
        composed_rope(x, cos, sin, true)
    }
}

/// Composed rotation, in f32 for half inputs.
pub fn composed_rope(x: &Tensor, cos: &Tensor, sin: &Tensor, interleaved: bool) -> Result<Tensor> {
    let dtype = x.dtype();
    let x = upcast(x)?;
    let (b, h, t, d) = x.dims4()?;
    let half = d / 2;
    if d % 2 != 0 || cos.dims() != [t, half] || sin.dims() != [t, half] {
        bail!(
            "rope: x {:?} needs cos/sin [{t}, {half}], got {:?}",
            x.dims(),
            cos.dims()
        )
    }
    let y = if interleaved {
        let x = x.reshape((b, h, t, half, 2))?;
        let (x0, x1) = (x.narrow(4, 0, 1)?, x.narrow(4, 1, 1)?);
        let cos = cos.to_dtype(x.dtype())?.reshape((1, 1, t, half, 1))?;
        let sin = sin.to_dtype(x.dtype())?.reshape((1, 1, t, half, 1))?;
        let y0 = (x0.broadcast_mul(&cos)? - x1.broadcast_mul(&sin)?)?;
        let y1 = (x0.broadcast_mul(&sin)? + x1.broadcast_mul(&cos)?)?;
        Tensor::cat(&[y0, y1], 4)?.reshape((b, h, t, d))?
    } else {
        let (x1, x2) = (
            x.narrow(D::Minus1, 0, half)?,
            x.narrow(D::Minus1, half, half)?,
        );
        let cos = cos.to_dtype(x.dtype())?.reshape((1, 1, t, half))?;
        let sin = sin.to_dtype(x.dtype())?.reshape((1, 1, t, half))?;
        let y1 = (x1.broadcast_mul(&cos)? - x2.broadcast_mul(&sin)?)?;
        let y2 = (x2.broadcast_mul(&cos)? + x1.broadcast_mul(&sin)?)?;
        Tensor::cat(&[y1, y2], D::Minus1)?
    };
    y.to_dtype(dtype)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::testing::*;

    fn tables(t: usize, half: usize) -> Result<(Tensor, Tensor)> {
        let angles = randn(&[t, half], 77, 2.0)?;
        Ok((angles.cos()?, angles.sin()?))
    }

    #[test]
    fn rope_matches_composed_and_finite_differences_in_both_conventions() -> Result<()> {
        let (cos, sin) = tables(5, 4)?;
        check_op(
            &[vec![2, 3, 5, 8]],
            50,
            &|xs| rope(&xs[0], &cos, &sin),
            &|xs| composed_rope(&xs[0], &cos, &sin, false),
        )?;
        check_op(
            &[vec![2, 3, 5, 8]],
            51,
            &|xs| rope_interleaved(&xs[0], &cos, &sin),
            &|xs| composed_rope(&xs[0], &cos, &sin, true),
        )
    }

    #[test]
    fn rope_agrees_with_candle_nn_forward() -> Result<()> {
        let (cos, sin) = tables(6, 8)?;
        let x = randn(&[1, 2, 6, 16], 9, 1.0)?;
        let want = candle_nn::rotary_emb::rope(&x, &cos, &sin)?;
        assert_close(&rope(&x, &cos, &sin)?, &want, 1e-6, "rope")?;
        let want = candle_nn::rotary_emb::rope_i(&x, &cos, &sin)?;
        assert_close(&rope_interleaved(&x, &cos, &sin)?, &want, 1e-6, "rope_i")
    }
}
