//! `Linear`, as candle-nn's, running the fused linear op.

use candle_core::{Module, Result, Tensor};
use candle_nn::{Init, VarBuilder};

use crate::ops::{self, Activation};

/// `x @ weight^T + bias` with weight `[out, in]` (PyTorch `nn.Linear`).
#[derive(Debug, Clone)]
pub struct Linear {
    weight: Tensor,
    bias: Option<Tensor>,
}

impl Linear {
    /// Wraps existing tensors, as `candle_nn::Linear::new`.
    pub fn new(weight: Tensor, bias: Option<Tensor>) -> Self {
        Self { weight, bias }
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
        ops::linear(x, &self.weight, self.bias.as_ref(), act)
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
    if bias {
        linear(in_dim, out_dim, vb)
    } else {
        linear_no_bias(in_dim, out_dim, vb)
    }
}
