//! Inference through the models whose candle-nn or candle-transformers code accel-rs patched, with
//! fixed weights (a function of each tensor's name), printing their outputs as JSON lines. It uses
//! candle alone, so that `scripts/zoo_unpatched_outputs.sh` can build it against candle-nn and
//! candle-transformers as published and write `tests/fixtures/zoo/unpatched_outputs.jsonl`; the
//! user crate runs it (`--infer`) on the patched crates, and `tests/tests/user_crate.rs` compares.
//!
//! Decoders with a KV cache (and Marian's decoder) run a prompt, then one more token through the
//! cache. Models whose
//! patch added an API (NV-Embed-v2's `new_with_config`, Yi's and MPT's deserializable configs) or
//! that read weights without a shape (RWKV v7) are not here: the published crates cannot build
//! them this way.

use anyhow::Result;
use candle_core::{DType, Device, IndexOp, Module, Shape, Tensor};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::VarBuilder;
use candle_transformers::models::{
    bert, bigcode, chatglm, debertav2, distilbert, gemma3, glm4_new, jina_bert, llama, llama2_c,
    mamba, marian, mixtral, modernbert, phi, qwen2_moe, qwen3, qwen3_moe, stella_en_v5, t5,
};
use serde_json::json;

/// The models this file runs, in order.
pub const MODELS: [&str; 21] = [
    "bert",
    "distilbert",
    "modernbert",
    "jina_bert",
    "debertav2",
    "stella_en_v5",
    "llama",
    "qwen3",
    "qwen3_moe",
    "gemma3",
    "mixtral",
    "qwen2_moe",
    "phi",
    "chatglm",
    "glm4_new",
    "glm4_new_one",
    "bigcode",
    "llama2_c",
    "mamba",
    "t5",
    "marian",
];

/// The attention and MLP shapes the newer decoders share.
pub fn decoder_json() -> serde_json::Value {
    json!({
        "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
        "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "hidden_act": "silu", "attention_bias": false, "tie_word_embeddings": false,
        "sliding_window": null, "max_window_layers": 2, "use_sliding_window": false
    })
}

/// `base` with the keys of `extra` set.
pub fn with(mut base: serde_json::Value, extra: serde_json::Value) -> serde_json::Value {
    for (k, v) in extra.as_object().expect("an object") {
        base[k] = v.clone();
    }
    base
}

