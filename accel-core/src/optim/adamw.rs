//! AdamW with PyTorch `torch.optim.AdamW` semantics, fused on CPU.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use candle_core::{DType, Tensor};
use serde::{Deserialize, Serialize};

use super::Optimizer;
use crate::checkpoint::StateDict;
use crate::{Error, Result};

/// Hyper-parameters of [`AdamW`]; the defaults are PyTorch's.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct AdamWConfig {
    /// Learning rate.
    pub lr: f64,
    /// Decay of the first moment.
    pub beta1: f64,
    /// Decay of the second moment.
    pub beta2: f64,
    /// Added to the denominator for stability.
    pub eps: f64,
    /// Decoupled weight decay.
    pub weight_decay: f64,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        Self {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
        }
    }
}

#[derive(Debug, Clone)]
struct ParamState {
    step: u64,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
}

/// A predicate on parameter names: true for parameters that get no weight decay.
pub type NoDecayFn = Arc<dyn Fn(&str) -> bool + Send + Sync>;

/// True for the parameters transformers' `Trainer` exempts from weight decay
/// (`get_decay_parameter_names`): every bias, and the parameters of
/// LayerNorm / RMSNorm modules (`ln_1.weight`, `ln_f.weight`,
/// `LayerNorm.weight`, `input_layernorm.weight`, `norm.weight`, `attn_norm.weight`).
///
/// ```
/// use accel_core::optim::transformers_no_decay;
/// assert!(transformers_no_decay("h.0.attn.c_attn.bias"));
/// assert!(transformers_no_decay("h.0.ln_1.weight"));
/// assert!(transformers_no_decay("encoder.LayerNorm.weight"));
/// assert!(!transformers_no_decay("h.0.attn.c_attn.weight"));
/// assert!(!transformers_no_decay("lm_head.weight"));
/// ```
pub fn transformers_no_decay(name: &str) -> bool {
    let mut segments = name.split('.');
    let last = segments.next_back().unwrap_or("");
    if last.to_ascii_lowercase().ends_with("bias") {
        return true;
    }
    let digits_or_empty = |s: &str| s.chars().all(|c| c.is_ascii_digit());
    segments.any(|seg| {
        let s = seg.to_ascii_lowercase();
        s.contains("layernorm")
            || s.contains("layer_norm")
            || s.contains("rmsnorm")
            || s.ends_with("_norm")
            || s.strip_prefix("ln")
                .is_some_and(|r| digits_or_empty(r) || r.starts_with('_'))
            || s.strip_prefix("norm")
                .is_some_and(|r| digits_or_empty(r) || r.starts_with('_'))
    })
}

/// AdamW; its moments are fp32 and updated in place by one fused pass over
/// all parameters (`accel_kernels::adamw_step`).
///
/// With [`AdamW::with_no_decay`], parameters whose name matches the predicate
/// are updated with `weight_decay = 0` (transformers' two parameter groups);
/// the names come from [`Optimizer::set_param_names`], which
/// `Accelerator::prepare_optimizer` calls.
#[derive(Clone)]
pub struct AdamW {
    config: AdamWConfig,
    state: BTreeMap<usize, ParamState>,
    no_decay: Option<NoDecayFn>,
    names: Vec<String>,
    no_decay_ids: BTreeSet<usize>,
}

impl std::fmt::Debug for AdamW {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AdamW")
            .field("config", &self.config)
            .field("state", &self.state)
            .field("no_decay_ids", &self.no_decay_ids)
            .finish_non_exhaustive()
    }
}

impl AdamW {
    /// An optimizer with no state yet (moments are created on the first step).
    pub fn new(config: AdamWConfig) -> Self {
        Self {
            config,
            state: BTreeMap::new(),
            no_decay: None,
            names: Vec::new(),
            no_decay_ids: BTreeSet::new(),
        }
    }

    /// Exempts the parameters whose name satisfies `pred` from weight decay
    /// (e.g. [`transformers_no_decay`]).
    pub fn with_no_decay(mut self, pred: impl Fn(&str) -> bool + Send + Sync + 'static) -> Self {
        self.no_decay = Some(Arc::new(pred));
        self.recompute_no_decay();
        self
    }

    /// The hyper-parameters.
    pub fn config(&self) -> &AdamWConfig {
        &self.config
    }

