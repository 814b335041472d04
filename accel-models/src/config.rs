//! `config.json` of each supported `model_type`, read with transformers'
//! defaults for optional keys and an error naming file and key otherwise.
//!
//! The keys every real checkpoint carries (sizes, epsilons) are required, so
//! a truncated or mistyped file fails here instead of producing a model of
//! the wrong shape; keys transformers defaults silently keep its defaults.

use std::path::{Path, PathBuf};

use accel_bigmodel::lora::LoraConfig;
use accel_nn::layers::{Activation, LoraSpec, QuantSpec};
use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::Value;

pub use crate::llama_config::{LlamaConfig, LlamaFamily, MoeConfig};
use crate::{Error, Result};

/// The `model_type`s this crate implements.
pub const KNOWN_MODEL_TYPES: &str =
    "llama, mistral, qwen2, qwen3, phi3, mixtral, qwen3_moe, gemma2, gemma3_text, gemma3, gpt2, bert";

/// `eos_token_id` as transformers allows it: absent, null, one id or a list.
pub(crate) fn token_ids(v: Option<&Value>) -> Vec<u32> {
    match v {
        Some(Value::Number(n)) => n.as_u64().map(|n| vec![n as u32]).unwrap_or_default(),
        Some(Value::Array(a)) => a
            .iter()
            .filter_map(|n| n.as_u64())
            .map(|n| n as u32)
            .collect(),
        _ => Vec::new(),
    }
}

/// A GPT-2 model's shape and options.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct Gpt2Config {
    /// Token count.
    pub vocab_size: usize,
    /// Width of the residual stream.
    pub n_embd: usize,
    /// Number of blocks.
    pub n_layer: usize,
    /// Attention heads.
    pub n_head: usize,
    /// Size of the learned position table.
    pub n_positions: usize,
    /// MLP width (`4 * n_embd` when null).
    #[serde(default)]
    pub n_inner: Option<usize>,
    /// LayerNorm epsilon.
    #[serde(default = "gpt2_eps")]
    pub layer_norm_epsilon: f64,
    /// MLP activation (`gelu_new`, the tanh approximation).
    #[serde(default = "gpt2_act")]
    pub activation_function: Activation,
    /// Whether attention scores are divided by `sqrt(head_dim)`.
    #[serde(default = "yes")]
    pub scale_attn_weights: bool,
    /// Whether scores are further divided by the layer's 1-based index.
    #[serde(default)]
    pub scale_attn_by_inverse_layer_idx: bool,
    /// Token id that ends generation.
    #[serde(default)]
    pub eos_token_id: Option<u32>,
    /// LoRA adapters (see [`ModelConfig::set_lora`]).
    #[serde(skip)]
    pub lora: Option<LoraSpec>,
    /// Quantized linear layers (see [`ModelConfig::set_quantization`]).
    #[serde(skip)]
    pub quant: Option<QuantSpec>,
}

fn gpt2_eps() -> f64 {
    1e-5
}
fn gpt2_act() -> Activation {
    Activation::GeluTanh
}
fn yes() -> bool {
    true
}

/// A BERT encoder's shape and options.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct BertConfig {
    /// Token count.
    pub vocab_size: usize,
    /// Width of the hidden states.
    pub hidden_size: usize,
    /// Number of `BertLayer`s.
    pub num_hidden_layers: usize,
    /// Attention heads.
    pub num_attention_heads: usize,
    /// MLP width.
    pub intermediate_size: usize,
    /// Size of the position table.
    pub max_position_embeddings: usize,
    /// Size of the token type table.
    #[serde(default = "two")]
    pub type_vocab_size: usize,
    /// LayerNorm epsilon.
    #[serde(default = "bert_eps")]
    pub layer_norm_eps: f64,
    /// MLP activation (exact GELU).
    #[serde(default = "bert_act")]
    pub hidden_act: Activation,
    /// Only `absolute` is implemented.
    #[serde(default = "absolute")]
    pub position_embedding_type: String,
    /// LoRA adapters (see [`ModelConfig::set_lora`]).
    #[serde(skip)]
    pub lora: Option<LoraSpec>,
    /// Quantized linear layers (see [`ModelConfig::set_quantization`]).
    #[serde(skip)]
    pub quant: Option<QuantSpec>,
}

fn two() -> usize {
    2
}
fn bert_eps() -> f64 {
    1e-12
}
fn bert_act() -> Activation {
    Activation::Gelu
}
fn absolute() -> String {
    "absolute".into()
}