/// The tiny config of `which` as its `config.json` would hold it, for the models both the sweep
/// and this file build.
///
/// # Panics
/// For a model not listed here.
pub fn model_config(which: &str) -> serde_json::Value {
    match which {
        "distilbert" => json!({
            "vocab_size": 64, "dim": 32, "n_layers": 2, "n_heads": 4, "hidden_dim": 64,
            "activation": "gelu", "max_position_embeddings": 32,
            "initializer_range": 0.02, "pad_token_id": 0
        }),
        "modernbert" => json!({
            "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2,
            "num_attention_heads": 4, "intermediate_size": 64,
            "max_position_embeddings": 32, "layer_norm_eps": 1e-5, "pad_token_id": 0,
            "global_attn_every_n_layers": 2, "global_rope_theta": 160000.0,
            "local_attention": 4, "local_rope_theta": 10000.0
        }),
        "jina_bert" => json!({
            "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2,
            "num_attention_heads": 4, "intermediate_size": 64, "hidden_act": "gelu",
            "max_position_embeddings": 32, "type_vocab_size": 2, "initializer_range": 0.02,
            "layer_norm_eps": 1e-12, "pad_token_id": 0, "position_embedding_type": "alibi"
        }),
        "debertav2" => json!({
            "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2,
            "num_attention_heads": 4, "intermediate_size": 64, "hidden_act": "gelu",
            "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0,
            "max_position_embeddings": 32, "type_vocab_size": 0, "initializer_range": 0.02,
            "layer_norm_eps": 1e-7, "relative_attention": true, "max_relative_positions": -1,
            "pad_token_id": 0, "position_biased_input": false,
            "pos_att_type": ["p2c", "c2p"], "position_buckets": 16, "share_att_key": true,
            "attention_head_size": null, "embedding_size": null,
            "norm_rel_ebd": "layer_norm", "conv_kernel_size": null, "conv_groups": null,
            "conv_act": null, "id2label": {"0": "no", "1": "yes"}, "label2id": null,
            "pooler_dropout": 0.0, "pooler_hidden_act": "gelu", "pooler_hidden_size": 32,
            "cls_dropout": 0.0
        }),
        "stella_en_v5" => json!({
            "variant": "Large", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 64,
            "rope_theta": 10000.0, "embed_head": {"in_features": 32, "out_features": 16},
            "norm_eps": 1e-6, "activation_fn": "silu", "num_key_value_heads": 2,
            "type_vocab_size": 0, "scaling_factor": 0.0
        }),
        "qwen3_moe" => with(
            decoder_json(),
            json!({"decoder_sparse_step": 1, "moe_intermediate_size": 32,
                   "num_experts_per_tok": 2, "num_experts": 4, "norm_topk_prob": true}),
        ),
        "gemma3" => with(
            decoder_json(),
            json!({"hidden_activation": "gelu_pytorch_tanh", "rope_local_base_freq": 10000.0,
                   "final_logit_softcapping": 30.0, "attn_logit_softcapping": null,
                   "query_pre_attn_scalar": 8, "sliding_window": 8,
                   "sliding_window_pattern": 2}),
        ),
        "mixtral" => with(
            decoder_json(),
            json!({"sliding_window": 64, "num_experts_per_tok": 2,
                   "num_local_experts": 4, "use_flash_attn": false}),
        ),
        "qwen2_moe" => with(
            decoder_json(),
            json!({"sliding_window": 64, "decoder_sparse_step": 1,
                   "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
                   "num_experts_per_tok": 2, "num_experts": 4,
                   "norm_topk_prob": false}),
        ),
        "phi" => with(
            decoder_json(),
            json!({"hidden_act": "gelu_new", "layer_norm_eps": 1e-5,
                   "partial_rotary_factor": 0.5, "qk_layernorm": false}),
        ),
        "glm4_new" => with(
            decoder_json(),
            json!({"partial_rotary_factor": 0.5, "attention_bias": true,
                   "eos_token_id": null}),
        ),
        "mamba" => {
            json!({"d_model": 32, "n_layer": 2, "vocab_size": 64, "pad_vocab_size_multiple": 8})
        }
        "t5" => json!({
            "vocab_size": 64, "d_model": 32, "d_kv": 8, "d_ff": 64, "num_layers": 2,
            "num_decoder_layers": 2, "num_heads": 4, "relative_attention_num_buckets": 8,
            "dropout_rate": 0.0, "layer_norm_epsilon": 1e-6, "initializer_factor": 1.0,
            "feed_forward_proj": "relu", "tie_word_embeddings": false,
            "is_encoder_decoder": true, "pad_token_id": 0, "eos_token_id": 1,
            "decoder_start_token_id": 0
        }),
        "marian" => json!({
            "vocab_size": 64, "decoder_vocab_size": 64, "max_position_embeddings": 64,
            "encoder_layers": 2, "encoder_ffn_dim": 64, "encoder_attention_heads": 4,
            "decoder_layers": 2, "decoder_ffn_dim": 64, "decoder_attention_heads": 4,
            "use_cache": true, "is_encoder_decoder": true, "activation_function": "swish",
            "d_model": 32, "decoder_start_token_id": 63, "scale_embedding": true,
            "pad_token_id": 63, "eos_token_id": 0, "forced_eos_token_id": 0,
            "share_encoder_decoder_embeddings": true
        }),
        other => panic!("{other}: no config in infer.rs"),
    }
}

/// ChatGLM3's layout at a tiny size (its `Config` has no serde: built field by field).
pub fn chatglm_config() -> chatglm::Config {
    chatglm::Config {
        num_layers: 2,
        padded_vocab_size: 64,
        hidden_size: 32,
        ffn_hidden_size: 64,
        kv_channels: 8,
        num_attention_heads: 4,
        seq_length: 64,
        layernorm_epsilon: 1e-5,
        rmsnorm: true,
        apply_residual_connection_post_layernorm: false,
        post_layer_norm: true,
        add_bias_linear: false,
        add_qkv_bias: true,
        bias_dropout_fusion: true,
        multi_query_attention: true,
        multi_query_group_num: 2,
        apply_query_key_layer_scaling: true,
        attention_softmax_in_fp32: true,
        fp32_residual_connection: false,
    }
}