    /// Ids of the parameters updated without weight decay.
    pub fn no_decay_ids(&self) -> Vec<usize> {
        self.no_decay_ids.iter().copied().collect()
    }

    fn recompute_no_decay(&mut self) {
        self.no_decay_ids = match &self.no_decay {
            Some(pred) => self
                .names
                .iter()
                .enumerate()
                .filter(|(_, n)| pred(n))
                .map(|(i, _)| i)
                .collect(),
            None => BTreeSet::new(),
        };
    }
}

impl Optimizer for AdamW {
    fn step(&mut self, params: &[Tensor], grads: &[Tensor], ids: &[usize]) -> Result<()> {
        for (p, &id) in params.iter().zip(ids) {
            if let std::collections::btree_map::Entry::Vacant(e) = self.state.entry(id) {
                e.insert(ParamState {
                    step: 0,
                    exp_avg: Tensor::zeros(p.shape(), DType::F32, p.device())?,
                    exp_avg_sq: Tensor::zeros(p.shape(), DType::F32, p.device())?,
                });
            }
        }
        // Parameters normally share one step count; group by it so bias
        // correction stays per-parameter as in PyTorch, and by whether the
        // parameter decays.
        let mut groups: BTreeMap<(u64, bool), Vec<usize>> = BTreeMap::new();
        for (k, id) in ids.iter().enumerate() {
            let s = self.state.get_mut(id).expect("state created above");
            s.step += 1;
            let decays = !self.no_decay_ids.contains(id);
            groups.entry((s.step, decays)).or_default().push(k);
        }
        for ((step, decays), ks) in groups {
            let hp = accel_kernels::AdamWParams {
                lr: self.config.lr,
                beta1: self.config.beta1,
                beta2: self.config.beta2,
                eps: self.config.eps,
                weight_decay: if decays {
                    self.config.weight_decay
                } else {
                    0.0
                },
            };
            let pick = |f: &dyn Fn(usize) -> Tensor| ks.iter().map(|&k| f(k)).collect::<Vec<_>>();
            let ps = pick(&|k| params[k].clone());
            let gs = pick(&|k| grads[k].clone());
            let ms = pick(&|k| self.state[&ids[k]].exp_avg.clone());
            let vs = pick(&|k| self.state[&ids[k]].exp_avg_sq.clone());
            accel_kernels::adamw_step(&ps, &gs, &ms, &vs, step, &hp)?;
        }
        Ok(())
    }

    fn set_param_names(&mut self, names: &[String]) {
        self.names = names.to_vec();
        self.recompute_no_decay();
    }

    fn learning_rate(&self) -> f64 {
        self.config.lr
    }

    fn set_learning_rate(&mut self, lr: f64) {
        self.config.lr = lr;
    }

    fn state_dict(&self) -> Result<StateDict> {
        let mut tensors = BTreeMap::new();
        let mut steps = serde_json::Map::new();
        for (id, s) in &self.state {
            tensors.insert(format!("state.{id}.exp_avg"), s.exp_avg.clone());
            tensors.insert(format!("state.{id}.exp_avg_sq"), s.exp_avg_sq.clone());
            steps.insert(id.to_string(), s.step.into());
        }
        let meta = serde_json::json!({
            "optimizer": "AdamW",
            "param_groups": [self.config],
            "step": steps,
            "no_decay": self.no_decay_ids(),
        });
        Ok(StateDict { tensors, meta })
    }

