//! LoRA adapters on [`Linear`] layers, as PEFT's `LoraLayer`.
//!
//! A model is built with a [`LoraSpec`] (held in its config), and every
//! linear layer whose module name the spec targets asks its weight source
//! for `lora_A.weight` `[r, in]` (Kaiming-uniform, as PEFT draws it) and
//! `lora_B.weight` `[out, r]` (zeros) beside its own weight. They are
//! ordinary parameters of the block, so every weight source (a `VarMap`, the
//! Accelerator's seeded and sharded builders, a checkpoint holding them)
//! serves them and FSDP, offload and checkpoints treat them as any other.
//! The forward adds `scaling * B (A dropout(x))` to the frozen layer's.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use accel_bigmodel::lora::{LoraConfig, LORA_A, LORA_B};
use candle_core::{Result, Tensor};
use candle_nn::{Init, VarBuilder};

use crate::ops::{self, Activation};

/// The LoRA setting a model is built with: its [`LoraConfig`] and the
/// switch that turns the adapters' dropout on in training.
///
/// Clones share the switch, so the model's `train(true)` reaches every
/// layer built from a clone of its config, also those rebuilt later.
#[derive(Debug, Clone)]
pub struct LoraSpec {
    config: Arc<LoraConfig>,
    training: Arc<AtomicBool>,
}

impl PartialEq for LoraSpec {
    fn eq(&self, other: &Self) -> bool {
        self.config == other.config
    }
}

impl LoraSpec {
    /// Adapters as `config` says, in evaluation mode (no dropout) until
    /// [`LoraSpec::set_training`].
    pub fn new(config: LoraConfig) -> Self {
        Self {
            config: Arc::new(config),
            training: Arc::default(),
        }
    }

    /// The adapters' settings.
    pub fn config(&self) -> &LoraConfig {
        &self.config
    }

    /// Turns the adapters' dropout on (training) or off (evaluation), as
    /// PyTorch's `model.train()` / `model.eval()`.
    pub fn set_training(&self, training: bool) {
        self.training.store(training, Ordering::Relaxed);
    }

    /// Whether the adapters are in training mode.
    pub fn is_training(&self) -> bool {
        self.training.load(Ordering::Relaxed)
    }
}

/// The adapter of one linear layer.
#[derive(Debug, Clone)]
pub struct LoraLayer {
    a: Tensor,
    b: Tensor,
    scaling: f64,
    dropout: f32,
    training: Arc<AtomicBool>,
}

impl LoraLayer {
    /// `A` `[r, in]`.
    pub fn a(&self) -> &Tensor {
        &self.a
    }

    /// `B` `[out, r]`.
    pub fn b(&self) -> &Tensor {
        &self.b
    }

    /// The update's factor (`alpha / r`).
    pub fn scaling(&self) -> f64 {
        self.scaling
    }

    /// `scaling * B (A dropout(x))`.
    fn update(&self, x: &Tensor) -> Result<Tensor> {
        let train = self.training.load(Ordering::Relaxed);
        let x = ops::dropout(x, self.dropout, train && self.dropout > 0.0)?;
        let h = ops::linear(&x, &self.a, None, None)?;
        ops::linear(&h, &self.b, None, None)? * self.scaling
    }
}

/// The adapter of the linear layer at `vb` (weight `[out, in]`), when
/// `spec` targets its module name.
pub(super) fn adapter_for(
    spec: Option<&LoraSpec>,
    vb: &VarBuilder,
    out: usize,
    inp: usize,
) -> Result<Option<LoraLayer>> {
    let Some(spec) = spec.filter(|s| s.config.targets_module(&vb.prefix())) else {
        return Ok(None);
    };
    let r = spec.config.r;
    // PEFT: kaiming_uniform_(A, a=sqrt(5)), i.e. U(-1/sqrt(in), 1/sqrt(in)).
    let bound = 1.0 / (inp as f64).sqrt();
    let a_init = Init::Uniform {
        lo: -bound,
        up: bound,
    };
    let a = vb
        .pp(LORA_A.trim_end_matches(".weight"))
        .get_with_hints((r, inp), "weight", a_init)?;
    let b = vb.pp(LORA_B.trim_end_matches(".weight")).get_with_hints(
        (out, r),
        "weight",
        Init::Const(0.0),
    )?;
    Ok(Some(LoraLayer {
        a,
        b,
        scaling: spec.config.scaling(),
        dropout: spec.config.dropout,
        training: spec.training.clone(),
    }))
}

/// `y` plus the adapter's update of `x`, then `act`.
pub(super) fn forward(
    lora: &LoraLayer,
    x: &Tensor,
    y: Tensor,
    act: Option<Activation>,
) -> Result<Tensor> {
    let y = (y + lora.update(x)?)?;
    match act {
        None => Ok(y),
        Some(Activation::Gelu) => ops::gelu(&y),
        Some(Activation::GeluTanh) => ops::gelu_tanh(&y),
        Some(Activation::Silu) => ops::silu(&y),
        Some(Activation::Relu) => ops::relu(&y),
    }
}
