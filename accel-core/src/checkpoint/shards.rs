//! Sharded model weights, laid out exactly as Accelerate's `save_model` /
//! `huggingface_hub.split_torch_state_dict_into_shards` lay them out, so
//! `transformers.from_pretrained` and `accelerate.load_checkpoint_in_model`
//! read our folders and we read theirs.
//!
//! One shard is `model.safetensors`; several are
//! `model-00001-of-0000N.safetensors` plus `model.safetensors.index.json`
//! (`{"metadata": {"total_size": ...}, "weight_map": {name: file}}`).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};
use serde::Serialize;

use accel_bigmodel::CheckpointSource;

use super::fs_util::{python_json, write_bytes_atomic};
use super::safetensors_io::read_safetensors;
use super::st_format::file_error;
use crate::{Error, Result};

/// File name of unsharded model weights (Accelerate's `SAFE_WEIGHTS_NAME`).
pub const SAFE_WEIGHTS_NAME: &str = accel_bigmodel::SAFE_WEIGHTS_NAME;
/// File name of the shard index (Accelerate's `SAFE_WEIGHTS_INDEX_NAME`).
pub const SAFE_WEIGHTS_INDEX_NAME: &str = accel_bigmodel::SAFE_WEIGHTS_INDEX_NAME;

/// Which tensors go into which file: the outcome of
/// `split_torch_state_dict_into_shards`, without touching the disk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardPlan {
    /// File names in shard order, each with its tensor names in the order
    /// they were assigned.
    pub files: Vec<(String, Vec<String>)>,
    /// Bytes of all tensors together (the index's `metadata.total_size`).
    pub total_size: u64,
}

impl ShardPlan {
    /// Splits tensors given as `(name, size in bytes)` in order, with the
    /// `huggingface_hub` algorithm: a tensor larger than `max_shard_size`
    /// gets a shard of its own (appended at once, so it may precede the shard
    /// still being filled); a tensor that would push the current shard over
    /// the limit closes it and starts a new one.
    ///
    /// Files are named `{stem}.safetensors` for a single shard (also for no
    /// tensors at all: an empty file keeps save/load symmetric, where Python
    /// would write nothing) and `{stem}-{i:05}-of-{n:05}.safetensors` otherwise.
    pub fn new<'a>(
        stem: &str,
        sizes: impl IntoIterator<Item = (&'a str, u64)>,
        max_shard_size: u64,
    ) -> Self {
        let mut shards: Vec<Vec<String>> = Vec::new();
        let mut current: Vec<String> = Vec::new();
        let (mut current_size, mut total_size) = (0u64, 0u64);
        for (name, size) in sizes {
            total_size += size;
            if size > max_shard_size {
                shards.push(vec![name.to_string()]);
                continue;
            }
            if current_size + size > max_shard_size {
                shards.push(std::mem::take(&mut current));
                current_size = 0;
            }
            current.push(name.to_string());
            current_size += size;
        }
        if !current.is_empty() || shards.is_empty() {
            shards.push(current);
        }
        let n = shards.len();
        let files = if n == 1 {
            vec![(
                format!("{stem}.safetensors"),
                shards.pop().expect("one shard"),
            )]
        } else {
            shards
                .into_iter()
                .enumerate()
                .map(|(i, names)| (format!("{stem}-{:05}-of-{n:05}.safetensors", i + 1), names))
                .collect()
        };
        Self { files, total_size }
    }

    /// True when there is more than one file (and so an index).
    pub fn is_sharded(&self) -> bool {
        self.files.len() > 1
    }

    /// Tensor name -> file name.
    pub fn weight_map(&self) -> BTreeMap<String, String> {
        self.files
            .iter()
            .flat_map(|(file, names)| names.iter().map(move |n| (n.clone(), file.clone())))
            .collect()
    }

    /// The index file's text: Python's
    /// `json.dumps({"metadata": {"total_size": N}, "weight_map": ...}, indent=2, sort_keys=True) + "\n"`.
    pub fn index_json(&self) -> Result<String> {
        #[derive(Serialize)]
        struct Meta {
            total_size: u64,
        }
        // Field order is alphabetical and BTreeMap sorts: that is sort_keys=True.
        #[derive(Serialize)]
        struct Index {
            metadata: Meta,
            weight_map: BTreeMap<String, String>,
        }
        let index = Index {
            metadata: Meta {
                total_size: self.total_size,
            },
            weight_map: self.weight_map(),
        };
        let bytes = python_json(&index, Path::new(SAFE_WEIGHTS_INDEX_NAME))?;
        Ok(String::from_utf8(bytes).expect("serde_json writes UTF-8"))
    }
}

