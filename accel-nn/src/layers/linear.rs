//! `Linear`, as candle-nn's, running the fused linear op.

use candle_core::{Module, Result, Tensor};
use candle_nn::{Init, VarBuilder};

use super::lora::{self, LoraLayer, LoraSpec};
use crate::ops::{self, Activation};

/// `x @ weight^T + bias` with weight `[out, in]` (PyTorch `nn.Linear`),
/// plus a LoRA adapter's update when it has one ([`Linear::with_lora`]).
#[derive(Debug, Clone)]
pub struct Linear {
    weight: Tensor,
    bias: Option<Tensor>,
    lora: Option<LoraLayer>,
}

impl Linear {
    /// Wraps existing tensors, as `candle_nn::Linear::new`.
    pub fn new(weight: Tensor, bias: Option<Tensor>) -> Self {
        Self {
            weight,
            bias,
            lora: None,
        }
    }

    /// The layer with a LoRA adapter when `spec` targets its module (the
    /// prefix of `vb`, where its weight lives): `lora_A.weight` and
    /// `lora_B.weight` are asked from `vb` beside the weight, drawn as PEFT
    /// draws them where the source does not hold them.
    ///
    /// # Errors
    /// Those of the weight source.
    pub fn with_lora(mut self, spec: Option<&LoraSpec>, vb: &VarBuilder) -> Result<Self> {
        let (out, inp) = self.weight.dims2()?;
        self.lora = lora::adapter_for(spec, vb, out, inp)?;
        Ok(self)
    }

    /// The layer's LoRA adapter, if any.
    pub fn lora(&self) -> Option<&LoraLayer> {
        self.lora.as_ref()
    }

    /// The `[out, in]` weight.
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    /// The `[out]` bias, if any.
    pub fn bias(&self) -> Option<&Tensor> {
        self.bias.as_ref()
    }

    /// The layer followed by `act`, fused into one op on CPU (saves a pass
    /// over the output and the activation's backward chain).
    pub fn forward_act(&self, x: &Tensor, act: Option<Activation>) -> Result<Tensor> {
        match &self.lora {
            None => ops::linear(x, &self.weight, self.bias.as_ref(), act),
            Some(l) => {
                let y = ops::linear(x, &self.weight, self.bias.as_ref(), None)?;
                lora::forward(l, x, y, act)
            }
        }
    }
}

impl Module for Linear {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.forward_act(x, None)
    }
}

/// A `Linear` with bias under `vb` (`weight`, `bias`), initialised like
/// `candle_nn::linear` (Kaiming-normal weight, uniform ±1/sqrt(in) bias).
pub fn linear(in_dim: usize, out_dim: usize, vb: VarBuilder) -> Result<Linear> {
    let w = vb.get_with_hints(
        (out_dim, in_dim),
        "weight",
        candle_nn::init::DEFAULT_KAIMING_NORMAL,
    )?;
    let bound = 1.0 / (in_dim as f64).sqrt();
    let init = Init::Uniform {
        lo: -bound,
        up: bound,
    };
    let b = vb.get_with_hints(out_dim, "bias", init)?;
    Ok(Linear::new(w, Some(b)))
}

/// A `Linear` without bias under `vb` (`weight`).
pub fn linear_no_bias(in_dim: usize, out_dim: usize, vb: VarBuilder) -> Result<Linear> {
    let w = vb.get_with_hints(
        (out_dim, in_dim),
        "weight",
        candle_nn::init::DEFAULT_KAIMING_NORMAL,
    )?;
    Ok(Linear::new(w, None))
}

/// [`linear`] or [`linear_no_bias`], picked by `bias` (HF's `*_bias` flags).
pub fn linear_b(in_dim: usize, out_dim: usize, bias: bool, vb: VarBuilder) -> Result<Linear> {
    linear_b_lora(in_dim, out_dim, bias, vb, None)
}

/// [`linear_b`] with a LoRA adapter where `lora` targets the module (see
/// [`Linear::with_lora`]).
pub fn linear_b_lora(
    in_dim: usize,
    out_dim: usize,
    bias: bool,
    vb: VarBuilder,
    lora: Option<&LoraSpec>,
) -> Result<Linear> {
    let layer = if bias {
        linear(in_dim, out_dim, vb.clone())?
    } else {
        linear_no_bias(in_dim, out_dim, vb.clone())?
    };
    layer.with_lora(lora, &vb)
}
