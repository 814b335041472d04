//! The planner's helpers for tied parameters and its fallback search for a module that fits.

use crate::bytes::Bytes;
use crate::error::{Error, Result};
use crate::sizes::{is_no_split, ModuleSizes};
use crate::tree::{ModuleTree, TreeItem};

/// Whether tensor `param` lies inside `name`, by Accelerate's test
/// `name + "." in param + "."`: a *substring* test, so `h.0` is also "inside"
/// `wh.0.x`. Kept as is because placements depend on it.
fn inside(name: &str, param: &str) -> bool {
    format!("{param}.").contains(&format!("{name}."))
}

/// The tie groups that straddle `name` (some member inside it, some outside),
/// and the members outside it, in group order.
pub(crate) fn tied_params_outside<'t>(
    tied: &'t [Vec<String>],
    name: &str,
) -> (Vec<&'t Vec<String>>, Vec<&'t str>) {
    let groups: Vec<&Vec<String>> = tied
        .iter()
        .filter(|g| g.iter().any(|k| inside(name, k)) && !g.iter().all(|k| inside(name, k)))
        .collect();
    let outside = groups
        .iter()
        .flat_map(|g| g.iter().filter(|p| !inside(name, p)).map(String::as_str))
        .collect();
    (groups, outside)
}

/// The size of a module together with the modules holding its tied parameters
/// (Accelerate's `get_module_size_with_ties`), and those modules.
///
/// Each outside parameter is charged as its whole enclosing queue entry minus
/// the parameter itself (which the module already counts). A parameter whose
/// module is no longer queued makes Accelerate fail with `IndexError`.
pub(crate) fn module_size_with_ties(
    tree: &ModuleTree,
    op: &'static str,
    tied_params: &[&str],
    module_size: Bytes,
    module_sizes: &ModuleSizes,
    queue: &[TreeItem],
) -> Result<(Bytes, Vec<TreeItem>)> {
    let mut size = module_size;
    let mut modules = Vec::with_capacity(tied_params.len());
    for param in tied_params {
        let item = queue
            .iter()
            .copied()
            .find(|&i| {
                let n = tree.item_name(i);
                param.len() > n.len() && param.starts_with(n) && param.as_bytes()[n.len()] == b'.'
            })
            .ok_or_else(|| Error::TiedParameterNotQueued {
                op,
                param: param.to_string(),
            })?;
        modules.push(item);
    }
    for (param, &item) in tied_params.iter().zip(&modules) {
        size = size + module_sizes.get(tree.item_name(item)) - module_sizes.get(param);
    }
    Ok((size, modules))
}

