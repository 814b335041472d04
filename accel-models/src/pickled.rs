//! `pytorch_model.bin` checkpoints (`torch.save`'s zip of pickles, one file
//! or shards with `pytorch_model.bin.index.json`), read with candle's pickle
//! reader and written once as safetensors beside the Hugging Face cache, so
//! every loader (memory-mapped weights, device maps, offload, FSDP pieces)
//! reads them as it reads any folder. transformers loads such folders too;
//! the copy costs the model's size on disk once, and is reused while the
//! `.bin` files keep their size and modification time.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use candle_core::Tensor;

use crate::{Error, Result};

const BIN: &str = "pytorch_model.bin";
const BIN_INDEX: &str = "pytorch_model.bin.index.json";

/// The folder to load for `dir`: itself when it holds safetensors or no
/// `.bin` weights, else the converted copy (made now when missing).
///
/// # Errors
/// A `.bin` file candle cannot read (naming it), an unreadable index, a
/// failed write.
pub(crate) fn loadable(dir: &Path) -> Result<PathBuf> {
    if !dir.is_dir() {
        return Ok(dir.to_path_buf());
    }
    let names: Vec<String> = std::fs::read_dir(dir)
        .map_err(|source| Error::Io {
            path: dir.to_path_buf(),
            source,
        })?
        .flatten()
        .map(|e| e.file_name().to_string_lossy().to_string())
        .collect();
    if names.iter().any(|n| n.ends_with(".safetensors")) {
        return Ok(dir.to_path_buf());
    }
    let shards: Vec<String> = if names.iter().any(|n| n == BIN_INDEX) {
        let index = read_index(&dir.join(BIN_INDEX))?;
        let mut files: Vec<String> = index.values().cloned().collect();
        files.sort();
        files.dedup();
        files
    } else if names.iter().any(|n| n == BIN) {
        vec![BIN.to_string()]
    } else {
        return Ok(dir.to_path_buf());
    };
    let out = converted_dir(dir, &shards)?;
    if out.join("config.json").is_file() {
        return Ok(out);
    }
    convert(dir, &names, &shards, &out)?;
    Ok(out)
}

/// `weight_map` of a `.bin` index.
fn read_index(path: &Path) -> Result<BTreeMap<String, String>> {
    let text = std::fs::read_to_string(path).map_err(|source| Error::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| Error::BadConfig {
        path: path.to_path_buf(),
        reason: e.to_string(),
    })?;
    serde_json::from_value(v["weight_map"].clone()).map_err(|e| Error::BadConfig {
        path: path.to_path_buf(),
        reason: format!("weight_map: {e}"),
    })
}

/// `{hub cache}/../accel/converted/{digest}`: keyed by the folder and each
/// shard's size and modification time.
fn converted_dir(dir: &Path, shards: &[String]) -> Result<PathBuf> {
    let canon = dir.canonicalize().unwrap_or_else(|_| dir.to_path_buf());
    let mut key = canon.display().to_string();
    for s in shards {
        let meta = std::fs::metadata(dir.join(s)).map_err(|source| Error::Io {
            path: dir.join(s),
            source,
        })?;
        let mtime = meta
            .modified()
            .ok()
            .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
            .map_or(0, |d| d.as_nanos());
        key.push_str(&format!("|{s}:{}:{mtime}", meta.len()));
    }
    // FNV-1a: a name, not a security boundary.
    let digest = key.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    });
    let root = crate::hub::hub_cache_dir();
    let base = root
        .parent()
        .unwrap_or(&root)
        .join("accel")
        .join("converted");
    Ok(base.join(format!("{digest:016x}")))
}

/// Writes each shard as safetensors (and the index), then the folder's other
/// files, `config.json` last: its presence marks a finished copy.
fn convert(dir: &Path, names: &[String], shards: &[String], out: &Path) -> Result<()> {
    let tmp = out.with_extension("partial");
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| Error::Io { path, source }
    };
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp).map_err(io(&tmp))?;
    tracing::warn!(
        checkpoint = %dir.display(),
        copy = %out.display(),
        "pytorch_model.bin weights are written once as safetensors beside the Hugging Face cache"
    );
    let mut weight_map = BTreeMap::new();
    for shard in shards {
        let path = dir.join(shard);
        let tensors: HashMap<String, Tensor> = candle_core::pickle::read_all(&path)
            .map_err(|e| Error::BadConfig {
                path: path.clone(),
                reason: format!("not a readable torch.save checkpoint: {e}"),
            })?
            .into_iter()
            .collect();
        let name = shard
            .replace(".bin", ".safetensors")
            .replace("pytorch_model", "model");
        for k in tensors.keys() {
            weight_map.insert(k.clone(), name.clone());
        }
        candle_core::safetensors::save(&tensors, tmp.join(&name))?;
    }
    if shards.len() > 1 {
        let index = serde_json::json!({ "metadata": {}, "weight_map": weight_map });
        let p = tmp.join("model.safetensors.index.json");
        std::fs::write(&p, index.to_string()).map_err(io(&p))?;
    }
    for n in names
        .iter()
        .filter(|n| !n.starts_with("pytorch_model") && n.as_str() != "config.json")
    {
        let src = dir.join(n);
        if src.is_file() {
            std::fs::copy(&src, tmp.join(n)).map_err(io(&src))?;
        }
    }
    let cfg = dir.join("config.json");
    std::fs::copy(&cfg, tmp.join("config.json")).map_err(io(&cfg))?;
    let _ = std::fs::remove_dir_all(out);
    std::fs::rename(&tmp, out).map_err(io(out))
}
