//! `config.json` of Gemma 3's text model (`gemma3_text`, or the
//! `text_config` of a `gemma3` folder), in transformers 5's spelling
//! (`layer_types`, `rope_parameters` per layer type) and the Hub's older one
//! (`sliding_window_pattern`, `rope_theta` with `rope_local_base_freq`); and
//! of Gemma 2 (`gemma2`), the same layer without q/k norms, one rotary
//! embedding for every layer, and soft-capped attention scores.

use std::path::Path;

use accel_nn::layers::{LoraSpec, QuantSpec};
use serde::Deserialize;
use serde_json::Value;

use crate::config::{parse, token_ids};
use crate::rope::{RopeParameters, RopeSpec};
use crate::{Error, Result};

/// The keys of a Gemma 3 text config as read from the file.
#[derive(Debug, Clone, Deserialize)]
struct RawGemma3 {
    vocab_size: usize,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    max_position_embeddings: usize,
    rms_norm_eps: f64,
    query_pre_attn_scalar: Option<f64>,
    sliding_window: Option<usize>,
    layer_types: Option<Vec<String>>,
    sliding_window_pattern: Option<usize>,
    rope_parameters: Option<Value>,
    rope_theta: Option<f64>,
    rope_local_base_freq: Option<f64>,
    rope_scaling: Option<RopeParameters>,
    final_logit_softcapping: Option<f64>,
    attn_logit_softcapping: Option<f64>,
    hidden_activation: Option<String>,
    #[serde(default)]
    attention_bias: bool,
    tie_word_embeddings: Option<bool>,
    use_bidirectional_attention: Option<bool>,
    eos_token_id: Option<Value>,
}

/// A Gemma 3 text model's shape and options.
#[derive(Debug, Clone, PartialEq)]
pub struct Gemma3Config {
    /// Token count.
    pub vocab_size: usize,
    /// Width of the residual stream.
    pub hidden_size: usize,
    /// Width of the GeGLU MLP.
    pub intermediate_size: usize,
    /// Decoder layers.
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// Key/value heads.
    pub num_key_value_heads: usize,
    /// Width of one head.
    pub head_dim: usize,
    /// Longest context.
    pub max_position_embeddings: usize,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f64,
    /// Scores are scaled by `query_pre_attn_scalar ** -0.5`.
    pub query_pre_attn_scalar: f64,
    /// The window of the sliding layers.
    pub sliding_window: usize,
    /// Which layers slide.
    pub sliding_layers: Vec<bool>,
    /// Rotary embedding of the sliding layers.
    pub rope_local: RopeSpec,
    /// Rotary embedding of the full-attention layers.
    pub rope_global: RopeSpec,
    /// `tanh(logits / c) * c` on the output logits.
    pub final_logit_softcapping: Option<f64>,
    /// `tanh(scores / c) * c` on the attention scores before the mask
    /// (Gemma 2's `attn_logit_softcapping`).
    pub attn_logit_softcapping: Option<f64>,
    /// 2 (`gemma2`: no q/k norms) or 3.
    pub version: u8,
    /// Biases on the attention projections.
    pub attention_bias: bool,
    /// Whether the head reuses the embedding table.
    pub tie_word_embeddings: bool,
    /// Token ids that end generation.
    pub eos_token_ids: Vec<u32>,
    /// The checkpoint's prefix of the text model (`model` for a text folder).
    pub prefix: String,
    /// LoRA adapters (see [`crate::ModelConfig::set_lora`]).
    pub lora: Option<LoraSpec>,
    /// Quantized linear layers (see [`crate::ModelConfig::set_quantization`]).
    pub quant: Option<QuantSpec>,
}

