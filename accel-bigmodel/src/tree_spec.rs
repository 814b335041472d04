//! Reading a [`ModuleTree`] from the flat, language-neutral JSON tree of the reference cases.

use crate::dtype::DTypeName;
use crate::error::bail_spec;
use crate::error::Result;
use crate::tree::ModuleTree;
use serde_json::Value;

fn field<'a>(obj: &'a Value, path: &str, key: &str) -> Result<&'a Value> {
    match obj.get(key) {
        Some(v) => Ok(v),
        None => bail_spec!(path, "missing key {key:?}"),
    }
}

fn string<'a>(obj: &'a Value, path: &str, key: &str) -> Result<&'a str> {
    match field(obj, path, key)? {
        Value::String(s) => Ok(s),
        other => bail_spec!(format!("{path}.{key}"), "expected a string, got {other}"),
    }
}

fn array<'a>(obj: &'a Value, path: &str, key: &str) -> Result<&'a [Value]> {
    match obj.get(key) {
        // A tree without buffers or ties may leave those lists out.
        None if key == "buffers" || key == "tied" => Ok(&[]),
        None => bail_spec!(path, "missing key {key:?}"),
        Some(Value::Array(a)) => Ok(a),
        Some(other) => bail_spec!(format!("{path}.{key}"), "expected a list, got {other}"),
    }
}

fn shape(obj: &Value, path: &str) -> Result<Vec<usize>> {
    let dims = array(obj, path, "shape")?;
    dims.iter()
        .enumerate()
        .map(
            |(i, d)| match d.as_u64().and_then(|d| usize::try_from(d).ok()) {
                Some(d) => Ok(d),
                None => bail_spec!(
                    format!("{path}.shape[{i}]"),
                    "expected a dimension, got {d}"
                ),
            },
        )
        .collect()
}

