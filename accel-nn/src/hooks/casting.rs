//! [`LayerwiseCastingHook`]: weights stored in a low-precision dtype and cast
//! to the compute dtype only for the forward (Diffusers' and Accelerate's
//! `apply_layerwise_casting`).

use candle_core::{DType, Tensor};

use accel_bigmodel::is_placeholder;

use super::{add_hook_to_module, ModelHook, ModuleWeights};
use crate::block::{Activations, AnyBlock};
use crate::Result;

/// Stores the module's floating-point weights as `storage_dtype` (bf16, f16,
/// f8e4m3) and runs the forward with them cast to `compute_dtype`.
///
/// `post_forward` puts back the stored tensors kept from `pre_forward`
/// instead of casting the compute copies down again: the forward does not
/// change weights, so the result is bitwise the same and costs nothing, and
/// the compute copies are freed. Placeholders (offloaded weights) are
/// re-typed without being materialised.
pub struct LayerwiseCastingHook {
    /// The dtype weights are kept in between forwards.
    pub storage_dtype: DType,
    /// The dtype the forward computes in.
    pub compute_dtype: DType,
    stash: Vec<(String, Tensor)>,
}

impl LayerwiseCastingHook {
    /// A hook storing in `storage_dtype` and computing in `compute_dtype`.
    pub fn new(storage_dtype: DType, compute_dtype: DType) -> Self {
        LayerwiseCastingHook {
            storage_dtype,
            compute_dtype,
            stash: Vec::new(),
        }
    }
}

fn is_fused(dtype: DType) -> bool {
    matches!(dtype, DType::F32 | DType::BF16 | DType::F16)
}

/// Casts every floating-point tensor of `weights` to `dtype` in place of the
/// old one: real host f32/bf16/f16 weights in one fused parallel pass of
/// accel-kernels, others (f8, device tensors) through candle's `to_dtype`.
fn cast_weights(weights: &ModuleWeights, dtype: DType) -> Result<()> {
    let all = weights.tensors();
    let todo: Vec<&(String, Tensor)> = all
        .iter()
        .filter(|(_, t)| t.dtype().is_float() && t.dtype() != dtype)
        .collect();
    let (fused, other): (Vec<_>, Vec<_>) = todo.into_iter().partition(|(_, t)| {
        !is_placeholder(t) && t.device().is_cpu() && is_fused(t.dtype()) && is_fused(dtype)
    });
    let src: Vec<Tensor> = fused.iter().map(|(_, t)| t.clone()).collect();
    // cast_tensors refuses non-f32/f16/bf16 targets even for an empty list.
    let cast = match src.is_empty() {
        true => Vec::new(),
        false => accel_kernels::cast_tensors(&src, dtype)?,
    };
    for ((name, _), t) in fused.iter().zip(cast) {
        weights.set(name, t)?;
    }
    for (name, t) in other {
        let t = if is_placeholder(t) {
            accel_bigmodel::placeholder(t.shape().clone(), dtype, t.device())?
        } else {
            t.to_dtype(dtype)?
        };
        weights.set(name, t)?;
    }
    Ok(())
}

impl ModelHook for LayerwiseCastingHook {
    fn init_hook(&mut self, weights: &ModuleWeights) -> Result<()> {
        cast_weights(weights, self.storage_dtype)
    }

    fn pre_forward(&mut self, weights: &ModuleWeights, args: Activations) -> Result<Activations> {
        self.stash = weights.tensors();
        cast_weights(weights, self.compute_dtype)?;
        Ok(args)
    }

    fn post_forward(&mut self, weights: &ModuleWeights, output: Tensor) -> Result<Tensor> {
        for (name, t) in std::mem::take(&mut self.stash) {
            // A later hook (offload) may have released the weight meanwhile;
            // then the placeholder in storage dtype is what belongs there.
            let now = weights.tensor(&name).expect("names come from the handle");
            if is_placeholder(&now) && !is_placeholder(&t) {
                cast_weights(weights, self.storage_dtype)?;
                continue;
            }
            weights.set(&name, t)?;
        }
        Ok(output)
    }

    fn detach_hook(&mut self, weights: &ModuleWeights) -> Result<()> {
        cast_weights(weights, self.compute_dtype)
    }

    fn name(&self) -> &'static str {
        "LayerwiseCastingHook"
    }
}

/// Adds a [`LayerwiseCastingHook`] after any hook `module` already has.
///
/// # Errors
/// Those of [`add_hook_to_module`].
pub fn apply_layerwise_casting(
    module: &dyn AnyBlock,
    storage_dtype: DType,
    compute_dtype: DType,
) -> Result<()> {
    let hook = LayerwiseCastingHook::new(storage_dtype, compute_dtype);
    add_hook_to_module(module, Box::new(hook), true)
}
