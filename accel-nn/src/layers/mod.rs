//! Layers with candle-nn's constructor signatures and VarBuilder names, so
//! a candle-nn model moves over by changing its imports; every forward is
//! differentiable (fused on CPU, composed elsewhere) in f32, bf16 and f16.

mod dropout;
mod embedding;
mod kv_cache;
mod linear;
mod lora;
mod mlp;
mod moe;
mod norm;
mod quantized;
mod rotary;

pub use crate::ops::Activation;
pub use dropout::Dropout;
pub use embedding::{embedding, Embedding};
pub use kv_cache::KvCache;
pub use linear::{linear, linear_b, linear_b_lora, linear_b_with, linear_no_bias, Linear};
pub use lora::{LoraLayer, LoraSpec};
pub use mlp::{swiglu_mlp, swiglu_mlp_lora, swiglu_mlp_with, SwiGluMlp};
pub use moe::{load_balancing_loss, ExpertNames, RouterStats, SparseMoe};
pub use norm::{layer_norm, layer_norm_no_bias, rms_norm, LayerNorm, RmsNorm};
pub use quantized::{QuantSpec, QuantizedWeight};
pub use rotary::{Llama3RopeScaling, RotaryEmbedding};

#[cfg(test)]
mod tests;
