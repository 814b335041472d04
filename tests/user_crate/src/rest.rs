//! More of candle-transformers' text zoo: MixFormer (Phi-1.5), Stella v5, Nomic BERT, Jina BERT,
//! ChatGLM3, GLM-4 (new layout), CodeGeeX4, LFM2 (short convolutions), GPT-BigCode, llama2.c,
//! RecurrentGemma (RG-LRU scan) and Granite-MoE-Hybrid, each built with tiny shapes as a user
//! would.

use accel_core::Accelerator;
use anyhow::Result;
use candle_core::{DType, Device, IndexOp, Module, Tensor, D};
use candle_nn::{VarBuilder, VarMap};
use candle_transformers::models::{
    bigcode, chatglm, codegeex4_9b, glm4_new, granitemoehybrid, jina_bert, lfm2, llama2_c, mistral,
    mixformer, nomic_bert, nvembed_v2, recurrent_gemma, stella_en_v5,
};
use serde_json::json;
use std::cell::RefCell;

use super::{
    bigcode_config, chatglm_config, decoder_json, last_loss, llama2_c_config, model_config, with,
    Forward,
};

/// Mean-pooled hidden states (`[b, s, 32]`) through `head`, cross-entropy against `labels`.
fn pooled_loss(
    hidden: &Tensor,
    mask: &Tensor,
    head: &candle_nn::Linear,
    labels: &Tensor,
) -> Result<Tensor> {
    let m = mask.to_dtype(hidden.dtype())?.unsqueeze(D::Minus1)?;
    let pooled = hidden
        .broadcast_mul(&m)?
        .sum(1)?
        .broadcast_div(&m.sum(1)?)?;
    let logits = head.forward(&pooled)?.to_dtype(DType::F32)?;
    Ok(candle_nn::loss::cross_entropy(&logits, labels)?)
}

/// Cross-entropy of `[b, vocab]` logits against `next`.
fn loss(logits: Tensor, next: &Tensor) -> Result<Tensor> {
    Ok(candle_nn::loss::cross_entropy(
        &logits.to_dtype(DType::F32)?,
        next,
    )?)
}

