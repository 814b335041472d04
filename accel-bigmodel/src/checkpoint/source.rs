//! [`CheckpointSource`]: a memory-mapped checkpoint (one file or a shard set)
//! that finds tensors by name and materialises them on a device.

use std::collections::{BTreeMap, HashMap};
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use candle_core::{DType, Device, Shape, Tensor};

use crate::error::{Error, Result};
use crate::lora::LoraAdapter;
use crate::mapped::MappedFiles;
use crate::safetensors::{CheckpointFiles, HeaderEntry, MmapFile, WeightIndex};

/// Where one tensor of a checkpoint lives, read from the headers alone.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorLocation<'a> {
    /// The file (shard) holding it.
    pub file: &'a Path,
    /// Its header entry: dtype name, shape and offsets within the data section.
    pub entry: &'a HeaderEntry,
    /// Its bytes as absolute offsets in `file`.
    pub byte_range: Range<u64>,
}

impl TensorLocation<'_> {
    /// Its dimensions.
    pub fn shape(&self) -> &[usize] {
        &self.entry.shape
    }

    /// Its candle dtype, when candle can hold it.
    pub fn dtype(&self) -> Option<DType> {
        self.entry.candle_dtype()
    }
}

/// A safetensors checkpoint, memory-mapped: a single file, or every shard of
/// an index, checked against each other when opened.
///
/// Opening validates every header and, for shards, that each holds exactly the
/// tensors the index maps to it; no tensor data is read until
/// [`CheckpointSource::tensor`] asks for it. The files must not be modified
/// while the source is alive (the usual contract of memory-mapped checkpoints,
/// see [`MmapFile`]).
///
/// It is also a candle `SimpleBackend`, so a model can be built straight from
/// it: `VarBuilder::from_backend(Box::new(source), dtype, device)`; each
/// tensor is then checked against the shape the model asks for and converted
/// to the builder's dtype. A tensor over the mapped file (see
/// [`crate::mapped`]) is handed out again when the model asks for the same
/// name twice (a head tied to the embeddings), so both share it.
#[derive(Debug)]
pub struct CheckpointSource {
    checkpoint: PathBuf,
    files: CheckpointFiles,
    mapped: Vec<MmapFile>,
    by_name: BTreeMap<String, usize>,
    // The files' copy-on-write mappings for tensors over their pages,
    // shared with the loaders made from this source.
    files_mapped: Arc<MappedFiles>,
    // Mapped tensors handed to models built on this source, by name: a name
    // asked for again (a head tied to the embeddings) gets the same tensor,
    // as tied modules share one parameter in PyTorch, instead of a copy.
    built: Mutex<HashMap<String, Tensor>>,
    // A LoRA adapter merged into the weights it adapts as they are read, or
    // (`adapter_unmerged`) served beside them as `{module}.lora_A.weight`.
    adapter: Option<Arc<LoraAdapter>>,
    adapter_unmerged: bool,
    // Linear weights quantized as they are read (`with_quantization`).
    pub(super) quant: Option<Arc<crate::quant::QuantizeOnLoad>>,
}

impl CheckpointSource {
    /// Opens a checkpoint: a `.safetensors` file, an index `.json`, or a folder
    /// holding `model.safetensors` or one `*.index.json` (see [`CheckpointFiles::resolve`]).
    ///
    /// # Errors
    /// Those of [`CheckpointFiles::resolve`]; [`Error::MissingFile`] naming a
    /// missing shard and the index; [`Error::Safetensors`] for a damaged file or
    /// a shard that disagrees with the index, naming file and tensor.
    pub fn open(checkpoint: impl AsRef<Path>) -> Result<Self> {
        let checkpoint = checkpoint.as_ref();
        let files = CheckpointFiles::resolve(checkpoint)?;
        if let Some(index) = files.index() {
            index.check_shards_exist()?;
        }
        let mut mapped = Vec::new();
        let mut by_name = BTreeMap::new();
        for path in files.paths() {
            let file = MmapFile::open(&path)?;
            if let Some(index) = files.index() {
                let name = path.file_name().unwrap_or_default().to_string_lossy();
                index.check_shard(&name, file.header())?;
            }
            for name in file.header().tensors().keys() {
                by_name.insert(name.clone(), mapped.len());
            }
            mapped.push(file);
        }
        Ok(CheckpointSource {
            checkpoint: checkpoint.to_path_buf(),
            files,
            files_mapped: Arc::default(),
            built: Mutex::new(HashMap::new()),
            mapped,
            by_name,
            adapter: None,
            adapter_unmerged: false,
            quant: None,
        })
    }

