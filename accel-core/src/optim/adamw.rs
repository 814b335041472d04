//! AdamW with PyTorch `torch.optim.AdamW` semantics, fused on CPU.

use std::collections::BTreeMap;

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

/// AdamW; its moments are fp32 and updated in place by one fused pass over
/// all parameters (`accel_kernels::adamw_step`).
#[derive(Debug, Clone)]
pub struct AdamW {
    config: AdamWConfig,
    state: BTreeMap<usize, ParamState>,
}

impl AdamW {
    /// An optimizer with no state yet (moments are created on the first step).
    pub fn new(config: AdamWConfig) -> Self {
        Self {
            config,
            state: BTreeMap::new(),
        }
    }

    /// The hyper-parameters.
    pub fn config(&self) -> &AdamWConfig {
        &self.config
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
        // correction stays per-parameter as in PyTorch.
        let mut groups: BTreeMap<u64, Vec<usize>> = BTreeMap::new();
        for (k, id) in ids.iter().enumerate() {
            let s = self.state.get_mut(id).expect("state created above");
            s.step += 1;
            groups.entry(s.step).or_default().push(k);
        }
        let hp = accel_kernels::AdamWParams {
            lr: self.config.lr,
            beta1: self.config.beta1,
            beta2: self.config.beta2,
            eps: self.config.eps,
            weight_decay: self.config.weight_decay,
        };
        for (step, ks) in groups {
            let pick = |f: &dyn Fn(usize) -> Tensor| ks.iter().map(|&k| f(k)).collect::<Vec<_>>();
            let ps = pick(&|k| params[k].clone());
            let gs = pick(&|k| grads[k].clone());
            let ms = pick(&|k| self.state[&ids[k]].exp_avg.clone());
            let vs = pick(&|k| self.state[&ids[k]].exp_avg_sq.clone());
            accel_kernels::adamw_step(&ps, &gs, &ms, &vs, step, &hp)?;
        }
        Ok(())
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
