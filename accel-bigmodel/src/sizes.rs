//! Size accounting: bytes per module and the largest unsplittable layer.

use crate::bytes::Bytes;
use crate::dtype::DTypeName;
use crate::ordered_map::OrderedMap;
use crate::tree::{ModuleId, ModuleTree, TensorId, TensorKind, TreeItem};
use std::collections::HashMap;

/// Per-tensor dtype overrides, by full tensor name (Accelerate's `special_dtypes`).
pub type SpecialDtypes = HashMap<String, DTypeName>;

/// Bytes per module and per tensor, keyed by dotted name (`""` = whole model),
/// in the order Accelerate's `compute_module_sizes` fills its dict.
///
/// A name with no entry (a module holding only tied aliases) has size 0, as
/// with Accelerate's `defaultdict(int)`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ModuleSizes {
    map: OrderedMap<String, Bytes>,
}

impl ModuleSizes {
    /// The size of `name`, 0 when it has no entry.
    pub fn get(&self, name: &str) -> Bytes {
        self.map.get(name).copied().unwrap_or(Bytes::ZERO)
    }

    /// Whether `name` has an entry.
    pub fn contains(&self, name: &str) -> bool {
        self.map.contains_key(name)
    }

    /// The whole model's size (entry `""`).
    pub fn total(&self) -> Bytes {
        self.get("")
    }

    /// Entries in insertion order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, Bytes)> {
        self.map.iter().map(|(k, v)| (k.as_str(), *v))
    }

    /// Number of entries.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether there are no entries (a model without tensors).
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    fn add(&mut self, name: &str, size: Bytes) {
        // Every dotted prefix of the tensor name, shortest first: "", "a", "a.b", "a.b.c".
        *self.map.entry_or(String::new(), Bytes::ZERO) += size;
        for (i, _) in name.match_indices('.') {
            *self.map.entry_or(name[..i].to_string(), Bytes::ZERO) += size;
        }
        if !name.is_empty() {
            *self.map.entry_or(name.to_string(), Bytes::ZERO) += size;
        }
    }

    /// A copy without the names in `drop` (order kept).
    pub(crate) fn without(&self, drop: &std::collections::HashSet<&str>) -> ModuleSizes {
        let mut map = self.map.clone();
        map.retain(|k, _| !drop.contains(k.as_str()));
        ModuleSizes { map }
    }
}

/// Serialises as a JSON object in insertion order.
impl serde::Serialize for ModuleSizes {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_map(self.iter())
    }
}

/// The size of one tensor once loaded, as `compute_module_sizes` counts it:
/// a `special_dtypes` entry wins; otherwise without a target dtype the tensor's
/// own; integer and bool tensors are never converted; others take the smaller of
/// the target and their own element size.
fn tensor_size(
    name: &str,
    numel: u128,
    own: DTypeName,
    dtype: Option<DTypeName>,
    special_dtypes: Option<&SpecialDtypes>,
) -> Bytes {
    let element = match (special_dtypes.and_then(|s| s.get(name)), dtype) {
        (Some(special), _) => special.byte_size(),
        (None, None) => own.byte_size(),
        (None, Some(_)) if own.keeps_own_size() => own.byte_size(),
        (None, Some(target)) => target.byte_size().py_min(own.byte_size()),
    };
    element.times(numel)
}

/// Sizes every module and tensor of `tree` (Accelerate's `compute_module_sizes`).
///
/// Parameters come first, then buffers, each in pre-order with tied aliases
/// counted once. With `dtype`, floating tensors are sized at the smaller of
/// `dtype` and their own dtype; `special_dtypes` overrides single tensors by name.
pub fn compute_module_sizes(
    tree: &ModuleTree,
    dtype: Option<DTypeName>,
    special_dtypes: Option<&SpecialDtypes>,
) -> ModuleSizes {
    let root = tree.root();
    let mut sizes = ModuleSizes::default();
    for kind in [TensorKind::Parameter, TensorKind::Buffer] {
        for t in tree.subtree_tensors(root, kind) {
            let info = tree.tensor(t);
            let size = tensor_size(&info.name, info.numel(), info.dtype, dtype, special_dtypes);
            sizes.add(&info.name, size);
        }
    }
    sizes
}

