//! The module tree of a model as transformers builds it, for planning device
//! maps that equal Accelerate's on the Python model.
//!
//! [`Model::tree`]'s default knows only the weights the blocks hold, each
//! once. The Python model also has a module for a tied `lm_head` (its weight
//! an alias of the embedding's, which `find_tied_parameters` reports) and
//! non-persistent buffers (rotary `inv_freq`, BERT's `position_ids`), which
//! Accelerate plans and sizes too.

use accel_bigmodel::{DTypeName, ModuleTree};
use accel_nn::block::Model;
use candle_core::DType;

/// A buffer the Python model registers: name, shape, dtype.
pub(crate) type Buffer = (String, Vec<usize>, DTypeName);

/// The tree of `model` with `lm_head.weight` tied to `tied_to` (when the
/// embeddings are tied) and `buffers` registered on their modules.
///
/// # Errors
/// A dtype torch lacks; names clashing between modules and tensors.
pub(crate) fn model_tree(
    model: &dyn Model,
    dtype: Option<DType>,
    tied_head: Option<(&str, &str)>,
    buffers: &[Buffer],
    empty_modules: &[(&str, &str)],
) -> accel_nn::Result<ModuleTree> {
    let tensors = model.tree_tensors(dtype)?;
    let mut tree = ModuleTree::new(None);
    let mut pending: Vec<_> = empty_modules.to_vec();
    for (name, shape, dt) in tensors {
        // A parameter-less module (GPT-2's `transformer.drop`) goes where
        // Python registered it: before the first module that follows it.
        pending.retain(|(module, before)| {
            let due = name.starts_with(&format!("{before}."));
            if due {
                let _ = ensure_module(&mut tree, module);
            }
            !due
        });
        ensure_module(&mut tree, parent(&name))?;
        tree.add_parameter(&name, shape, dt)?;
    }
    for (name, shape, dt) in buffers {
        ensure_module(&mut tree, parent(name))?;
        tree.add_buffer(name, shape.clone(), *dt, false)?;
    }
    if let Some((alias, source)) = tied_head {
        let id = tree
            .tensor_id(source)
            .ok_or_else(|| accel_bigmodel::Error::UnknownParameter {
                op: "tie",
                name: source.to_string(),
            })?;
        let info = tree.tensor(id).clone();
        ensure_module(&mut tree, parent(alias))?;
        tree.add_parameter(alias, info.shape, info.dtype)?;
        tree.tie(&[source, alias])?;
    }
    for block in model.blocks() {
        let name = block.name();
        if !block.class_name().is_empty() && tree.module_id(&name).is_some() {
            tree.set_class_name(&name, block.class_name())?;
        }
    }
    Ok(tree)
}

/// The module owning tensor `name`.
fn parent(name: &str) -> &str {
    name.rsplit_once('.').map_or("", |(m, _)| m)
}

/// Creates `module` and its missing ancestors, classes unknown.
fn ensure_module(tree: &mut ModuleTree, module: &str) -> accel_bigmodel::Result<()> {
    if module.is_empty() || tree.module_id(module).is_some() {
        return Ok(());
    }
    ensure_module(tree, parent(module))?;
    tree.add_module(module, None).map(|_| ())
}