/// Any supported `config.json`, by `model_type`.
#[derive(Debug, Clone, PartialEq)]
pub enum ModelConfig {
    /// `llama`, `mistral`, `qwen2`, `qwen3`, `phi3`, `mixtral`, `qwen3_moe`.
    Llama(LlamaConfig),
    /// `gemma3_text`, the text model of a `gemma3` folder, and `gemma2`.
    Gemma3(crate::gemma::Gemma3Config),
    /// `gpt2`.
    Gpt2(Gpt2Config),
    /// `bert`.
    Bert(BertConfig),
}

impl ModelConfig {
    /// Builds the model with LoRA adapters on the linear layers `config`
    /// targets (PEFT's `get_peft_model`), and returns the spec the layers
    /// share (its training switch turns the adapters' dropout on). GPT-2's
    /// `Conv1D` weights are stored `[in, out]`, so its adapters record
    /// `fan_in_fan_out`, as PEFT sets it.
    pub fn set_lora(&mut self, mut config: LoraConfig) -> LoraSpec {
        config.fan_in_fan_out = matches!(self, Self::Gpt2(_));
        let spec = LoraSpec::new(config);
        let slot = match self {
            Self::Llama(c) => &mut c.lora,
            Self::Gemma3(c) => &mut c.lora,
            Self::Gpt2(c) => &mut c.lora,
            Self::Bert(c) => &mut c.lora,
        };
        *slot = Some(spec.clone());
        spec
    }

    /// The LoRA adapters the model is built with, if any.
    pub fn lora(&self) -> Option<&LoraSpec> {
        match self {
            Self::Llama(c) => c.lora.as_ref(),
            Self::Gemma3(c) => c.lora.as_ref(),
            Self::Gpt2(c) => c.lora.as_ref(),
            Self::Bert(c) => c.lora.as_ref(),
        }
    }

    /// Reads `config.json` from a checkpoint folder (or the file itself).
    ///
    /// # Errors
    /// [`Error::Io`], [`Error::BadConfig`] for malformed JSON or a value of
    /// the wrong type, [`Error::MissingKey`] (also for a missing
    /// `model_type`), [`Error::UnknownModelType`], [`Error::Unsupported`];
    /// every one names the file.
    pub fn from_path(path: impl AsRef<Path>) -> Result<Self> {
        let path = config_path(path.as_ref());
        let text = std::fs::read_to_string(&path).map_err(|source| Error::Io {
            path: path.clone(),
            source,
        })?;
        let value: Value = serde_json::from_str(&text).map_err(|e| Error::BadConfig {
            path: path.clone(),
            reason: e.to_string(),
        })?;
        let quantization = value.get("quantization_config").cloned();
        let mut cfg = Self::from_value(path.clone(), value)?;
        cfg.read_quantization(&path, quantization)?;
        Ok(cfg)
    }

    /// [`ModelConfig::from_path`] of the parsed file, without its
    /// `quantization_config`.
    fn from_value(path: PathBuf, value: Value) -> Result<Self> {
        let model_type = match value.get("model_type") {
            Some(Value::String(s)) => s.clone(),
            _ => {
                return Err(Error::MissingKey {
                    path,
                    key: "model_type".into(),
                })
            }
        };
        let family = match model_type.as_str() {
            "llama" => LlamaFamily::Llama,
            "mistral" => LlamaFamily::Mistral,
            "qwen2" => LlamaFamily::Qwen2,
            "qwen3" => LlamaFamily::Qwen3,
            "phi3" => LlamaFamily::Phi3,
            "mixtral" => LlamaFamily::Mixtral,
            "qwen3_moe" => LlamaFamily::Qwen3Moe,
            "gemma2" | "gemma3_text" | "gemma3" => {
                return Ok(Self::Gemma3(crate::gemma::Gemma3Config::from_value(
                    &path, value,
                )?))
            }
            "gpt2" => return Ok(Self::Gpt2(parse(&path, value)?)),
            "bert" => {
                let cfg: BertConfig = parse(&path, value)?;
                if cfg.position_embedding_type != "absolute" {
                    return Err(Error::Unsupported {
                        path,
                        key: "position_embedding_type".into(),
                        reason: format!("{:?}; only absolute", cfg.position_embedding_type),
                    });
                }
                return Ok(Self::Bert(cfg));
            }
            _ => {
                return Err(Error::UnknownModelType {
                    path,
                    model_type,
                    known: KNOWN_MODEL_TYPES,
                })
            }
        };
        Ok(Self::Llama(LlamaConfig::from_value(&path, family, value)?))
    }

