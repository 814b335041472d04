//! `config.json` of the Llama-shaped decoders: Llama 2/3, Mistral, Qwen2,
//! Qwen3, Phi-3 / Phi-4-mini, Mixtral and Qwen3-MoE, which share the skeleton
//! (embeddings, pre-norm decoder layers with rotary grouped-query attention,
//! a final RMSNorm, the head) and differ in the parts of a layer.

use std::path::Path;

use accel_nn::layers::{Activation, LoraSpec, QuantSpec};
use serde::Deserialize;
use serde_json::Value;

use crate::config::{parse, token_ids};
use crate::rope::{RopeParameters, RopeSpec};
use crate::{Error, Result};

/// Which member of the family a [`LlamaConfig`] describes: it decides the
/// class names and the parts of a decoder layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LlamaFamily {
    /// `llama` (Llama 2 and 3).
    Llama,
    /// `mistral`.
    Mistral,
    /// `qwen2`: q/k/v projections always have biases.
    Qwen2,
    /// `qwen3`: per-head RMS norms on q and k.
    Qwen3,
    /// `phi3` (Phi-3, Phi-4-mini): fused `qkv_proj` and `gate_up_proj`.
    Phi3,
    /// `mixtral`: a sparse mixture of experts (`block_sparse_moe`) for the MLP.
    Mixtral,
    /// `qwen3_moe`: Qwen3's attention, sparse experts in `mlp`.
    Qwen3Moe,
}

impl LlamaFamily {
    /// transformers' decoder layer class, what `no_split_module_classes` and
    /// `fsdp_transformer_layer_cls_to_wrap` name.
    pub fn layer_class(self) -> &'static str {
        match self {
            LlamaFamily::Llama => "LlamaDecoderLayer",
            LlamaFamily::Mistral => "MistralDecoderLayer",
            LlamaFamily::Qwen2 => "Qwen2DecoderLayer",
            LlamaFamily::Qwen3 => "Qwen3DecoderLayer",
            LlamaFamily::Phi3 => "Phi3DecoderLayer",
            LlamaFamily::Mixtral => "MixtralDecoderLayer",
            LlamaFamily::Qwen3Moe => "Qwen3MoeDecoderLayer",
        }
    }

    /// transformers' RMSNorm class of the final norm.
    pub fn norm_class(self) -> &'static str {
        match self {
            LlamaFamily::Llama => "LlamaRMSNorm",
            LlamaFamily::Mistral => "MistralRMSNorm",
            LlamaFamily::Qwen2 => "Qwen2RMSNorm",
            LlamaFamily::Qwen3 => "Qwen3RMSNorm",
            LlamaFamily::Phi3 => "Phi3RMSNorm",
            LlamaFamily::Mixtral => "MixtralRMSNorm",
            LlamaFamily::Qwen3Moe => "Qwen3MoeRMSNorm",
        }
    }

    /// The `model_type` string.
    pub fn model_type(self) -> &'static str {
        match self {
            LlamaFamily::Llama => "llama",
            LlamaFamily::Mistral => "mistral",
            LlamaFamily::Qwen2 => "qwen2",
            LlamaFamily::Qwen3 => "qwen3",
            LlamaFamily::Phi3 => "phi3",
            LlamaFamily::Mixtral => "mixtral",
            LlamaFamily::Qwen3Moe => "qwen3_moe",
        }
    }

    /// The modules PEFT targets when none are named (its
    /// `TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING`).
    pub fn default_lora_targets(self) -> &'static [&'static str] {
        match self {
            LlamaFamily::Phi3 => &["qkv_proj"],
            _ => &["q_proj", "v_proj"],
        }
    }
}

/// A sparse mixture-of-experts MLP's settings.
#[derive(Debug, Clone, PartialEq)]
pub struct MoeConfig {
    /// Experts per sparse layer.
    pub num_experts: usize,
    /// Experts each token is routed to.
    pub top_k: usize,
    /// Width of one expert's MLP.
    pub intermediate_size: usize,
    /// Whether the top-k routing weights are renormalised to sum to one
    /// (always for Mixtral).
    pub norm_topk_prob: bool,
    /// Which layers are sparse (Qwen3-MoE's `decoder_sparse_step` and
    /// `mlp_only_layers`; the others have a dense MLP).
    pub sparse_layers: Vec<bool>,
    /// Weight of the load-balancing loss added to the loss.
    pub router_aux_loss_coef: f64,
    /// Whether the loss includes the load-balancing term
    /// (`output_router_logits`).
    pub output_router_logits: bool,
}