/// Total bytes of the buffers in `module`'s subtree (`compute_module_total_buffer_size`).
///
/// Accelerate runs `compute_module_sizes` on the submodule here, so tensor names
/// are relative to it and `special_dtypes` (keyed by full names) is looked up by
/// those relative names; this reproduces that.
pub fn compute_module_total_buffer_size(
    tree: &ModuleTree,
    module: ModuleId,
    dtype: Option<DTypeName>,
    special_dtypes: Option<&SpecialDtypes>,
) -> Bytes {
    let prefix_len = match tree.module(module).name.len() {
        0 => 0,
        n => n + 1,
    };
    tree.subtree_tensors(module, TensorKind::Buffer)
        .into_iter()
        .map(|t: TensorId| {
            let info = tree.tensor(t);
            tensor_size(
                &info.name[prefix_len..],
                info.numel(),
                info.dtype,
                dtype,
                special_dtypes,
            )
        })
        .sum()
}

/// The largest layer and every layer of that size (`get_max_layer_size`).
#[derive(Clone, Debug, PartialEq)]
pub struct MaxLayer {
    /// Its size (0 when there is no layer).
    pub size: Bytes,
    /// Names of the layers of exactly that size, in visiting order.
    pub names: Vec<String>,
}

/// Finds the largest layer among `items` and their descendants, a layer being a
/// tensor, a module without children, or a module whose class is in
/// `no_split_module_classes` (Accelerate's `get_max_layer_size`).
///
/// Modules are visited depth first, children in registration order.
pub fn get_max_layer_size(
    tree: &ModuleTree,
    items: &[TreeItem],
    module_sizes: &ModuleSizes,
    no_split_module_classes: &[String],
) -> MaxLayer {
    let mut max = MaxLayer {
        size: Bytes::ZERO,
        names: Vec::new(),
    };
    // Reversed so that `pop` takes the front, as Accelerate's `pop(0)`.
    let mut stack: Vec<TreeItem> = items.iter().rev().copied().collect();
    while let Some(item) = stack.pop() {
        let name = tree.item_name(item);
        let children = match item {
            TreeItem::Module(m) if !is_no_split(tree, m, no_split_module_classes) => {
                tree.children(m)
            }
            _ => &[],
        };
        if children.is_empty() {
            let size = module_sizes.get(name);
            if size > max.size {
                max.size = size;
                max.names = vec![name.to_string()];
            } else if size == max.size {
                max.names.push(name.to_string());
            }
        } else {
            stack.extend(children.iter().rev().map(|&c| TreeItem::Module(c)));
        }
    }
    max
}

