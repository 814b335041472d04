//! The recurrent and encoder-decoder end of candle-transformers' text zoo: Gemma 4 (text),
//! Based (short convolution, Taylor linear attention, sliding window), RWKV v5 and v6 (their
//! recurrent step unrolled over the sequence), Mamba 2 (the chunked SSD prefill), Marian
//! (translation), DeBERTa v2 (disentangled attention, sequence classification), SmolLM3
//! (NoPE layers), Yi and MPT (ALiBi), RWKV v7 (its sequence prefill), each built with tiny
//! shapes as a user would.

use accel_core::Accelerator;
use anyhow::Result;
use candle_core::{DType, Device, IndexOp, Tensor};
use candle_nn::{VarBuilder, VarMap};
use candle_transformers::models::{
    based, debertav2, gemma4, mamba2, marian, mpt, rwkv_v5, rwkv_v6, rwkv_v7, smol::smollm3, yi,
};
use serde_json::json;
use std::cell::RefCell;

use super::{decoder_json, last_loss, model_config, with, Forward};

/// Cross-entropy of `[b, vocab]` logits against `next`.
fn loss(logits: Tensor, next: &Tensor) -> Result<Tensor> {
    Ok(candle_nn::loss::cross_entropy(
        &logits.to_dtype(DType::F32)?,
        next,
    )?)
}

/// One RWKV v5 or v6 step: a token per sequence in, logits out.
type RwkvStep = Box<dyn Fn(&Tensor, &mut rwkv_v5::State) -> candle_core::Result<Tensor>>;