/// Finds, depth first, the first module or tensor of `queue` that fits in
/// `size_limit` with its ties, and returns it with the queue it leaves behind:
/// each of its queued ancestors replaced by that ancestor's direct parameters
/// and children (Accelerate's `fallback_allocate`).
///
/// `Ok(None)` when nothing fits or the limit is negative.
///
/// # Errors
/// [`Error::FractionalSizeLimit`] for a float limit and
/// [`Error::TiedParameterNotQueued`] as in the main loop: Accelerate raises there too.
pub(crate) fn fallback_allocate(
    tree: &ModuleTree,
    queue: &[TreeItem],
    module_sizes: &ModuleSizes,
    size_limit: Bytes,
    no_split_module_classes: &[String],
    tied: &[Vec<String>],
) -> Result<Option<(TreeItem, Vec<TreeItem>)>> {
    // Accelerate first runs the limit through `convert_file_size_to_int`, which
    // returns an int unchanged, rejects a negative one, and crashes on a float.
    if size_limit.is_float() {
        return Err(Error::FractionalSizeLimit {
            limit: size_limit.to_string(),
        });
    }
    if size_limit < Bytes::ZERO {
        return Ok(None);
    }

    let mut search: Vec<TreeItem> = queue.to_vec();
    let mut found = None;
    while !search.is_empty() {
        let item = search.remove(0);
        let name = tree.item_name(item);
        let (_, outside) = tied_params_outside(tied, name);
        let (size, _) = module_size_with_ties(
            tree,
            "fallback_allocate",
            &outside,
            module_sizes.get(name),
            module_sizes,
            &search,
        )?;
        if size <= size_limit {
            found = Some(item);
            break;
        }
        if let TreeItem::Module(m) = item {
            if !tree.children(m).is_empty() && !is_no_split(tree, m, no_split_module_classes) {
                let mut expanded = tree.split_items(m);
                expanded.append(&mut search);
                search = expanded;
            }
        }
    }
    let Some(target) = found else {
        return Ok(None);
    };

    // Open up every queued ancestor of the target, outermost first, so that the
    // target itself becomes a queue entry that can be taken out.
    let name = tree.item_name(target);
    let mut modules = queue.to_vec();
    for (dot, _) in name.match_indices('.') {
        let parent = &name[..dot];
        if let Some(idx) = modules.iter().position(|&i| tree.item_name(i) == parent) {
            if let TreeItem::Module(m) = modules[idx] {
                modules.splice(idx..=idx, tree.split_items(m));
            }
        }
    }
    // Always found: the target was reached by opening exactly these ancestors.
    let Some(idx) = modules.iter().position(|&i| tree.item_name(i) == name) else {
        return Ok(None);
    };
    let target = modules.remove(idx);
    Ok(Some((target, modules)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::DTypeName;
    use crate::sizes::compute_module_sizes;

    #[test]
    fn inside_is_a_substring_test() {
        assert!(inside("h.0", "h.0.w"));
        assert!(inside("h.0", "wh.0.w"));
        assert!(!inside("h.0", "h.01.w"));
        assert!(inside("w", "w"));
    }

    fn tree() -> Result<ModuleTree> {
        let mut tree = ModuleTree::new(Some("Net"));
        for (m, c) in [
            ("big", "Linear"),
            ("seq", "Seq"),
            ("seq.0", "Linear"),
            ("seq.1", "Linear"),
        ] {
            tree.add_module(m, Some(c))?;
        }
        tree.add_parameter("big.weight", vec![100], DTypeName::FLOAT32)?;
        tree.add_parameter("seq.scale", vec![2], DTypeName::FLOAT32)?;
        tree.add_parameter("seq.0.weight", vec![10], DTypeName::FLOAT32)?;
        tree.add_parameter("seq.1.weight", vec![20], DTypeName::FLOAT32)?;
        Ok(tree)
    }

    #[test]
    fn fallback_opens_ancestors_and_returns_the_rest() -> Result<()> {
        let tree = tree()?;
        let sizes = compute_module_sizes(&tree, None, None);
        let queue = tree.root_items();
        let (found, rest) =
            fallback_allocate(&tree, &queue, &sizes, Bytes::new(50), &[], &[])?.unwrap();
        // "big" (400) and "seq" (128) are too big; depth first, "seq.scale" (8) fits first.
        assert_eq!(tree.item_name(found), "seq.scale");
        let rest: Vec<_> = rest.iter().map(|&i| tree.item_name(i)).collect();
        assert_eq!(rest, ["big", "seq.0", "seq.1"]);
        assert!(fallback_allocate(&tree, &queue, &sizes, Bytes::new(-1), &[], &[])?.is_none());
        assert!(fallback_allocate(&tree, &queue, &sizes, Bytes::new(4), &[], &[])?.is_none());
        // The class list stops the search from opening "seq".
        let no_split = ["Seq".to_string()];
        assert!(
            fallback_allocate(&tree, &queue, &sizes, Bytes::new(50), &no_split, &[])?.is_none()
        );
        Ok(())
    }

    #[test]
    fn fallback_rejects_a_fractional_limit() -> Result<()> {
        let tree = tree()?;
        let sizes = compute_module_sizes(&tree, None, None);
        let limit = Bytes::from_bits(8 * 50, true);
        let err =
            fallback_allocate(&tree, &tree.root_items(), &sizes, limit, &[], &[]).unwrap_err();
        assert!(err.to_string().contains("AttributeError"), "{err}");
        Ok(())
    }

    #[test]
    fn ties_charge_the_enclosing_queued_module() -> Result<()> {
        let mut tree = tree()?;
        tree.add_module("head", Some("Linear"))?;
        tree.add_parameter("head.weight", vec![10], DTypeName::FLOAT32)?;
        tree.tie(&["seq.0.weight", "head.weight"])?;
        let sizes = compute_module_sizes(&tree, None, None);
        let tied = tree.tied_parameters().to_vec();
        let (groups, outside) = tied_params_outside(&tied, "head");
        assert_eq!((groups.len(), outside.clone()), (1, vec!["seq.0.weight"]));
        let queue = tree.root_items();
        let (size, modules) =
            module_size_with_ties(&tree, "test", &outside, sizes.get("head"), &sizes, &queue)?;
        // head holds only the alias (0 bytes); seq is 128 bytes, minus the 40 of the shared weight.
        assert_eq!(size, Bytes::new(88));
        assert_eq!(tree.item_name(modules[0]), "seq");
        let err = module_size_with_ties(&tree, "test", &outside, Bytes::ZERO, &sizes, &queue[..1]);
        assert!(matches!(err, Err(Error::TiedParameterNotQueued { .. })));
        Ok(())
    }
}
