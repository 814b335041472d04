//! Checkpoint files for unit tests: single safetensors files and shard sets with an index.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::Tensor;

/// Writes `tensors` to a safetensors file at `path`.
pub(crate) fn write(path: &Path, tensors: &[(&str, Tensor)]) -> PathBuf {
    let map: HashMap<String, Tensor> = tensors
        .iter()
        .map(|(n, t)| (n.to_string(), t.clone()))
        .collect();
    candle_core::safetensors::save(&map, path).unwrap();
    path.to_path_buf()
}

/// Writes one shard per entry of `shards` into `dir`, plus `model.safetensors.index.json`.
pub(crate) fn write_sharded(dir: &Path, shards: &[(&str, Vec<(&str, Tensor)>)]) -> PathBuf {
    let mut weight_map = serde_json::Map::new();
    for (file, tensors) in shards {
        write(&dir.join(file), tensors);
        for (name, _) in tensors {
            weight_map.insert(name.to_string(), serde_json::Value::from(*file));
        }
    }
    let index = dir.join("model.safetensors.index.json");
    let value = serde_json::json!({"metadata": {"total_size": 0}, "weight_map": weight_map});
    std::fs::write(&index, serde_json::to_string_pretty(&value).unwrap()).unwrap();
    index
}
