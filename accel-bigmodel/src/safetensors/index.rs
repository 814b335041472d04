//! Which files make up a checkpoint: a single `model.safetensors`, or shards
//! listed by a `model.safetensors.index.json` `weight_map`, found the way
//! Accelerate's `load_checkpoint_in_model` finds them.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::Value;

use super::header::SafetensorsHeader;
use crate::error::{Error, Result};

/// File name of unsharded model weights (Accelerate's `SAFE_WEIGHTS_NAME`).
pub const SAFE_WEIGHTS_NAME: &str = "model.safetensors";
/// File name of the shard index (Accelerate's `SAFE_WEIGHTS_INDEX_NAME`).
pub const SAFE_WEIGHTS_INDEX_NAME: &str = "model.safetensors.index.json";

/// A shard index: `{"metadata": {...}, "weight_map": {tensor: shard file}}`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WeightIndex {
    path: PathBuf,
    weight_map: BTreeMap<String, String>,
}

impl WeightIndex {
    /// Reads an index file, refusing shard names that leave its folder.
    ///
    /// # Errors
    /// [`Error::MissingFile`] when absent, [`Error::Io`] when unreadable,
    /// [`Error::BadIndex`] when it is not JSON or has no usable `weight_map`.
    pub fn read(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let bytes = std::fs::read(path).map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => Error::MissingFile {
                path: path.to_path_buf(),
                what: "checkpoint index".to_string(),
            },
            _ => Error::io("reading", path, e),
        })?;
        let bad = |reason: String| Error::BadIndex {
            path: path.to_path_buf(),
            reason,
        };
        let value: Value = serde_json::from_slice(&bytes).map_err(|e| bad(e.to_string()))?;
        let map = value
            .get("weight_map")
            .and_then(Value::as_object)
            .ok_or_else(|| bad("no `weight_map` object".to_string()))?;
        let weight_map = map
            .iter()
            .map(|(tensor, file)| {
                let file = file.as_str().ok_or_else(|| {
                    bad(format!("`weight_map` entry `{tensor}` is not a file name"))
                })?;
                // A plain name only: an index must not make us read files
                // outside the checkpoint folder (`../x`, `/etc/x`).
                if Path::new(file).file_name().is_none_or(|f| f != file) {
                    return Err(bad(format!(
                        "`weight_map` maps `{tensor}` to `{file}`, which is not a file in this folder"
                    )));
                }
                Ok((tensor.clone(), file.to_string()))
            })
            .collect::<Result<_>>()?;
        Ok(WeightIndex {
            path: path.to_path_buf(),
            weight_map,
        })
    }

    /// The index file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The folder holding the index and its shards.
    pub fn folder(&self) -> &Path {
        self.path.parent().unwrap_or(Path::new("."))
    }

    /// Tensor name -> shard file name.
    pub fn weight_map(&self) -> &BTreeMap<String, String> {
        &self.weight_map
    }

    /// Shard file name -> the tensors the index puts there, files sorted (as
    /// Accelerate's `sorted(set(index.values()))`) and names sorted.
    pub fn shards(&self) -> BTreeMap<&str, Vec<&str>> {
        let mut out: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
        for (tensor, file) in &self.weight_map {
            out.entry(file.as_str()).or_default().push(tensor.as_str());
        }
        out
    }

    /// Paths of the shards, in [`WeightIndex::shards`] order.
    pub fn shard_paths(&self) -> Vec<PathBuf> {
        let folder = self.folder();
        self.shards().keys().map(|f| folder.join(f)).collect()
    }

    /// Checks that every shard exists, before any of gigabytes of them is read.
    ///
    /// # Errors
    /// [`Error::MissingFile`] naming the shard, the index and a tensor it should hold.
    pub fn check_shards_exist(&self) -> Result<()> {
        for (file, tensors) in self.shards() {
            let path = self.folder().join(file);
            if !path.is_file() {
                return Err(Error::MissingFile {
                    path,
                    what: format!(
                        "shard listed in {} for {} tensor(s), e.g. `{}`",
                        self.path.display(),
                        tensors.len(),
                        tensors[0]
                    ),
                });
            }
        }
        Ok(())
    }

    /// Checks that the shard `file` holds exactly the tensors the index maps
    /// to it, so that no name is silently dropped or served from two files.
    ///
    /// # Errors
    /// [`Error::Safetensors`] naming the shard, the tensor and the index.
    pub fn check_shard(&self, file: &str, header: &SafetensorsHeader) -> Result<()> {
        let bad = |tensor: &str, reason: String| Error::Safetensors {
            path: header.path().to_path_buf(),
            tensor: Some(tensor.to_string()),
            reason,
        };
        let shards = self.shards();
        let wanted = shards.get(file).map(Vec::as_slice).unwrap_or(&[]);
        if let Some(absent) = wanted.iter().find(|n| header.get(n).is_none()) {
            return Err(bad(
                absent,
                format!(
                    "{} maps tensor `{absent}` to this shard, but the shard does not hold it",
                    self.path.display()
                ),
            ));
        }
        let extra = header
            .tensors()
            .keys()
            .find(|n| self.weight_map.get(*n).is_none_or(|f| f != file));
        if let Some(extra) = extra {
            return Err(bad(
                extra,
                format!(
                    "the shard holds tensor `{extra}`, which {} does not map to it",
                    self.path.display()
                ),
            ));
        }
        Ok(())
    }
}