impl Gemma3Config {
    /// transformers' decoder layer class (`no_split_module_classes`, FSDP's wrap).
    pub fn layer_class(&self) -> &'static str {
        if self.version == 2 {
            "Gemma2DecoderLayer"
        } else {
            "Gemma3DecoderLayer"
        }
    }

    /// The embedding's class.
    pub fn embedding_class(&self) -> &'static str {
        if self.version == 2 {
            "Embedding"
        } else {
            "Gemma3TextScaledWordEmbedding"
        }
    }

    /// The final norm's class.
    pub fn norm_class(&self) -> &'static str {
        if self.version == 2 {
            "Gemma2RMSNorm"
        } else {
            "Gemma3RMSNorm"
        }
    }

    /// The config of a `gemma3_text` file, or the `text_config` of a
    /// `gemma3` (multimodal) one.
    pub(crate) fn from_value(path: &Path, value: Value) -> Result<Self> {
        let model_type = value
            .get("model_type")
            .and_then(Value::as_str)
            .unwrap_or("");
        let version = if model_type == "gemma2" { 2 } else { 3 };
        let multimodal = model_type == "gemma3";
        let text = if multimodal {
            value
                .get("text_config")
                .cloned()
                .ok_or_else(|| Error::MissingKey {
                    path: path.to_path_buf(),
                    key: "text_config".into(),
                })?
        } else {
            value
        };
        let raw: RawGemma3 = parse(path, text)?;
        let unsupported = |key: &str, reason: String| Error::Unsupported {
            path: path.to_path_buf(),
            key: key.into(),
            reason,
        };
        if let Some(c) = raw
            .attn_logit_softcapping
            .filter(|c| !(c.is_finite() && *c > 0.0))
        {
            return Err(unsupported(
                "attn_logit_softcapping",
                format!("{c}: must be a positive number"),
            ));
        }
        if raw.use_bidirectional_attention == Some(true) {
            return Err(unsupported(
                "use_bidirectional_attention",
                "true: only causal attention is implemented".into(),
            ));
        }
        if let Some(act) = raw
            .hidden_activation
            .as_deref()
            .filter(|a| *a != "gelu_pytorch_tanh")
        {
            return Err(unsupported(
                "hidden_activation",
                format!("{act:?}; Gemma uses gelu_pytorch_tanh"),
            ));
        }
        let heads = raw.num_attention_heads;
        let kv = raw.num_key_value_heads.unwrap_or(heads);
        if heads == 0 || kv == 0 || !heads.is_multiple_of(kv) {
            return Err(unsupported(
                "num_key_value_heads",
                format!("{kv} does not divide num_attention_heads {heads}"),
            ));
        }
        let head_dim = raw.head_dim.unwrap_or(256);
        let n = raw.num_hidden_layers;
        let sliding_layers: Vec<bool> = match (&raw.layer_types, raw.sliding_window_pattern) {
            (Some(types), _) => types
                .iter()
                .map(|t| match t.as_str() {
                    "sliding_attention" => Ok(true),
                    "full_attention" => Ok(false),
                    other => Err(unsupported("layer_types", format!("{other:?}"))),
                })
                .collect::<Result<_>>()?,
            // Gemma 2 without `layer_types`: even layers slide.
            (None, None) if version == 2 => (0..n).map(|i| (i + 1) % 2 == 1).collect(),
            // Older configs: every `pattern`-th layer is global.
            (None, p) => (0..n).map(|i| (i + 1) % p.unwrap_or(6) != 0).collect(),
        };
        if sliding_layers.len() != n {
            return Err(unsupported(
                "layer_types",
                format!("{} entries for {n} layers", sliding_layers.len()),
            ));
        }
        let dims = (head_dim, raw.max_position_embeddings);
        let (rope_local, rope_global) = match &raw.rope_parameters {
            // Gemma 2: one embedding for every layer.
            Some(one) if version == 2 => {
                let params: RopeParameters = parse(path, one.clone())?;
                let spec = RopeSpec::parse(
                    path,
                    "rope_parameters",
                    Some(&params),
                    dims,
                    (None, None, None),
                )?;
                (spec.clone(), spec)
            }
            None if version == 2 => {
                let spec = RopeSpec::parse(
                    path,
                    "rope_scaling",
                    raw.rope_scaling.as_ref(),
                    dims,
                    (Some(raw.rope_theta.unwrap_or(10_000.0)), None, None),
                )?;
                (spec.clone(), spec)
            }
            Some(Value::Object(per_type)) if per_type.contains_key("full_attention") => {
                let get = |k: &str| -> Result<Option<RopeParameters>> {
                    per_type.get(k).map(|v| parse(path, v.clone())).transpose()
                };
                let (local, global) = (get("sliding_attention")?, get("full_attention")?);
                (
                    RopeSpec::parse(
                        path,
                        "rope_parameters.sliding_attention",
                        local.as_ref(),
                        dims,
                        (None, None, None),
                    )?,
                    RopeSpec::parse(
                        path,
                        "rope_parameters.full_attention",
                        global.as_ref(),
                        dims,
                        (None, None, None),
                    )?,
                )
            }
            _ => (
                RopeSpec::parse(
                    path,
                    "rope_local_base_freq",
                    None,
                    dims,
                    (
                        Some(raw.rope_local_base_freq.unwrap_or(10_000.0)),
                        None,
                        None,
                    ),
                )?,
                RopeSpec::parse(
                    path,
                    "rope_scaling",
                    raw.rope_scaling.as_ref(),
                    dims,
                    (Some(raw.rope_theta.unwrap_or(1_000_000.0)), None, None),
                )?,
            ),
        };
        Ok(Self {
            vocab_size: raw.vocab_size,
            hidden_size: raw.hidden_size,
            intermediate_size: raw.intermediate_size,
            num_hidden_layers: n,
            num_attention_heads: heads,
            num_key_value_heads: kv,
            head_dim,
            max_position_embeddings: raw.max_position_embeddings,
            rms_norm_eps: raw.rms_norm_eps,
            query_pre_attn_scalar: raw.query_pre_attn_scalar.unwrap_or(256.0),
            sliding_window: raw.sliding_window.unwrap_or(4096),
            sliding_layers,
            rope_local,
            rope_global,
            final_logit_softcapping: raw.final_logit_softcapping,
            attn_logit_softcapping: raw.attn_logit_softcapping,
            version,
            attention_bias: raw.attention_bias,
            tie_word_embeddings: raw.tie_word_embeddings.unwrap_or(true),
            eos_token_ids: token_ids(raw.eos_token_id.as_ref()),
            prefix: if multimodal {
                "language_model.model"
            } else {
                "model"
            }
            .into(),
            lora: None,
            quant: None,
        })
    }
}
