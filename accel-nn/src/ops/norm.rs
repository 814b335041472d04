//! Layer norm and RMS norm with a backward for the input, weight and bias.
//!
//! candle 0.11's `candle_nn::ops::{layer_norm, rms_norm}` have no backward
//! (and `candle_nn::LayerNorm::forward` dispatches to them), which is how a
//! candle-transformers BERT ends up with no gradients at all. Statistics are
//! computed in f32 for half inputs: a bf16 variance keeps almost no bits.

use candle_core::{DType, Result, Tensor, D};

use super::{fused, fused_cuda, upcast};
use crate::kernels;

/// `(x - mean) / sqrt(var + eps) * w [+ b]` over the last dimension
/// (PyTorch `layer_norm` with the biased variance).
///
/// On CPU and CUDA this is one op forward and one backward (on CUDA in f32,
/// half inputs converted around it, as the composed path computes them).
pub fn layer_norm(x: &Tensor, w: &Tensor, b: Option<&Tensor>, eps: f64) -> Result<Tensor> {
    if fused(x) {
        kernels::layer_norm(x, w, b, eps)
    } else if fused_cuda(x) {
        let b = b.map(|b| b.to_dtype(DType::F32)).transpose()?;
        kernels::layer_norm(
            &x.to_dtype(DType::F32)?,
            &w.to_dtype(DType::F32)?,
            b.as_ref(),
            eps,
        )?
        .to_dtype(x.dtype())
    } else {
        composed_layer_norm(x, w, b, eps)
    }
}

/// `x / sqrt(mean(x^2) + eps) * w` over the last dimension (Llama's RMSNorm),
/// one op on CPU and CUDA like [`layer_norm`].
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    if fused(x) {
        kernels::rms_norm(x, w, eps)
    } else if fused_cuda(x) {
        kernels::rms_norm(&x.to_dtype(DType::F32)?, &w.to_dtype(DType::F32)?, eps)?
            .to_dtype(x.dtype())
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

    /// The CUDA row kernels against the composed ops on the same GPU, and the
    /// gradients of x, w and b against the CPU kernel's: shapes whose rows
    /// are not a multiple of a block's 8 warps or of the 64-row partial
    /// sums, widths not a multiple of 32, and bf16 inputs.
    #[test]
    #[ignore = "needs a CUDA GPU (run scripts/gpu_check.sh)"]
    fn cuda_norms_match_the_composed_ops_and_the_cpu_gradients() -> Result<()> {
        let gpu = accel_kernels::cuda_device(0)
            .unwrap_or_else(|e| panic!("needs a CUDA device (build with --features cuda): {e}"));
        for (k, (rows, d)) in [(3usize, 50usize), (130, 256), (2, 1000), (1, 1)]
            .into_iter()
            .enumerate()
        {
            let seed = 10 * k as u64;
            let (x, w, b) = (
                randn(&[rows, d], seed, 2.0)?.affine(1.0, 0.5)?,
                randn(&[d], seed + 1, 1.0)?,
                randn(&[d], seed + 2, 1.0)?,
            );
            let g = randn(&[rows, d], seed + 3, 1.0)?;
            for rms in [false, true] {
                let norm = |x: &Tensor, w: &Tensor, b: &Tensor| {
                    if rms {
                        rms_norm(x, w, 1e-6)
                    } else {
                        layer_norm(x, w, Some(b), 1e-5)
                    }
                };
                let composed = |x: &Tensor, w: &Tensor, b: &Tensor| {
                    if rms {
                        composed_rms_norm(x, w, 1e-6)
                    } else {
                        composed_layer_norm(x, w, Some(b), 1e-5)
                    }
                };
                let what = format!(
                    "{} [{rows}, {d}]",
                    if rms { "rms_norm" } else { "layer_norm" }
                );
                // Gradients of sum(norm(x, w, b) * g) on the CPU (the fused kernel) and the GPU.
                let grads = |dev: &candle_core::Device| -> Result<(Tensor, Vec<Tensor>)> {
                    let vars = [&x, &w, &b]
                        .map(|t| candle_core::Var::from_tensor(&t.to_device(dev)?))
                        .into_iter()
                        .collect::<Result<Vec<_>>>()?;
                    let y = norm(
                        vars[0].as_tensor(),
                        vars[1].as_tensor(),
                        vars[2].as_tensor(),
                    )?;
                    let gs = (&y * g.to_device(dev)?)?.sum_all()?.backward()?;
                    let n = if rms { 2 } else { 3 };
                    let dx = vars[..n]
                        .iter()
                        .map(|v| {
                            let g = gs.get(v.as_tensor()).expect("a gradient");
                            g.to_device(&candle_core::Device::Cpu)
                        })
                        .collect::<Result<Vec<_>>>()?;
                    Ok((y.to_device(&candle_core::Device::Cpu)?, dx))
                };
                let (y_gpu, g_gpu) = grads(&gpu)?;
                let (y_cpu, g_cpu) = grads(&candle_core::Device::Cpu)?;
                let (xg, wg, bg) = (x.to_device(&gpu)?, w.to_device(&gpu)?, b.to_device(&gpu)?);
                let want = composed(&xg, &wg, &bg)?.to_device(&candle_core::Device::Cpu)?;
                assert_close(
                    &y_gpu,
                    &want,
                    1e-5,
                    &format!("{what} vs composed on the GPU"),
                )?;
                assert_close(&y_gpu, &y_cpu, 1e-5, &format!("{what} vs the CPU kernel"))?;
                for (i, (got, want)) in g_gpu.iter().zip(&g_cpu).enumerate() {
                    assert_close(
                        got,
                        want,
                        1e-4,
                        &format!("{what} gradient {i} vs the CPU kernel"),
                    )?;
                }
                // bf16 in, bf16 out, computed in f32 like the composed path.
                let xh = xg.to_dtype(DType::BF16)?;
                let got = norm(&xh, &wg, &bg)?;
                assert_eq!(got.dtype(), DType::BF16);
                let want = composed(&xh, &wg, &bg)?;
                assert_close(&got, &want, 1e-2, &format!("{what} in bf16"))?;
            }
        }
        Ok(())
    }
}
