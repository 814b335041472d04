//! Optimizers over fp32 master weights, and the prepared handle that applies
//! accumulation, loss-scale skipping and master-to-model copies around them.

mod adamw;
mod prepared;
mod sgd;

pub use adamw::{transformers_no_decay, AdamW, AdamWConfig, NoDecayFn};
pub use prepared::PreparedOptimizer;
pub use sgd::{Sgd, SgdConfig};

use candle_core::Tensor;

use crate::checkpoint::StateDict;
use crate::Result;

/// An optimizer that updates fp32 parameters in place from fp32 gradients.
///
/// `ids` are the indices of `params` in the prepared model (stable across
/// steps), so per-parameter state survives parameters that skip a step for
/// lack of a gradient, as in PyTorch.
pub trait Optimizer: Send {
    /// Applies one update to `params[k]` from `grads[k]`; `ids[k]` identifies the parameter.
    fn step(&mut self, params: &[Tensor], grads: &[Tensor], ids: &[usize]) -> Result<()>;
    /// Receives the model's parameter names once, before any step; `names[id]`
    /// names parameter `id` (for per-name settings such as weight-decay exclusion).
    fn set_param_names(&mut self, names: &[String]) {
        let _ = names;
    }
    /// The learning rate the next step uses.
    fn learning_rate(&self) -> f64;
    /// Sets the learning rate (schedulers call this).
    fn set_learning_rate(&mut self, lr: f64);
    /// The optimizer state: per-parameter tensors named `state.{id}.{field}` and
    /// hyper-parameters plus step counts in `meta`.
    fn state_dict(&self) -> Result<StateDict>;
    /// Restores [`Optimizer::state_dict`]; `params` gives the shapes to check against.
    fn load_state_dict(&mut self, state: StateDict, params: &[Tensor]) -> Result<()>;
}

/// An optimizer chosen at run time (the Trainer's AdamW, or a DeepSpeed
/// configuration's AdamW or SGD) is still one.
impl Optimizer for Box<dyn Optimizer> {
    fn step(&mut self, params: &[Tensor], grads: &[Tensor], ids: &[usize]) -> Result<()> {
        (**self).step(params, grads, ids)
    }
    fn set_param_names(&mut self, names: &[String]) {
        (**self).set_param_names(names)
    }
    fn learning_rate(&self) -> f64 {
        (**self).learning_rate()
    }
    fn set_learning_rate(&mut self, lr: f64) {
        (**self).set_learning_rate(lr)
    }
    fn state_dict(&self) -> Result<StateDict> {
        (**self).state_dict()
    }
    fn load_state_dict(&mut self, state: StateDict, params: &[Tensor]) -> Result<()> {
        (**self).load_state_dict(state, params)
    }
}

/// Splits `state.{id}.{field}` tensor names; other names are rejected by the caller.
pub(crate) fn parse_state_key(key: &str) -> Option<(usize, &str)> {
    let rest = key.strip_prefix("state.")?;
    let (id, field) = rest.split_once('.')?;
    Some((id.parse().ok()?, field))
}
