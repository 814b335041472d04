//! Rotary position embeddings with a backward, fused on CPU.
//!
//! cos/sin tables are `[t, d/2]` (candle's `rotary_emb` convention; HF
//! duplicates them to `[t, d]`); [`crate::layers::RotaryEmbedding`] builds
//! them. They are treated as constants: no gradient flows into them on the
//! fused path.

use candle_core::{bail, DType, Result, Tensor, D};

use super::{fused, fused_cuda, upcast};
use crate::kernels;

/// Whether CUDA tensors take the rotation kernel of `rope.cu`. Off until a
/// GPU run of `scripts/gpu_check.sh` has passed `cuda_rope_...` (below); the
/// kernel compiles in CI but has never run.
const CUDA_ROPE_CHECKED: bool = false;

/// Rotates `x [b, h, t, d]` in HF Llama's `rotate_half` convention: the
/// pairs are `(i, i + d/2)`.
pub fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    fused_or_composed(x, cos, sin, false)
}

/// Rotates `x [b, h, t, d]` with interleaved pairs `(2i, 2i + 1)` (GPT-J,
/// the original RoFormer).
pub fn rope_interleaved(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    fused_or_composed(x, cos, sin, true)
}

fn fused_or_composed(x: &Tensor, cos: &Tensor, sin: &Tensor, interleaved: bool) -> Result<Tensor> {
    if fused(x) {
        kernels::rope(x, cos, sin, interleaved)
    } else if CUDA_ROPE_CHECKED && fused_cuda(x) {
        let f32 = |t: &Tensor| t.to_dtype(DType::F32);
        kernels::rope(&f32(x)?, &f32(cos)?, &f32(sin)?, interleaved)?.to_dtype(x.dtype())
    } else {
        composed_rope(x, cos, sin, interleaved)
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

    /// The rotation kernel of `rope.cu` against the CPU kernel, bit for bit
    /// (same products and sums, no contraction), forward and backward, in
    /// both conventions, with more rows than positions (batch and heads).
    /// What must pass before `CUDA_ROPE_CHECKED`.
    #[test]
    #[ignore = "needs a CUDA GPU (run scripts/gpu_check.sh)"]
    fn cuda_rope_is_bitwise_the_cpu_kernel_forward_and_backward() -> Result<()> {
        let gpu = accel_kernels::cuda_device(0)
            .unwrap_or_else(|e| panic!("needs a CUDA device (build with --features cuda): {e}"));
        let cpu = candle_core::Device::Cpu;
        let (cos, sin) = tables(37, 32)?;
        let x = randn(&[2, 3, 37, 64], 80, 1.0)?;
        let g = randn(&[2, 3, 37, 64], 81, 1.0)?;
        for interleaved in [false, true] {
            let run = |dev: &candle_core::Device| -> Result<Vec<Vec<u32>>> {
                let v = candle_core::Var::from_tensor(&x.to_device(dev)?)?;
                let (c, s) = (cos.to_device(dev)?, sin.to_device(dev)?);
                let y = kernels::rope(v.as_tensor(), &c, &s, interleaved)?;
                let grads = (&y * g.to_device(dev)?)?.sum_all()?.backward()?;
                let dx = grads.get(&v).expect("a gradient");
                let bits = |t: &Tensor| -> Result<Vec<u32>> {
                    let v = t.to_device(&cpu)?.flatten_all()?.to_vec1::<f32>()?;
                    Ok(v.into_iter().map(f32::to_bits).collect())
                };
                Ok(vec![bits(&y)?, bits(dx)?])
            };
            let (want, got) = (run(&cpu)?, run(&gpu)?);
            assert!(
                want[0] == got[0],
                "interleaved {interleaved}: forward differs"
            );
            assert!(
                want[1] == got[1],
                "interleaved {interleaved}: gradient differs"
            );
        }
        Ok(())
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