impl ModuleTree {
    /// Builds a tree from the reference spec's `model_tree` object:
    /// `modules` (pre-order `{name, class}`), `parameters` (`{name, shape, dtype}`,
    /// tied aliases included), `buffers` (`{name, shape, dtype, persistent}`) and
    /// `tied` (groups of parameter names sharing one storage).
    ///
    /// # Errors
    /// [`crate::Error::InvalidSpec`] naming the field at fault, or the errors of the
    /// `add_*`/[`ModuleTree::tie`] builders (unknown parent module, duplicate name, unknown dtype).
    pub fn from_spec_json(tree: &Value) -> Result<Self> {
        let modules = array(tree, "model_tree", "modules")?;
        let root_class = match modules.first() {
            Some(root) if string(root, "modules[0]", "name")?.is_empty() => {
                root.get("class").and_then(Value::as_str)
            }
            _ => bail_spec!(
                "modules[0]",
                "the first module must be the root (name \"\")"
            ),
        };
        let mut out = ModuleTree::new(root_class);
        for (i, module) in modules.iter().enumerate().skip(1) {
            let path = format!("modules[{i}]");
            let name = string(module, &path, "name")?;
            out.add_module(name, module.get("class").and_then(Value::as_str))?;
        }
        for (i, param) in array(tree, "model_tree", "parameters")?.iter().enumerate() {
            let path = format!("parameters[{i}]");
            let dtype = DTypeName::parse(string(param, &path, "dtype")?)?;
            out.add_parameter(string(param, &path, "name")?, shape(param, &path)?, dtype)?;
        }
        for (i, buffer) in array(tree, "model_tree", "buffers")?.iter().enumerate() {
            let path = format!("buffers[{i}]");
            let dtype = DTypeName::parse(string(buffer, &path, "dtype")?)?;
            let persistent = buffer
                .get("persistent")
                .and_then(Value::as_bool)
                .unwrap_or(true);
            out.add_buffer(
                string(buffer, &path, "name")?,
                shape(buffer, &path)?,
                dtype,
                persistent,
            )?;
        }
        for (i, group) in array(tree, "model_tree", "tied")?.iter().enumerate() {
            let Some(names) = group.as_array() else {
                bail_spec!(
                    format!("tied[{i}]"),
                    "expected a list of names, got {group}"
                );
            };
            let names: Vec<&str> = names.iter().filter_map(Value::as_str).collect();
            out.tie(&names)?;
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tree::{TensorKind, TreeItem};
    use serde_json::json;

    fn tied_lm() -> Value {
        json!({
            "modules": [
                {"name": "", "class": "LM"},
                {"name": "wte", "class": "Embedding"},
                {"name": "h", "class": "ModuleList"},
                {"name": "h.0", "class": "Block"},
                {"name": "lm_head", "class": "Linear"}
            ],
            "parameters": [
                {"name": "wte.weight", "shape": [10, 4], "dtype": "float32"},
                {"name": "h.0.w", "shape": [4, 4], "dtype": "float16"},
                {"name": "lm_head.weight", "shape": [10, 4], "dtype": "float32"}
            ],
            "buffers": [{"name": "mask", "shape": [4], "dtype": "bool", "persistent": false}],
            "tied": [["lm_head.weight", "wte.weight"]]
        })
    }

    #[test]
    fn spec_trees_keep_registration_order_and_ties() -> Result<()> {
        let tree = ModuleTree::from_spec_json(&tied_lm())?;
        let names: Vec<_> = tree
            .modules()
            .into_iter()
            .map(|m| tree.module(m).name.clone())
            .collect();
        assert_eq!(names, ["", "wte", "h", "h.0", "lm_head"]);
        assert_eq!(
            tree.tied_parameters(),
            [vec!["lm_head.weight".to_string(), "wte.weight".into()]]
        );
        // The alias is skipped by a deduplicating walk, not by a listing.
        assert_eq!(tree.parameters().len(), 3);
        assert_eq!(
            tree.subtree_tensors(tree.root(), TensorKind::Parameter)
                .len(),
            2
        );
        let items: Vec<_> = tree
            .root_items()
            .into_iter()
            .map(|i| tree.item_name(i).to_string())
            .collect();
        assert_eq!(items, ["wte", "h", "lm_head", "mask"]);
        assert!(matches!(tree.root_items()[3], TreeItem::Tensor(_)));
        assert_eq!(tree.class_name_at("mask"), Some("Tensor"));
        assert_eq!(tree.class_name_at("h.0.w"), Some("Parameter"));
        Ok(())
    }

    #[test]
    fn a_tensor_on_a_missing_module_names_both() {
        let mut spec = tied_lm();
        spec["parameters"][1]["name"] = json!("h.1.w");
        let err = ModuleTree::from_spec_json(&spec).unwrap_err().to_string();
        assert!(
            err.contains("\"h.1.w\"") && err.contains("\"h.1\""),
            "{err}"
        );
    }

    #[test]
    fn tensors_imply_their_modules() -> Result<()> {
        let tree = ModuleTree::from_tensors([
            ("b.1.w", vec![2], DTypeName::FLOAT32),
            ("a.w", vec![2], DTypeName::FLOAT32),
            ("b.0.w", vec![2], DTypeName::FLOAT32),
            ("a.v", vec![2], DTypeName::FLOAT32),
        ])?;
        let names: Vec<_> = tree
            .modules()
            .into_iter()
            .map(|m| tree.module(m).name.clone())
            .collect();
        assert_eq!(names, ["", "b", "b.1", "b.0", "a"]);
        let params: Vec<_> = tree
            .parameters()
            .into_iter()
            .map(|t| tree.tensor(t).name.clone())
            .collect();
        assert_eq!(params, ["b.1.w", "b.0.w", "a.w", "a.v"]);
        assert_eq!(tree.module(tree.module_id("a").unwrap()).class_name, None);
        Ok(())
    }

    #[test]
    fn ties_merge_and_reject_mismatches() -> Result<()> {
        let mut tree = ModuleTree::from_tensors([
            ("a.w", vec![2], DTypeName::FLOAT32),
            ("b.w", vec![2], DTypeName::FLOAT32),
            ("c.w", vec![2], DTypeName::FLOAT32),
            ("d.w", vec![3], DTypeName::FLOAT32),
        ])?;
        tree.tie(&["c.w", "b.w"])?;
        tree.tie(&["a.w", "c.w"])?;
        assert_eq!(
            tree.tied_parameters(),
            [vec!["a.w".to_string(), "b.w".into(), "c.w".into()]]
        );
        assert!(tree.tie(&["a.w", "d.w"]).is_err());
        assert!(tree.tie(&["a.w", "nope"]).is_err());
        Ok(())
    }
}
