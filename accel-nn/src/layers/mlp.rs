//! The gated MLP of Llama-style models.

use candle_core::{Module, Result, Tensor};
use candle_nn::VarBuilder;

use super::linear::{linear_b_with, Linear};
use super::lora::LoraSpec;
use super::quantized::QuantSpec;
use crate::ops;

/// `down_proj(silu(gate_proj(x)) * up_proj(x))`, HF's `LlamaMLP` with its
/// parameter names.
#[derive(Debug, Clone)]
pub struct SwiGluMlp {
    gate_proj: Linear,
    up_proj: Linear,
    down_proj: Linear,
}

impl SwiGluMlp {
    /// From existing layers.
    pub fn new(gate_proj: Linear, up_proj: Linear, down_proj: Linear) -> Self {
        Self {
            gate_proj,
            up_proj,
            down_proj,
        }
    }

    /// The gate projection `[intermediate, hidden]`.
    pub fn gate_proj(&self) -> &Linear {
        &self.gate_proj
    }

    /// The up projection `[intermediate, hidden]`.
    pub fn up_proj(&self) -> &Linear {
        &self.up_proj
    }

    /// The down projection `[hidden, intermediate]`.
    pub fn down_proj(&self) -> &Linear {
        &self.down_proj
    }
}

impl Module for SwiGluMlp {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let h = ops::swiglu(&self.gate_proj.forward(x)?, &self.up_proj.forward(x)?)?;
        self.down_proj.forward(&h)
    }
}

/// A `SwiGluMlp` under `vb` (`gate_proj`, `up_proj`, `down_proj`), with
/// biases when `bias` (HF's `mlp_bias`).
pub fn swiglu_mlp(
    hidden: usize,
    intermediate: usize,
    bias: bool,
    vb: VarBuilder,
) -> Result<SwiGluMlp> {
    swiglu_mlp_lora(hidden, intermediate, bias, vb, None)
}

/// [`swiglu_mlp`] with LoRA adapters on the projections `lora` targets.
pub fn swiglu_mlp_lora(
    hidden: usize,
    intermediate: usize,
    bias: bool,
    vb: VarBuilder,
    lora: Option<&LoraSpec>,
) -> Result<SwiGluMlp> {
    swiglu_mlp_with(hidden, intermediate, bias, vb, lora, None)
}

/// [`swiglu_mlp_lora`] whose quantized projections compute as `quant` says.
pub fn swiglu_mlp_with(
    hidden: usize,
    intermediate: usize,
    bias: bool,
    vb: VarBuilder,
    lora: Option<&LoraSpec>,
    quant: Option<&QuantSpec>,
) -> Result<SwiGluMlp> {
    let proj = |i, o, name| linear_b_with(i, o, bias, vb.pp(name), lora, quant);
    Ok(SwiGluMlp::new(
        proj(hidden, intermediate, "gate_proj")?,
        proj(hidden, intermediate, "up_proj")?,
        proj(intermediate, hidden, "down_proj")?,
    ))
}
