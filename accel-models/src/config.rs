//! `config.json` of each supported `model_type`, read with transformers'
//! defaults for optional keys and an error naming file and key otherwise.
//!
//! The keys every real checkpoint carries (sizes, epsilons) are required, so
//! a truncated or mistyped file fails here instead of producing a model of
//! the wrong shape; keys transformers defaults silently keep its defaults.

use std::path::{Path, PathBuf};

use accel_bigmodel::lora::LoraConfig;
use accel_nn::layers::{Activation, Llama3RopeScaling, LoraSpec, QuantSpec};
use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::Value;

use crate::{Error, Result};

/// The `model_type`s this crate implements.
pub const KNOWN_MODEL_TYPES: &str = "llama, mistral, qwen2, gpt2, bert";

/// Which member of the Llama family a [`LlamaConfig`] describes: it decides
/// the decoder layer's class name and Qwen2's attention biases.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LlamaFamily {
    /// `model_type: llama` (Llama 2 and 3).
    Llama,
    /// `model_type: mistral`.
    Mistral,
    /// `model_type: qwen2`: q/k/v projections always have biases.
    Qwen2,
}

impl LlamaFamily {
    /// transformers' decoder layer class, what `no_split_module_classes` and
    /// `fsdp_transformer_layer_cls_to_wrap` name.
    pub fn layer_class(self) -> &'static str {
        match self {
            LlamaFamily::Llama => "LlamaDecoderLayer",
            LlamaFamily::Mistral => "MistralDecoderLayer",
            LlamaFamily::Qwen2 => "Qwen2DecoderLayer",
        }
    }

    /// transformers' RMSNorm class of the final norm.
    pub fn norm_class(self) -> &'static str {
        match self {
            LlamaFamily::Llama => "LlamaRMSNorm",
            LlamaFamily::Mistral => "MistralRMSNorm",
            LlamaFamily::Qwen2 => "Qwen2RMSNorm",
        }
    }
}

/// Rotary settings as transformers 5 writes them (`rope_parameters`), also
/// accepted as the older `rope_scaling` dict.
#[derive(Debug, Clone, Deserialize)]
struct RopeParameters {
    #[serde(alias = "type")]
    rope_type: Option<String>,
    rope_theta: Option<f64>,
    factor: Option<f64>,
    low_freq_factor: Option<f64>,
    high_freq_factor: Option<f64>,
    original_max_position_embeddings: Option<usize>,
}

/// The keys of a Llama, Mistral or Qwen2 `config.json` as read from the file.
#[derive(Debug, Clone, Deserialize)]
struct RawLlama {
    vocab_size: usize,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    max_position_embeddings: usize,
    rms_norm_eps: f64,
    rope_theta: Option<f64>,
    rope_scaling: Option<RopeParameters>,
    rope_parameters: Option<RopeParameters>,
    #[serde(default)]
    attention_bias: bool,
    #[serde(default)]
    mlp_bias: bool,
    #[serde(default)]
    tie_word_embeddings: bool,
    hidden_act: Option<Activation>,
    sliding_window: Option<usize>,
    use_sliding_window: Option<bool>,
    eos_token_id: Option<Value>,
}

/// A Llama-family model's shape and options (Llama 2/3, Mistral, Qwen2).
#[derive(Debug, Clone, PartialEq)]
pub struct LlamaConfig {
    /// Which member of the family.
    pub family: LlamaFamily,
    /// Token count of the embedding and lm_head.
    pub vocab_size: usize,
    /// Width of the residual stream.
    pub hidden_size: usize,
    /// Width of the SwiGLU MLP.
    pub intermediate_size: usize,
    /// Number of decoder layers.
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// Key/value heads (fewer than query heads: grouped-query attention).
    pub num_key_value_heads: usize,
    /// Width of one head.
    pub head_dim: usize,
    /// Longest context (size of the rotary tables).
    pub max_position_embeddings: usize,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f64,
    /// RoPE base.
    pub rope_theta: f64,
    /// Llama 3 frequency scaling, when configured.
    pub rope_scaling: Option<Llama3RopeScaling>,
    /// Biases on q/k/v (Qwen2 always; Llama's `attention_bias` also on o_proj).
    pub qkv_bias: bool,
    /// Bias on o_proj (Llama's `attention_bias`).
    pub o_bias: bool,
    /// Biases in the MLP.
    pub mlp_bias: bool,
    /// Whether lm_head reuses `model.embed_tokens.weight`.
    pub tie_word_embeddings: bool,
    /// Mistral's sliding attention window, when active.
    pub sliding_window: Option<usize>,
    /// Token ids that end generation (`eos_token_id`, one or a list).
    pub eos_token_ids: Vec<u32>,
    /// LoRA adapters to build on the linear layers (not in `config.json`;
    /// see [`ModelConfig::set_lora`]).
    pub lora: Option<LoraSpec>,
    /// How quantized linear layers compute (`quantization_config`, see
    /// [`ModelConfig::set_quantization`]).
    pub quant: Option<QuantSpec>,
}