/// llama2.c's layout at a tiny size.
pub fn llama2_c_config() -> llama2_c::Config {
    llama2_c::Config {
        dim: 32,
        hidden_dim: 64,
        n_layers: 2,
        n_heads: 4,
        n_kv_heads: 2,
        vocab_size: 64,
        seq_len: 32,
        norm_eps: 1e-5,
    }
}

/// GPT-BigCode (StarCoder 1) at a tiny size: multi-query attention, learned positions, tied head.
pub fn bigcode_config(use_cache: bool) -> bigcode::Config {
    bigcode::Config {
        vocab_size: 64,
        max_position_embeddings: 64,
        num_hidden_layers: 2,
        hidden_size: 32,
        layer_norm_epsilon: 1e-5,
        n_inner: Some(64),
        num_attention_heads: 4,
        multi_query: true,
        use_cache,
    }
}

pub fn bert_config() -> Result<bert::Config> {
    Ok(serde_json::from_value(json!({
        "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
        "intermediate_size": 64, "hidden_act": "gelu", "hidden_dropout_prob": 0.0,
        "max_position_embeddings": 32, "type_vocab_size": 2, "initializer_range": 0.02,
        "layer_norm_eps": 1e-12, "pad_token_id": 0
    }))?)
}

pub fn llama_config() -> Result<llama::Config> {
    let c: llama::LlamaConfig = serde_json::from_value(json!({
        "hidden_size": 32, "intermediate_size": 64, "vocab_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 64, "tie_word_embeddings": false
    }))?;
    Ok(c.into_config(false))
}

/// Weights that are a function of the tensor's name and shape: uniform in [-0.2, 0.2), the same
/// whichever crate asks, in whatever order.
struct Named;

impl SimpleBackend for Named {
    fn get(
        &self,
        s: Shape,
        name: &str,
        _: candle_nn::Init,
        dtype: DType,
        dev: &Device,
    ) -> candle_core::Result<Tensor> {
        let seed = name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
        });
        let values: Vec<f32> = (0..s.elem_count() as u64)
            .map(|i| {
                let x = (seed ^ i.wrapping_mul(0x9e37_79b9_7f4a_7c15))
                    .wrapping_mul(0xbf58_476d_1ce4_e5b9);
                ((x >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.4
            })
            .collect();
        Tensor::from_vec(values, s, dev)?.to_dtype(dtype)
    }

    fn get_unchecked(&self, name: &str, _: DType, _: &Device) -> candle_core::Result<Tensor> {
        candle_core::bail!("{name}: asked for without a shape")
    }

    fn contains_tensor(&self, _: &str) -> bool {
        true
    }
}

/// Prints one JSON line per model of `only` (every model when empty) and dtype: its outputs, or
/// the error its forward gave.
pub fn run(only: &[String]) -> Result<()> {
    let dev = Device::Cpu;
    for which in MODELS {
        if !only.is_empty() && !only.iter().any(|o| o == which) {
            continue;
        }
        for dtype in [DType::F32, DType::BF16] {
            let vb = VarBuilder::from_backend(Box::new(Named), dtype, dev.clone());
            let line = match outputs(which, vb, &dev) {
                Ok(outs) => {
                    let outs: Vec<serde_json::Value> = outs
                        .iter()
                        .map(|t| Ok(digest(&t.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?)))
                        .collect::<Result<_>>()?;
                    json!({"model": which, "dtype": format!("{dtype:?}"), "outputs": outs})
                }
                Err(e) => {
                    let first = e.to_string().lines().next().unwrap_or_default().to_string();
                    json!({"model": which, "dtype": format!("{dtype:?}"), "error": first})
                }
            };
            println!("{line}");
        }
    }
    Ok(())
}