    fn load_state_dict(&mut self, mut state: StateDict, params: &[Tensor]) -> Result<()> {
        let bad = |reason: String| Error::Config {
            key: "optimizer".into(),
            reason,
        };
        let kind = state
            .meta
            .get("optimizer")
            .and_then(|v| v.as_str())
            .unwrap_or("");
        if kind != "AdamW" {
            return Err(bad(format!(
                "checkpoint holds a {kind:?} optimizer, not AdamW"
            )));
        }
        let group = state.meta["param_groups"]
            .get(0)
            .cloned()
            .ok_or_else(|| bad("no param_groups".into()))?;
        let config: AdamWConfig =
            serde_json::from_value(group).map_err(|e| bad(format!("param_groups[0]: {e}")))?;
        let steps = state.meta["step"]
            .as_object()
            .cloned()
            .ok_or_else(|| bad("no step map".into()))?;
        let mut new_state = BTreeMap::new();
        for (id, step) in steps {
            let id: usize = id
                .parse()
                .map_err(|_| bad(format!("bad parameter id {id:?}")))?;
            let step = step
                .as_u64()
                .ok_or_else(|| bad(format!("bad step for parameter {id}")))?;
            let p = params.get(id).ok_or_else(|| {
                bad(format!(
                    "state for parameter {id}, but the model has {}",
                    params.len()
                ))
            })?;
            let mut take = |field: &str| -> Result<Tensor> {
                let key = format!("state.{id}.{field}");
                let t = state
                    .tensors
                    .remove(&key)
                    .ok_or_else(|| bad(format!("missing tensor `{key}`")))?;
                if t.dims() != p.dims() || t.dtype() != DType::F32 {
                    return Err(bad(format!(
                        "tensor `{key}` is {:?} {:?}, expected F32 {:?}",
                        t.dtype(),
                        t.dims(),
                        p.dims()
                    )));
                }
                // Own a fresh buffer: the kernels update moments in place.
                Ok(t.copy()?)
            };
            let exp_avg = take("exp_avg")?;
            let exp_avg_sq = take("exp_avg_sq")?;
            new_state.insert(
                id,
                ParamState {
                    step,
                    exp_avg,
                    exp_avg_sq,
                },
            );
        }
        if let Some(extra) = state.tensors.keys().next() {
            return Err(bad(format!("unexpected tensor `{extra}`")));
        }
        self.config = config;
        self.state = new_state;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use candle_core::Device;

    use super::*;

    fn vals(t: &Tensor) -> Vec<f32> {
        t.to_vec1::<f32>().unwrap()
    }

    #[test]
    fn no_decay_parameters_step_as_adamw_without_weight_decay() {
        let dev = Device::Cpu;
        let init = [1.0f32, -2.0, 3.0, 0.5];
        let grad = [0.1f32, 0.2, -0.3, 0.05];
        let fresh = |v: &[f32]| Tensor::new(v, &dev).unwrap();
        let config = AdamWConfig {
            lr: 0.1,
            weight_decay: 0.5,
            ..Default::default()
        };
        let mut opt = AdamW::new(config).with_no_decay(transformers_no_decay);
        opt.set_param_names(&["fc.bias".to_string(), "fc.weight".to_string()]);
        assert_eq!(opt.no_decay_ids(), vec![0]);
        let mut plain = AdamW::new(AdamWConfig {
            weight_decay: 0.0,
            ..config
        });
        let (bias, weight, reference) = (fresh(&init), fresh(&init), fresh(&init));
        for _ in 0..3 {
            let g = [fresh(&grad), fresh(&grad)];
            opt.step(&[bias.clone(), weight.clone()], &g, &[0, 1])
                .unwrap();
            plain
                .step(std::slice::from_ref(&reference), &[fresh(&grad)], &[0])
                .unwrap();
        }
        assert_eq!(vals(&bias), vals(&reference));
        let (b, w) = (vals(&bias), vals(&weight));
        assert!(
            b.iter().zip(&w).all(|(b, w)| (b - w).abs() > 1e-3),
            "{b:?} vs {w:?}"
        );
        let meta = opt.state_dict().unwrap().meta;
        assert_eq!(meta["no_decay"], serde_json::json!([0]));
    }

    #[test]
    fn no_decay_names_follow_transformers() {
        for name in [
            "bias",
            "h.0.attn.c_attn.bias",
            "h.0.ln_1.weight",
            "ln_f.weight",
            "ln.weight",
            "blocks.1.ln2.weight",
            "encoder.layer.0.output.LayerNorm.weight",
            "model.layers.0.input_layernorm.weight",
            "model.layers.0.post_attention_layer_norm.weight",
            "model.norm.weight",
            "layers.0.attn_norm.weight",
            "layers.0.rmsnorm.weight",
        ] {
            assert!(transformers_no_decay(name), "{name}");
        }
        for name in [
            "h.0.attn.c_attn.weight",
            "lm_head.weight",
            "wte.weight",
            "linear.weight",
            "lnx_proj.weight",
            "normalizer.weight",
        ] {
            assert!(!transformers_no_decay(name), "{name}");
        }
    }
}