/// The keys of a Llama-family `config.json` as read from the file.
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
    partial_rotary_factor: Option<f64>,
    original_max_position_embeddings: Option<usize>,
    #[serde(default)]
    attention_bias: bool,
    #[serde(default)]
    mlp_bias: bool,
    #[serde(default)]
    tie_word_embeddings: bool,
    hidden_act: Option<Activation>,
    sliding_window: Option<usize>,
    use_sliding_window: Option<bool>,
    max_window_layers: Option<usize>,
    layer_types: Option<Vec<String>>,
    eos_token_id: Option<Value>,
    // Mixtral / Qwen3-MoE
    num_local_experts: Option<usize>,
    num_experts: Option<usize>,
    num_experts_per_tok: Option<usize>,
    moe_intermediate_size: Option<usize>,
    norm_topk_prob: Option<bool>,
    decoder_sparse_step: Option<usize>,
    #[serde(default)]
    mlp_only_layers: Vec<usize>,
    router_aux_loss_coef: Option<f64>,
    #[serde(default)]
    output_router_logits: bool,
    router_jitter_noise: Option<f64>,
}

/// A Llama-family model's shape and options.
#[derive(Debug, Clone, PartialEq)]
pub struct LlamaConfig {
    /// Which member of the family.
    pub family: LlamaFamily,
    /// Token count of the embedding and lm_head.
    pub vocab_size: usize,
    /// Width of the residual stream.
    pub hidden_size: usize,
    /// Width of the dense SwiGLU MLP.
    pub intermediate_size: usize,
    /// Number of decoder layers.
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// Key/value heads (fewer than query heads: grouped-query attention).
    pub num_key_value_heads: usize,
    /// Width of one head.
    pub head_dim: usize,
    /// Longest context.
    pub max_position_embeddings: usize,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f64,
    /// The rotary embedding (base, rotated dims, scaling).
    pub rope: RopeSpec,
    /// Biases on q/k/v (Qwen2 always; `attention_bias` elsewhere).
    pub qkv_bias: bool,
    /// Bias on o_proj (`attention_bias` of Llama and Qwen3).
    pub o_bias: bool,
    /// Biases in the MLP (Llama's `mlp_bias`).
    pub mlp_bias: bool,
    /// Per-head RMS norms on q and k (Qwen3).
    pub qk_norm: bool,
    /// Whether lm_head reuses `model.embed_tokens.weight`.
    pub tie_word_embeddings: bool,
    /// The sliding attention window, for the layers `sliding_layers` marks.
    pub sliding_window: Option<usize>,
    /// Which layers attend within the window.
    pub sliding_layers: Vec<bool>,
    /// Sparse mixture-of-experts MLPs (Mixtral, Qwen3-MoE).
    pub moe: Option<MoeConfig>,
    /// Token ids that end generation (`eos_token_id`, one or a list).
    pub eos_token_ids: Vec<u32>,
    /// LoRA adapters to build on the linear layers (not in `config.json`;
    /// see [`crate::ModelConfig::set_lora`]).
    pub lora: Option<LoraSpec>,
    /// How quantized linear layers compute (`quantization_config`, see
    /// [`crate::ModelConfig::set_quantization`]).
    pub quant: Option<QuantSpec>,
}

impl LlamaConfig {
    /// The window layer `i` attends within, if any.
    pub fn window_of(&self, i: usize) -> Option<usize> {
        self.sliding_window
            .filter(|_| self.sliding_layers.get(i).copied().unwrap_or(false))
    }

    /// Reads the config of `family` from the parsed file at `path`.
    pub(crate) fn from_value(path: &Path, family: LlamaFamily, value: Value) -> Result<Self> {
        let raw: RawLlama = parse(path, value)?;
        Self::from_raw(path, family, raw)
    }

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
        let (key, params) = match (&raw.rope_parameters, &raw.rope_scaling) {
            (Some(p), _) => ("rope_parameters", Some(p)),
            (None, s) => ("rope_scaling", s.as_ref()),
        };
        let rope = RopeSpec::parse(
            path,
            key,
            params,
            (head_dim, raw.max_position_embeddings),
            (
                raw.rope_theta,
                raw.partial_rotary_factor,
                raw.original_max_position_embeddings,
            ),
        )?;
        if let Some(j) = raw.router_jitter_noise.filter(|j| *j != 0.0) {
            return Err(unsupported(
                "router_jitter_noise",
                format!("{j}: routing noise in training is not implemented; set it to 0"),
            ));
        }
        let n = raw.num_hidden_layers;
        let sliding_layers = sliding_layers(path, family, &raw)?;
        let moe = moe_config(family, &raw, n);
        let (qkv_bias, o_bias) = match family {
            LlamaFamily::Qwen2 => (true, false),
            LlamaFamily::Llama | LlamaFamily::Qwen3 | LlamaFamily::Qwen3Moe => {
                (raw.attention_bias, raw.attention_bias)
            }
            LlamaFamily::Mistral | LlamaFamily::Phi3 | LlamaFamily::Mixtral => (false, false),
        };
        Ok(Self {
            family,
            vocab_size: raw.vocab_size,
            hidden_size: raw.hidden_size,
            intermediate_size: raw.intermediate_size,
            num_hidden_layers: n,
            num_attention_heads: heads,
            num_key_value_heads: kv_heads,
            head_dim,
            max_position_embeddings: raw.max_position_embeddings,
            rms_norm_eps: raw.rms_norm_eps,
            rope,
            qkv_bias,
            o_bias,
            mlp_bias: family == LlamaFamily::Llama && raw.mlp_bias,
            qk_norm: matches!(family, LlamaFamily::Qwen3 | LlamaFamily::Qwen3Moe),
            tie_word_embeddings: raw.tie_word_embeddings,
            sliding_window: raw
                .sliding_window
                .filter(|_| sliding_layers.contains(&true)),
            sliding_layers,
            moe,
            eos_token_ids: token_ids(raw.eos_token_id.as_ref()),
            lora: None,
            quant: None,
        })
    }
}

