//! `LayerNorm` and `RmsNorm`, as candle-nn's but with a backward.
//!
//! `candle_nn::LayerNorm::forward` sends contiguous inputs to a custom op
//! without backward; these run [`crate::ops::layer_norm`] and
//! [`crate::ops::rms_norm`] instead.

use candle_core::{Module, Result, Tensor};
use candle_nn::{Init, LayerNormConfig, VarBuilder};

use crate::ops;

/// Layer normalisation over the last dimension (or RMS normalisation when
/// built with `remove_mean: false`, as candle-nn allows).
#[derive(Debug, Clone)]
pub struct LayerNorm {
    weight: Tensor,
    bias: Option<Tensor>,
    remove_mean: bool,
    eps: f64,
}

impl LayerNorm {
    /// With weight and bias, as `candle_nn::LayerNorm::new`.
    pub fn new(weight: Tensor, bias: Tensor, eps: f64) -> Self {
        Self {
            weight,
            bias: Some(bias),
            remove_mean: true,
            eps,
        }
    }

    /// Without bias (e.g. OLMo, some GPT-NeoX variants).
    pub fn new_no_bias(weight: Tensor, eps: f64) -> Self {
        Self {
            weight,
            bias: None,
            remove_mean: true,
            eps,
        }
    }

    /// The `[d]` scale.
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    /// The `[d]` shift, if any.
    pub fn bias(&self) -> Option<&Tensor> {
        self.bias.as_ref()
    }

    /// The epsilon added to the variance.
    pub fn eps(&self) -> f64 {
        self.eps
    }
}

impl Module for LayerNorm {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        if self.remove_mean {
            return ops::layer_norm(x, &self.weight, self.bias.as_ref(), self.eps);
        }
        let y = ops::rms_norm(x, &self.weight, self.eps)?;
        match &self.bias {
            Some(b) => y.broadcast_add(b),
            None => Ok(y),
        }
    }
}

/// A `LayerNorm` of width `size` under `vb`, as `candle_nn::layer_norm`:
/// `weight`/`bias` (or the old `gamma`/`beta` names when the checkpoint has
/// them), ones and zeros when created fresh.
pub fn layer_norm<C: Into<LayerNormConfig>>(
    size: usize,
    config: C,
    vb: VarBuilder,
) -> Result<LayerNorm> {
    let config = config.into();
    let pick = |names: [&'static str; 2]| {
        names
            .into_iter()
            .find(|n| vb.contains_tensor(n))
            .unwrap_or(names[0])
    };
    let weight = vb.get_with_hints(size, pick(["weight", "gamma"]), Init::Const(1.0))?;
    let bias = if config.affine {
        Some(vb.get_with_hints(size, pick(["bias", "beta"]), Init::Const(0.0))?)
    } else {
        None
    };
    Ok(LayerNorm {
        weight,
        bias,
        remove_mean: config.remove_mean,
        eps: config.eps,
    })
}

/// A `LayerNorm` without bias, as `candle_nn::layer_norm_no_bias`.
pub fn layer_norm_no_bias(size: usize, eps: f64, vb: VarBuilder) -> Result<LayerNorm> {
    let config = LayerNormConfig {
        eps,
        remove_mean: true,
        affine: false,
    };
    layer_norm(size, config, vb)
}

/// RMS normalisation with a learned scale (Llama, Mistral, Qwen).
#[derive(Debug, Clone)]
pub struct RmsNorm {
    weight: Tensor,
    eps: f64,
}

impl RmsNorm {
    /// As `candle_nn::RmsNorm::new`.
    pub fn new(weight: Tensor, eps: f64) -> Self {
        Self { weight, eps }
    }

    /// The `[d]` scale.
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }
}

impl Module for RmsNorm {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        ops::rms_norm(x, &self.weight, self.eps)
    }
}

/// An `RmsNorm` of width `size` under `vb` (`weight`, ones when fresh).
pub fn rms_norm(size: usize, eps: f64, vb: VarBuilder) -> Result<RmsNorm> {
    Ok(RmsNorm::new(
        vb.get_with_hints(size, "weight", Init::Const(1.0))?,
        eps,
    ))
}
