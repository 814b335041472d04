//! [`SequentialHook`]: several hooks run as one (Accelerate's `SequentialHook`).

use candle_core::Tensor;

use super::{ModelHook, ModuleWeights};
use crate::error::Result;

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

    fn pre_forward(&mut self, weights: &ModuleWeights, args: Tensor) -> Result<Tensor> {
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

    fn offloads(&self) -> bool {
        self.hooks.iter().any(|h| h.offloads())
    }

    fn name(&self) -> &'static str {
        "SequentialHook"
    }
}
