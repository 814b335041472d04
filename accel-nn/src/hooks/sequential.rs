//! [`SequentialHook`]: several hooks run as one (Accelerate's `SequentialHook`).

use std::sync::Arc;

use candle_core::Tensor;

use super::{ModelHook, ModuleWeights};
use crate::block::{Activations, ForwardFn};
use crate::Result;

/// Runs its hooks in order for every callback: each `pre_forward` gets the
/// previous one's result, and so does each `post_forward`, in the same order
/// (as Accelerate's `SequentialHook`, which does not reverse post-forwards).
pub struct SequentialHook {
    hooks: Vec<Box<dyn ModelHook>>,
}

impl SequentialHook {
    /// Hooks to run in this order.
    pub fn new(hooks: Vec<Box<dyn ModelHook>>) -> Self {
        SequentialHook { hooks }
    }

    /// The hooks, in order.
    pub fn hooks(&self) -> &[Box<dyn ModelHook>] {
        &self.hooks
    }
}

impl ModelHook for SequentialHook {
    fn init_hook(&mut self, weights: &ModuleWeights) -> Result<()> {
        self.hooks.iter_mut().try_for_each(|h| h.init_hook(weights))
    }

    fn pre_forward(&mut self, weights: &ModuleWeights, args: Activations) -> Result<Activations> {
        self.hooks
            .iter_mut()
            .try_fold(args, |a, h| h.pre_forward(weights, a))
    }

    fn post_forward(&mut self, weights: &ModuleWeights, output: Tensor) -> Result<Tensor> {
        self.hooks
            .iter_mut()
            .try_fold(output, |o, h| h.post_forward(weights, o))
    }

    fn detach_hook(&mut self, weights: &ModuleWeights) -> Result<()> {
        self.hooks
            .iter_mut()
            .try_for_each(|h| h.detach_hook(weights))
    }

    fn wraps_forward(&self) -> bool {
        self.hooks.iter().any(|h| h.wraps_forward())
    }

    fn run_forward(
        &mut self,
        weights: &ModuleWeights,
        args: Activations,
        forward: &Arc<ForwardFn>,
    ) -> Result<Tensor> {
        // `add_hook_to_module` lets at most one of them wrap.
        match self.hooks.iter_mut().find(|h| h.wraps_forward()) {
            Some(h) => h.run_forward(weights, args, forward),
            None => forward(weights, &args),
        }
    }

    fn offloads(&self) -> bool {
        self.hooks.iter().any(|h| h.offloads())
    }

    fn name(&self) -> &'static str {
        "SequentialHook"
    }
}