/// Saves model weights as `model.safetensors` or shards + index, filling
/// shards in name order; see [`save_sharded`] (which also takes tensors in a
/// caller-chosen order). `max_shard_size` is in bytes (see [`parse_size`];
/// Accelerate's default is `"10GB"`).
pub fn save_model(
    dir: impl AsRef<Path>,
    tensors: &BTreeMap<String, Tensor>,
    max_shard_size: u64,
) -> Result<Vec<PathBuf>> {
    save_sharded(dir, "model", tensors, max_shard_size)
}

/// Saves tensors, in the order given, as `{stem}.safetensors` or as
/// `{stem}-0000i-of-0000N.safetensors` shards plus `{stem}.safetensors.index.json`
/// (see [`ShardPlan::new`]), each file atomically, the index last.
///
/// Then removes what an earlier save into the same folder left that this save
/// did not write, so readers never mix generations: other
/// `{stem}-ddddd-of-ddddd.safetensors` shards, `{stem}.safetensors` when
/// sharding now, and the index when not. Returns the files written.
///
/// Tensors that share storage are written twice (candle has no storage ids to
/// deduplicate by, unlike PyTorch); pass tied weights once.
pub fn save_sharded<'a, K, I>(
    dir: impl AsRef<Path>,
    stem: &str,
    tensors: I,
    max_shard_size: u64,
) -> Result<Vec<PathBuf>>
where
    K: AsRef<str>,
    I: IntoIterator<Item = (K, &'a Tensor)>,
{
    save_sharded_as(dir, stem, tensors, max_shard_size, &|_| false)
}

/// [`save_sharded`], the u8 tensors `int8` names written as `I8` (see
/// [`super::write_safetensors_as`]).
pub fn save_sharded_as<'a, K, I>(
    dir: impl AsRef<Path>,
    stem: &str,
    tensors: I,
    max_shard_size: u64,
    int8: &dyn Fn(&str) -> bool,
) -> Result<Vec<PathBuf>>
where
    K: AsRef<str>,
    I: IntoIterator<Item = (K, &'a Tensor)>,
{
    let dir = dir.as_ref();
    let mut by_name: BTreeMap<String, &Tensor> = BTreeMap::new();
    let mut order = Vec::new();
    for (name, t) in tensors {
        let name = name.as_ref().to_string();
        if by_name.insert(name.clone(), t).is_some() {
            return Err(Error::Usage(format!(
                "{}: tensor name `{name}` given twice",
                dir.display()
            )));
        }
        let size = (t.elem_count() * t.dtype().size_in_bytes()) as u64;
        order.push((name, size));
    }
    let plan = ShardPlan::new(
        stem,
        order.iter().map(|(n, s)| (n.as_str(), *s)),
        max_shard_size,
    );
    std::fs::create_dir_all(dir).map_err(|e| Error::io("creating folder", dir, e))?;

    let mut written = Vec::new();
    for (file, names) in &plan.files {
        let path = dir.join(file);
        let named = names.iter().map(|n| (n.as_str(), by_name[n]));
        super::write_safetensors_as(&path, named, None, int8)?;
        written.push(path);
    }
    let index_name = format!("{stem}.safetensors.index.json");
    if plan.is_sharded() {
        let path = dir.join(&index_name);
        write_bytes_atomic(&path, plan.index_json()?.as_bytes())?;
        written.push(path);
    }

    let single = format!("{stem}.safetensors");
    let keep: BTreeSet<&str> = plan.files.iter().map(|(f, _)| f.as_str()).collect();
    let entries = std::fs::read_dir(dir).map_err(|e| Error::io("listing", dir, e))?;
    for entry in entries {
        let entry = entry.map_err(|e| Error::io("listing", dir, e))?;
        let Ok(name) = entry.file_name().into_string() else {
            continue;
        };
        let stale = if plan.is_sharded() {
            name == single || (is_shard_name(stem, &name) && !keep.contains(name.as_str()))
        } else {
            name == index_name || is_shard_name(stem, &name)
        };
        if stale && entry.path().is_file() {
            tracing::debug!(file = %entry.path().display(), "removing weights file of an earlier save");
            std::fs::remove_file(entry.path())
                .map_err(|e| Error::io("removing stale", entry.path(), e))?;
        }
    }
    Ok(written)
}

/// `{stem}-ddddd-of-ddddd.safetensors`: Accelerate's `(.*?)-\d{5}-of-\d{5}` test.
fn is_shard_name(stem: &str, name: &str) -> bool {
    let Some(mid) = name
        .strip_prefix(stem)
        .and_then(|r| r.strip_prefix('-'))
        .and_then(|r| r.strip_suffix(".safetensors"))
    else {
        return false;
    };
    let b = mid.as_bytes();
    b.len() == 14 && &mid[5..9] == "-of-" && b[..5].iter().chain(&b[9..]).all(u8::is_ascii_digit)
}

/// Loads model weights saved by [`save_model`] (or by Accelerate /
/// `transformers`) onto `device`; see [`load_sharded`].
pub fn load_model_tensors(
    dir: impl AsRef<Path>,
    device: &Device,
) -> Result<BTreeMap<String, Tensor>> {
    load_sharded(dir, "model", device)
}

/// Loads `{stem}.safetensors`, or else the index and every shard it lists.
///
/// Errors: neither file -> [`Error::MissingFile`]; a shard listed in the index
/// but absent -> [`Error::MissingFile`] naming the shard and the index; an
/// index entry whose shard lacks the tensor, or a shard holding a tensor the
/// index does not list -> [`Error::Safetensors`] naming the shard, the
/// tensor and the index; malformed index -> [`Error::Json`]; an index
/// listing non-safetensors shards -> [`Error::Bigmodel`]. Shards are
/// memory-mapped through `accel_bigmodel::CheckpointSource`.
pub fn load_sharded(
    dir: impl AsRef<Path>,
    stem: &str,
    device: &Device,
) -> Result<BTreeMap<String, Tensor>> {
    let dir = dir.as_ref();
    let single = dir.join(format!("{stem}.safetensors"));
    let index_name = format!("{stem}.safetensors.index.json");
    let index = dir.join(&index_name);
    if single.is_file() {
        // transformers checks the single file first, so we do too.
        return read_safetensors(&single, device);
    }
    if !index.is_file() {
        return Err(Error::MissingFile {
            path: single,
            what: format!(
                "model weights: neither {stem}.safetensors nor {index_name} is in {}",
                dir.display()
            ),
        });
    }
    // accel-bigmodel reads the index (refusing names outside the folder),
    // checks every shard exists before mapping any, and that each holds
    // exactly the tensors the index maps to it.
    let source = CheckpointSource::open(&index).map_err(file_error)?;
    source
        .names()
        .map(|name| {
            let tensor = source.tensor(name, device, None).map_err(file_error)?;
            Ok((name.to_string(), tensor))
        })
        .collect()
}

/// Parses a size like Accelerate's `convert_file_size_to_int`.
///
/// - a plain integer: bytes (`"1000"`);
/// - `GiB`/`MiB`/`KiB` (any case): powers of 2 (`"1.5GiB"`);
/// - `GB`/`MB`/`KB`: powers of 10 (`"10GB"`), but with a lower-case final `b`
///   (`"5Gb"`, `"5gb"`) the number is bits and is divided by 8, as Accelerate does;
/// - `Gbit`/`Mbit`/`Kbit` (any case): bits, divided by 8 (an extension).
///
/// Fractions are truncated like Python's `int(float(x) * unit)`. Anything else,
/// a negative result or one beyond `u64`, is [`Error::Config`] naming the value.
pub fn parse_size(size: &str) -> Result<u64> {
    let invalid = || {
        Error::Config {
        key: "max_shard_size".to_string(),
        reason: format!("`{size}` is not a valid size; use an integer for bytes, or a number with a unit like \"5.0GB\""),
    }
    };
    let s = size.trim();
    if !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()) {
        return s.parse().map_err(|_| invalid());
    }
    let upper = s.to_ascii_uppercase();
    let units: [(&str, f64, bool); 9] = [
        ("GIB", (1u64 << 30) as f64, false),
        ("MIB", (1u64 << 20) as f64, false),
        ("KIB", (1u64 << 10) as f64, false),
        ("GBIT", 1e9, true),
        ("MBIT", 1e6, true),
        ("KBIT", 1e3, true),
        ("GB", 1e9, s.ends_with('b')),
        ("MB", 1e6, s.ends_with('b')),
        ("KB", 1e3, s.ends_with('b')),
    ];
    let (number, unit, bits) = units
        .iter()
        .find_map(|(suffix, unit, bits)| {
            upper
                .ends_with(suffix)
                .then(|| (&s[..s.len() - suffix.len()], *unit, *bits))
        })
        .ok_or_else(invalid)?;
    let value: f64 = number.trim().parse().map_err(|_| invalid())?;
    let bytes = (value * unit).trunc();
    if !bytes.is_finite() || bytes < 0.0 || bytes >= u64::MAX as f64 {
        return Err(invalid());
    }
    let bytes = bytes as u64;
    Ok(if bits { bytes / 8 } else { bytes })
}

#[cfg(test)]
#[path = "shards_tests.rs"]
mod tests;
