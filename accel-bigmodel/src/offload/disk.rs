//! Accelerate's offload folder: one raw `{name}.dat` per tensor plus an
//! `index.json` of dtypes and shapes, and [`OffloadedWeightsLoader`], which
//! also reads weights straight out of safetensors shards.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::{DType, Device, Tensor, WithDType};
use half::{bf16, f16};
use serde::{Deserialize, Serialize};

use super::read::{read_into, read_tensor};
use super::{StagingPool, WeightSource};
use crate::checkpoint::CheckpointSource;
use crate::error::{Error, Result};
use crate::mapped::MappedFiles;

/// The name of an offload folder's index.
pub const OFFLOAD_INDEX_NAME: &str = "index.json";

/// One entry of an offload `index.json`, as Accelerate writes and reads it.
///
/// A `.dat` entry is `{"dtype": "float32", "shape": [..]}` with numpy's dtype
/// name (`bfloat16` for bf16, whose bytes numpy cannot type and which
/// Accelerate stores as the raw 16-bit patterns). A safetensors entry is
/// `{"safetensors_file": path, "weight_name": name, "dtype": target}` and
/// points into a checkpoint shard, so disk offload needs no copy.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct OffloadEntry {
    /// numpy dtype name of the stored data, or for a safetensors entry the
    /// dtype to convert to after reading (`None`: keep the file's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dtype: Option<String>,
    /// Shape of a `.dat` tensor (`[]` for a scalar, stored as one element).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shape: Option<Vec<usize>>,
    /// The shard holding the tensor, for a safetensors entry.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub safetensors_file: Option<PathBuf>,
    /// The tensor's name inside that shard, when it differs from the key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight_name: Option<String>,
}

/// numpy's name of a candle dtype, as Accelerate records it.
pub fn numpy_dtype_name(dtype: DType) -> Option<&'static str> {
    Some(match dtype {
        DType::F32 => "float32",
        DType::F64 => "float64",
        DType::F16 => "float16",
        DType::BF16 => "bfloat16",
        DType::I64 => "int64",
        DType::I32 => "int32",
        DType::I16 => "int16",
        DType::U32 => "uint32",
        DType::U8 => "uint8",
        _ => return None,
    })
}

/// The candle dtype of a numpy (or torch) dtype name.
pub fn dtype_from_numpy(name: &str) -> Option<DType> {
    Some(match name {
        "float32" => DType::F32,
        "float64" => DType::F64,
        "float16" => DType::F16,
        "bfloat16" => DType::BF16,
        "int64" => DType::I64,
        "int32" => DType::I32,
        "int16" => DType::I16,
        "uint32" => DType::U32,
        "uint8" => DType::U8,
        _ => return None,
    })
}

fn write_slice<T: WithDType + bytemuck::Pod>(t: &Tensor, file: &mut File) -> Result<()> {
    let mut io = Ok(());
    accel_kernels::with_slice::<T, ()>(t, "offload_weight", |s| {
        io = file.write_all(bytemuck::cast_slice(s));
        Ok(())
    })?;
    io.map_err(|e| Error::io("writing", PathBuf::from("<offload .dat>"), e))
}

/// Writes one tensor to `{folder}/{name}.dat` and returns its index entry
/// (Accelerate's `offload_weight`). Bytes are little-endian, as numpy's
/// memmap writes them on the hosts Accelerate runs on.
///
/// # Errors
/// [`Error::BadOffloadIndex`] for a dtype numpy has no name for, [`Error::Io`].
pub fn offload_weight(tensor: &Tensor, name: &str, folder: &Path) -> Result<OffloadEntry> {
    let path = folder.join(format!("{name}.dat"));
    let dtype = numpy_dtype_name(tensor.dtype()).ok_or_else(|| Error::BadOffloadIndex {
        path: folder.join(OFFLOAD_INDEX_NAME),
        key: name.to_string(),
        reason: format!("dtype {:?} has no numpy name", tensor.dtype()),
    })?;
    let t = tensor.to_device(&Device::Cpu)?.contiguous()?;
    let mut file = File::create(&path).map_err(|e| Error::io("creating", &path, e))?;
    match t.dtype() {
        DType::F32 => write_slice::<f32>(&t, &mut file),
        DType::F64 => write_slice::<f64>(&t, &mut file),
        DType::F16 => write_slice::<f16>(&t, &mut file),
        DType::BF16 => write_slice::<bf16>(&t, &mut file),
        DType::I64 => write_slice::<i64>(&t, &mut file),
        DType::I32 => write_slice::<i32>(&t, &mut file),
        DType::I16 => write_slice::<i16>(&t, &mut file),
        DType::U32 => write_slice::<u32>(&t, &mut file),
        _ => write_slice::<u8>(&t, &mut file),
    }
    .map_err(|e| match e {
        Error::Io { op, source, .. } => Error::Io { op, path, source },
        other => other,
    })?;
    Ok(OffloadEntry {
        dtype: Some(dtype.to_string()),
        shape: Some(tensor.dims().to_vec()),
        ..OffloadEntry::default_entry()
    })
}

