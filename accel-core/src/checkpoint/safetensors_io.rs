//! Single-file checkpoint I/O: safetensors and JSON, written atomically and
//! read with errors that name the file and the tensor at fault.
//!
//! Files are plain safetensors with `{"format": "pt"}` in `__metadata__`, so
//! Python's `safetensors` and `transformers` load them as PyTorch weights.
//! Reading memory-maps the file and validates its header with accel-bigmodel's
//! parser (rather than only trusting `safetensors::SafeTensors::deserialize`)
//! so a damaged file gets a precise reason, e.g. "tensor `w` data ends at
//! byte 400 but the file has 320".

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Shape, Tensor, Var};
use serde_json::Value;

use super::fs_util::{atomic_write_with, python_json, write_bytes_atomic};
use super::st_format::{file_error, open, read_bytes, to_raw, Raw};
use super::StateDict;
use crate::{Error, Result};
use accel_bigmodel::MmapFile;

/// The name, shape and dtype a model expects for one tensor; what
/// [`load_into`] validates a file against.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorSpec {
    /// The tensor's name in the file (e.g. `"encoder.0.weight"`).
    pub name: String,
    /// The shape the model wants.
    pub shape: Shape,
    /// The dtype the model wants.
    pub dtype: DType,
}

impl TensorSpec {
    /// The spec of a live tensor: its name, current shape and dtype.
    pub fn of(name: impl Into<String>, tensor: &Tensor) -> Self {
        Self {
            name: name.into(),
            shape: tensor.shape().clone(),
            dtype: tensor.dtype(),
        }
    }
}

/// The specs of a map of live tensors, for [`load_into`].
pub fn specs_of(tensors: &BTreeMap<String, Tensor>) -> Vec<TensorSpec> {
    tensors.iter().map(|(n, t)| TensorSpec::of(n, t)).collect()
}

