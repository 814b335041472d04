//! SGD with momentum, PyTorch `torch.optim.SGD` semantics.

use std::collections::BTreeMap;

use candle_core::Tensor;
use serde::{Deserialize, Serialize};

use super::Optimizer;
use crate::checkpoint::StateDict;
use crate::{Error, Result};

/// Hyper-parameters of [`Sgd`]; the defaults are PyTorch's (with lr required there).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct SgdConfig {
    /// Learning rate.
    pub lr: f64,
    /// Momentum factor (0 disables the buffer).
    pub momentum: f64,
    /// Dampening of the momentum.
    pub dampening: f64,
    /// L2 penalty added to the gradient.
    pub weight_decay: f64,
    /// Nesterov momentum.
    pub nesterov: bool,
}

impl Default for SgdConfig {
    fn default() -> Self {
        Self {
            lr: 1e-3,
            momentum: 0.0,
            dampening: 0.0,
            weight_decay: 0.0,
            nesterov: false,
        }
    }
}

/// Stochastic gradient descent.
#[derive(Debug, Clone)]
pub struct Sgd {
    config: SgdConfig,
    momentum: BTreeMap<usize, Tensor>,
}

impl Sgd {
    /// An optimizer with no momentum buffers yet.
    pub fn new(config: SgdConfig) -> Self {
        Self {
            config,
            momentum: BTreeMap::new(),
        }
    }
}

impl Optimizer for Sgd {
    fn step(&mut self, params: &[Tensor], grads: &[Tensor], ids: &[usize]) -> Result<()> {
        let c = self.config;
        let hp = accel_kernels::SgdParams {
            lr: c.lr,
            momentum: c.momentum,
            dampening: c.dampening,
            weight_decay: c.weight_decay,
            nesterov: c.nesterov,
        };
        if c.momentum == 0.0 {
            accel_kernels::sgd_step(params, grads, None, 1, &hp)?;
            return Ok(());
        }
        // The kernel initialises a buffer from the gradient at step 1, as
        // PyTorch does for a parameter's first step; later steps use step 2.
        let mut fresh = vec![false; ids.len()];
        for (k, &id) in ids.iter().enumerate() {
            if let std::collections::btree_map::Entry::Vacant(e) = self.momentum.entry(id) {
                let p = &params[k];
                e.insert(Tensor::zeros(
                    p.shape(),
                    candle_core::DType::F32,
                    p.device(),
                )?);
                fresh[k] = true;
            }
        }
        for (want_fresh, step) in [(true, 1), (false, 2)] {
            let ks: Vec<usize> = (0..ids.len()).filter(|&k| fresh[k] == want_fresh).collect();
            if ks.is_empty() {
                continue;
            }
            let p: Vec<Tensor> = ks.iter().map(|&k| params[k].clone()).collect();
            let g: Vec<Tensor> = ks.iter().map(|&k| grads[k].clone()).collect();
            let b: Vec<Tensor> = ks.iter().map(|&k| self.momentum[&ids[k]].clone()).collect();
            accel_kernels::sgd_step(&p, &g, Some(&b), step, &hp)?;
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
        let tensors = self
            .momentum
            .iter()
            .map(|(id, t)| (format!("state.{id}.momentum_buffer"), t.clone()))
            .collect();
        let meta = serde_json::json!({ "optimizer": "SGD", "param_groups": [self.config] });
        Ok(StateDict { tensors, meta })
    }

    fn load_state_dict(&mut self, state: StateDict, params: &[Tensor]) -> Result<()> {
        let bad = |reason: String| Error::Config {
            key: "optimizer".into(),
            reason,
        };
        if state.meta.get("optimizer").and_then(|v| v.as_str()) != Some("SGD") {
            return Err(bad("checkpoint does not hold an SGD optimizer".into()));
        }
        let config: SgdConfig = serde_json::from_value(state.meta["param_groups"][0].clone())
            .map_err(|e| bad(format!("param_groups[0]: {e}")))?;
        let mut momentum = BTreeMap::new();
        for (key, t) in state.tensors {
            let id = match super::parse_state_key(&key) {
                Some((id, "momentum_buffer")) if id < params.len() => id,
                _ => return Err(bad(format!("unexpected tensor `{key}`"))),
            };
            if t.dims() != params[id].dims() {
                return Err(bad(format!(
                    "tensor `{key}` has shape {:?}, expected {:?}",
                    t.dims(),
                    params[id].dims()
                )));
            }
            momentum.insert(id, t.copy()?);
        }
        self.config = config;
        self.momentum = momentum;
        Ok(())
    }
}