impl OffloadEntry {
    fn default_entry() -> Self {
        OffloadEntry {
            dtype: None,
            shape: None,
            safetensors_file: None,
            weight_name: None,
        }
    }
}

/// Merges `index` into `{folder}/index.json` (Accelerate's `save_offload_index`:
/// existing entries are kept unless `index` replaces them).
///
/// # Errors
/// [`Error::Io`], [`Error::Json`] for an unreadable existing index.
pub fn save_offload_index(index: &BTreeMap<String, OffloadEntry>, folder: &Path) -> Result<()> {
    if index.is_empty() {
        return Ok(());
    }
    let path = folder.join(OFFLOAD_INDEX_NAME);
    let mut current = if path.is_file() {
        read_index(&path)?
    } else {
        BTreeMap::new()
    };
    current.extend(index.iter().map(|(k, v)| (k.clone(), v.clone())));
    let text = serde_json::to_string_pretty(&current)?;
    std::fs::write(&path, text).map_err(|e| Error::io("writing", &path, e))
}

fn read_index(path: &Path) -> Result<BTreeMap<String, OffloadEntry>> {
    let text = std::fs::read_to_string(path).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => Error::MissingFile {
            path: path.to_path_buf(),
            what: "offload folder index".to_string(),
        },
        _ => Error::io("reading", path, e),
    })?;
    serde_json::from_str(&text).map_err(|e| Error::BadOffloadIndex {
        path: path.to_path_buf(),
        key: String::new(),
        reason: e.to_string(),
    })
}

/// Writes every tensor of `state_dict` into `folder` (created if needed) and
/// merges their entries into its index (Accelerate's `offload_state_dict`).
///
/// # Errors
/// As [`offload_weight`] and [`save_offload_index`].
pub fn offload_state_dict<'a>(
    folder: &Path,
    state_dict: impl IntoIterator<Item = (&'a str, &'a Tensor)>,
) -> Result<()> {
    std::fs::create_dir_all(folder).map_err(|e| Error::io("creating", folder, e))?;
    let mut index = BTreeMap::new();
    for (name, tensor) in state_dict {
        index.insert(name.to_string(), offload_weight(tensor, name, folder)?);
    }
    save_offload_index(&index, folder)
}

/// Weights served from memory, an offload folder or safetensors shards
/// (Accelerate's `OffloadedWeightsLoader`); in-memory tensors win.
#[derive(Debug, Default)]
pub struct OffloadedWeightsLoader {
    state_dict: BTreeMap<String, Tensor>,
    folder: Option<PathBuf>,
    index: BTreeMap<String, OffloadEntry>,
    // Resolved (file, offset, stored dtype, shape) of safetensors entries.
    located: BTreeMap<String, (PathBuf, u64, DType, Vec<usize>)>,
    // Files mapped for tensors over their pages (shared with the source
    // the loader was made from).
    files: Arc<MappedFiles>,
    // Read every weight into memory even where it could be mapped.
    no_mapping: bool,
}

impl OffloadedWeightsLoader {
    /// Opens an offload folder through its `index.json`.
    ///
    /// # Errors
    /// [`Error::MissingFile`] without an index, [`Error::BadOffloadIndex`],
    /// and for safetensors entries the errors of reading their headers.
    pub fn open(folder: impl AsRef<Path>) -> Result<Self> {
        let folder = folder.as_ref();
        let index = read_index(&folder.join(OFFLOAD_INDEX_NAME))?;
        let mut loader = OffloadedWeightsLoader {
            folder: Some(folder.to_path_buf()),
            ..Self::default()
        };
        loader.add_index(index)?;
        Ok(loader)
    }

