//! A PEFT LoRA folder read back: its config and `A`/`B` pairs by module,
//! and the merged weight `W + scaling * B A` of each adapted module (what
//! PEFT's `merge_and_unload` computes).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};

use super::{LoraConfig, ADAPTER_CONFIG_NAME, ADAPTER_WEIGHTS_NAME, PEFT_PREFIX};
use crate::{CheckpointSource, Error, Result};

/// The file names of one module's pair in `adapter_model.safetensors`.
#[derive(Debug, Default, Clone)]
struct Pair {
    a: Option<String>,
    b: Option<String>,
}

/// A LoRA adapter folder (`adapter_config.json`, `adapter_model.safetensors`).
#[derive(Debug)]
pub struct LoraAdapter {
    dir: PathBuf,
    config: LoraConfig,
    weights: CheckpointSource,
    /// Base model module name to its pair's tensor names in the file.
    modules: BTreeMap<String, (String, String)>,
}

fn invalid(path: &Path, reason: impl Into<String>) -> Error {
    Error::InvalidCheckpoint {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
}

/// `base_model.model.{module}.lora_A.weight` (or PEFT's in-memory
/// `….lora_A.{adapter}.weight`) to the module and which matrix.
fn parse_key(key: &str) -> Option<(&str, bool)> {
    let rest = key.strip_prefix(PEFT_PREFIX).unwrap_or(key);
    for (marker, is_a) in [(".lora_A.", true), (".lora_B.", false)] {
        if let Some(at) = rest.find(marker) {
            let tail = &rest[at + marker.len()..];
            let weight = tail == "weight"
                || tail
                    .strip_suffix(".weight")
                    .is_some_and(|name| !name.contains('.'));
            return weight.then_some((&rest[..at], is_a));
        }
    }
    None
}

impl LoraAdapter {
    /// Opens a PEFT adapter folder and checks that its tensors are LoRA
    /// pairs of the config's rank.
    ///
    /// # Errors
    /// A missing or unreadable file, a config PEFT features this crate does
    /// not support, a tensor that is not a LoRA matrix, an unpaired or
    /// misshapen matrix; each names the file and the tensor.
    pub fn open(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref();
        let config_path = dir.join(ADAPTER_CONFIG_NAME);
        let text = std::fs::read_to_string(&config_path).map_err(|source| Error::Io {
            op: "reading the adapter config",
            path: config_path.clone(),
            source,
        })?;
        let config =
            LoraConfig::from_peft_json(&text).map_err(|reason| invalid(&config_path, reason))?;
        let weights_path = dir.join(ADAPTER_WEIGHTS_NAME);
        if !weights_path.is_file() {
            return Err(Error::MissingFile {
                path: weights_path,
                what: "the adapter's weights (adapter_model.safetensors)".into(),
            });
        }
        let weights = CheckpointSource::open(&weights_path)?;
        let mut pairs: BTreeMap<String, Pair> = BTreeMap::new();
        for key in weights.names() {
            let Some((module, is_a)) = parse_key(key) else {
                return Err(invalid(
                    &weights_path,
                    format!(
                        "tensor `{key}` is not a LoRA matrix (lora_A / lora_B); embedding \
                         adapters, DoRA magnitudes and saved modules are not supported"
                    ),
                ));
            };
            let pair = pairs.entry(module.to_string()).or_default();
            let slot = if is_a { &mut pair.a } else { &mut pair.b };
            if slot.replace(key.to_string()).is_some() {
                return Err(invalid(
                    &weights_path,
                    format!(
                        "module `{module}` has two lora_{} matrices",
                        if is_a { 'A' } else { 'B' }
                    ),
                ));
            }
        }
        let mut modules = BTreeMap::new();
        for (module, pair) in pairs {
            let (Some(a), Some(b)) = (pair.a, pair.b) else {
                return Err(invalid(
                    &weights_path,
                    format!("module `{module}` has only one of lora_A / lora_B"),
                ));
            };
            let (sa, sb) = (shape(&weights, &a), shape(&weights, &b));
            if sa.len() != 2 || sb.len() != 2 || sa[0] != config.r || sb[1] != config.r {
                return Err(invalid(
                    &weights_path,
                    format!(
                        "module `{module}`: lora_A {sa:?} and lora_B {sb:?} are not [r, in] and \
                         [out, r] with r = {} (adapter_config.json)",
                        config.r
                    ),
                ));
            }
            modules.insert(module, (a, b));
        }
        if modules.is_empty() {
            return Err(invalid(&weights_path, "the adapter holds no LoRA matrix"));
        }
        Ok(Self {
            dir: dir.to_path_buf(),
            config,
            weights,
            modules,
        })
    }

    /// The folder it was read from.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The adapter's settings.
    pub fn config(&self) -> &LoraConfig {
        &self.config
    }

    /// The adapted modules, by their base model names.
    pub fn modules(&self) -> impl Iterator<Item = &str> {
        self.modules.keys().map(String::as_str)
    }

    /// Whether the base tensor `name` is the weight of an adapted module.
    pub fn adapts(&self, name: &str) -> bool {
        self.module_of(name).is_some()
    }

    /// The file's key of the model-side name `{module}.lora_A.weight` or
    /// `{module}.lora_B.weight`, when the adapter holds that matrix.
    pub fn matrix_key(&self, name: &str) -> Option<&str> {
        let (module, is_a) = match (
            name.strip_suffix(".lora_A.weight"),
            name.strip_suffix(".lora_B.weight"),
        ) {
            (Some(m), _) => (m, true),
            (_, Some(m)) => (m, false),
            _ => return None,
        };
        let (a, b) = self.modules.get(module)?;
        Some(if is_a { a } else { b })
    }

    /// The matrix a model names `{module}.lora_A.weight` (or `lora_B`) on
    /// `device` in `dtype`, when the adapter holds it: the adapter loaded
    /// unmerged, as PEFT's `PeftModel.from_pretrained` runs it.
    ///
    /// # Errors
    /// A tensor that cannot be read.
    pub fn matrix(&self, name: &str, device: &Device, dtype: DType) -> Result<Option<Tensor>> {
        match self.matrix_key(name) {
            Some(key) => Ok(Some(self.weights.tensor(key, device, Some(dtype))?)),
            None => Ok(None),
        }
    }

    /// The dims of the matrix a model names `name`, when the adapter holds it.
    pub fn matrix_shape(&self, name: &str) -> Option<Vec<usize>> {
        Some(shape(&self.weights, self.matrix_key(name)?))
    }

    fn module_of(&self, name: &str) -> Option<&(String, String)> {
        self.modules.get(name.strip_suffix(".weight")?)
    }

    /// `base` (the tensor `name` of the base model) with the adapter's
    /// update added, `W + scaling * B A` (transposed for `fan_in_fan_out`
    /// weights), summed in f32 and returned in `base`'s dtype; `base`
    /// itself for a tensor the adapter does not touch.
    ///
    /// # Errors
    /// An update whose shape is not the base weight's, naming both.
    pub fn merge(&self, name: &str, base: Tensor) -> Result<Tensor> {
        let Some((a, b)) = self.module_of(name) else {
            return Ok(base);
        };
        let dev = base.device().clone();
        let a = self.weights.tensor(a, &dev, Some(DType::F32))?;
        let b = self.weights.tensor(b, &dev, Some(DType::F32))?;
        let mut delta = (b.matmul(&a)? * self.config.scaling())?;
        if self.config.fan_in_fan_out {
            delta = delta.t()?;
        }
        if delta.dims() != base.dims() {
            return Err(Error::ShapeMismatch {
                path: self.dir.join(ADAPTER_WEIGHTS_NAME),
                tensor: name.to_string(),
                expected: base.dims().to_vec(),
                got: delta.dims().to_vec(),
            });
        }
        let dtype = base.dtype();
        Ok((base.to_dtype(DType::F32)? + delta)?.to_dtype(dtype)?)
    }

    /// Checks that every adapted module's weight is in `base`.
    ///
    /// # Errors
    /// [`Error::MissingTensor`] for the first that is not.
    pub(crate) fn check_base(&self, base: &CheckpointSource) -> Result<()> {
        for module in self.modules.keys() {
            let name = format!("{module}.weight");
            if !base.contains(&name) {
                return Err(Error::InvalidCheckpoint {
                    path: self.dir.join(ADAPTER_WEIGHTS_NAME),
                    reason: format!(
                        "adapts `{module}`, but the base checkpoint {} has no `{name}` (an \
                         adapter trained for another model?)",
                        base.checkpoint().display()
                    ),
                });
            }
        }
        Ok(())
    }

    /// The adapter's own tensors on `device` in f32, by file name.
    ///
    /// # Errors
    /// A tensor that cannot be read.
    pub fn tensors(&self, device: &Device) -> Result<Vec<(String, Tensor)>> {
        self.weights
            .names()
            .map(|n| {
                Ok((
                    n.to_string(),
                    self.weights.tensor(n, device, Some(DType::F32))?,
                ))
            })
            .collect()
    }
}

fn shape(source: &CheckpointSource, name: &str) -> Vec<usize> {
    source
        .locate(name)
        .map(|l| l.shape().to_vec())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::parse_key;

    #[test]
    fn peft_keys_name_their_module() {
        let k = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight";
        assert_eq!(
            parse_key(k),
            Some(("model.layers.0.self_attn.q_proj", true))
        );
        let k = "base_model.model.h.0.attn.c_attn.lora_B.default.weight";
        assert_eq!(parse_key(k), Some(("h.0.attn.c_attn", false)));
        assert_eq!(parse_key("base_model.model.x.lora_magnitude_vector"), None);
        assert_eq!(parse_key("base_model.model.x.lora_A.a.b.weight"), None);
        assert_eq!(parse_key("model.embed_tokens.weight"), None);
    }
}
