//! Differentiable ops in candle-nn's `ops` style, one file per family.
//!
//! Every op has a backward in f32, bf16 and f16. Half-precision inputs are
//! computed in f32 inside and returned in their own dtype. On CPU the hot
//! ops run as fused kernels (custom ops with hand-written `bwd`); on other
//! devices they are composed from candle ops, which have a backward
//! everywhere. The composed forms are public in [`composed`] so the two
//! paths can be checked against each other on CPU.

use candle_core::{DType, Result, Tensor};

mod activation;
mod attention;
pub(crate) mod dropout;
mod linear;
mod loss;
mod norm;
mod quantized;
mod rope;
mod softmax;

pub use crate::kernels::{
    attention_kernel, bf16_path, quant_path, with_bf16_path, with_quant_path, AttentionKernel,
    Bf16Path, QuantPath,
};
pub use activation::{gelu, gelu_tanh, relu, silu, swiglu, Activation};
pub use attention::{
    attention_qkv, cuda_flash_attention, scaled_dot_product_attention, AttentionMask,
};
pub use dropout::dropout;
pub use linear::linear;
pub use loss::{cross_entropy, linear_cross_entropy};
pub use norm::{layer_norm, rms_norm};
pub use quantized::quantized_linear;
pub use rope::{rope, rope_interleaved};
pub use softmax::{log_softmax, softmax, softmax_last_dim};

/// The composed (candle-op) forms of the fused ops: what runs on CUDA and
/// other devices, and the reference the fused CPU kernels are tested
/// against. Same signatures and results as the ops of the parent module.
pub mod composed {
    pub use super::activation::composed_activation as activation;
    pub use super::activation::composed_swiglu as swiglu;
    pub use super::attention::composed_attention as scaled_dot_product_attention;
    pub use super::attention::composed_attention_qkv as attention_qkv;
    pub use super::linear::composed_linear as linear;
    pub use super::loss::{
        composed_cross_entropy as cross_entropy,
        composed_linear_cross_entropy as linear_cross_entropy,
    };
    pub use super::norm::{composed_layer_norm as layer_norm, composed_rms_norm as rms_norm};
    pub use super::rope::composed_rope as rope;
    pub use super::softmax::{
        composed_log_softmax_last_dim as log_softmax_last_dim,
        composed_softmax_last_dim as softmax_last_dim,
    };
}

/// Whether `t` takes the fused CPU kernels: a CPU tensor of a dtype they
/// handle (f64 and integer tensors go the composed way).
fn fused(t: &Tensor) -> bool {
    t.device().is_cpu() && fused_dtype(t)
}

/// Whether `t` takes accel-kernels' CUDA kernels (the norms have them): a
/// CUDA tensor of a dtype [`fused`] takes, in a build with the `cuda`
/// feature (which brings the kernels; a CUDA tensor can exist without it
/// when another crate turns on candle's).
fn fused_cuda(t: &Tensor) -> bool {
    cfg!(feature = "cuda") && t.device().is_cuda() && fused_dtype(t)
}

/// The dtypes the fused kernels handle.
fn fused_dtype(t: &Tensor) -> bool {
    matches!(t.dtype(), DType::F32 | DType::F16 | DType::BF16)
}

/// `t` in f32 when it is f16/bf16, else unchanged: the composed paths do
/// their arithmetic there, as PyTorch autocast does for norms and softmax.
fn upcast(t: &Tensor) -> Result<Tensor> {
    match t.dtype() {
        DType::F16 | DType::BF16 => t.to_dtype(DType::F32),
        _ => Ok(t.clone()),
    }
}

#[cfg(test)]
pub(crate) mod testing;

#[cfg(test)]
mod candle_nn_tests;

#[cfg(test)]
mod tests {
    //! The composed paths (what CUDA runs) in half precision: every one
    //! must accept f16/bf16, return the input dtype (losses f32) and give
    //! finite gradients of the input dtype.

    use candle_core::{DType, Device, Result, Tensor, Var};

    use super::testing::randn;
    use super::*;

    #[test]
    fn every_composed_op_runs_and_differentiates_in_half_precision() -> Result<()> {
        for dtype in [DType::BF16, DType::F16] {
            let var = |shape: &[usize], seed| -> Result<Var> {
                Var::from_tensor(&randn(shape, seed, 1.0)?.to_dtype(dtype)?)
            };
            let (x, w, b) = (var(&[2, 3, 8], 1)?, var(&[8], 2)?, var(&[8], 3)?);
            let (q, k) = (var(&[2, 4, 3, 8], 4)?, var(&[2, 2, 3, 8], 5)?);
            let lw = var(&[5, 8], 6)?;
            let angles = randn(&[3, 4], 7, 1.0)?;
            let (cos, sin) = (angles.cos()?, angles.sin()?);
            let mask = AttentionMask::CausalAndAdditive {
                offset: 0,
                bias: Tensor::zeros((2, 1, 1, 3), dtype, &Device::Cpu)?,
            };
            let targets = Tensor::new(&[[1u32, 4, u32::MAX], [0, 2, 3]], &Device::Cpu)?;
            let outs = [
                composed::softmax_last_dim(&x)?,
                composed::log_softmax_last_dim(&x)?,
                composed::layer_norm(&x, &w, Some(&b), 1e-5)?,
                composed::rms_norm(&x, &w, 1e-5)?,
                composed::activation(&x, Some(Activation::Gelu))?,
                composed::swiglu(&x, &x)?,
                composed::linear(&x, &lw, None, Some(Activation::Silu))?,
                composed::rope(&q, &cos, &sin, false)?,
                composed::scaled_dot_product_attention(&q, &k, &k, &mask, 0.3)?,
                composed::attention_qkv(&x.narrow(2, 0, 6)?, 2, &mask, 0.3)?,
            ];
            let mut total = Tensor::zeros((), DType::F32, &Device::Cpu)?;
            for (i, y) in outs.iter().enumerate() {
                assert_eq!(y.dtype(), dtype, "{dtype:?} op {i}");
                total = (total + y.to_dtype(DType::F32)?.sum_all()?)?;
            }
            let ce = composed::cross_entropy(&x.narrow(2, 0, 5)?, &targets)?;
            let lce = composed::linear_cross_entropy(&x, &lw, &targets)?;
            assert_eq!((ce.dtype(), lce.dtype()), (DType::F32, DType::F32));
            let grads = (total + ce + lce)?.backward()?;
            for (i, v) in [&x, &w, &b, &q, &k, &lw].into_iter().enumerate() {
                let g = grads.get(v.as_tensor()).expect("gradient");
                assert_eq!(g.dtype(), dtype, "{dtype:?} gradient {i}");
                let s = g
                    .to_dtype(DType::F32)?
                    .abs()?
                    .sum_all()?
                    .to_scalar::<f32>()?;
                assert!(s.is_finite() && s > 0.0, "{dtype:?} gradient {i}: {s}");
            }
        }
        Ok(())
    }
}