/// Which layers use the sliding window: `layer_types` where the config has
/// it; else every layer for Mistral, Mixtral and Phi-3 when a window is
/// set, and for the Qwen models the layers from `max_window_layers` on when
/// `use_sliding_window` is set (transformers' defaults).
fn sliding_layers(path: &Path, family: LlamaFamily, raw: &RawLlama) -> Result<Vec<bool>> {
    let n = raw.num_hidden_layers;
    if raw.sliding_window.is_none() {
        return Ok(vec![false; n]);
    }
    if let Some(types) = &raw.layer_types {
        if types.len() != n {
            return Err(Error::Unsupported {
                path: path.to_path_buf(),
                key: "layer_types".into(),
                reason: format!("{} entries for {n} layers", types.len()),
            });
        }
        return types
            .iter()
            .map(|t| match t.as_str() {
                "full_attention" => Ok(false),
                "sliding_attention" => Ok(true),
                other => Err(Error::Unsupported {
                    path: path.to_path_buf(),
                    key: "layer_types".into(),
                    reason: format!("{other:?}; supported: full_attention, sliding_attention"),
                }),
            })
            .collect();
    }
    Ok(match family {
        LlamaFamily::Llama => vec![false; n],
        LlamaFamily::Mistral | LlamaFamily::Mixtral | LlamaFamily::Phi3 => vec![true; n],
        LlamaFamily::Qwen2 | LlamaFamily::Qwen3 | LlamaFamily::Qwen3Moe => {
            let on = raw.use_sliding_window == Some(true);
            let from = raw.max_window_layers.unwrap_or(28);
            (0..n).map(|i| on && i >= from).collect()
        }
    })
}

/// The experts of Mixtral (every layer sparse, top-k always renormalised)
/// and Qwen3-MoE (`decoder_sparse_step`, `mlp_only_layers`, `norm_topk_prob`).
fn moe_config(family: LlamaFamily, raw: &RawLlama, n: usize) -> Option<MoeConfig> {
    match family {
        LlamaFamily::Mixtral => Some(MoeConfig {
            num_experts: raw.num_local_experts.unwrap_or(8),
            top_k: raw.num_experts_per_tok.unwrap_or(2),
            intermediate_size: raw.intermediate_size,
            norm_topk_prob: true,
            sparse_layers: vec![true; n],
            router_aux_loss_coef: raw.router_aux_loss_coef.unwrap_or(0.001),
            output_router_logits: raw.output_router_logits,
        }),
        LlamaFamily::Qwen3Moe => {
            // transformers 5 writes `num_local_experts`; Hub configs `num_experts`.
            let experts = raw.num_experts.or(raw.num_local_experts).unwrap_or(128);
            let step = raw.decoder_sparse_step.unwrap_or(1).max(1);
            Some(MoeConfig {
                num_experts: experts,
                top_k: raw.num_experts_per_tok.unwrap_or(8),
                intermediate_size: raw.moe_intermediate_size.unwrap_or(768),
                norm_topk_prob: raw.norm_topk_prob.unwrap_or(false),
                sparse_layers: (0..n)
                    .map(|i| {
                        !raw.mlp_only_layers.contains(&i) && experts > 0 && (i + 1) % step == 0
                    })
                    .collect(),
                router_aux_loss_coef: raw.router_aux_loss_coef.unwrap_or(0.001),
                output_router_logits: raw.output_router_logits,
            })
        }
        _ => None,
    }
}