/// The training closure of `which`, or `None` for a model this file does not build.
pub fn forward(
    which: &str,
    vb: VarBuilder<'static>,
    _varmap: &VarMap,
    dev: &Device,
) -> Result<Option<Forward>> {
    let long: Vec<u32> = (0..32u32).map(|i| (i * 7 + 3) % 64).collect();
    let long = Tensor::from_vec(long, (2, 16), dev)?;
    let next = Tensor::new(&[3u32, 8], dev)?;
    let labels = Tensor::new(&[1u32, 0], dev)?;
    let mask = Tensor::ones((2, 16), DType::U32, dev)?;
    let glm = json!({
        "num_layers": 2, "padded_vocab_size": 64, "hidden_size": 32, "ffn_hidden_size": 64,
        "kv_channels": 8, "num_attention_heads": 4, "seq_length": 64,
        "layernorm_epsilon": 1e-5, "rmsnorm": true,
        "apply_residual_connection_post_layernorm": false, "post_layer_norm": true,
        "add_bias_linear": false, "add_qkv_bias": true, "bias_dropout_fusion": true,
        "multi_query_attention": true, "multi_query_group_num": 2,
        "apply_query_key_layer_scaling": true, "attention_softmax_in_fp32": true,
        "fp32_residual_connection": false, "rope_ratio": 1
    });
    Ok(Some(match which {
        "mixformer" => {
            // Phi-1.5's MixFormerSequentialForCausalLM: parallel blocks, fused qkv, partial rotary.
            let cfg: mixformer::Config = serde_json::from_value(json!({
                "vocab_size": 64, "n_positions": 64, "n_embd": 32, "n_layer": 2, "n_inner": 64,
                "n_head": 4, "rotary_dim": 4, "activation_function": "gelu",
                "layer_norm_epsilon": 1e-5, "tie_word_embeddings": false,
                "pad_vocab_size_multiple": 8
            }))?;
            let m = RefCell::new(mixformer::MixFormerSequentialForCausalLM::new(&cfg, vb)?);
            Box::new(move |_: &Accelerator| {
                let mut m = m.borrow_mut();
                m.clear_kv_cache();
                loss(m.forward(&long)?, &next)
            })
        }
        "stella_en_v5" => {
            // The 1.5B layout (Qwen2 without causal mask) and its embedding head; the
            // embedding's 16 dimensions scored as classes.
            let cfg: stella_en_v5::Config = serde_json::from_value(model_config("stella_en_v5"))?;
            let m = RefCell::new(stella_en_v5::EmbeddingModel::new(
                &cfg,
                vb.clone(),
                vb.pp("embed_head"),
            )?);
            Box::new(move |_: &Accelerator| loss(m.borrow_mut().forward(&long, &mask)?, &labels))
        }
        "nvembed_v2" => {
            // NV-Embed-v2's layout at a tiny size: a bidirectional Mistral, latent-attention
            // pooling (4 latents, 2 heads of 8), the mean-pooled embedding scored as 2 classes.
            let cfg: mistral::Config = serde_json::from_value(with(
                decoder_json(),
                json!({"use_flash_attn": false, "head_dim": null}),
            ))?;
            let latent = nvembed_v2::model::LatentConfig {
                num_latents: 4,
                heads: 2,
                dim_head: 8,
            };
            let m = RefCell::new(nvembed_v2::model::Model::new_with_config(
                &cfg,
                latent,
                vb.clone(),
            )?);
            let head = candle_nn::linear(32, 2, vb.pp("classifier"))?;
            let pool = mask.to_dtype(vb.dtype())?;
            Box::new(move |_: &Accelerator| {
                let emb = m.borrow_mut().forward(&long, &mask, &pool)?;
                let logits = head.forward(&emb)?.to_dtype(DType::F32)?;
                Ok(candle_nn::loss::cross_entropy(&logits, &labels)?)
            })
        }
        "nomic_bert" => {
            let cfg: nomic_bert::Config = serde_json::from_value(json!({
                "vocab_size": 64, "n_embd": 32, "n_head": 4, "n_layer": 2, "n_inner": 64,
                "n_positions": 32, "type_vocab_size": 2, "layer_norm_epsilon": 1e-12,
                "rotary_emb_fraction": 1.0, "rotary_emb_base": 1000.0,
                "rotary_emb_interleaved": false, "qkv_proj_bias": false, "mlp_fc1_bias": false,
                "mlp_fc2_bias": false, "activation_function": "swiglu", "prenorm": false,
                "model_type": null
            }))?;
            let m = nomic_bert::NomicBertModel::load(vb.pp("model"), &cfg)?;
            let head = candle_nn::linear(32, 2, vb.pp("classifier"))?;
            // The second sequence padded at its last 4 positions.
            let mask: Vec<u32> = (0..32).map(|i| u32::from(i < 28)).collect();
            let mask = Tensor::from_vec(mask, (2, 16), dev)?;
            Box::new(move |_: &Accelerator| {
                let hidden = m.forward(&long, None, Some(&mask))?;
                pooled_loss(&hidden, &mask, &head, &labels)
            })
        }
        "jina_bert" => {
            // ALiBi instead of position embeddings, a gated (GLU) MLP.
            let cfg: jina_bert::Config = serde_json::from_value(model_config("jina_bert"))?;
            let m = jina_bert::BertModel::new(vb.pp("model"), &cfg)?;
            let head = candle_nn::linear(32, 2, vb.pp("classifier"))?;
            Box::new(move |_: &Accelerator| pooled_loss(&m.forward(&long)?, &mask, &head, &labels))
        }
        "chatglm" => {
            // ChatGLM3: the GLM-4 layout; its `Config` is built field by field (no serde).
            let cfg = chatglm_config();
            let m = RefCell::new(chatglm::Model::new(&cfg, vb)?);
            Box::new(move |_: &Accelerator| {
                let mut m = m.borrow_mut();
                m.reset_kv_cache();
                loss(m.forward(&long)?, &next)
            })
        }
        "codegeex4_9b" => {
            let cfg: codegeex4_9b::Config = serde_json::from_value(glm)?;
            let m = RefCell::new(codegeex4_9b::Model::new(&cfg, vb)?);
            Box::new(move |_: &Accelerator| {
                let mut m = m.borrow_mut();
                m.reset_kv_cache();
                loss(m.forward(&long)?, &next)
            })
        }
        "glm4_new" => {
            let cfg: glm4_new::Config = serde_json::from_value(model_config("glm4_new"))?;
            let m = RefCell::new(glm4_new::ModelForCausalLM::new(&cfg, vb)?);
            Box::new(move |_: &Accelerator| {
                let mut m = m.borrow_mut();
                m.clear_kv_cache();
                last_loss(m.forward(&long, 0)?, &next)
            })
        }
        "lfm2" => {
            // A short-convolution layer, then an attention layer.
            let cfg: lfm2::Lfm2Config = serde_json::from_value(json!({
                "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "norm_eps": 1e-5,
                "rope_theta": 10000.0, "max_position_embeddings": 64, "conv_L_cache": 3,
                "conv_bias": false, "layer_types": ["conv", "full_attention"],
                "tie_embedding": false, "bos_token_id": 1, "eos_token_id": 2,
                "block_ffn_dim_multiplier": 0.5, "block_multiple_of": 16
            }))?;
            let cfg = cfg.into_config(false);
            let dtype = vb.dtype();
            let m = lfm2::Model::new(&cfg, vb)?;
            let dev = dev.clone();
            Box::new(move |_: &Accelerator| {
                let mut cache = lfm2::Cache::new(false, dtype, &cfg, &dev)?;
                loss(m.forward(&long, 0, &mut cache)?, &next)
            })
        }
        "bigcode" => {
            // GPT-BigCode (StarCoder 1): multi-query attention, learned positions, tied head.
            let cfg = bigcode_config(false);
            let m = RefCell::new(bigcode::GPTBigCode::load(vb, cfg)?);
            Box::new(move |_: &Accelerator| loss(m.borrow_mut().forward(&long, 0)?, &next))
        }
        "llama2_c" => {
            let cfg = llama2_c_config();
            // The cache asks its VarBuilder for a checkpoint's rotary tables and computes them
            // when there are none: an empty one, so that they do not become parameters.
            let tables = VarBuilder::from_tensors(Default::default(), DType::F32, dev);
            let cache = RefCell::new(llama2_c::Cache::new(false, &cfg, tables)?);
            let m = llama2_c::Llama::load(vb, cfg)?;
            Box::new(move |_: &Accelerator| {
                let logits = m.forward(&long, 0, &mut cache.borrow_mut())?;
                loss(logits.i((.., 15))?, &next)
            })
        }
        "recurrent_gemma" => {
            // A recurrent (conv + RG-LRU) block, then a local-attention block.
            let cfg: recurrent_gemma::Config = serde_json::from_value(json!({
                "num_hidden_layers": 2, "vocab_size": 64, "hidden_size": 32,
                "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 1,
                "head_dim": 8, "lru_width": 32, "attention_window_size": 16,
                "conv1d_width": 4, "logits_soft_cap": 30.0,
                "hidden_activation": "gelu_pytorch_tanh", "partial_rotary_factor": 0.5,
                "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
                "block_types": ["recurrent", "attention"], "attention_bias": false,
                "max_seq_len": 64
            }))?;
            // Built again each step (its recurrent state and cache have no reset); built
            // once now, so its variables exist when the model is prepared.
            let m = RefCell::new(Some(recurrent_gemma::Model::new(&cfg, vb.clone())?));
            Box::new(move |_: &Accelerator| {
                let mut model = match m.borrow_mut().take() {
                    Some(model) => model,
                    None => recurrent_gemma::Model::new(&cfg, vb.clone())?,
                };
                last_loss(model.forward(&long, 0)?, &next)
            })
        }
        "granitemoehybrid" => {
            // Granite 4's attention layers with their multipliers (its Mamba layers are not
            // implemented in candle).
            let cfg: granitemoehybrid::GraniteMoeHybridConfig = serde_json::from_value(json!({
                "hidden_size": 32, "intermediate_size": 64, "vocab_size": 64,
                "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "bos_token_id": 1,
                "eos_token_id": 2, "rope_scaling": null, "max_position_embeddings": 64,
                "layer_types": ["attention", "attention"], "attention_multiplier": 0.125,
                "embedding_multiplier": 2.0, "residual_multiplier": 0.5, "logits_scaling": 2.0
            }))?;
            let cfg = cfg.into_config(false);
            let dtype = vb.dtype();
            let m = granitemoehybrid::GraniteMoeHybrid::load(vb, &cfg)?;
            let dev = dev.clone();
            Box::new(move |_: &Accelerator| {
                let mut cache =
                    granitemoehybrid::GraniteMoeHybridCache::new(false, dtype, &cfg, &dev)?;
                loss(m.forward(&long, 0, &mut cache)?, &next)
            })
        }
        _ => return Ok(None),
    }))
}
