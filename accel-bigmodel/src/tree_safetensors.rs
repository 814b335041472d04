//! Reading a [`ModuleTree`] from safetensors headers alone, without touching tensor data.

use std::cmp::Ordering;
use std::path::Path;

use crate::error::{Error, Result};
use crate::safetensors::{CheckpointFiles, SafetensorsHeader};
use crate::tree::ModuleTree;

/// Compares dotted names segment by segment, numbers as numbers, so that
/// `h.2` comes before `h.10` as the layers were built.
fn natural_cmp(a: &str, b: &str) -> Ordering {
    let mut xs = a.split('.');
    let mut ys = b.split('.');
    loop {
        match (xs.next(), ys.next()) {
            (None, None) => return Ordering::Equal,
            (None, Some(_)) => return Ordering::Less,
            (Some(_), None) => return Ordering::Greater,
            (Some(x), Some(y)) => {
                let order = match (x.parse::<u64>(), y.parse::<u64>()) {
                    (Ok(i), Ok(j)) => i.cmp(&j).then_with(|| x.cmp(y)),
                    // A layer index before named siblings, for a stable total order.
                    (Ok(_), Err(_)) => Ordering::Less,
                    (Err(_), Ok(_)) => Ordering::Greater,
                    (Err(_), Err(_)) => x.cmp(y),
                };
                if order != Ordering::Equal {
                    return order;
                }
            }
        }
    }
}

impl ModuleTree {
    /// Builds a tree from the headers of a safetensors checkpoint: a file, an
    /// index `.json`, or a folder holding `model.safetensors` or one
    /// `*.index.json` with its shards.
    ///
    /// Only the length prefix and header of each file are read, so describing
    /// a checkpoint of any size costs a few kilobytes of I/O. Shards are checked
    /// against the index as when loading. Headers record neither module classes
    /// nor registration order, so classes are unknown and tensors are
    /// registered in natural name order (`h.2` before `h.10`); build the tree
    /// from the model itself (`crate::EmptyWeights`) when the planner must see
    /// the model's own order.
    ///
    /// # Errors
    /// Those of [`CheckpointFiles::resolve`] and [`SafetensorsHeader::read`];
    /// [`Error::MissingFile`] for a missing shard; [`Error::Safetensors`] for a
    /// shard disagreeing with the index or a dtype torch has no name for.
    pub fn from_safetensors(checkpoint: impl AsRef<Path>) -> Result<Self> {
        let files = CheckpointFiles::resolve(checkpoint)?;
        if let Some(index) = files.index() {
            index.check_shards_exist()?;
        }
        let mut headers = Vec::new();
        for path in files.paths() {
            let header = SafetensorsHeader::read(&path)?;
            if let Some(index) = files.index() {
                let name = path.file_name().unwrap_or_default().to_string_lossy();
                index.check_shard(&name, &header)?;
            }
            headers.push(header);
        }
        Self::from_safetensors_headers(&headers)
    }