/// Writes tensors to a safetensors file, atomically.
///
/// `tensors` is anything iterating `(name, &Tensor)`, e.g. `&BTreeMap<String,
/// Tensor>`. Tensors may be on any device and non-contiguous. Supported
/// dtypes: f32, f16, bf16, f64, u8, u32, i16, i32, i64.
///
/// `__metadata__` always holds `"format": "pt"` (overriding any `format` in
/// `metadata`), which `transformers` requires to accept the file, plus the
/// other entries of `metadata`. The file is written to `path.tmp-{pid}`,
/// fsynced, renamed over `path`, and the folder fsynced.
pub fn write_safetensors<'a, K, I>(
    path: impl AsRef<Path>,
    tensors: I,
    metadata: Option<HashMap<String, String>>,
) -> Result<()>
where
    K: AsRef<str>,
    I: IntoIterator<Item = (K, &'a Tensor)>,
{
    write_safetensors_as(path, tensors, metadata, &|_| false)
}

/// [`write_safetensors`], the u8 tensors `int8` names written as `I8`: the
/// signed bytes candle has no dtype for (LLM.int8 weights, which
/// transformers reads as int8).
pub fn write_safetensors_as<'a, K, I>(
    path: impl AsRef<Path>,
    tensors: I,
    metadata: Option<HashMap<String, String>>,
    int8: &dyn Fn(&str) -> bool,
) -> Result<()>
where
    K: AsRef<str>,
    I: IntoIterator<Item = (K, &'a Tensor)>,
{
    let path = path.as_ref();
    let mut raws: BTreeMap<String, Raw> = BTreeMap::new();
    for (name, t) in tensors {
        let name = name.as_ref();
        let mut raw = to_raw(path, name, t)?;
        if int8(name) {
            raw.as_int8(path, name)?;
        }
        if raws.insert(name.to_string(), raw).is_some() {
            return Err(Error::Usage(format!(
                "{}: tensor name `{name}` given twice",
                path.display()
            )));
        }
    }
    let mut meta = metadata.unwrap_or_default();
    meta.insert("format".to_string(), "pt".to_string());
    atomic_write_with(path, |tmp| {
        safetensors::serialize_to_file(raws.iter().map(|(n, r)| (n.as_str(), r)), Some(meta), tmp)
            .map_err(|e| match e {
                safetensors::SafeTensorError::IoError(io) => Error::io("writing", tmp, io),
                other => Error::Safetensors {
                    path: path.to_path_buf(),
                    reason: other.to_string(),
                },
            })
    })
}

/// Reads every tensor of a safetensors file onto `device`.
///
/// Errors: [`Error::MissingFile`] when the file is absent; [`Error::Safetensors`]
/// naming the problem (and tensor, where there is one) when it is truncated,
/// its header length exceeds the file, the header is bad JSON, offsets run
/// past the end, overlap or leave gaps, or a dtype is one candle cannot hold.
pub fn read_safetensors(
    path: impl AsRef<Path>,
    device: &Device,
) -> Result<BTreeMap<String, Tensor>> {
    Ok(read_safetensors_with_metadata(path, device)?.0)
}

/// [`read_safetensors`] that also returns the `__metadata__` strings.
pub fn read_safetensors_with_metadata(
    path: impl AsRef<Path>,
    device: &Device,
) -> Result<(BTreeMap<String, Tensor>, HashMap<String, String>)> {
    let file = open(path.as_ref())?;
    let tensors = file
        .header()
        .tensors()
        .keys()
        .map(|name| Ok((name.clone(), file.tensor(name, device).map_err(file_error)?)))
        .collect::<Result<_>>()?;
    Ok((tensors, file.header().metadata().clone()))
}

/// Checks a parsed file against specs; returns the names to load, in spec
/// order. Reads only the header, so nothing is materialized on failure.
fn validate<'s>(
    file: &MmapFile,
    expected: &'s [TensorSpec],
    strict: bool,
) -> Result<Vec<&'s TensorSpec>> {
    let path = || file.path().to_path_buf();
    let entries = file.header().tensors();
    let wanted: BTreeSet<&str> = expected.iter().map(|s| s.name.as_str()).collect();
    let missing: Vec<String> = wanted
        .iter()
        .filter(|n| !entries.contains_key(**n))
        .map(|n| n.to_string())
        .collect();
    let unexpected: Vec<String> = entries
        .keys()
        .filter(|n| !wanted.contains(n.as_str()))
        .cloned()
        .collect();
    if strict && !(missing.is_empty() && unexpected.is_empty()) {
        return Err(Error::KeyMismatch {
            path: path(),
            missing,
            unexpected,
        });
    }
    if !missing.is_empty() || !unexpected.is_empty() {
        tracing::warn!(path = %file.path().display(), ?missing, ?unexpected, "non-strict load: keys differ");
    }
    let mut present = Vec::new();
    for spec in expected {
        let Some(e) = entries.get(&spec.name) else {
            continue;
        };
        if e.shape != spec.shape.dims() {
            return Err(Error::ShapeMismatch {
                path: path(),
                tensor: spec.name.clone(),
                expected: spec.shape.dims().to_vec(),
                got: e.shape.clone(),
            });
        }
        match e.candle_dtype() {
            Some(got) if got == spec.dtype => {}
            Some(got) => {
                return Err(Error::DtypeMismatch {
                    path: path(),
                    tensor: spec.name.clone(),
                    expected: spec.dtype,
                    got,
                })
            }
            None => {
                return Err(Error::Safetensors {
                    path: path(),
                    reason: format!(
                        "tensor `{}` has dtype {}, which candle cannot hold; expected {:?}",
                        spec.name, e.dtype, spec.dtype
                    ),
                })
            }
        }
        present.push(spec);
    }
    Ok(present)
}

/// Reads the tensors `expected` names from a file onto `device`, after
/// checking keys, shapes and dtypes.
///
/// `strict`: any missing or unexpected name is an [`Error::KeyMismatch`]
/// listing all of them, sorted (like PyTorch's `load_state_dict(strict=True)`).
/// Non-strict: loads the names both sides have and logs the rest. Shapes and
/// dtypes are checked either way ([`Error::ShapeMismatch`],
/// [`Error::DtypeMismatch`]). Everything is validated from the header before
/// any tensor is created.
pub fn load_into(
    path: impl AsRef<Path>,
    expected: &[TensorSpec],
    strict: bool,
    device: &Device,
) -> Result<BTreeMap<String, Tensor>> {
    let file = open(path.as_ref())?;
    validate(&file, expected, strict)?
        .into_iter()
        .map(|spec| {
            let tensor = file.tensor(&spec.name, device).map_err(file_error)?;
            Ok((spec.name.clone(), tensor))
        })
        .collect()
}