    /// The same checkpoint with `adapter` merged into the weights it adapts
    /// as they are read (`W + scaling * B A`, PEFT's `merge_and_unload`):
    /// loading, dispatching and saving then see the merged model.
    ///
    /// # Errors
    /// An adapted module whose weight the checkpoint does not hold.
    pub fn with_adapter(mut self, adapter: Arc<LoraAdapter>) -> Result<Self> {
        adapter.check_base(&self)?;
        if self.quant.is_some() {
            return Err(Error::BadQuantConfig {
                key: "adapter".into(),
                reason: "a LoRA adapter cannot be merged into weights quantized on load; load \
                         it unmerged (with_adapter_unmerged), as PEFT runs it on a quantized base"
                    .into(),
            });
        }
        self.adapter = Some(adapter);
        self.adapter_unmerged = false;
        Ok(self)
    }

    /// The same checkpoint with `adapter`'s matrices served beside the
    /// weights, as `{module}.lora_A.weight` and `{module}.lora_B.weight`:
    /// a model built with LoRA layers of the adapter's config runs it
    /// unmerged (PEFT's `PeftModel.from_pretrained`), which a quantized
    /// base needs.
    ///
    /// # Errors
    /// An adapted module whose weight the checkpoint does not hold.
    pub fn with_adapter_unmerged(mut self, adapter: Arc<LoraAdapter>) -> Result<Self> {
        adapter.check_base(&self)?;
        self.adapter = Some(adapter);
        self.adapter_unmerged = true;
        Ok(self)
    }

    /// Whether the adapter is served unmerged.
    pub(super) fn adapter_is_unmerged(&self) -> bool {
        self.adapter_unmerged
    }

    /// The dims of the unmerged adapter's matrix `name`, when it holds it.
    pub(super) fn adapter_matrix_shape(&self, name: &str) -> Option<Vec<usize>> {
        self.unmerged()?.matrix_shape(name)
    }

    /// The adapter served unmerged, if any.
    fn unmerged(&self) -> Option<&LoraAdapter> {
        self.adapter.as_deref().filter(|_| self.adapter_unmerged)
    }

    /// The adapter merged into the weights, if any.
    pub fn adapter(&self) -> Option<&Arc<LoraAdapter>> {
        self.adapter.as_ref()
    }

    /// The path the source was opened from.
    pub fn checkpoint(&self) -> &Path {
        &self.checkpoint
    }

    /// The shard index, for a sharded checkpoint.
    pub fn index(&self) -> Option<&WeightIndex> {
        self.files.index()
    }

    /// The mapped files, in reading order.
    pub fn files(&self) -> impl Iterator<Item = &Path> {
        self.mapped.iter().map(MmapFile::path)
    }

    /// Number of tensors.
    pub fn len(&self) -> usize {
        self.by_name.len()
    }

    /// True when the checkpoint holds no tensor.
    pub fn is_empty(&self) -> bool {
        self.by_name.is_empty()
    }

    /// Tensor names, sorted.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.by_name.keys().map(String::as_str)
    }

    /// Whether the checkpoint holds `name`, or serves it as a part of a
    /// weight quantized on load.
    pub fn contains(&self, name: &str) -> bool {
        self.by_name.contains_key(name)
            || self.serves_quantized(name, None)
            || self
                .unmerged()
                .is_some_and(|a| a.matrix_key(name).is_some())
    }

    /// Where `name` lives: file, dtype, shape and byte range, from the headers.
    pub fn locate(&self, name: &str) -> Option<TensorLocation<'_>> {
        let file = &self.mapped[*self.by_name.get(name)?];
        let header = file.header();
        Some(TensorLocation {
            file: file.path(),
            entry: header.get(name)?,
            byte_range: header.byte_range(name)?,
        })
    }

    /// Materialises `name` on `device`, converted to `dtype` when given.
    ///
    /// The bytes go from the mapping straight to `device` in the file's dtype
    /// and are converted there, so a GPU target never holds a host copy. A
    /// CPU tensor in the file's own dtype is the file's pages themselves
    /// where [`crate::MappedAlloc`] is installed (see [`crate::mapped`]).
    ///
    /// With quantization on load ([`CheckpointSource::with_quantization`]),
    /// the parts of a quantized weight are computed from the checkpoint's
    /// (the weight itself when asked for as u8). An int8 tensor (LLM.int8
    /// weights), which candle cannot hold, comes as its bytes in u8.
    ///
    /// # Errors
    /// [`Error::MissingTensor`], [`Error::Safetensors`] when candle cannot hold
    /// the file's dtype, [`Error::Candle`] / [`Error::Kernels`] on device failure.
    pub fn tensor(&self, name: &str, device: &Device, dtype: Option<DType>) -> Result<Tensor> {
        if let Some(t) = self.quantized_part(name, dtype, device)? {
            return Ok(t);
        }
        if let Some(a) = self.unmerged() {
            if let Some(t) = a.matrix(name, device, dtype.unwrap_or(DType::F32))? {
                return Ok(t);
            }
        }
        self.tensor_unquantized(name, device, dtype)
    }

    /// [`CheckpointSource::tensor`] as the checkpoint stores it.
    pub(super) fn tensor_unquantized(
        &self,
        name: &str,
        device: &Device,
        dtype: Option<DType>,
    ) -> Result<Tensor> {
        let Some(&i) = self.by_name.get(name) else {
            return Err(Error::MissingTensor {
                name: name.to_string(),
                checkpoint: self.checkpoint.clone(),
            });
        };
        let merged = self.adapter.as_ref().filter(|_| !self.adapter_unmerged);
        if let Some(adapter) = merged.filter(|a| a.adapts(name)) {
            let base = self.mapped[i].tensor(name, device)?;
            self.mapped[i].release(name);
            let merged = adapter.merge(name, base)?;
            return match dtype {
                Some(dtype) => convert(merged, dtype),
                None => Ok(merged),
            };
        }
        if device.is_cpu() {
            if let Some(t) = self.mapped_tensor(i, name, dtype) {
                return Ok(t);
            }
        }
        if let Some(dtype) = dtype.filter(|_| device.is_cpu()) {
            if let Some(t) = self.mapped[i].tensor_read(name, dtype)? {
                return Ok(t);
            }
        }
        let tensor = self.mapped[i].tensor(name, device)?;
        // A copy now: the file's pages need not stay resident beside it.
        self.mapped[i].release(name);
        match dtype {
            Some(dtype) => convert(tensor, dtype),
            None => Ok(tensor),
        }
    }
}

