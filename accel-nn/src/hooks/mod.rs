//! Hooks run around a [`Block`](crate::block::Block)'s forward: Accelerate's
//! `hooks.py` (`ModelHook`, `SequentialHook`, `AlignDevicesHook`,
//! `add_hook_to_module`), layerwise casting and CPU/disk offload.
//!
//! A hook sees the block's [`ModuleWeights`] (names and current tensors) and
//! the forward's [`Activations`] and output; hooks keep their own state, as in
//! Accelerate. A hook may also *wrap* the computation ([`ModelHook::run_forward`]):
//! FSDP runs it on gathered weights inside an autograd node that regathers and
//! recomputes in backward, and activation checkpointing recomputes it.
//! See [`crate::block`] for why blocks are rebuilt rather than hooked in place.

mod align;
mod casting;
mod offload;
mod sequential;

use std::sync::Arc;

pub use align::AlignDevicesHook;
pub use casting::{apply_layerwise_casting, LayerwiseCastingHook};
pub use offload::{cpu_offload, cpu_offload_with_hook, disk_offload, UserCpuOffloadHook};
pub use sequential::SequentialHook;

pub use accel_bigmodel::ModuleWeights;
use candle_core::Tensor;

use crate::block::{Activations, AnyBlock, ForwardFn};
use crate::{Error, Result};

/// Callbacks run around a [`Block`](crate::block::Block)'s forward (Accelerate's `ModelHook`).
///
/// Every method has a do-nothing default, so a hook implements only what it needs.
pub trait ModelHook: Send {
    /// Called when the hook is attached; may move or replace the module's weights.
    ///
    /// # Errors
    /// Whatever prevents attaching; the hook is then not attached.
    fn init_hook(&mut self, weights: &ModuleWeights) -> Result<()> {
        let _ = weights;
        Ok(())
    }

    /// Called before the forward with its input; returns the input to use.
    ///
    /// # Errors
    /// Aborts the forward.
    fn pre_forward(&mut self, weights: &ModuleWeights, args: Activations) -> Result<Activations> {
        let _ = weights;
        Ok(args)
    }

    /// Called after the forward with its output; returns the output to give back.
    ///
    /// # Errors
    /// Aborts the forward.
    fn post_forward(&mut self, weights: &ModuleWeights, output: Tensor) -> Result<Tensor> {
        let _ = weights;
        Ok(output)
    }

    /// Whether this hook wraps the computation itself ([`ModelHook::run_forward`]).
    /// At most one hook of a block may.
    fn wraps_forward(&self) -> bool {
        false
    }

    /// Runs the computation between `pre_forward` and `post_forward`, for a
    /// hook that [wraps forwards](ModelHook::wraps_forward). `forward` runs
    /// the block on whatever weights it is given, now or later (in backward).
    ///
    /// # Errors
    /// Whatever the computation returns.
    fn run_forward(
        &mut self,
        weights: &ModuleWeights,
        args: Activations,
        forward: &Arc<ForwardFn>,
    ) -> Result<Tensor> {
        forward(weights, &args)
    }

    /// Called when the hook is removed; should undo what `init_hook` did.
    ///
    /// # Errors
    /// Whatever prevents restoring the weights.
    fn detach_hook(&mut self, weights: &ModuleWeights) -> Result<()> {
        let _ = weights;
        Ok(())
    }

    /// Whether this hook keeps the module's weights off its execution device
    /// between forwards (Accelerate's `has_offloaded_params` test).
    fn offloads(&self) -> bool {
        false
    }

    /// A short name for debugging output.
    fn name(&self) -> &'static str;
}

/// Attaches `hook` to `module` (Accelerate's `add_hook_to_module`).
///
/// With `append` and a hook already there, the two run as a
/// [`SequentialHook`] (old first), after the old one was detached and both are
/// initialised again, as Accelerate does. Without `append` an existing hook is
/// detached first; Accelerate drops it silently, which would leave its weights
/// wherever it had put them.
///
/// # Errors
/// Those of `detach_hook` and `init_hook`;
/// [`Error::HookConflict`] when both hooks wrap the computation.
pub fn add_hook_to_module(
    module: &dyn AnyBlock,
    hook: Box<dyn ModelHook>,
    append: bool,
) -> Result<()> {
    let hook: Box<dyn ModelHook> = match remove_hook_from_module(module)? {
        Some(old) if append => {
            if old.wraps_forward() && hook.wraps_forward() {
                let conflict = Error::HookConflict {
                    block: module.name(),
                    first: old.name(),
                    second: hook.name(),
                };
                module.put_hook(old);
                return Err(conflict);
            }
            Box::new(SequentialHook::new(vec![old, hook]))
        }
        _ => hook,
    };
    let mut hook = hook;
    hook.init_hook(module.weights())?;
    module.put_hook(hook);
    Ok(())
}

/// Detaches and returns the hook of `module`, if any, so its forward is the
/// plain layer again (Accelerate's `remove_hook_from_module`).
///
/// # Errors
/// Those of `detach_hook`; the hook is then left attached.
pub fn remove_hook_from_module(module: &dyn AnyBlock) -> Result<Option<Box<dyn ModelHook>>> {
    let Some(mut hook) = module.take_hook() else {
        return Ok(None);
    };
    if let Err(e) = hook.detach_hook(module.weights()) {
        module.put_hook(hook);
        return Err(e);
    }
    Ok(Some(hook))
}

/// Whether `module` has a hook that keeps its weights offloaded (Accelerate's
/// `has_offloaded_params`).
pub fn has_offloaded_params(module: &dyn AnyBlock) -> bool {
    let mut offloads = false;
    module.inspect_hook(&mut |h| offloads = h.is_some_and(|h| h.offloads()));
    offloads
}

#[cfg(test)]
#[path = "hooks_tests.rs"]
pub(crate) mod tests;
