//! FSDP acting on a model's blocks: which blocks form units, and the hook
//! that runs each block on gathered parameters.

use std::collections::HashMap;
use std::sync::Arc;

use accel_dist::fsdp::{matches_pattern, AutoWrapPolicy};
use accel_nn::block::{Activations, ForwardFn, Model};
use accel_nn::hooks::{add_hook_to_module, ModelHook, ModuleWeights};
use candle_core::Tensor;

use super::FsdpModel;
use crate::{Error, Result};

/// Which unit each parameter belongs to (absent: the root unit), choosing
/// whole blocks as `policy` says: a block is wrapped when its class name or
/// its module name matches a transformer pattern (with no pattern: when its
/// class repeats in the model, the decoder layers that transformers'
/// `_no_split_modules` names), or when it holds at least `min_num_params`
/// scalars under the size-based policy.
///
/// # Errors
/// A parameter no block holds (the sharded model could never reach it), or a
/// weight shared by a wrapped block and another block.
pub(crate) fn plan_units(
    model: &dyn Model,
    params: &[(String, usize)],
    policy: &AutoWrapPolicy,
) -> Result<HashMap<String, String>> {
    let mut owners: HashMap<String, Vec<(String, bool)>> = HashMap::new();
    let numel: HashMap<&str, usize> = params.iter().map(|(n, k)| (n.as_str(), *k)).collect();
    let mut class_count: HashMap<String, usize> = HashMap::new();
    for block in model.blocks() {
        *class_count
            .entry(block.class_name().to_string())
            .or_default() += 1;
    }
    for block in model.blocks() {
        let name = block.name();
        let names = block.weights().names();
        let wrapped = match policy {
            AutoWrapPolicy::NoWrap => false,
            AutoWrapPolicy::Transformer { patterns } if patterns.is_empty() => {
                class_count.get(block.class_name()).is_some_and(|&n| n > 1)
            }
            AutoWrapPolicy::Transformer { patterns } => patterns
                .iter()
                .any(|p| p == block.class_name() || matches_pattern(&name, p)),
            AutoWrapPolicy::Size { min_num_params } => {
                let size: usize = names.iter().filter_map(|n| numel.get(n.as_str())).sum();
                size >= *min_num_params
            }
        };
        for n in names {
            owners.entry(n).or_default().push((name.clone(), wrapped));
        }
    }
    if let AutoWrapPolicy::Transformer { patterns } = policy {
        // Accelerate raises for a class it cannot find; so do we, for a name
        // or pattern that no block answers to.
        let blocks = model.blocks();
        for p in patterns {
            let found = blocks
                .iter()
                .any(|b| p == b.class_name() || matches_pattern(&b.name(), p));
            if !found {
                let mut classes: Vec<&str> = blocks.iter().map(|b| b.class_name()).collect();
                classes.sort_unstable();
                classes.dedup();
                return Err(Error::Config {
                    key: "fsdp_transformer_layer_cls_to_wrap".into(),
                    reason: format!(
                        "Could not find the transformer layer class {p} in the model (its blocks \
                         are of classes {classes:?}; module-name patterns such as `h.*` work too)"
                    ),
                });
            }
        }
    }
    let mut unit_of = HashMap::new();
    for (param, _) in params {
        let Some(blocks) = owners.get(param) else {
            return Err(Error::Config {
                key: "fsdp".into(),
                reason: format!(
                    "parameter `{param}` is in no block of the model; a sharded model reaches its \
                     parameters only through its blocks (build every layer inside a Block)"
                ),
            });
        };
        match blocks.as_slice() {
            [(block, true)] => {
                unit_of.insert(param.clone(), block.clone());
            }
            [_] => {}
            many if many.iter().any(|(_, w)| *w) => {
                let names: Vec<&str> = many.iter().map(|(b, _)| b.as_str()).collect();
                return Err(Error::Config {
                    key: "fsdp_transformer_layer_cls_to_wrap".into(),
                    reason: format!(
                        "parameter `{param}` is shared by blocks {names:?}; a shared weight cannot \
                         be in a wrapped unit"
                    ),
                });
            }
            _ => {}
        }
    }
    Ok(unit_of)
}

/// Runs a block on the sharded parameters: a wrapped unit on its gathered
/// parameters (freed after, regathered and recomputed in backward, as the
/// strategy says), a root block on the root unit's parameters.
struct FsdpHook {
    fsdp: FsdpModel,
    unit: Option<usize>,
}

impl ModelHook for FsdpHook {
    fn wraps_forward(&self) -> bool {
        true
    }

    fn run_forward(
        &mut self,
        _weights: &ModuleWeights,
        args: Activations,
        forward: &Arc<ForwardFn>,
    ) -> accel_nn::Result<Tensor> {
        match self.unit {
            Some(u) => self.fsdp.forward_unit(u, &args, forward),
            None => self.fsdp.forward_root(&args, forward),
        }
    }

    fn name(&self) -> &'static str {
        "FullyShardedDataParallel"
    }
}

/// Attaches the FSDP hook to every block of `model`.
pub(crate) fn shard_blocks(model: &dyn Model, fsdp: &FsdpModel) -> Result<()> {
    for block in model.blocks() {
        let hook = FsdpHook {
            fsdp: fsdp.clone(),
            unit: fsdp.unit_of_block(&block.name()),
        };
        add_hook_to_module(block, Box::new(hook), false)?;
    }
    Ok(())
}