    /// A loader pointing at `names` inside a checkpoint's shards, converting
    /// to `dtype` when given: disk offload without writing anything.
    ///
    /// # Errors
    /// [`Error::MissingTensor`] for a name the checkpoint lacks.
    pub fn from_checkpoint<'a>(
        source: &CheckpointSource,
        names: impl IntoIterator<Item = &'a str>,
        dtype: Option<DType>,
    ) -> Result<Self> {
        let mut loader = OffloadedWeightsLoader {
            files: source.mapped_files(),
            ..Self::default()
        };
        for name in names {
            if let Some(adapter) = source.adapter().filter(|a| a.adapts(name)) {
                // The file holds the base weight, not the merged one.
                return Err(Error::InvalidCheckpoint {
                    path: adapter.dir().to_path_buf(),
                    reason: format!(
                        "`{name}` is adapted by this LoRA adapter and cannot be read from disk                          in place; keep it on a device or in CPU memory, or merge the adapter                          first (accel merge-lora)"
                    ),
                });
            }
            let at = source.locate(name).ok_or_else(|| Error::MissingTensor {
                name: name.to_string(),
                checkpoint: source.checkpoint().to_path_buf(),
            })?;
            let stored = at.entry.loaded_dtype().ok_or_else(|| Error::Safetensors {
                path: at.file.to_path_buf(),
                tensor: Some(name.to_string()),
                reason: format!("dtype {} cannot be held by candle", at.entry.dtype),
            })?;
            let entry = OffloadEntry {
                dtype: dtype.and_then(numpy_dtype_name).map(str::to_string),
                safetensors_file: Some(at.file.to_path_buf()),
                ..OffloadEntry::default_entry()
            };
            let place = (at.file.to_path_buf(), at.byte_range.start, stored);
            let shape = at.shape().to_vec();
            loader
                .located
                .insert(name.to_string(), (place.0, place.1, place.2, shape));
            loader.index.insert(name.to_string(), entry);
        }
        Ok(loader)
    }

    /// Whether weights stored in the dtype asked for are served as tensors
    /// over the file's own pages (the default where a
    /// [`crate::MappedAlloc`] is installed, see [`crate::mapped`]) or always
    /// read into memory.
    pub fn with_mapping(mut self, map: bool) -> Self {
        self.no_mapping = !map;
        self
    }

    /// Adds in-memory tensors, which take priority over the folder.
    pub fn with_state_dict(mut self, state_dict: BTreeMap<String, Tensor>) -> Self {
        self.state_dict.extend(state_dict);
        self
    }

    fn add_index(&mut self, index: BTreeMap<String, OffloadEntry>) -> Result<()> {
        let mut headers: BTreeMap<PathBuf, crate::SafetensorsHeader> = BTreeMap::new();
        for (key, entry) in &index {
            let Some(file) = &entry.safetensors_file else {
                continue;
            };
            if !headers.contains_key(file) {
                headers.insert(file.clone(), crate::SafetensorsHeader::read(file)?);
            }
            let header = &headers[file];
            let inner = entry.weight_name.as_deref().unwrap_or(key);
            let (Some(e), Some(range)) = (header.get(inner), header.byte_range(inner)) else {
                return Err(Error::MissingTensor {
                    name: inner.to_string(),
                    checkpoint: file.clone(),
                });
            };
            let stored = e.loaded_dtype().ok_or_else(|| Error::BadOffloadIndex {
                path: file.clone(),
                key: key.clone(),
                reason: format!("dtype {} cannot be held by candle", e.dtype),
            })?;
            let shape = e.shape.clone();
            self.located
                .insert(key.clone(), (file.clone(), range.start, stored, shape));
        }
        self.index.extend(index);
        Ok(())
    }

    /// The index entries.
    pub fn index(&self) -> &BTreeMap<String, OffloadEntry> {
        &self.index
    }

    fn describe_folder(&self) -> String {
        match &self.folder {
            Some(f) => f.display().to_string(),
            None => "offloaded weights".to_string(),
        }
    }

    fn bad(&self, key: &str, reason: String) -> Error {
        Error::BadOffloadIndex {
            path: self
                .folder
                .clone()
                .unwrap_or_default()
                .join(OFFLOAD_INDEX_NAME),
            key: key.to_string(),
            reason,
        }
    }
}

impl WeightSource for OffloadedWeightsLoader {
    fn describe(&self) -> String {
        self.describe_folder()
    }

    fn contains(&self, name: &str) -> bool {
        self.state_dict.contains_key(name) || self.index.contains_key(name)
    }

