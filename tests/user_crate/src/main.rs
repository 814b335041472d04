//! What a candle user writes: candle-transformers' BERT, DistilBERT and ModernBERT (with a
//! classification head), Llama, Mistral, Qwen2, Qwen2-MoE, Qwen3, Qwen3-MoE, Gemma 2 and 3, Mixtral, Phi-3,
//! Phi-2, StarCoder2, OLMo and OLMo 2, Helium, StableLM, Falcon and T5 (fresh); (more.rs)
//! Gemma, GLM-4, DeepSeek-V2, Granite, Mamba and XLM-RoBERTa; (rest.rs) MixFormer, Stella v5,
//! Nomic BERT, Jina BERT, ChatGLM3, GLM-4 (new layout), CodeGeeX4, LFM2, GPT-BigCode, llama2.c,
//! RecurrentGemma and Granite-MoE-Hybrid; (rest2.rs) Gemma 4 (text), Based, RWKV v5 and v6,
//! Mamba 2, Marian, DeBERTa v2, SmolLM3, Yi and MPT; built
//! with the Accelerator's VarBuilder and trained
//! with AdamW, in fp32 and bf16. Prints one JSON line per run and fails unless every parameter
//! gets a gradient at every step (experts included: 32 tokens over 4 experts) and the loss is
//! finite and falls. Names on the command line run only those models.

use accel_core::optim::{AdamW, AdamWConfig};
use accel_core::{Accelerator, AcceleratorConfig, PrecisionType};
use anyhow::{ensure, Result};
use candle_core::{DType, Tensor, D};
use candle_nn::{Module, VarMap};
use std::cell::RefCell;

use candle_transformers::models::{
    bert, distilbert, falcon, gemma2, gemma3, helium, llama, mistral, mixtral, modernbert, olmo,
    olmo2, phi, phi3, qwen2, qwen2_moe, qwen3, qwen3_moe, stable_lm, starcoder2, t5,
};
use serde_json::json;

mod infer;
mod more;
mod rest;
mod rest2;

pub(crate) use infer::{
    bert_config, bigcode_config, chatglm_config, decoder_json, llama2_c_config, llama_config,
    model_config, with,
};

/// A model's loss, built once, computed at each step.
pub(crate) type Forward = Box<dyn Fn(&Accelerator) -> Result<Tensor>>;

const STEPS: usize = 5;

/// Loss on the last position's logits (`[b, 1, vocab]`) against `next`.
pub(crate) fn last_loss(logits: Tensor, next: &Tensor) -> Result<Tensor> {
    let logits = logits.squeeze(1)?.to_dtype(DType::F32)?;
    Ok(candle_nn::loss::cross_entropy(&logits, next)?)
}

