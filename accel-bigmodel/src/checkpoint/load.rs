//! `load_checkpoint_in_model`: fill a model's candle `Var`s from a (possibly
//! sharded) safetensors checkpoint, validating everything first.

use std::collections::{BTreeSet, HashSet};
use std::path::{Path, PathBuf};

use candle_core::{DType, Var};
use candle_nn::VarMap;

use super::source::CheckpointSource;
use crate::error::{Error, Result};

/// How [`load_checkpoint_in_model`] treats dtypes and key mismatches; the
/// arguments of Accelerate's `load_checkpoint_in_model` that apply to candle.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LoadOptions {
    /// The dtype floating-point weights are loaded in (`dtype=` in Accelerate).
    /// `None` loads every tensor in its `Var`'s dtype, as PyTorch's
    /// `load_state_dict` converts to the existing parameter's dtype.
    pub dtype: Option<DType>,
    /// Modules kept in f32 when `dtype` is f16 (`keep_in_fp32_modules=`), matched
    /// as Accelerate matches them: `key` equals the tensor name, or the name
    /// contains `key` followed by a dot (`"lm_head"` matches `model.lm_head.weight`).
    pub keep_in_fp32_modules: Vec<String>,
    /// Refuse checkpoints whose names differ from the model's (Accelerate's
    /// default is `false`: missing weights keep their values, extras are skipped).
    pub strict: bool,
}

impl LoadOptions {
    /// Sets `dtype`.
    pub fn with_dtype(mut self, dtype: Option<DType>) -> Self {
        self.dtype = dtype;
        self
    }

    /// Sets `keep_in_fp32_modules`.
    pub fn with_keep_in_fp32_modules<S: Into<String>>(
        mut self,
        modules: impl IntoIterator<Item = S>,
    ) -> Self {
        self.keep_in_fp32_modules = modules.into_iter().map(Into::into).collect();
        self
    }

    /// Sets `strict`.
    pub fn with_strict(mut self, strict: bool) -> Self {
        self.strict = strict;
        self
    }

    /// The dtype these options give a checkpoint tensor stored as `stored`,
    /// and which option decided it; `None` when they leave it to the model.
    ///
    /// As in Accelerate, only floating-point tensors are converted, and
    /// `keep_in_fp32_modules` applies only when `dtype` is f16 (bf16 has f32's
    /// range, which is what keeping modules in f32 protects).
    pub fn target_dtype(&self, name: &str, stored: DType) -> Option<(DType, &'static str)> {
        let dtype = self.dtype?;
        if !stored.is_float() {
            return None;
        }
        if dtype == DType::F16 && self.keeps_in_fp32(name) {
            return Some((DType::F32, "keep_in_fp32_modules"));
        }
        Some((dtype, "LoadOptions::dtype"))
    }

    fn keeps_in_fp32(&self, name: &str) -> bool {
        // Accelerate: `((key in param_name) and (key + "." in param_name)) or key == param_name`.
        self.keep_in_fp32_modules
            .iter()
            .any(|key| name == key || name.contains(&format!("{key}.")))
    }
}

/// What [`load_checkpoint_in_model`] did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LoadReport {
    /// Names set from the checkpoint, sorted.
    pub loaded: Vec<String>,
    /// Model names the checkpoint lacks (left untouched), sorted.
    pub missing_keys: Vec<String>,
    /// Checkpoint names the model lacks (skipped), sorted; Accelerate warns about these.
    pub unexpected_keys: Vec<String>,
    /// The files read, in reading order.
    pub files: Vec<PathBuf>,
}