/// An RWKV state in the computation's dtype (candle creates it in f32, for f32 checkpoints).
fn rwkv_state(
    batch: usize,
    cfg: &rwkv_v5::Config,
    dtype: DType,
    dev: &Device,
) -> Result<rwkv_v5::State> {
    let mut state = rwkv_v5::State::new(batch, cfg, dev)?;
    for layer in state.per_layer.iter_mut() {
        layer.extract_key_value = layer.extract_key_value.to_dtype(dtype)?;
        layer.linear_attention = layer.linear_attention.to_dtype(dtype)?;
        layer.feed_forward = layer.feed_forward.to_dtype(dtype)?;
    }
    Ok(state)
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
    let rwkv: rwkv_v5::Config = serde_json::from_value(json!({
        "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2,
        "attention_hidden_size": 32, "num_attention_heads": 8, "head_size": 8,
        "intermediate_size": 64, "layer_norm_epsilon": 1e-5, "rescale_every": 6
    }))?;
    let dtype = vb.dtype();
    Ok(Some(match which {
        "gemma4" => {
            // The text decoder: a sliding-window layer (window 8 below the 16 tokens), then a
            // global one with proportional partial rotary.
            let cfg: gemma4::Gemma4TextConfig = serde_json::from_value(json!({
                "attention_bias": false, "head_dim": 8, "hidden_activation": "gelu_pytorch_tanh",
                "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
                "num_hidden_layers": 2, "num_key_value_heads": 2, "rms_norm_eps": 1e-6,
                "rope_theta": 10000.0, "vocab_size": 64, "sliding_window": 8,
                "final_logit_softcapping": 30.0, "query_pre_attn_scalar": 8,
                "max_position_embeddings": 64, "tie_word_embeddings": false,
                "layer_types": ["sliding_attention", "full_attention"], "global_head_dim": 16,
                "num_global_key_value_heads": 1, "rope_parameters": null,
                "use_bidirectional_attention": null, "use_flash_attn": false
            }))?;
            let m = RefCell::new(gemma4::text::TextModel::new(&cfg, vb)?);
            Box::new(move |_: &Accelerator| {
                let mut m = m.borrow_mut();
                m.clear_kv_cache();
                last_loss(m.forward(&long, 0)?, &next)
            })
        }
        "based" => {
            // Three layers, one of each mixer. One sequence: the short convolution's state is
            // created for a batch of 1.
            let cfg: based::Config = serde_json::from_value(json!({
                "vocab_size": 64, "n_embd": 32, "n_inner": 64, "n_layer": 3, "n_head": 4,
                "layer_norm_epsilon": 1e-5, "rotary_emb_base": 10000.0,
                "alt_mixer_layers": [1], "alt_mixer_2_layers": [2],
                "alt_mixer": {"num_heads": 4, "feature_dim": 4, "feature_map": {"input_dim": 4}},
                "alt_mixer_2": {"num_heads": 4, "window_size": 8}
            }))?;
            // Built again each step (the sliding window's cache has no reset); built once
            // now, so its variables exist when the model is prepared.
            let m = RefCell::new(Some(based::Model::new(&cfg, vb.clone())?));
            let one = long.narrow(0, 0, 1)?;
            let next = next.narrow(0, 0, 1)?;
            Box::new(move |_: &Accelerator| {
                let mut model = match m.borrow_mut().take() {
                    Some(model) => model,
                    None => based::Model::new(&cfg, vb.clone())?,
                };
                last_loss(model.forward(&one, 0)?, &next)
            })
        }
        "rwkv_v5" | "rwkv_v6" => {
            // One token at a time, as candle runs it: 8 steps unrolled, the loss on the last.
            // One sequence: the token shift's mixing (`xs * time_mix_key`, not broadcast) and
            // v6's data-dependent decay are shaped for a batch of 1.
            let batch = 1;
            let ids = long.narrow(0, 0, batch)?;
            let next = next.narrow(0, 0, batch)?;
            let step: RwkvStep = if which == "rwkv_v5" {
                let m = rwkv_v5::Model::new(&rwkv, vb)?;
                Box::new(move |x, state| m.forward(x, state))
            } else {
                let m = rwkv_v6::Model::new(&rwkv, vb)?;
                Box::new(move |x, state| m.forward(x, state))
            };
            let dev = dev.clone();
            Box::new(move |_: &Accelerator| {
                let mut state = rwkv_state(batch, &rwkv, dtype, &dev)?;
                let mut logits = None;
                for t in 0..8 {
                    logits = Some(step(&ids.i((.., t..t + 1))?.contiguous()?, &mut state)?);
                }
                last_loss(logits.expect("eight steps"), &next)
            })
        }
        "rwkv_v7" => {
            // The sequence prefill over 8 tokens, the loss on the last. Built again each step:
            // its projections are transposed copies of the weights made at construction, which
            // an optimizer step would not reach. It reads its LoRA widths off tensors that must
            // exist already (block 0's w1, a1 and g1; v1 of block 1, as layer 0 has no value
            // residual), so those are made first with the widths wanted.
            let cfg: rwkv_v7::Config = serde_json::from_value(json!({
                "version": "V7", "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2,
                "head_size": 8, "intermediate_size": 64
            }))?;
            // candle makes every weight at zeros (a checkpoint overwrites them), where the key
            // normalisation's gradient is NaN: each parameter is made first, drawn, with the
            // names and shapes of a model built on a scratch `VarMap`.
            let probe = VarMap::new();
            let pvb = VarBuilder::from_varmap(&probe, DType::F32, &Device::Cpu);
            for (layer, name, width) in [(0, "w1", 8), (0, "a1", 4), (1, "v1", 4), (0, "g1", 8)] {
                pvb.pp("blocks")
                    .pp(layer)
                    .pp("att")
                    .get((32, width), name)?;
            }
            rwkv_v7::Model::new(&cfg, pvb)?;
            let drawn = candle_nn::Init::Randn {
                mean: 0.0,
                stdev: 0.3,
            };
            for (name, var) in probe.data().lock().unwrap().iter() {
                vb.get_with_hints(var.shape(), name, drawn)?;
            }
            let tokens: Vec<u32> = long.i(0)?.to_vec1::<u32>()?[..8].to_vec();
            let next = next.narrow(0, 0, 1)?;
            let dev = dev.clone();
            Box::new(move |_: &Accelerator| {
                let m = rwkv_v7::Model::new(&cfg, vb.clone())?;
                let mut state = rwkv_v7::State::new_with_dtype(&cfg, &dev, dtype)?;
                loss(m.forward_seq(&tokens, &mut state)?.unsqueeze(0)?, &next)
            })
        }
        "mamba2" => {
            // The chunked SSD prefill (chunks of 8 over the 16 tokens).
            let cfg: mamba2::Config = serde_json::from_value(json!({
                "d_model": 32, "n_layer": 2, "vocab_size": 64, "d_state": 16, "expand": 2,
                "headdim": 8, "ngroups": 1, "pad_vocab_size_multiple": 8
            }))?;
            let m = mamba2::Model::new(&cfg, vb)?;
            let dev = dev.clone();
            Box::new(move |_: &Accelerator| {
                let mut state = mamba2::State::new(2, &cfg, dtype, &dev)?;
                let logits = m.forward_prefill(&long, &mut state, 8)?;
                loss(logits.i((.., 15))?, &next)
            })
        }
        "marian" => {
            // Translation: the encoder over 16 tokens, the decoder's 3 positions each scored.
            let cfg: marian::Config = serde_json::from_value(model_config("marian"))?;
            let m = RefCell::new(marian::MTModel::new(&cfg, vb)?);
            let decoder_ids = Tensor::new(&[[63u32, 5, 9], [63, 7, 11]], dev)?;
            let targets = Tensor::new(&[5u32, 9, 3, 7, 11, 8], dev)?;
            Box::new(move |_: &Accelerator| {
                let mut m = m.borrow_mut();
                m.reset_kv_cache();
                let encoded = m.encoder().forward(&long, 0)?;
                let logits = m.decode(&decoder_ids, &encoded, 0)?;
                let logits = logits.to_dtype(DType::F32)?.reshape((6, ()))?;
                Ok(candle_nn::loss::cross_entropy(&logits, &targets)?)
            })
        }
        "debertav2" => {
            // Disentangled (c2p and p2c) relative attention, the context pooler and a
            // 2-label classifier.
            let cfg: debertav2::Config = serde_json::from_value(model_config("debertav2"))?;
            let m = debertav2::DebertaV2SeqClassificationModel::load(vb.pp("deberta"), &cfg, None)?;
            let labels = Tensor::new(&[1u32, 0], dev)?;
            Box::new(move |_: &Accelerator| {
                let logits = m.forward(&long, None, None)?;
                loss(logits, &labels)
            })
        }
        "smollm3" => {
            // Every second layer without rotary embedding (NoPE).
            let cfg: smollm3::Config = serde_json::from_value(with(
                decoder_json(),
                json!({"no_rope_layer_interval": 2, "no_rope_layers": null}),
            ))?;
            let m = RefCell::new(smollm3::ModelForCausalLM::new(&cfg, vb)?);
            Box::new(move |_: &Accelerator| {
                let mut m = m.borrow_mut();
                m.clear_kv_cache();
                last_loss(m.forward(&long, 0)?, &next)
            })
        }
        "yi" => {
            // Its cache has no reset: the model is rebuilt from the same variables each step.
            let cfg: yi::Config = serde_json::from_value(json!({
                "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
                "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                "hidden_act": "silu", "max_position_embeddings": 64, "rms_norm_eps": 1e-5,
                "rope_theta": 10000.0
            }))?;
            yi::Model::new(&cfg, vb.clone())?; // the variables, before the Accelerator prepares them
            Box::new(move |_: &Accelerator| {
                let mut m = yi::Model::new(&cfg, vb.clone())?;
                last_loss(m.forward(&long, 0)?, &next)
            })
        }
        "mpt" => {
            // ALiBi attention, grouped keys and values, the head tied to the embedding; rebuilt
            // each step as Yi (its cache has no reset).
            let cfg: mpt::Config = serde_json::from_value(json!({
                "d_model": 32, "n_heads": 4, "n_layers": 2, "expansion_ratio": 2,
                "max_seq_len": 64, "vocab_size": 64, "kv_n_heads": 2, "attn_prefix_lm": false,
                "attn_alibi": true, "attn_alibi_bias_max": 8
            }))?;
            mpt::Model::new(&cfg, vb.clone())?;
            Box::new(move |_: &Accelerator| {
                let mut m = mpt::Model::new(&cfg, vb.clone())?;
                loss(m.forward(&long)?, &next)
            })
        }
        _ => return Ok(None),
    }))
}
