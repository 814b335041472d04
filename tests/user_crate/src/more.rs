//! The rest of candle-transformers' text zoo that trains as it is: Gemma (1), GLM-4, DeepSeek-V2
//! (MLA attention, shared and routed experts), Granite, Mamba (its recurrent step unrolled over
//! the sequence) and XLM-RoBERTa (masked LM), each built with tiny shapes as a user would.

use accel_core::Accelerator;
use anyhow::Result;
use candle_core::{DType, Device, IndexOp, Tensor};
use candle_nn::{VarBuilder, VarMap};
use candle_transformers::models::{deepseek2, gemma, glm4, granite, mamba, xlm_roberta};
use serde_json::json;
use std::cell::RefCell;

use super::{decoder_json, last_loss, model_config, with, Forward};

/// The training closure of `which`, or `None` for a model this file does not build.
pub fn forward(
    which: &str,
    vb: VarBuilder<'static>,
    varmap: &VarMap,
    dev: &Device,
) -> Result<Option<Forward>> {
    let long: Vec<u32> = (0..32u32).map(|i| (i * 7 + 3) % 64).collect();
    let long = Tensor::from_vec(long, (2, 16), dev)?;
    let next = Tensor::new(&[3u32, 8], dev)?;
    Ok(Some(match which {
        "gemma" => {
            let cfg: gemma::Config = serde_json::from_value(with(
                decoder_json(),
                json!({"hidden_act": null, "hidden_activation": "gelu_pytorch_tanh"}),
            ))?;
            let m = RefCell::new(gemma::Model::new(false, &cfg, vb)?);
            Box::new(move |_: &Accelerator| {
                let mut m = m.borrow_mut();
                m.clear_kv_cache();
                last_loss(m.forward(&long, 0)?, &next)
            })
        }
        "glm4" => {
            let cfg: glm4::Config = serde_json::from_value(json!({
                "num_layers": 2, "padded_vocab_size": 64, "hidden_size": 32, "ffn_hidden_size": 64,
                "kv_channels": 8, "num_attention_heads": 4, "seq_length": 64,
                "layernorm_epsilon": 1e-5, "rmsnorm": true,
                "apply_residual_connection_post_layernorm": false, "post_layer_norm": true,
                "add_bias_linear": false, "add_qkv_bias": true, "bias_dropout_fusion": true,
                "multi_query_attention": true, "multi_query_group_num": 2,
                "apply_query_key_layer_scaling": true, "attention_softmax_in_fp32": true,
                "fp32_residual_connection": false, "rope_ratio": 1, "eos_token_id": null
            }))?;
            let m = RefCell::new(glm4::Model::new(&cfg, vb)?);
            Box::new(move |_: &Accelerator| {
                let mut m = m.borrow_mut();
                m.reset_kv_cache();
                let logits = m.forward(&long)?.to_dtype(DType::F32)?;
                Ok(candle_nn::loss::cross_entropy(&logits, &next)?)
            })
        }
        "deepseek2" => {
            // 2 x 16 tokens over 4 routed experts (top 2), one shared, after one dense layer.
            let cfg: deepseek2::DeepSeekV2Config = serde_json::from_value(json!({
                "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
                "moe_intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 4,
                "n_shared_experts": 1, "n_routed_experts": 4, "num_experts_per_tok": 2,
                "first_k_dense_replace": 1, "max_position_embeddings": 64, "rms_norm_eps": 1e-6,
                "rope_theta": 10000.0, "rope_scaling": null, "attention_bias": false,
                "q_lora_rank": 16, "qk_rope_head_dim": 4, "kv_lora_rank": 16, "v_head_dim": 8,
                "qk_nope_head_dim": 8, "n_group": 1, "topk_group": 1
            }))?;
            let m = RefCell::new(deepseek2::DeepSeekV2::new(&cfg, vb)?);
            // candle creates the router at zeros (as a checkpoint would overwrite it); with every
            // score tied, top-2 is always experts 0 and 1. Drawn as a trained router would differ.
            for (name, var) in varmap.data().lock().unwrap().iter() {
                if name.ends_with("mlp.gate.weight") {
                    let w = Tensor::randn(0f32, 1.0, var.shape(), dev)?.to_dtype(var.dtype())?;
                    var.set(&w)?;
                }
            }
            Box::new(move |_: &Accelerator| {
                let mut m = m.borrow_mut();
                m.clear_kv_cache();
                last_loss(m.forward(&long, 0)?, &next)
            })
        }
        "granite" => {
            let cfg: granite::GraniteConfig = serde_json::from_value(json!({
                "hidden_size": 32, "intermediate_size": 64, "vocab_size": 64,
                "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "bos_token_id": 1, "eos_token_id": 2,
                "rope_scaling": null, "max_position_embeddings": 64
            }))?;
            let cfg = cfg.into_config(false);
            let dtype = vb.dtype();
            let m = granite::Granite::load(vb, &cfg)?;
            let dev = dev.clone();
            Box::new(move |_: &Accelerator| {
                let mut cache = granite::Cache::new(false, dtype, &cfg, &dev)?;
                let logits = m.forward(&long, 0, &mut cache)?.to_dtype(DType::F32)?;
                Ok(candle_nn::loss::cross_entropy(&logits, &next)?)
            })
        }
        "mamba" => {
            // The selective scan one token at a time, as candle runs it: 8 steps unrolled, the
            // loss on the last, so every step's parameters are reached through the state.
            let cfg: mamba::Config = serde_json::from_value(model_config("mamba"))?;
            let dtype = vb.dtype();
            let m = mamba::Model::new(&cfg, vb)?;
            let dev = dev.clone();
            Box::new(move |_: &Accelerator| {
                let mut state = mamba::State::new(2, &cfg, dtype, &dev)?;
                let mut logits = None;
                for t in 0..8 {
                    logits = Some(m.forward(&long.i((.., t))?.contiguous()?, &mut state)?);
                }
                let logits = logits.expect("eight steps").to_dtype(DType::F32)?;
                Ok(candle_nn::loss::cross_entropy(&logits, &next)?)
            })
        }
        "xlm_roberta" => {
            let cfg: xlm_roberta::Config = serde_json::from_value(json!({
                "hidden_size": 32, "layer_norm_eps": 1e-5, "attention_probs_dropout_prob": 0.0,
                "hidden_dropout_prob": 0.0, "num_attention_heads": 4,
                "position_embedding_type": "absolute", "intermediate_size": 64,
                "hidden_act": "gelu", "num_hidden_layers": 2, "vocab_size": 64,
                "max_position_embeddings": 40, "type_vocab_size": 1, "pad_token_id": 1
            }))?;
            let m = xlm_roberta::XLMRobertaForMaskedLM::new(&cfg, vb)?;
            // Token ids away from the padding id 1; every position predicts itself.
            let ids = (long.clone() + 2.0)?;
            let mask = Tensor::ones((2, 16), DType::U32, &ids.device().clone())?;
            let types = Tensor::zeros((2, 16), DType::U32, &ids.device().clone())?;
            Box::new(move |_: &Accelerator| {
                let logits = m.forward(&ids, &mask, &types, None, None, None)?;
                let logits = logits.to_dtype(DType::F32)?.reshape((32, ()))?;
                Ok(candle_nn::loss::cross_entropy(
                    &logits,
                    &ids.flatten_all()?,
                )?)
            })
        }
        _ => return Ok(None),
    }))
}
