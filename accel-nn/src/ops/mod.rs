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
mod rope;
mod softmax;

pub use activation::{gelu, gelu_tanh, relu, silu, swiglu, Activation};
pub use attention::{attention_qkv, scaled_dot_product_attention, AttentionMask};
pub use dropout::dropout;
pub use linear::linear;
pub use loss::{cross_entropy, linear_cross_entropy};
pub use norm::{layer_norm, rms_norm};
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
    t.device().is_cpu() && matches!(t.dtype(), DType::F32 | DType::F16 | DType::BF16)
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
