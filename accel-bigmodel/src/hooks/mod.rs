//! Forward hooks for candle modules: Accelerate's `hooks.py` (`ModelHook`,
//! `SequentialHook`, `AlignDevicesHook`, `add_hook_to_module`) and layerwise casting.
//!
//! # Why a hooked module instead of hooks on candle layers
//! candle has no module system with forward hooks, and its layers capture
//! their weight `Tensor`s when built: a `candle_nn::Linear` holds the tensor it
//! was given forever. Two ways around that were considered:
//!
//! * writing new data into the layer's `Var`s (`Var::set`): impossible for
//!   offload, because `set` copies into the existing storage and requires the
//!   same shape *and* a contiguous target, so a one-element placeholder can
//!   never grow into a real weight, nor a weight shrink back;
//! * keeping the layer as its constructor and rebuilding it from a weights
//!   handle whenever a hook replaced a weight. This is what [`HookedModule`]
//!   does: any candle code that builds from a `VarBuilder` (real
//!   `candle_nn::Linear`, `LayerNorm`, `Embedding`, a whole transformer block)
//!   works unchanged, building only clones tensor handles, and a released
//!   weight really is freed because nothing else holds it.
//!
//! A hook sees the module's [`ModuleWeights`] (names and current `Var`s) and
//! the forward's input and output; hooks keep their own state, as in
//! Accelerate. Inputs and outputs are one `Tensor` each, as in
//! `candle_nn::Module`.

mod align;
mod casting;
mod module;
mod sequential;

pub use align::AlignDevicesHook;
pub use casting::{apply_layerwise_casting, LayerwiseCastingHook};
pub use module::{is_placeholder, BuildFn, HookedModel, HookedModule, ModuleWeights};
pub use sequential::SequentialHook;

use candle_core::Tensor;

use crate::error::Result;

/// Callbacks run around a [`HookedModule`]'s forward (Accelerate's `ModelHook`).
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
    fn pre_forward(&mut self, weights: &ModuleWeights, args: Tensor) -> Result<Tensor> {
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
/// Those of `detach_hook` and `init_hook`.
pub fn add_hook_to_module(
    module: &mut HookedModule,
    hook: Box<dyn ModelHook>,
    append: bool,
) -> Result<()> {
    let hook = match remove_hook_from_module(module)? {
        Some(old) if append => Box::new(SequentialHook::new(vec![old, hook])),
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
pub fn remove_hook_from_module(module: &mut HookedModule) -> Result<Option<Box<dyn ModelHook>>> {
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
pub fn has_offloaded_params(module: &HookedModule) -> bool {
    module.with_hook(|h| h.is_some_and(|h| h.offloads()))
}

#[cfg(test)]
#[path = "hooks_tests.rs"]
pub(crate) mod tests;