/// The files a checkpoint path designates.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CheckpointFiles {
    /// One safetensors file holding every tensor.
    Single(PathBuf),
    /// Shards listed by an index.
    Sharded(WeightIndex),
}

impl CheckpointFiles {
    /// Resolves `checkpoint` as Accelerate's `load_checkpoint_in_model` does,
    /// for safetensors: a `.safetensors` file; an index `.json` file; or a
    /// folder holding `model.safetensors`, or else exactly one `*.index.json`.
    ///
    /// # Errors
    /// [`Error::MissingFile`] when nothing is at `checkpoint`,
    /// [`Error::InvalidCheckpoint`] for pickled PyTorch files, folders without
    /// (or with several) indexes and indexes listing non-safetensors shards,
    /// and the errors of [`WeightIndex::read`].
    pub fn resolve(checkpoint: impl AsRef<Path>) -> Result<Self> {
        let checkpoint = checkpoint.as_ref();
        let invalid = |reason: String| Error::InvalidCheckpoint {
            path: checkpoint.to_path_buf(),
            reason,
        };
        let files = if checkpoint.is_file() {
            let name = checkpoint.to_string_lossy();
            if name.ends_with(".json") {
                CheckpointFiles::Sharded(WeightIndex::read(checkpoint)?)
            } else if name.ends_with(".safetensors") {
                CheckpointFiles::Single(checkpoint.to_path_buf())
            } else {
                return Err(invalid(
                    "not a .safetensors file or an index; pickled PyTorch checkpoints are not supported"
                        .to_string(),
                ));
            }
        } else if checkpoint.is_dir() {
            let single = checkpoint.join(SAFE_WEIGHTS_NAME);
            if single.is_file() {
                CheckpointFiles::Single(single)
            } else {
                let indexes = list_indexes(checkpoint)?;
                match &indexes[..] {
                    [index] => CheckpointFiles::Sharded(WeightIndex::read(index)?),
                    [] => return Err(invalid(format!(
                        "not a folder containing a `.index.json` file or a {SAFE_WEIGHTS_NAME} file"
                    ))),
                    _ => return Err(invalid(
                        "folder contains more than one `.index.json` file, delete the irrelevant ones."
                            .to_string(),
                    )),
                }
            }
        } else {
            return Err(Error::MissingFile {
                path: checkpoint.to_path_buf(),
                what: "a safetensors file, a shard index or a folder holding one".to_string(),
            });
        };
        if let CheckpointFiles::Sharded(index) = &files {
            let shards = index.shards();
            if let Some(file) = shards.keys().find(|f| !f.ends_with(".safetensors")) {
                return Err(Error::InvalidCheckpoint {
                    path: index.path().to_path_buf(),
                    reason: format!(
                        "shard `{file}` is not a .safetensors file; pickled PyTorch checkpoints are not supported"
                    ),
                });
            }
        }
        Ok(files)
    }

    /// The files to read, in reading order.
    pub fn paths(&self) -> Vec<PathBuf> {
        match self {
            CheckpointFiles::Single(path) => vec![path.clone()],
            CheckpointFiles::Sharded(index) => index.shard_paths(),
        }
    }

    /// The index, for a sharded checkpoint.
    pub fn index(&self) -> Option<&WeightIndex> {
        match self {
            CheckpointFiles::Single(_) => None,
            CheckpointFiles::Sharded(index) => Some(index),
        }
    }
}

/// `*.index.json` files directly in `dir`, sorted.
fn list_indexes(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    let entries = std::fs::read_dir(dir).map_err(|e| Error::io("listing", dir, e))?;
    for entry in entries {
        let entry = entry.map_err(|e| Error::io("listing", dir, e))?;
        let name = entry.file_name();
        if name.to_string_lossy().ends_with(".index.json") && entry.path().is_file() {
            out.push(entry.path());
        }
    }
    out.sort();
    Ok(out)
}