/// An output as the comparison needs it: its length, an FNV-1a hash of its values' bits (equal
/// hashes: equal bits), whether every value is finite, and its first values to read.
fn digest(values: &[f32]) -> serde_json::Value {
    let hash = values
        .iter()
        .flat_map(|v| v.to_bits().to_le_bytes())
        .fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
        });
    json!({
        "len": values.len(),
        "bits_fnv1a": format!("{hash:016x}"),
        "finite": values.iter().all(|v| v.is_finite()),
        "head": values.iter().take(4).map(|v| v.to_string()).collect::<Vec<_>>(),
    })
}

/// The outputs of `which` in inference: hidden states or logits, a prompt's then (decoders with
/// a cache) one more token's.
fn outputs(which: &str, vb: VarBuilder<'static>, dev: &Device) -> Result<Vec<Tensor>> {
    let ids = Tensor::new(&[[5u32, 9, 13, 21, 34, 2], [7, 11, 17, 29, 0, 0]], dev)?;
    let mask = Tensor::new(&[[1u32, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]], dev)?;
    let long: Vec<u32> = (0..32u32).map(|i| (i * 7 + 3) % 64).collect();
    let long = Tensor::from_vec(long, (2, 16), dev)?;
    let one = Tensor::new(&[[3u32], [8]], dev)?;
    Ok(match which {
        "bert" => {
            let m = bert::BertModel::load(vb.pp("bert"), &bert_config()?)?;
            vec![m.forward(&ids, &ids.zeros_like()?, Some(&mask))?]
        }
        "distilbert" => {
            let cfg: distilbert::Config = serde_json::from_value(model_config("distilbert"))?;
            let m = distilbert::DistilBertModel::load(vb.pp("distilbert"), &cfg)?;
            let hide = (1.0 - mask.to_dtype(DType::F32)?)?
                .to_dtype(DType::U8)?
                .reshape((2, 1, 1, 6))?;
            vec![m.forward(&ids, &hide)?]
        }
        "modernbert" => {
            let cfg: modernbert::Config = serde_json::from_value(model_config("modernbert"))?;
            vec![modernbert::ModernBert::load(vb.pp("model"), &cfg)?.forward(&ids, &mask)?]
        }
        "jina_bert" => {
            let cfg: jina_bert::Config = serde_json::from_value(model_config("jina_bert"))?;
            vec![jina_bert::BertModel::new(vb.pp("model"), &cfg)?.forward(&long)?]
        }
        "debertav2" => {
            let cfg: debertav2::Config = serde_json::from_value(model_config("debertav2"))?;
            let m = debertav2::DebertaV2SeqClassificationModel::load(vb.pp("deberta"), &cfg, None)?;
            vec![m.forward(&long, None, None)?]
        }
        "stella_en_v5" => {
            let cfg: stella_en_v5::Config = serde_json::from_value(model_config("stella_en_v5"))?;
            let mut m = stella_en_v5::EmbeddingModel::new(&cfg, vb.clone(), vb.pp("embed_head"))?;
            vec![m.forward(&ids, &mask)?]
        }
        "llama" => {
            let cfg = llama_config()?;
            let m = llama::Llama::load(vb.clone(), &cfg)?;
            let mut cache = llama::Cache::new(true, vb.dtype(), &cfg, dev)?;
            vec![
                m.forward(&ids, 0, &mut cache)?,
                m.forward(&one, 6, &mut cache)?,
            ]
        }
        "qwen3" => {
            let cfg: qwen3::Config = serde_json::from_value(decoder_json())?;
            let mut m = qwen3::ModelForCausalLM::new(&cfg, vb)?;
            vec![m.forward(&long, 0)?, m.forward(&one, 16)?]
        }
        "qwen3_moe" => {
            let cfg: qwen3_moe::Config = serde_json::from_value(model_config("qwen3_moe"))?;
            let mut m = qwen3_moe::ModelForCausalLM::new(&cfg, vb)?;
            vec![m.forward(&long, 0)?, m.forward(&one, 16)?]
        }
        "gemma3" => {
            // A window of 8 below the 16 tokens: the sliding layers' rotating cache.
            let cfg: gemma3::Config = serde_json::from_value(model_config("gemma3"))?;
            let mut m = gemma3::Model::new(false, &cfg, vb)?;
            vec![m.forward(&long, 0)?, m.forward(&one, 16)?]
        }
        "mixtral" => {
            let cfg: mixtral::Config = serde_json::from_value(model_config("mixtral"))?;
            let mut m = mixtral::Model::new(&cfg, vb)?;
            vec![m.forward(&long, 0)?, m.forward(&one, 16)?]
        }
        "qwen2_moe" => {
            let cfg: qwen2_moe::Config = serde_json::from_value(model_config("qwen2_moe"))?;
            let mut m = qwen2_moe::Model::new(&cfg, vb)?;
            vec![m.forward(&long, 0)?, m.forward(&one, 16)?]
        }
        "phi" => {
            let cfg: phi::Config = serde_json::from_value(model_config("phi"))?;
            let mut m = phi::Model::new(&cfg, vb)?;
            vec![m.forward(&long)?, m.forward(&one)?]
        }
        "chatglm" => {
            let cfg = chatglm_config();
            let mut m = chatglm::Model::new(&cfg, vb)?;
            vec![m.forward(&long)?, m.forward(&one)?]
        }
        "glm4_new" | "glm4_new_one" => {
            let cfg: glm4_new::Config = serde_json::from_value(model_config("glm4_new"))?;
            let mut m = glm4_new::ModelForCausalLM::new(&cfg, vb)?;
            // One sequence too: the published rotary took the batch's first sequence only,
            // so only a batch of one runs there.
            let rows = if which == "glm4_new" { 2 } else { 1 };
            let prompt = m.forward(&long.narrow(0, 0, rows)?, 0)?;
            vec![prompt, m.forward(&one.narrow(0, 0, rows)?, 16)?]
        }
        "bigcode" => {
            let cfg = bigcode_config(true);
            let mut m = bigcode::GPTBigCode::load(vb, cfg)?;
            vec![m.forward(&long, 0)?, m.forward(&one, 16)?]
        }
        "llama2_c" => {
            let cfg = llama2_c_config();
            // The rotary tables computed, not read: an empty VarBuilder for them.
            let tables = VarBuilder::from_tensors(Default::default(), DType::F32, dev);
            let mut cache = llama2_c::Cache::new(true, &cfg, tables)?;
            let m = llama2_c::Llama::load(vb, cfg)?;
            let prompt = m.forward(&long, 0, &mut cache)?.i((.., 15))?;
            vec![prompt, m.forward(&one, 16, &mut cache)?]
        }
        "mamba" => {
            let cfg: mamba::Config = serde_json::from_value(model_config("mamba"))?;
            let m = mamba::Model::new(&cfg, vb.clone())?;
            // One sequence: the published scan broadcasts its state for one only.
            let mut state = mamba::State::new(1, &cfg, vb.dtype(), dev)?;
            let mut outs = vec![];
            for t in 0..8 {
                outs.push(m.forward(&long.i((0..1, t))?.contiguous()?, &mut state)?);
            }
            outs
        }
        "t5" => {
            let cfg: t5::Config = serde_json::from_value(model_config("t5"))?;
            let mut m = t5::T5ForConditionalGeneration::load(vb, &cfg)?;
            let decoder_ids = Tensor::new(&[[0u32, 5, 9], [0, 7, 11]], dev)?;
            vec![m.forward(&ids, &decoder_ids)?]
        }
        "marian" => {
            let cfg: marian::Config = serde_json::from_value(model_config("marian"))?;
            let mut m = marian::MTModel::new(&cfg, vb)?;
            let encoded = m.encoder().forward(&long, 0)?;
            let start = Tensor::new(&[[63u32, 5, 9], [63, 7, 11]], dev)?;
            let logits = m.decode(&start, &encoded, 0)?;
            vec![encoded.clone(), logits, m.decode(&one, &encoded, 3)?]
        }
        other => anyhow::bail!("{other}: not a model of infer.rs"),
    })
}