/// Loads a safetensors checkpoint into named candle `Var`s, Accelerate's
/// `load_checkpoint_in_model` without a device map.
///
/// `checkpoint` is a `.safetensors` file, an index `.json`, or a folder with
/// `model.safetensors` or one `*.index.json` plus its shards. Files are
/// memory-mapped; each tensor goes from the mapping to its `Var`'s device,
/// is converted to the `Var`'s dtype there and copied in, so peak memory is
/// one tensor beyond the model.
///
/// Everything is validated before any `Var` changes: every header, every
/// shard against the index, the key sets (`strict`), each shape, dtype rule
/// and `Var` layout. After that only a device failure (out of memory) while
/// copying could leave some `Var`s set and others not.
///
/// candle `Var`s keep the dtype they were created with, so `opts.dtype` and
/// `keep_in_fp32_modules` cannot re-type the model as Accelerate's do; they
/// are checked instead: build the model in the dtype you load (e.g.
/// `VarBuilder::from_varmap(&map, DType::F16, &dev)`, with `set_dtype(F32)`
/// on the kept modules).
///
/// # Errors
/// Those of [`CheckpointSource::open`]; [`Error::DuplicateName`] for a name
/// given twice; [`Error::KeyMismatch`] listing all missing and unexpected
/// names (strict only); [`Error::ShapeMismatch`] naming tensor and file;
/// [`Error::Safetensors`] for a dtype candle cannot hold;
/// [`Error::VarDtypeMismatch`]; [`Error::NonContiguousVar`]; [`Error::Candle`].
pub fn load_checkpoint_in_model(
    vars: &[(String, Var)],
    checkpoint: impl AsRef<Path>,
    opts: &LoadOptions,
) -> Result<LoadReport> {
    let mut seen = HashSet::new();
    if let Some((name, _)) = vars.iter().find(|(n, _)| !seen.insert(n.as_str())) {
        return Err(Error::DuplicateName { name: name.clone() });
    }
    let source = CheckpointSource::open(checkpoint.as_ref())?;
    let model: BTreeSet<&str> = vars.iter().map(|(n, _)| n.as_str()).collect();
    let missing_keys: Vec<String> = model
        .iter()
        .filter(|n| !source.contains(n))
        .map(|n| n.to_string())
        .collect();
    let unexpected_keys: Vec<String> = source
        .names()
        .filter(|n| !model.contains(n))
        .map(str::to_string)
        .collect();
    if opts.strict && !(missing_keys.is_empty() && unexpected_keys.is_empty()) {
        return Err(Error::KeyMismatch {
            checkpoint: source.checkpoint().to_path_buf(),
            missing: missing_keys,
            unexpected: unexpected_keys,
        });
    }

    let mut present: Vec<&(String, Var)> =
        vars.iter().filter(|(n, _)| source.contains(n)).collect();
    present.sort_by(|a, b| a.0.cmp(&b.0));
    for (name, var) in &present {
        validate(&source, name, var, opts)?;
    }
    for (name, var) in &present {
        let tensor = source.tensor(name, var.device(), Some(var.dtype()))?;
        var.set(&tensor)?;
    }
    Ok(LoadReport {
        loaded: present.iter().map(|(n, _)| n.clone()).collect(),
        missing_keys,
        unexpected_keys,
        files: source.files().map(Path::to_path_buf).collect(),
    })
}

/// Header-only checks of one tensor against its `Var`.
fn validate(source: &CheckpointSource, name: &str, var: &Var, opts: &LoadOptions) -> Result<()> {
    let at = source
        .locate(name)
        .expect("only names the checkpoint holds");
    if at.shape() != var.dims() {
        return Err(Error::ShapeMismatch {
            path: at.file.to_path_buf(),
            tensor: name.to_string(),
            expected: var.dims().to_vec(),
            got: at.shape().to_vec(),
        });
    }
    let stored = at.dtype().ok_or_else(|| Error::Safetensors {
        path: at.file.to_path_buf(),
        tensor: Some(name.to_string()),
        reason: format!(
            "tensor `{name}` has dtype {}, which candle cannot hold",
            at.entry.dtype
        ),
    })?;
    if let Some((expected, rule)) = opts.target_dtype(name, stored) {
        if expected != var.dtype() {
            return Err(Error::VarDtypeMismatch {
                tensor: name.to_string(),
                expected,
                got: var.dtype(),
                rule,
            });
        }
    }
    if !var.as_tensor().is_contiguous() {
        return Err(Error::NonContiguousVar {
            tensor: name.to_string(),
        });
    }
    Ok(())
}

/// [`load_checkpoint_in_model`] for every `Var` of a candle `VarMap`.
///
/// # Errors
/// As [`load_checkpoint_in_model`].
pub fn load_checkpoint_in_varmap(
    varmap: &VarMap,
    checkpoint: impl AsRef<Path>,
    opts: &LoadOptions,
) -> Result<LoadReport> {
    // Clone the (cheap, shared) Vars out so the map is not locked during I/O.
    let vars: Vec<(String, Var)> = {
        let data = varmap.data().lock().expect("VarMap lock poisoned");
        data.iter().map(|(n, v)| (n.clone(), v.clone())).collect()
    };
    load_checkpoint_in_model(&vars, checkpoint, opts)
}

#[cfg(test)]
#[path = "load_tests.rs"]
mod tests;