fn train(which: &str, precision: PrecisionType) -> Result<()> {
    let config = AcceleratorConfig::default()
        .with_seed(7)
        .with_mixed_precision(precision);
    let mut acc = Accelerator::new(config)?;
    let dev = acc.device().clone();
    let varmap = VarMap::new();
    let vb = acc.var_builder(&varmap);
    let ids = Tensor::new(&[[5u32, 9, 13, 21, 34, 2], [7, 11, 17, 29, 0, 0]], &dev)?;
    let forward: Forward = match which {
        "gemma" | "glm4" | "deepseek2" | "granite" | "mamba" | "xlm_roberta" => {
            more::forward(which, vb, &varmap, &dev)?.expect("built in more.rs")
        }
        "mixformer" | "stella_en_v5" | "nvembed_v2" | "nomic_bert" | "jina_bert" | "chatglm"
        | "codegeex4_9b" | "glm4_new" | "lfm2" | "bigcode" | "llama2_c" | "recurrent_gemma"
        | "granitemoehybrid" => rest::forward(which, vb, &varmap, &dev)?.expect("built in rest.rs"),
        "gemma4" | "based" | "rwkv_v5" | "rwkv_v6" | "rwkv_v7" | "mamba2" | "marian"
        | "debertav2" | "smollm3" | "yi" | "mpt" => {
            rest2::forward(which, vb, &varmap, &dev)?.expect("built in rest2.rs")
        }
        "bert" => {
            let model = bert::BertModel::load(vb.pp("bert"), &bert_config()?)?;
            let head = candle_nn::linear(32, 2, vb.pp("classifier"))?;
            let mask = Tensor::new(&[[1u32, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]], &dev)?;
            let labels = Tensor::new(&[1u32, 0], &dev)?;
            Box::new(move |acc: &Accelerator| {
                let hidden = model.forward(&ids, &ids.zeros_like()?, Some(&mask))?;
                let m = mask.to_dtype(acc.compute_dtype())?.unsqueeze(D::Minus1)?;
                let pooled = hidden
                    .broadcast_mul(&m)?
                    .sum(1)?
                    .broadcast_div(&m.sum(1)?)?;
                let logits = head.forward(&pooled)?.to_dtype(DType::F32)?;
                Ok(candle_nn::loss::cross_entropy(&logits, &labels)?)
            })
        }
        "t5" => {
            // An encoder-decoder, fresh: its layer norms must start at ones.
            let cfg: t5::Config = serde_json::from_value(model_config("t5"))?;
            let m = RefCell::new(t5::T5ForConditionalGeneration::load(vb, &cfg)?);
            let decoder_ids = Tensor::new(&[[0u32, 5, 9], [0, 7, 11]], &dev)?;
            let next = Tensor::new(&[3u32, 8], &dev)?;
            Box::new(move |_: &Accelerator| {
                let mut m = m.borrow_mut();
                m.clear_kv_cache();
                let logits = m.forward(&ids, &decoder_ids)?.to_dtype(DType::F32)?;
                Ok(candle_nn::loss::cross_entropy(&logits, &next)?)
            })
        }
        "distilbert" | "modernbert" => {
            // Encoders: mean-pooled hidden states through a classification head.
            let mask = Tensor::new(&[[1u32, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]], &dev)?;
            let labels = Tensor::new(&[1u32, 0], &dev)?;
            let head = candle_nn::linear(32, 2, vb.pp("classifier"))?;
            let encode: Box<dyn Fn() -> candle_core::Result<Tensor>> = if which == "distilbert" {
                let cfg: distilbert::Config = serde_json::from_value(model_config("distilbert"))?;
                let model = distilbert::DistilBertModel::load(vb.pp("distilbert"), &cfg)?;
                // DistilBERT's mask marks the keys to hide.
                let hide = (1.0 - mask.to_dtype(DType::F32)?)?
                    .to_dtype(DType::U8)?
                    .reshape((2, 1, 1, 6))?;
                let ids = ids.clone();
                Box::new(move || model.forward(&ids, &hide))
            } else {
                let cfg: modernbert::Config = serde_json::from_value(model_config("modernbert"))?;
                let model = modernbert::ModernBert::load(vb.pp("model"), &cfg)?;
                let (ids, mask) = (ids.clone(), mask.clone());
                Box::new(move || model.forward(&ids, &mask))
            };
            Box::new(move |acc: &Accelerator| {
                let hidden = encode()?;
                let m = mask.to_dtype(acc.compute_dtype())?.unsqueeze(D::Minus1)?;
                let pooled = hidden
                    .broadcast_mul(&m)?
                    .sum(1)?
                    .broadcast_div(&m.sum(1)?)?;
                let logits = head.forward(&pooled)?.to_dtype(DType::F32)?;
                Ok(candle_nn::loss::cross_entropy(&logits, &labels)?)
            })
        }
        "qwen3" | "qwen3_moe" | "gemma3" | "mixtral" | "mistral" | "qwen2" | "phi3" | "gemma2"
        | "starcoder2" | "olmo2" | "stable_lm" | "olmo" | "helium" | "phi" | "qwen2_moe"
        | "falcon" => {
            // 2 x 16 tokens, so that every expert is routed some at every step.
            let long: Vec<u32> = (0..32u32).map(|i| (i * 7 + 3) % 64).collect();
            let long = Tensor::from_vec(long, (2, 16), &dev)?;
            let next = Tensor::new(&[3u32, 8], &dev)?;
            match which {
                "phi3" => {
                    let cfg: phi3::Config = serde_json::from_value(with(
                        decoder_json(),
                        json!({"bos_token_id": 1, "eos_token_id": 2, "rope_scaling": null,
                               "original_max_position_embeddings": null,
                               "partial_rotary_factor": 0.5}),
                    ))?;
                    let m = RefCell::new(phi3::Model::new(&cfg, vb)?);
                    Box::new(move |_: &Accelerator| {
                        let mut m = m.borrow_mut();
                        m.clear_kv_cache();
                        last_loss(m.forward(&long, 0)?, &next)
                    })
                }
                "gemma2" => {
                    let cfg: gemma2::Config = serde_json::from_value(with(
                        decoder_json(),
                        json!({"hidden_activation": "gelu_pytorch_tanh",
                               "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0,
                               "query_pre_attn_scalar": 8, "sliding_window": 8}),
                    ))?;
                    let m = RefCell::new(gemma2::Model::new(false, &cfg, vb)?);
                    Box::new(move |_: &Accelerator| {
                        let mut m = m.borrow_mut();
                        m.clear_kv_cache();
                        last_loss(m.forward(&long, 0)?, &next)
                    })
                }
                "starcoder2" => {
                    let cfg: starcoder2::Config = serde_json::from_value(with(
                        decoder_json(),
                        json!({"hidden_act": "gelu_pytorch_tanh", "norm_epsilon": 1e-5,
                               "use_bias": true}),
                    ))?;
                    let m = RefCell::new(starcoder2::Model::new(&cfg, vb)?);
                    Box::new(move |_: &Accelerator| {
                        let mut m = m.borrow_mut();
                        m.clear_kv_cache();
                        last_loss(m.forward(&long, 0)?, &next)
                    })
                }
                "olmo2" => {
                    let cfg: olmo2::Config =
                        serde_json::from_value(with(decoder_json(), json!({"clip_qkv": null})))?;
                    let m = RefCell::new(olmo2::Model::new(&cfg, vb)?);
                    Box::new(move |_: &Accelerator| {
                        let mut m = m.borrow_mut();
                        m.clear_kv_cache();
                        last_loss(m.forward(&long, 0)?, &next)
                    })
                }
                "stable_lm" => {
                    let cfg: stable_lm::Config = serde_json::from_value(with(
                        decoder_json(),
                        json!({"partial_rotary_factor": 0.25, "layer_norm_eps": 1e-5,
                               "use_cache": true, "use_qkv_bias": true}),
                    ))?;
                    // Built again each step (its cache has no reset); built
                    // once now, so its variables exist when the model is prepared.
                    let m = RefCell::new(Some(stable_lm::Model::new(&cfg, vb.clone())?));
                    Box::new(move |_: &Accelerator| {
                        let mut model = match m.borrow_mut().take() {
                            Some(model) => model,
                            None => stable_lm::Model::new(&cfg, vb.clone())?,
                        };
                        last_loss(model.forward(&long, 0)?, &next)
                    })
                }
                "qwen2_moe" => {
                    // Routed experts beside a gated shared expert.
                    let cfg: qwen2_moe::Config = serde_json::from_value(model_config("qwen2_moe"))?;
                    let m = RefCell::new(qwen2_moe::Model::new(&cfg, vb)?);
                    Box::new(move |_: &Accelerator| {
                        let mut m = m.borrow_mut();
                        m.clear_kv_cache();
                        last_loss(m.forward(&long, 0)?, &next)
                    })
                }
                "falcon" => {
                    // Falcon-7B's layout: multi-query attention, parallel attention and
                    // MLP, rotary embeddings.
                    let cfg: falcon::Config = serde_json::from_value(json!({
                        "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2,
                        "num_attention_heads": 4, "layer_norm_epsilon": 1e-5,
                        "initializer_range": 0.02, "use_cache": true, "bos_token_id": 1,
                        "eos_token_id": 2, "hidden_dropout": 0.0, "attention_dropout": 0.0,
                        "n_head_kv": null, "alibi": false, "new_decoder_architecture": false,
                        "multi_query": true, "parallel_attn": true, "bias": false
                    }))?;
                    let m = RefCell::new(falcon::Falcon::load(vb, cfg)?);
                    // candle's multi-query Falcon takes one sequence at a time
                    // (a batch of 2 fails in its attention's broadcast).
                    let one = long.narrow(0, 0, 1)?;
                    let next = next.narrow(0, 0, 1)?;
                    Box::new(move |_: &Accelerator| {
                        let mut m = m.borrow_mut();
                        m.clear_kv_cache();
                        let logits = m.forward(&one)?.to_dtype(DType::F32)?;
                        Ok(candle_nn::loss::cross_entropy(&logits, &next)?)
                    })
                }
                "olmo" => {
                    let cfg: olmo::Config =
                        serde_json::from_value(with(decoder_json(), json!({"clip_qkv": null})))?;
                    let m = RefCell::new(olmo::Model::new(&cfg, vb)?);
                    Box::new(move |_: &Accelerator| {
                        let mut m = m.borrow_mut();
                        m.clear_kv_cache();
                        last_loss(m.forward(&long, 0)?, &next)
                    })
                }
                "helium" => {
                    let cfg: helium::Config = serde_json::from_value(with(
                        decoder_json(),
                        json!({"bos_token_id": 1, "eos_token_id": 2, "mlp_bias": false,
                               "use_flash_attn": false}),
                    ))?;
                    let m = RefCell::new(helium::Model::new(&cfg, vb)?);
                    Box::new(move |_: &Accelerator| {
                        let mut m = m.borrow_mut();
                        m.clear_kv_cache();
                        last_loss(m.forward(&long, 0)?, &next)
                    })
                }
                "phi" => {
                    // Phi-1/2: parallel attention and MLP, partial rotary, LayerNorm.
                    let cfg: phi::Config = serde_json::from_value(model_config("phi"))?;
                    let m = RefCell::new(phi::Model::new(&cfg, vb)?);
                    Box::new(move |_: &Accelerator| {
                        let mut m = m.borrow_mut();
                        m.clear_kv_cache();
                        let logits = m.forward(&long)?.to_dtype(DType::F32)?;
                        Ok(candle_nn::loss::cross_entropy(&logits, &next)?)
                    })
                }
                "mistral" => {
                    let cfg: mistral::Config = serde_json::from_value(with(
                        decoder_json(),
                        json!({"use_flash_attn": false, "head_dim": null}),
                    ))?;
                    let m = RefCell::new(mistral::Model::new(&cfg, vb)?);
                    Box::new(move |_: &Accelerator| {
                        let mut m = m.borrow_mut();
                        m.clear_kv_cache();
                        last_loss(m.forward(&long, 0)?, &next)
                    })
                }
                "qwen2" => {
                    let cfg: qwen2::Config = serde_json::from_value(with(
                        decoder_json(),
                        json!({"sliding_window": 64}),
                    ))?;
                    let m = RefCell::new(qwen2::ModelForCausalLM::new(&cfg, vb)?);
                    Box::new(move |_: &Accelerator| {
                        let mut m = m.borrow_mut();
                        m.clear_kv_cache();
                        last_loss(m.forward(&long, 0)?, &next)
                    })
                }
                "qwen3" => {
                    let cfg: qwen3::Config = serde_json::from_value(decoder_json())?;
                    let m = RefCell::new(qwen3::ModelForCausalLM::new(&cfg, vb)?);
                    Box::new(move |_: &Accelerator| {
                        let mut m = m.borrow_mut();
                        m.clear_kv_cache();
                        last_loss(m.forward(&long, 0)?, &next)
                    })
                }
                "qwen3_moe" => {
                    let cfg: qwen3_moe::Config = serde_json::from_value(model_config("qwen3_moe"))?;
                    let m = RefCell::new(qwen3_moe::ModelForCausalLM::new(&cfg, vb)?);
                    Box::new(move |_: &Accelerator| {
                        let mut m = m.borrow_mut();
                        m.clear_kv_cache();
                        last_loss(m.forward(&long, 0)?, &next)
                    })
                }
                "gemma3" => {
                    // A window of 8 below the 16 tokens: the sliding layers' rotating cache.
                    let cfg: gemma3::Config = serde_json::from_value(model_config("gemma3"))?;
                    let m = RefCell::new(gemma3::Model::new(false, &cfg, vb)?);
                    Box::new(move |_: &Accelerator| {
                        let mut m = m.borrow_mut();
                        m.clear_kv_cache();
                        last_loss(m.forward(&long, 0)?, &next)
                    })
                }
                _ => {
                    let cfg: mixtral::Config = serde_json::from_value(model_config("mixtral"))?;
                    // Built again each step (its cache has no reset); the
                    // VarBuilder hands out the same variables.
                    let first = mixtral::Model::new(&cfg, vb.clone())?;
                    let m = RefCell::new(Some(first));
                    Box::new(move |_: &Accelerator| {
                        let mut model = match m.borrow_mut().take() {
                            Some(model) => model,
                            None => mixtral::Model::new(&cfg, vb.clone())?,
                        };
                        last_loss(model.forward(&long, 0)?, &next)
                    })
                }
            }
        }
        _ => {
            let cfg = llama_config()?;
            let model = llama::Llama::load(vb, &cfg)?;
            let next = Tensor::new(&[3u32, 8], &dev)?;
            Box::new(move |acc: &Accelerator| {
                let mut cache = llama::Cache::new(false, acc.compute_dtype(), &cfg, acc.device())?;
                let logits = model.forward(&ids, 0, &mut cache)?;
                Ok(candle_nn::loss::cross_entropy(&logits, &next)?)
            })
        }
    };
    let model = acc.prepare_model(&varmap)?;
    let adamw = AdamWConfig {
        lr: 1e-2,
        ..Default::default()
    };
    let mut opt = acc.prepare_optimizer(&model, AdamW::new(adamw));
    let mut losses = vec![];
    for step in 0..STEPS {
        let loss = forward(&acc)?;
        acc.backward(&loss)?;
        let with_grad = model.gradients().len();
        ensure!(
            with_grad == model.len(),
            "{which} {precision}: step {step}: {with_grad} of {} parameters got a gradient; none: {:?}",
            model.len(),
            model.unreached_parameters()
        );
        opt.step()?;
        opt.zero_grad();
        let loss = loss.to_scalar::<f32>()?;
        ensure!(
            loss.is_finite(),
            "{which} {precision}: step {step}: loss {loss}"
        );
        losses.push(loss);
    }
    ensure!(
        losses[STEPS - 1] < losses[0],
        "{which} {precision}: the loss did not fall: {losses:?}"
    );
    println!(
        "{}",
        json!({ "model": which, "precision": precision.to_string(), "params": model.len(), "losses": losses })
    );
    Ok(())
}

