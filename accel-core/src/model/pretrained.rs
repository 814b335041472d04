//! Where a prepared model's weights came from, and the model written back
//! as a Hugging Face folder that `from_pretrained` loads: the weights in the
//! source's dtypes (sharded past a size, as `save_pretrained`), with the
//! source's `config.json`, `generation_config.json` and tokenizer files.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use accel_bigmodel::CheckpointSource;
use candle_core::{DType, Tensor};

use super::PreparedModel;
use crate::{Accelerator, Error, Result};

/// The tokenizer's files of a Hugging Face folder: what an adapter folder
/// carries over from its base model (as a Trainer saves its tokenizer beside
/// the adapter), and part of [`CARRIED_FILES`].
pub const TOKENIZER_FILES: [&str; 10] = [
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.txt",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
];

/// The files of a Hugging Face folder, besides its weights, that a saved
/// model carries over from its source (those the source has): its configs,
/// then [`TOKENIZER_FILES`].
pub const CARRIED_FILES: [&str; 13] = concat(
    [
        "config.json",
        "generation_config.json",
        "preprocessor_config.json",
    ],
    TOKENIZER_FILES,
);

/// `a` then `b`, at compile time (`C` must be `A + B`).
const fn concat<const A: usize, const B: usize, const C: usize>(
    a: [&'static str; A],
    b: [&'static str; B],
) -> [&'static str; C] {
    assert!(A + B == C, "the lengths do not add up");
    let mut out = [""; C];
    let mut i = 0;
    while i < A {
        out[i] = a[i];
        i += 1;
    }
    while i < C {
        out[i] = b[i - A];
        i += 1;
    }
    out
}

/// The checkpoint a model's weights were loaded from.
#[derive(Debug)]
pub(crate) struct PretrainedSource {
    /// The folder holding the checkpoint and its config.
    pub dir: PathBuf,
    /// Each checkpoint tensor's dtype, by name.
    pub dtypes: HashMap<String, DType>,
}

impl PretrainedSource {
    /// What `source` says of itself.
    pub fn of(source: &CheckpointSource) -> Arc<Self> {
        let path = source.checkpoint();
        let dir = if path.is_dir() {
            path.to_path_buf()
        } else {
            path.parent().unwrap_or(Path::new(".")).to_path_buf()
        };
        let dtypes = source
            .names()
            .filter_map(|n| Some((n.to_string(), source.locate(n)?.dtype()?)))
            .collect();
        Arc::new(Self { dir, dtypes })
    }
}

impl PreparedModel {
    /// Records the checkpoint the weights were loaded from.
    pub(crate) fn set_source(&self, source: Arc<PretrainedSource>) {
        self.lock().source = Some(source);
    }

    /// The folder the model's weights were loaded from
    /// ([`PreparedModel::load_checkpoint`], `prepare_pretrained`), if any.
    pub fn pretrained_dir(&self) -> Option<PathBuf> {
        self.lock().source.as_ref().map(|s| s.dir.clone())
    }

    /// Saves the model as a Hugging Face folder in `dir`: the weights in the
    /// source checkpoint's dtype of each tensor (fp32 for a model trained
    /// from scratch), one `model.safetensors` or shards with an index past
    /// `max_shard_size` (`"5GB"` is `save_pretrained`'s default), and the
    /// source folder's [`CARRIED_FILES`]. Each file is written atomically.
    /// The main process writes; every process must call it (a sharded model
    /// gathers its full weights first).
    ///
    /// A LoRA model ([`Accelerator::prepare_lora`]) saves its adapter
    /// instead, as `PeftModel.save_pretrained` does: `adapter_config.json`
    /// and `adapter_model.safetensors`, plus the base's tokenizer files.
    ///
    /// # Errors
    /// A bad `max_shard_size`; a failed write on any rank ([`Error::RankFailed`]
    /// on the others); a source file that cannot be read, named.
    pub fn save_pretrained(
        &self,
        acc: &Accelerator,
        dir: impl AsRef<Path>,
        max_shard_size: &str,
    ) -> Result<Vec<PathBuf>> {
        self.save_pretrained_as(acc, dir, max_shard_size, None)
    }

    /// As [`PreparedModel::save_pretrained`], every weight in `dtype` when
    /// given (DeepSpeed's `stage3_gather_16bit_weights_on_model_save`: the
    /// compute dtype of the run).
    ///
    /// # Errors
    /// As [`PreparedModel::save_pretrained`].
    pub fn save_pretrained_as(
        &self,
        acc: &Accelerator,
        dir: impl AsRef<Path>,
        max_shard_size: &str,
        dtype: Option<DType>,
    ) -> Result<Vec<PathBuf>> {
        let limit = crate::checkpoint::parse_size(max_shard_size)?;
        if let Some(config) = self.adapter_config() {
            return self.save_adapter(acc, dir.as_ref(), &config);
        }
        let source = self.lock().source.clone();
        let mut tensors = BTreeMap::new();
        for (name, t) in self.full_weights()? {
            let dtype = dtype.unwrap_or_else(|| {
                source
                    .as_ref()
                    .and_then(|s| s.dtypes.get(&name).copied())
                    .unwrap_or(DType::F32)
            });
            tensors.insert(name, t.to_dtype(dtype)?);
        }
        let written = if acc.is_main_process() {
            write_folder(dir.as_ref(), &tensors, limit, source.as_deref())
        } else {
            Ok(vec![])
        };
        acc.agree("save_pretrained", written)
    }
}

/// Writes the weights, then copies the source's other files.
fn write_folder(
    dir: &Path,
    tensors: &BTreeMap<String, Tensor>,
    limit: u64,
    source: Option<&PretrainedSource>,
) -> Result<Vec<PathBuf>> {
    let mut written = crate::checkpoint::save_model(dir, tensors, limit)?;
    if let Some(source) = source {
        written.extend(copy_files(&source.dir, dir, &CARRIED_FILES)?);
    }
    Ok(written)
}

/// Copies those of `names` that `from_dir` holds into `dir`, each atomically.
pub(crate) fn copy_files(from_dir: &Path, dir: &Path, names: &[&str]) -> Result<Vec<PathBuf>> {
    let mut written = vec![];
    for name in names {
        let from = from_dir.join(name);
        if !from.is_file() {
            continue;
        }
        let to = dir.join(name);
        if from.canonicalize().ok() == to.canonicalize().ok() {
            continue;
        }
        let bytes = std::fs::read(&from).map_err(|e| Error::io("reading", &from, e))?;
        crate::checkpoint::write_bytes_atomic(&to, &bytes)?;
        written.push(to);
    }
    Ok(written)
}
