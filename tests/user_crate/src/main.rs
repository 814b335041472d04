//! What a candle user writes: candle-transformers' BERT (with a classification head) and Llama,
//! built with the Accelerator's VarBuilder and trained with AdamW, in fp32 and bf16. Prints one
//! JSON line per run and fails unless every parameter gets a gradient at every step and the loss
//! is finite and falls.

use accel_core::optim::{AdamW, AdamWConfig};
use accel_core::{Accelerator, AcceleratorConfig, PrecisionType};
use anyhow::{ensure, Result};
use candle_core::{DType, Tensor, D};
use candle_nn::{Module, VarMap};
use candle_transformers::models::{bert, llama};
use serde_json::json;

const STEPS: usize = 5;

fn bert_config() -> Result<bert::Config> {
    Ok(serde_json::from_value(json!({
        "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
        "intermediate_size": 64, "hidden_act": "gelu", "hidden_dropout_prob": 0.0,
        "max_position_embeddings": 32, "type_vocab_size": 2, "initializer_range": 0.02,
        "layer_norm_eps": 1e-12, "pad_token_id": 0
    }))?)
}

fn llama_config() -> Result<llama::Config> {
    let c: llama::LlamaConfig = serde_json::from_value(json!({
        "hidden_size": 32, "intermediate_size": 64, "vocab_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 64, "tie_word_embeddings": false
    }))?;
    Ok(c.into_config(false))
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
    let forward: Box<dyn Fn(&Accelerator) -> Result<Tensor>> = match which {
        "bert" => {
            let model = bert::BertModel::load(vb.pp("bert"), &bert_config()?)?;
            let head = candle_nn::linear(32, 2, vb.pp("classifier"))?;
            let mask = Tensor::new(&[[1u32, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]], &dev)?;
            let labels = Tensor::new(&[1u32, 0], &dev)?;
            Box::new(move |acc: &Accelerator| {
                let hidden = model.forward(&ids, &ids.zeros_like()?, Some(&mask))?;
                let m = mask.to_dtype(acc.compute_dtype())?.unsqueeze(D::Minus1)?;
                let pooled = hidden.broadcast_mul(&m)?.sum(1)?.broadcast_div(&m.sum(1)?)?;
                let logits = head.forward(&pooled)?.to_dtype(DType::F32)?;
                Ok(candle_nn::loss::cross_entropy(&logits, &labels)?)
            })
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
        ensure!(loss.is_finite(), "{which} {precision}: step {step}: loss {loss}");
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
    for which in ["bert", "llama"] {
        for precision in [PrecisionType::No, PrecisionType::Bf16] {
            train(which, precision)?;
        }
    }
    Ok(())
}
