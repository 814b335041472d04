//! `Linear`, as candle-nn's, running the fused linear op.

use candle_core::{Module, Result, Tensor};
use candle_nn::{Init, VarBuilder};

use super::lora::{self, LoraLayer, LoraSpec};
use super::quantized::{QuantSpec, QuantizedWeight};
use crate::ops::{self, Activation};

/// `x @ weight^T + bias` with weight `[out, in]` (PyTorch `nn.Linear`),
/// plus a LoRA adapter's update when it has one ([`Linear::with_lora`]).
/// The weight may be quantized (bitsandbytes' `Linear4bit` /
/// `Linear8bitLt`): frozen, and multiplied without being dequantized whole.
#[derive(Debug, Clone)]
pub struct Linear {
    weight: Tensor,
    quantized: Option<QuantizedWeight>,
    bias: Option<Tensor>,
    lora: Option<LoraLayer>,
}

impl Linear {
    /// Wraps existing tensors, as `candle_nn::Linear::new`.
    pub fn new(weight: Tensor, bias: Option<Tensor>) -> Self {
        Self {
            weight,
            quantized: None,
            bias,
            lora: None,
        }
    }

    /// A layer over a quantized weight.
    pub fn from_quantized(weight: QuantizedWeight, bias: Option<Tensor>) -> Self {
        Self {
            weight: weight.packed().clone(),
            quantized: Some(weight),
            bias,
            lora: None,
        }
    }

    /// The quantized weight, for a layer whose module was quantized.
    pub fn quantized(&self) -> Option<&QuantizedWeight> {
        self.quantized.as_ref()
    }

    /// `(out, in)`.
    ///
    /// # Errors
    /// A dense weight that is not 2-D.
    pub fn dims(&self) -> Result<(usize, usize)> {
        match &self.quantized {
            Some(q) => Ok(q.dims()),
            None => self.weight.dims2(),
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
        let (out, inp) = self.dims()?;
        self.lora = lora::adapter_for(spec, vb, out, inp)?;
        Ok(self)
    }

    /// The layer's LoRA adapter, if any.
    pub fn lora(&self) -> Option<&LoraLayer> {
        self.lora.as_ref()
    }

    /// The `[out, in]` weight; for a quantized layer, its packed codes (u8,
    /// see [`Linear::quantized`]).
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
        let base = |act| match &self.quantized {
            Some(q) => ops::quantized_linear(x, q, self.bias.as_ref(), act),
            None => ops::linear(x, &self.weight, self.bias.as_ref(), act),
        };
        match &self.lora {
            None => base(act),
            Some(l) => lora::forward(l, x, base(None)?, act),
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
/// A source holding the module quantized gives a quantized layer.
pub fn linear(in_dim: usize, out_dim: usize, vb: VarBuilder) -> Result<Linear> {
    linear_b_with(in_dim, out_dim, true, vb, None, None)
}

/// A `Linear` without bias under `vb` (`weight`).
pub fn linear_no_bias(in_dim: usize, out_dim: usize, vb: VarBuilder) -> Result<Linear> {
    linear_b_with(in_dim, out_dim, false, vb, None, None)
}

/// The layer's weight: quantized when the source holds it so (see
/// [`QuantizedWeight::from_var_builder`]), else dense.
fn weight_at(
    in_dim: usize,
    out_dim: usize,
    bias: bool,
    vb: &VarBuilder,
    quant: Option<&QuantSpec>,
) -> Result<Linear> {
    // The weight before the bias: the order transformers registers them in.
    let quantized = QuantizedWeight::from_var_builder(vb, out_dim, in_dim, quant)?;
    let dense = match quantized {
        Some(_) => None,
        None => Some(vb.get_with_hints(
            (out_dim, in_dim),
            "weight",
            candle_nn::init::DEFAULT_KAIMING_NORMAL,
        )?),
    };
    let b = if bias {
        let bound = 1.0 / (in_dim as f64).sqrt();
        let init = Init::Uniform {
            lo: -bound,
            up: bound,
        };
        Some(vb.get_with_hints(out_dim, "bias", init)?)
    } else {
        None
    };
    Ok(match (quantized, dense) {
        (Some(q), _) => Linear::from_quantized(q, b),
        (None, Some(w)) => Linear::new(w, b),
        (None, None) => unreachable!("a dense weight is read when there is no quantized one"),
    })
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
    linear_b_with(in_dim, out_dim, bias, vb, lora, None)
}

/// [`linear_b_lora`] whose quantized weight, when the source holds one,
/// computes as `quant` says (bitsandbytes' compute dtype).
pub fn linear_b_with(
    in_dim: usize,
    out_dim: usize,
    bias: bool,
    vb: VarBuilder,
    lora: Option<&LoraSpec>,
    quant: Option<&QuantSpec>,
) -> Result<Linear> {
    weight_at(in_dim, out_dim, bias, &vb, quant)?.with_lora(lora, &vb)
}