fn main() -> Result<()> {
    let only: Vec<String> = std::env::args().skip(1).collect();
    if only.first().map(String::as_str) == Some("--infer") {
        return infer::run(&only[1..]);
    }
    for which in [
        "bert",
        "llama",
        "qwen3",
        "qwen3_moe",
        "gemma3",
        "mixtral",
        "mistral",
        "qwen2",
        "distilbert",
        "modernbert",
        "phi3",
        "gemma2",
        "starcoder2",
        "olmo2",
        "stable_lm",
        "t5",
        "olmo",
        "helium",
        "phi",
        "qwen2_moe",
        "falcon",
        "gemma",
        "glm4",
        "deepseek2",
        "granite",
        "mamba",
        "xlm_roberta",
        "mixformer",
        "stella_en_v5",
        "nvembed_v2",
        "nomic_bert",
        "jina_bert",
        "chatglm",
        "codegeex4_9b",
        "glm4_new",
        "lfm2",
        "bigcode",
        "llama2_c",
        "recurrent_gemma",
        "granitemoehybrid",
        "gemma4",
        "based",
        "rwkv_v5",
        "rwkv_v6",
        "rwkv_v7",
        "mamba2",
        "marian",
        "debertav2",
        "smollm3",
        "yi",
        "mpt",
    ] {
        // Names on the command line run only those models.
        if !only.is_empty() && !only.iter().any(|o| o == which) {
            continue;
        }
        for precision in [PrecisionType::No, PrecisionType::Bf16] {
            train(which, precision)?;
        }
    }
    Ok(())
}