/// Whether Accelerate must keep `module` whole because of its class.
pub(crate) fn is_no_split(
    tree: &ModuleTree,
    module: ModuleId,
    no_split_module_classes: &[String],
) -> bool {
    tree.module(module)
        .class_name
        .as_deref()
        .is_some_and(|c| no_split_module_classes.iter().any(|n| n == c))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Result;

    fn tree() -> Result<ModuleTree> {
        let mut tree = ModuleTree::new(Some("Net"));
        tree.add_module("emb", Some("Embedding"))?;
        tree.add_module("blk", Some("Block"))?;
        tree.add_module("blk.fc", Some("Linear"))?;
        tree.add_module("head", Some("Linear"))?;
        tree.add_parameter("emb.weight", vec![10, 4], DTypeName::FLOAT32)?;
        tree.add_parameter("blk.fc.weight", vec![4, 4], DTypeName::FLOAT32)?;
        tree.add_parameter("blk.fc.bias", vec![4], DTypeName::FLOAT32)?;
        tree.add_parameter("head.weight", vec![10, 4], DTypeName::FLOAT32)?;
        tree.add_buffer("blk.mask", vec![3, 5], DTypeName::BOOL, false)?;
        tree.add_buffer("blk.pos", vec![4], DTypeName::INT64, true)?;
        tree.tie(&["emb.weight", "head.weight"])?;
        Ok(tree)
    }

    #[test]
    fn bool_buffers_make_fractional_float_sizes() -> Result<()> {
        let sizes = compute_module_sizes(&tree()?, None, None);
        // 160 + 64 + 16 params, then 15 bools (1.875) and 32 bytes of int64.
        assert_eq!(sizes.get("blk").to_string(), "113.875");
        assert_eq!(sizes.total().to_string(), "273.875");
        assert_eq!(sizes.get("emb").to_string(), "160");
        assert!(!sizes.contains("head"), "an alias-only module has no entry");
        let order: Vec<_> = sizes.iter().map(|(k, _)| k).collect();
        assert_eq!(
            order,
            [
                "",
                "emb",
                "emb.weight",
                "blk",
                "blk.fc",
                "blk.fc.weight",
                "blk.fc.bias",
                "blk.mask",
                "blk.pos"
            ]
        );
        Ok(())
    }

    #[test]
    fn a_target_dtype_shrinks_floats_only_and_special_dtypes_win() -> Result<()> {
        let tree = tree()?;
        let special = SpecialDtypes::from([("blk.fc.bias".to_string(), DTypeName::FLOAT64)]);
        let sizes = compute_module_sizes(&tree, Some(DTypeName::BFLOAT16), Some(&special));
        assert_eq!(sizes.get("emb").to_string(), "80");
        assert_eq!(sizes.get("blk.fc.bias").to_string(), "32");
        assert_eq!(sizes.get("blk.pos").to_string(), "32");
        assert_eq!(sizes.get("blk.mask").to_string(), "1.875");
        // A larger target dtype never grows a tensor.
        let sizes = compute_module_sizes(&tree, Some(DTypeName::FLOAT64), None);
        assert_eq!(sizes.get("emb").to_string(), "160");
        Ok(())
    }

    #[test]
    fn buffer_totals_look_special_dtypes_up_by_relative_name() -> Result<()> {
        let tree = tree()?;
        let blk = tree.module_id("blk").unwrap();
        let full = SpecialDtypes::from([("blk.pos".to_string(), DTypeName::INT8)]);
        assert_eq!(
            compute_module_total_buffer_size(&tree, blk, None, Some(&full)).to_string(),
            "33.875"
        );
        let relative = SpecialDtypes::from([("pos".to_string(), DTypeName::INT8)]);
        assert_eq!(
            compute_module_total_buffer_size(&tree, blk, None, Some(&relative)).to_string(),
            "5.875"
        );
        Ok(())
    }

    #[test]
    fn max_layer_respects_no_split_classes_and_ties() -> Result<()> {
        let tree = tree()?;
        let sizes = compute_module_sizes(&tree, None, None);
        let layer = get_max_layer_size(&tree, &tree.root_items(), &sizes, &[]);
        assert_eq!(
            (layer.size.to_string(), layer.names),
            ("160".to_string(), vec!["emb".to_string()])
        );
        let layer = get_max_layer_size(&tree, &tree.root_items(), &sizes, &["Block".to_string()]);
        assert_eq!(layer.names, ["emb"]);
        let small = compute_module_sizes(&tree, Some(DTypeName::parse("int4")?), None);
        // int4 sizes floats to 0 bytes: every layer ties at 0 except the buffers' module.
        let layer = get_max_layer_size(&tree, &tree.root_items(), &small, &[]);
        assert_eq!(layer.size.to_string(), "0");
        Ok(())
    }
}