    /// Builds a tree from already-read headers (see [`ModuleTree::from_safetensors`]).
    ///
    /// # Errors
    /// [`Error::Safetensors`] for a dtype torch has no name for (`F4`, `F6_*`),
    /// [`Error::DuplicateName`] for a name in two files or used as both a
    /// tensor and a module.
    pub fn from_safetensors_headers(headers: &[SafetensorsHeader]) -> Result<Self> {
        let mut tensors = Vec::new();
        for header in headers {
            for (name, entry) in header.tensors() {
                let dtype = entry.torch_dtype().ok_or_else(|| Error::Safetensors {
                    path: header.path().to_path_buf(),
                    tensor: Some(name.clone()),
                    reason: format!(
                        "tensor `{name}` has dtype {}, which has no torch dtype to size it with",
                        entry.dtype
                    ),
                })?;
                tensors.push((name.as_str(), entry.shape.clone(), dtype));
            }
        }
        tensors.sort_by(|a, b| natural_cmp(a.0, b.0));
        ModuleTree::from_tensors(tensors)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::DTypeName;

    fn write_header(path: &Path, header: &str, data_len: u64) {
        let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(header.as_bytes());
        std::fs::write(path, &bytes).unwrap();
        // Extend without writing: the data region is a hole (and never read).
        let file = std::fs::OpenOptions::new().write(true).open(path).unwrap();
        file.set_len(bytes.len() as u64 + data_len).unwrap();
    }

    #[test]
    fn names_sort_naturally_with_layer_numbers_as_numbers() {
        let mut names = vec!["h.10.w", "h.2.w", "h.2", "emb", "h.ln", "h.1.w"];
        names.sort_by(|a, b| natural_cmp(a, b));
        assert_eq!(names, ["emb", "h.1.w", "h.2", "h.2.w", "h.10.w", "h.ln"]);
    }

    #[test]
    fn a_tree_comes_from_the_header_of_a_sparse_multi_gigabyte_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("model.safetensors");
        // 4 GiB of f32 + 2 GiB of bf16, never written: the file is one hole.
        let header = r#"{"__metadata__":{"format":"pt"},"layers.10.w":{"dtype":"F32","shape":[32768,32768],"data_offsets":[0,4294967296]},"layers.2.w":{"dtype":"BF16","shape":[32768,32768],"data_offsets":[4294967296,6442450944]}}"#;
        write_header(&path, header, 6 << 30);
        let tree = ModuleTree::from_safetensors(dir.path()).unwrap();
        let names: Vec<(&str, &[usize], DTypeName)> = tree
            .parameters()
            .into_iter()
            .map(|t| {
                let t = tree.tensor(t);
                (t.name.as_str(), &t.shape[..], t.dtype)
            })
            .collect();
        assert_eq!(
            names,
            [
                ("layers.2.w", &[32768usize, 32768][..], DTypeName::BFLOAT16),
                ("layers.10.w", &[32768, 32768][..], DTypeName::FLOAT32),
            ]
        );
        assert!(tree.module_id("layers.10").is_some());
    }

    #[test]
    fn dtypes_without_a_torch_name_are_named_with_file_and_tensor() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("q.safetensors");
        write_header(
            &path,
            r#"{"q":{"dtype":"F4","shape":[4],"data_offsets":[0,2]}}"#,
            2,
        );
        let err = ModuleTree::from_safetensors(&path).unwrap_err();
        assert_eq!(
            err.to_string(),
            format!(
                "{}: invalid safetensors file: tensor `q` has dtype F4, which has no torch dtype to size it with",
                path.display()
            )
        );
    }
}

impl ModuleTree {
    /// Builds a tree from the variables of a candle `VarMap` (names, shapes,
    /// dtypes), in natural name order since a `VarMap` does not keep creation
    /// order. Variables that share storage are not detected; declare tied
    /// weights with [`ModuleTree::tie`].
    ///
    /// # Errors
    /// A dtype with no torch equivalent, or names that clash.
    pub fn from_varmap(varmap: &candle_nn::VarMap) -> Result<Self> {
        let data = varmap.data().lock().unwrap_or_else(|e| e.into_inner());
        let mut entries: Vec<(String, Vec<usize>, candle_core::DType)> = data
            .iter()
            .map(|(n, v)| (n.clone(), v.dims().to_vec(), v.dtype()))
            .collect();
        drop(data);
        entries.sort_by(|a, b| natural_cmp(&a.0, &b.0));
        let tensors = entries
            .into_iter()
            .map(|(n, shape, dtype)| Ok((n, shape, crate::DTypeName::try_from(dtype)?)))
            .collect::<Result<Vec<_>>>()?;
        ModuleTree::from_tensors(tensors)
    }
}

#[cfg(test)]
mod varmap_tests {
    use super::*;

    #[test]
    fn a_varmap_becomes_a_tree_sized_like_its_variables() {
        let vm = candle_nn::VarMap::new();
        let vb = candle_nn::VarBuilder::from_varmap(
            &vm,
            candle_core::DType::F32,
            &candle_core::Device::Cpu,
        );
        for i in [10, 2] {
            candle_nn::linear(4, 3, vb.pp(format!("h.{i}"))).unwrap();
        }
        let tree = ModuleTree::from_varmap(&vm).unwrap();
        let sizes = crate::compute_module_sizes(&tree, None, None);
        assert_eq!(sizes.get("").as_f64(), (2 * (4 * 3 + 3) * 4) as f64);
        assert_eq!(sizes.get("h.2").as_f64(), ((4 * 3 + 3) * 4) as f64);
        // Natural order: h.2 is registered before h.10.
        let names: Vec<&str> = tree
            .parameters()
            .iter()
            .map(|&id| tree.tensor(id).name.as_str())
            .collect();
        assert_eq!(names[0], "h.2.bias");
        assert_eq!(names[2], "h.10.bias");
    }
}