impl LlamaConfig {
    fn from_raw(path: &Path, family: LlamaFamily, raw: RawLlama) -> Result<Self> {
        let unsupported = |key: &str, reason: String| Error::Unsupported {
            path: path.to_path_buf(),
            key: key.to_string(),
            reason,
        };
        if let Some(act) = raw.hidden_act.filter(|a| *a != Activation::Silu) {
            return Err(unsupported(
                "hidden_act",
                format!("{act:?}; the Llama family uses silu"),
            ));
        }
        let heads = raw.num_attention_heads;
        let kv_heads = raw.num_key_value_heads.unwrap_or(heads);
        if heads == 0 || kv_heads == 0 || !heads.is_multiple_of(kv_heads) {
            return Err(unsupported(
                "num_key_value_heads",
                format!("{kv_heads} does not divide num_attention_heads {heads}"),
            ));
        }
        let head_dim = raw.head_dim.unwrap_or(raw.hidden_size / heads);
        // transformers 5 writes `rope_parameters`; Hub checkpoints carry
        // `rope_theta` and `rope_scaling`.
        let (key, rope) = match (&raw.rope_parameters, &raw.rope_scaling) {
            (Some(p), _) => ("rope_parameters", Some(p)),
            (None, s) => ("rope_scaling", s.as_ref()),
        };
        let rope_theta = rope
            .and_then(|r| r.rope_theta)
            .or(raw.rope_theta)
            .unwrap_or(10_000.0);
        let rope_scaling = match rope {
            None => None,
            Some(r) => match r.rope_type.as_deref() {
                None | Some("default") => None,
                Some("llama3") => {
                    let need = |v: Option<f64>, k: &str| {
                        v.ok_or_else(|| Error::MissingKey {
                            path: path.to_path_buf(),
                            key: format!("{key}.{k}"),
                        })
                    };
                    Some(Llama3RopeScaling {
                        factor: need(r.factor, "factor")?,
                        low_freq_factor: need(r.low_freq_factor, "low_freq_factor")?,
                        high_freq_factor: need(r.high_freq_factor, "high_freq_factor")?,
                        original_max_position_embeddings: r
                            .original_max_position_embeddings
                            .ok_or_else(|| Error::MissingKey {
                                path: path.to_path_buf(),
                                key: format!("{key}.original_max_position_embeddings"),
                            })?,
                    })
                }
                Some(other) => {
                    return Err(unsupported(
                        &format!("{key}.rope_type"),
                        format!("{other:?}; supported: default, llama3"),
                    ))
                }
            },
        };
        // Qwen2 keeps a sliding window in its config but uses it only when
        // `use_sliding_window` is set; Llama has none.
        let sliding_window = match family {
            LlamaFamily::Llama => None,
            LlamaFamily::Mistral => raw.sliding_window,
            LlamaFamily::Qwen2 => raw
                .sliding_window
                .filter(|_| raw.use_sliding_window == Some(true)),
        };
        Ok(Self {
            family,
            vocab_size: raw.vocab_size,
            hidden_size: raw.hidden_size,
            intermediate_size: raw.intermediate_size,
            num_hidden_layers: raw.num_hidden_layers,
            num_attention_heads: heads,
            num_key_value_heads: kv_heads,
            head_dim,
            max_position_embeddings: raw.max_position_embeddings,
            rms_norm_eps: raw.rms_norm_eps,
            rope_theta,
            rope_scaling,
            qkv_bias: family == LlamaFamily::Qwen2 || raw.attention_bias,
            o_bias: family == LlamaFamily::Llama && raw.attention_bias,
            mlp_bias: raw.mlp_bias,
            tie_word_embeddings: raw.tie_word_embeddings,
            sliding_window,
            eos_token_ids: token_ids(raw.eos_token_id.as_ref()),
            lora: None,
            quant: None,
        })
    }
}

/// `eos_token_id` as transformers allows it: absent, null, one id or a list.
fn token_ids(v: Option<&Value>) -> Vec<u32> {
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
    /// `llama`, `mistral`, `qwen2`.
    Llama(LlamaConfig),
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
        let raw: RawLlama = parse(&path, value)?;
        Ok(Self::Llama(LlamaConfig::from_raw(&path, family, raw)?))
    }

    /// The `model_type` string.
    pub fn model_type(&self) -> &'static str {
        match self {
            ModelConfig::Llama(c) => match c.family {
                LlamaFamily::Llama => "llama",
                LlamaFamily::Mistral => "mistral",
                LlamaFamily::Qwen2 => "qwen2",
            },
            ModelConfig::Gpt2(_) => "gpt2",
            ModelConfig::Bert(_) => "bert",
        }
    }

    /// The vocabulary size.
    pub fn vocab_size(&self) -> usize {
        match self {
            ModelConfig::Llama(c) => c.vocab_size,
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
fn parse<T: DeserializeOwned>(path: &Path, value: Value) -> Result<T> {
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
            (c.rope_theta, c.head_dim, c.num_key_value_heads),
            (5e5, 4, 1)
        );
        assert_eq!(c.rope_scaling.unwrap().factor, 8.0);
        let bad = format!(r#"{{{base}, "rope_scaling": {{"rope_type": "yarn", "factor": 2.0}}}}"#);
        let e = ModelConfig::from_path(write(dir.path(), &bad)).unwrap_err();
        assert!(e.to_string().contains("rope_scaling.rope_type"), "{e}");
    }
}