    fn load(&self, name: &str, device: &Device) -> Result<Tensor> {
        if let Some(t) = self.state_dict.get(name) {
            return Ok(t.to_device(device)?);
        }
        let at = self.stored_at(name)?;
        if at.dtype == at.stored {
            if let Some(t) = self.mapped(&at) {
                return Ok(t.to_device(device)?);
            }
        }
        let t = read_tensor(&at.path, at.offset, at.stored, &at.shape)?;
        let t = match at.dtype == at.stored {
            true => t,
            false => crate::checkpoint::convert(t, at.dtype)?,
        };
        Ok(t.to_device(device)?)
    }

    fn load_staged(
        &self,
        name: &str,
        shape: &[usize],
        dtype: DType,
        pool: &StagingPool,
    ) -> Result<Option<Tensor>> {
        if self.state_dict.contains_key(name) {
            return Ok(None);
        }
        let at = self.stored_at(name)?;
        let count = |s: &[usize]| s.iter().product::<usize>().max(1);
        if count(&at.shape) != count(shape) {
            return Ok(None);
        }
        if at.stored == dtype && at.dtype == at.stored {
            if !self.no_mapping && self.files.maps(&at.path) {
                // `load` hands out the file's own pages: no buffer to fill.
                return Ok(None);
            }
            let dst = pool.take(shape, dtype)?;
            if read_into(&at.path, at.offset, &dst)? {
                return Ok(Some(dst));
            }
            pool.give_back(vec![dst]);
            return Ok(None);
        }
        // One conversion, stored -> dtype, as `load` then `convert` would do it.
        let one_cast = at.dtype == at.stored || at.dtype == dtype;
        let casts = |d: DType| matches!(d, DType::F32 | DType::BF16 | DType::F16);
        if !one_cast || !casts(at.stored) || !casts(dtype) {
            return Ok(None);
        }
        let raw = pool.take(shape, at.stored)?;
        if !read_into(&at.path, at.offset, &raw)? {
            pool.give_back(vec![raw]);
            return Ok(None);
        }
        let dst = pool.take(shape, dtype)?;
        accel_kernels::cast_into(std::slice::from_ref(&raw), std::slice::from_ref(&dst))?;
        // `raw` was only read from by the cast: nothing else holds it.
        pool.give_back(vec![raw]);
        Ok(Some(dst))
    }
}

/// Where the bytes of one offloaded weight are and what they become.
struct StoredAt {
    path: PathBuf,
    offset: u64,
    /// The dtype of the bytes.
    stored: DType,
    shape: Vec<usize>,
    /// The dtype `load` returns (the index's conversion target, if any).
    dtype: DType,
}

impl OffloadedWeightsLoader {
    /// The weight at `at` as a tensor over the mapped file, in its stored dtype.
    /// `None` where that cannot be (see [`with_mapping`](Self::with_mapping)).
    fn mapped(&self, at: &StoredAt) -> Option<Tensor> {
        if self.no_mapping {
            return None;
        }
        self.files.tensor(&at.path, at.offset, at.stored, &at.shape)
    }

    fn stored_at(&self, name: &str) -> Result<StoredAt> {
        let Some(entry) = self.index.get(name) else {
            return Err(Error::MissingOffloadedWeight {
                name: name.to_string(),
                source_desc: self.describe_folder(),
            });
        };
        let named = |d: &str| {
            dtype_from_numpy(d).ok_or_else(|| self.bad(name, format!("unknown dtype {d:?}")))
        };
        if let Some((file, offset, stored, shape)) = self.located.get(name) {
            let dtype = match entry.dtype.as_deref() {
                None => *stored,
                Some(d) => named(d)?,
            };
            return Ok(StoredAt {
                path: file.clone(),
                offset: *offset,
                stored: *stored,
                shape: shape.clone(),
                dtype,
            });
        }
        let (Some(d), Some(shape)) = (entry.dtype.as_deref(), entry.shape.as_ref()) else {
            return Err(self.bad(name, "a .dat entry needs `dtype` and `shape`".into()));
        };
        let dtype = named(d)?;
        let folder = self.folder.clone().unwrap_or_default();
        Ok(StoredAt {
            path: folder.join(format!("{name}.dat")),
            offset: 0,
            stored: dtype,
            shape: shape.clone(),
            dtype,
        })
    }
}

#[cfg(test)]
#[path = "disk_tests.rs"]
mod tests;