impl CheckpointSource {
    /// `name` for a model being built on this source: a mapped tensor is
    /// kept, and handed out again to a later request for the same name.
    fn for_model(&self, name: &str, device: &Device, dtype: DType) -> Result<Tensor> {
        let mut built = self.built.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(t) = built.get(name) {
            if device.is_cpu() && t.dtype() == dtype {
                return Ok(t.clone());
            }
        }
        let t = self.tensor(name, device, Some(dtype))?;
        if crate::mapped::is_mapped(&t) {
            built.insert(name.to_string(), t.clone());
        }
        Ok(t)
    }

    /// `name` of file `i` over the file's pages, when it is stored as
    /// `dtype` (or `dtype` is `None`) and can be mapped.
    fn mapped_tensor(&self, i: usize, name: &str, dtype: Option<DType>) -> Option<Tensor> {
        let file = &self.mapped[i];
        let entry = file.header().get(name)?;
        let stored = entry.candle_dtype()?;
        if dtype.is_some_and(|d| d != stored) {
            return None;
        }
        let start = file.header().byte_range(name)?.start;
        self.files_mapped
            .tensor(file.path(), start, stored, &entry.shape)
    }

    /// The mappings tensors are taken from, for a loader made from this source.
    pub(crate) fn mapped_files(&self) -> Arc<MappedFiles> {
        self.files_mapped.clone()
    }
}

fn is_half_or_f32(dtype: DType) -> bool {
    matches!(dtype, DType::F32 | DType::BF16 | DType::F16)
}

/// Converts a freshly materialised tensor to `dtype`: host f32/bf16/f16 through
/// accel-kernels' parallel cast (bitwise equal to candle's), everything else
/// through candle's `to_dtype`.
pub fn convert(tensor: Tensor, dtype: DType) -> Result<Tensor> {
    if tensor.dtype() == dtype {
        return Ok(tensor);
    }
    if is_half_or_f32(tensor.dtype()) && is_half_or_f32(dtype) && tensor.device().is_cpu() {
        let mut out = accel_kernels::cast_tensors(std::slice::from_ref(&tensor), dtype)?;
        return Ok(out.pop().expect("one tensor in, one out"));
    }
    Ok(tensor.to_dtype(dtype)?)
}

impl candle_nn::var_builder::SimpleBackend for CheckpointSource {
    fn get(
        &self,
        shape: Shape,
        name: &str,
        _init: candle_nn::Init,
        dtype: DType,
        device: &Device,
    ) -> candle_core::Result<Tensor> {
        let got = self.shape_of(name, Some(dtype)).ok_or_else(|| {
            candle_core::Error::wrap(Error::MissingTensor {
                name: name.to_string(),
                checkpoint: self.checkpoint.clone(),
            })
        })?;
        if got != shape.dims() {
            let path = self
                .locate(name)
                .map_or(self.checkpoint.clone(), |at| at.file.to_path_buf());
            return Err(candle_core::Error::wrap(Error::ShapeMismatch {
                path,
                tensor: name.to_string(),
                expected: shape.dims().to_vec(),
                got,
            }));
        }
        self.for_model(name, device, dtype)
            .map_err(candle_core::Error::wrap)
    }

    fn get_unchecked(
        &self,
        name: &str,
        dtype: DType,
        device: &Device,
    ) -> candle_core::Result<Tensor> {
        self.for_model(name, device, dtype)
            .map_err(candle_core::Error::wrap)
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.contains(name)
    }
}

#[cfg(test)]
#[path = "source_tests.rs"]
mod tests;
