//! Checkpoint files for the loading tests: real ones written by candle, and
//! hand-crafted ones with exactly the defect a test needs.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::Tensor;

/// Writes `tensors` to a safetensors file at `path` with candle's writer.
pub fn write(path: &Path, tensors: &[(&str, Tensor)]) -> PathBuf {
    let map: HashMap<String, Tensor> = tensors
        .iter()
        .map(|(n, t)| (n.to_string(), t.clone()))
        .collect();
    candle_core::safetensors::save(&map, path).unwrap();
    path.to_path_buf()
}

/// Writes one shard per entry into `dir`, plus `model.safetensors.index.json`; returns the index.
pub fn write_sharded(dir: &Path, shards: &[(&str, Vec<(&str, Tensor)>)]) -> PathBuf {
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

/// A file made of a length prefix, `header` and `data`, as given.
pub fn craft(path: &Path, header: &str, data: &[u8]) -> PathBuf {
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header.as_bytes());
    bytes.extend_from_slice(data);
    std::fs::write(path, bytes).unwrap();
    path.to_path_buf()
}

/// This process's resident set size in bytes, from `/proc/self/status`.
pub fn rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    let kb: u64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    kb * 1024
}