/// Restores model weights from a file into candle `Var`s, all or nothing.
///
/// Validates keys (see `strict` in [`load_into`]), shapes and dtypes, then
/// creates every tensor on its `Var`'s device, and only then calls
/// `Var::set` on each. A bad file therefore leaves every `Var` untouched; only
/// a device failure during the final copies could leave some set.
pub fn restore_vars(path: impl AsRef<Path>, vars: &[(String, Var)], strict: bool) -> Result<()> {
    let file = open(path.as_ref())?;
    let specs: Vec<TensorSpec> = vars
        .iter()
        .map(|(n, v)| TensorSpec::of(n, v.as_tensor()))
        .collect();
    let present: BTreeSet<&str> = validate(&file, &specs, strict)?
        .into_iter()
        .map(|s| s.name.as_str())
        .collect();
    let mut staged = Vec::with_capacity(present.len());
    for (name, var) in vars.iter().filter(|(n, _)| present.contains(n.as_str())) {
        if !var.as_tensor().is_contiguous() {
            return Err(Error::Usage(format!(
                "cannot restore `{name}`: its Var is not contiguous"
            )));
        }
        staged.push((var, file.tensor(name, var.device()).map_err(file_error)?));
    }
    for (var, tensor) in staged {
        var.set(&tensor)?;
    }
    Ok(())
}

// ---------------------------------------------------------------- JSON

/// Writes a JSON value atomically (same protocol as [`write_safetensors`]),
/// laid out as Python's `json.dumps(value, indent=2) + "\n"`.
pub fn write_json(path: impl AsRef<Path>, value: &Value) -> Result<()> {
    let path = path.as_ref();
    write_bytes_atomic(path, &python_json(value, path)?)
}

/// Reads a JSON file: [`Error::MissingFile`] when absent, [`Error::Json`]
/// (with line and column) when unparsable.
pub fn read_json(path: impl AsRef<Path>) -> Result<Value> {
    let path = path.as_ref();
    let bytes = read_bytes(path, "JSON file")?;
    serde_json::from_slice(&bytes).map_err(|e| Error::Json {
        path: path.to_path_buf(),
        reason: e.to_string(),
    })
}

// ---------------------------------------------------------------- state dicts

/// Saves a [`StateDict`] as `{dir}/{stem}.safetensors` (when it has tensors)
/// and `{dir}/{stem}.json` (when `meta` is not `Null`, or when the state is
/// entirely empty, so that every saved state leaves a file behind and a lost
/// one is detected on load). Returns the files written.
pub fn save_state_dict(
    dir: impl AsRef<Path>,
    stem: &str,
    state: &StateDict,
) -> Result<Vec<PathBuf>> {
    let dir = dir.as_ref();
    let mut written = Vec::new();
    if !state.tensors.is_empty() {
        let path = dir.join(format!("{stem}.safetensors"));
        write_safetensors(&path, &state.tensors, None)?;
        written.push(path);
    }
    if !state.meta.is_null() || state.tensors.is_empty() {
        let path = dir.join(format!("{stem}.json"));
        write_json(&path, &state.meta)?;
        written.push(path);
    }
    Ok(written)
}

/// Loads what [`save_state_dict`] wrote, tensors onto `device`. A missing
/// `.safetensors` means no tensors and a missing `.json` means `Null` meta;
/// both missing is [`Error::MissingFile`].
pub fn load_state_dict(dir: impl AsRef<Path>, stem: &str, device: &Device) -> Result<StateDict> {
    let dir = dir.as_ref();
    let st = dir.join(format!("{stem}.safetensors"));
    let js = dir.join(format!("{stem}.json"));
    let (has_st, has_js) = (st.is_file(), js.is_file());
    if !has_st && !has_js {
        return Err(Error::MissingFile {
            path: st,
            what: format!("saved state of `{stem}` ({stem}.safetensors and/or {stem}.json)"),
        });
    }
    Ok(StateDict {
        tensors: if has_st {
            read_safetensors(&st, device)?
        } else {
            BTreeMap::new()
        },
        meta: if has_js { read_json(&js)? } else { Value::Null },
    })
}

#[cfg(test)]
#[path = "safetensors_io_tests.rs"]
mod tests;
