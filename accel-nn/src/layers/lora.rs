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
    let a = vb.get_with_hints((r, inp), LORA_A, a_init)?;
    let b = vb.get_with_hints((out, r), LORA_B, Init::Const(0.0))?;
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

#[cfg(test)]
mod tests {
    use accel_bigmodel::lora::LoraTargets;
    use candle_core::{DType, Device, Module, Var};
    use candle_nn::VarMap;

    use super::*;
    use crate::layers::{linear_b_lora, Linear};

    fn spec(targets: &str, dropout: f32) -> LoraSpec {
        let mut c = LoraConfig::new(2, LoraTargets::parse(targets).unwrap());
        c.alpha = 6.0;
        c.dropout = dropout;
        LoraSpec::new(c)
    }

    /// Targeted modules get `A` drawn in PEFT's bounds and `B` zero; the
    /// others get nothing.
    #[test]
    fn targets_get_peft_initialised_adapters() -> Result<()> {
        let varmap = VarMap::new();
        let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
        let s = spec("q", 0.0);
        let q = linear_b_lora(16, 4, false, vb.pp("attn.q"), Some(&s))?;
        let k = linear_b_lora(16, 4, false, vb.pp("attn.k"), Some(&s))?;
        assert!(k.lora().is_none());
        let l = q.lora().unwrap();
        assert_eq!(l.a().dims(), [2, 16]);
        assert_eq!(l.b().dims(), [4, 2]);
        assert_eq!(l.scaling(), 3.0);
        let bound = 0.25f32;
        let a = l.a().flatten_all()?.to_vec1::<f32>()?;
        assert!(a.iter().all(|v| v.abs() <= bound) && a.iter().any(|v| *v != 0.0));
        assert_eq!(l.b().abs()?.sum_all()?.to_scalar::<f32>()?, 0.0);
        let mut names: Vec<String> = varmap.data().lock().unwrap().keys().cloned().collect();
        names.sort();
        assert_eq!(
            names,
            [
                "attn.k.weight",
                "attn.q.lora_A.weight",
                "attn.q.lora_B.weight",
                "attn.q.weight"
            ]
        );
        Ok(())
    }

    /// `x W^T + b + scaling * (x A^T) B^T` forward, its gradients to `A` and
    /// `B` against the closed forms, fused with an activation; dropout acts
    /// only in training.
    #[test]
    fn the_update_and_its_gradients_are_peft_s() -> Result<()> {
        let dev = Device::Cpu;
        let varmap = VarMap::new();
        let vb = VarBuilder::from_varmap(&varmap, DType::F32, &dev);
        let s = spec("all-linear", 0.0);
        let layer = linear_b_lora(3, 4, true, vb.pp("m"), Some(&s))?;
        let get = |n: &str| varmap.data().lock().unwrap()[n].clone();
        let (a, b): (Var, Var) = (get("m.lora_A.weight"), get("m.lora_B.weight"));
        b.set(&Tensor::new(
            &[[0.5f32, -1.0], [2.0, 0.25], [0.0, 1.0], [-0.5, 0.5]],
            &dev,
        )?)?;
        let (w, bias) = (get("m.weight"), get("m.bias"));
        let x = Tensor::new(&[[1.0f32, -2.0, 0.5], [0.3, 0.7, -1.1]], &dev)?;
        let y = layer.forward(&x)?;
        let xa = x.matmul(&a.t()?)?;
        let want = (x.matmul(&w.t()?)?.broadcast_add(&bias)? + (xa.matmul(&b.t()?)? * 3.0)?)?;
        let diff = (&y - &want)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(diff < 1e-5, "{diff}");
        // d(sum y)/dB = scaling * 1^T (x A^T); d(sum y)/dA = scaling * (1 B)^T x.
        let g = y.sum_all()?.backward()?;
        let ones = Tensor::ones((2, 4), DType::F32, &dev)?;
        let db = (ones.t()?.matmul(&xa)? * 3.0)?;
        let da = (ones.matmul(b.as_tensor())?.t()?.matmul(&x)? * 3.0)?;
        for (got, want) in [
            (g.get(b.as_tensor()).unwrap(), db),
            (g.get(a.as_tensor()).unwrap(), da),
        ] {
            let d = (got - want)?.abs()?.max_all()?.to_scalar::<f32>()?;
            assert!(d < 1e-5, "{d}");
        }
        // With an activation the update goes in before it.
        let act = layer.forward_act(&x, Some(Activation::Relu))?;
        let d = (act - want.relu()?)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(d < 1e-5, "{d}");
        Ok(())
    }

    #[test]
    fn dropout_acts_in_training_only() -> Result<()> {
        let dev = Device::Cpu;
        let varmap = VarMap::new();
        let vb = VarBuilder::from_varmap(&varmap, DType::F32, &dev);
        let s = spec("all-linear", 0.5);
        let layer: Linear = linear_b_lora(64, 8, false, vb.pp("m"), Some(&s))?;
        let b = varmap.data().lock().unwrap()["m.lora_B.weight"].clone();
        b.set(&Tensor::ones((8, 2), DType::F32, &dev)?)?;
        let x = Tensor::ones((4, 64), DType::F32, &dev)?;
        let eval = layer.forward(&x)?;
        assert_eq!(eval.to_vec2::<f32>()?, layer.forward(&x)?.to_vec2::<f32>()?);
        s.set_training(true);
        let train = layer.forward(&x)?;
        assert_ne!(eval.to_vec2::<f32>()?, train.to_vec2::<f32>()?);
        s.set_training(false);
        assert_eq!(eval.to_vec2::<f32>()?, layer.forward(&x)?.to_vec2::<f32>()?);
        Ok(())
    }
}