    /// The `model_type` string.
    pub fn model_type(&self) -> &'static str {
        match self {
            ModelConfig::Llama(c) => c.family.model_type(),
            ModelConfig::Gemma3(c) if c.version == 2 => "gemma2",
            ModelConfig::Gemma3(_) => "gemma3_text",
            ModelConfig::Gpt2(_) => "gpt2",
            ModelConfig::Bert(_) => "bert",
        }
    }

    /// The vocabulary size.
    pub fn vocab_size(&self) -> usize {
        match self {
            ModelConfig::Llama(c) => c.vocab_size,
            ModelConfig::Gemma3(c) => c.vocab_size,
            ModelConfig::Gpt2(c) => c.vocab_size,
            ModelConfig::Bert(c) => c.vocab_size,
        }
    }
}

/// `dir/config.json` for a folder, else the path itself.
pub(crate) fn config_path(path: &Path) -> PathBuf {
    if path.is_dir() {
        path.join("config.json")
    } else {
        path.to_path_buf()
    }
}

/// Deserializes `value`, turning serde's "missing field" into
/// [`Error::MissingKey`] so callers can match on the key.
pub(crate) fn parse<T: DeserializeOwned>(path: &Path, value: Value) -> Result<T> {
    serde_json::from_value(value).map_err(|e| {
        let msg = e.to_string();
        match msg
            .strip_prefix("missing field `")
            .and_then(|r| r.split('`').next())
        {
            Some(key) => Error::MissingKey {
                path: path.to_path_buf(),
                key: key.to_string(),
            },
            None => Error::BadConfig {
                path: path.to_path_buf(),
                reason: msg,
            },
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, json: &str) -> PathBuf {
        let p = dir.join("config.json");
        std::fs::write(&p, json).unwrap();
        p
    }

    #[test]
    fn unknown_model_type_names_file_and_value() {
        let dir = tempfile::tempdir().unwrap();
        let p = write(dir.path(), r#"{"model_type": "t5"}"#);
        let e = ModelConfig::from_path(dir.path()).unwrap_err();
        assert!(matches!(&e, Error::UnknownModelType { model_type, .. } if model_type == "t5"));
        let msg = e.to_string();
        assert!(
            msg.contains(&p.display().to_string()) && msg.contains("t5"),
            "{msg}"
        );
    }

    #[test]
    fn a_missing_key_is_named_with_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let p = write(
            dir.path(),
            r#"{"model_type": "llama", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
                "num_hidden_layers": 1, "num_attention_heads": 2, "max_position_embeddings": 8}"#,
        );
        let e = ModelConfig::from_path(dir.path()).unwrap_err();
        assert!(
            matches!(&e, Error::MissingKey { key, path } if key == "rms_norm_eps" && *path == p)
        );
        let e = ModelConfig::from_path(write(dir.path(), "{}")).unwrap_err();
        assert!(matches!(&e, Error::MissingKey { key, .. } if key == "model_type"));
    }

    #[test]
    fn llama3_scaling_reads_from_both_spellings() {
        let dir = tempfile::tempdir().unwrap();
        let base = r#""model_type": "llama", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
            "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
            "max_position_embeddings": 8, "rms_norm_eps": 1e-6"#;
        let scaling = r#""rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 16"#;
        let old = format!(r#"{{{base}, "rope_theta": 5e5, "rope_scaling": {{{scaling}}}}}"#);
        let new = format!(r#"{{{base}, "rope_parameters": {{"rope_theta": 5e5, {scaling}}}}}"#);
        let a = ModelConfig::from_path(write(dir.path(), &old)).unwrap();
        let b = ModelConfig::from_path(write(dir.path(), &new)).unwrap();
        assert_eq!(a, b);
        let ModelConfig::Llama(c) = a else { panic!() };
        assert_eq!(
            (c.rope.theta, c.head_dim, c.num_key_value_heads),
            (5e5, 4, 1)
        );
        let Some(crate::RopeScaling::Llama3(s)) = c.rope.scaling else {
            panic!("{:?}", c.rope)
        };
        assert_eq!(s.factor, 8.0);
        let bad = format!(r#"{{{base}, "rope_scaling": {{"rope_type": "yarn", "factor": 2.0}}}}"#);
        let e = ModelConfig::from_path(write(dir.path(), &bad)).unwrap_err();
        assert!(e.to_string().contains("rope_scaling.rope_type"), "{e}");
    }
}
