//! The models against transformers' own numbers for the tiny checkpoints in
//! `tests/fixtures/hf/` (written by `scripts/make_hf_fixtures.py`, which
//! stores transformers 5's fp32 logits, loss and greedy `generate` tokens in
//! each folder's `reference.json`).

use std::path::Path;

use accel_models::{AutoModel, Bert, Error, Tokenizer};
use accel_nn::block::Model;
use accel_nn::{DeviceMapChoice, LoadDispatchOptions};
use candle_core::{DType, Device, Tensor};
use serde_json::Value;

mod common;

use common::*;

// As the example programs do: weights in the checkpoint's dtype are its
// pages (accel_bigmodel::mapped), so every test here runs on mapped weights.
#[global_allocator]
static ALLOC: accel_bigmodel::MappedAlloc = accel_bigmodel::MappedAlloc::system();

#[test]
fn decoder_logits_match_transformers_in_fp32() {
    for name in DECODERS {
        let model = AutoModel::load(fixture(name), DType::F32, &Device::Cpu).unwrap();
        check_logits(name, &model, "plain");
    }
}

#[test]
fn decoder_loss_matches_transformers_with_shifted_labels() {
    for name in DECODERS {
        let r = reference(name);
        let model = AutoModel::load(fixture(name), DType::F32, &Device::Cpu).unwrap();
        let ids = ids_tensor(&r["input_ids"]);
        let loss: f32 = model.loss(&ids, &ids).unwrap().to_scalar().unwrap();
        let want = r["loss"].as_f64().unwrap() as f32;
        assert!(
            (loss - want).abs() < TOL,
            "{name}: loss {loss} vs transformers' {want}"
        );
        // i64 labels with -100 are ignored as in transformers: masking the
        // last label changes nothing (it is shifted out anyway).
        let mut rows: Vec<Vec<i64>> = serde_json::from_value(r["input_ids"].clone()).unwrap();
        for row in &mut rows {
            *row.first_mut().unwrap() = -100;
        }
        let (b, t) = (rows.len(), rows[0].len());
        let labels = Tensor::from_vec(rows.concat(), (b, t), &Device::Cpu).unwrap();
        let loss_i64: f32 = model.loss(&ids, &labels).unwrap().to_scalar().unwrap();
        assert!(
            (loss_i64 - want).abs() < TOL,
            "{name}: i64 labels loss {loss_i64}"
        );
    }
}

/// Weights written into the model's variables in place after it ran (as a
/// training run loads a checkpoint, then steps its optimizer) are the ones
/// its next forward uses: no block keeps a copy of a weight made when it was
/// built (GPT-2's transposed `Conv1D` once did).
#[test]
fn weights_updated_in_place_reach_the_next_forward() {
    for name in DECODERS {
        let r = reference(name);
        let ids = ids_tensor(&r["input_ids"]);
        let varmap = candle_nn::VarMap::new();
        let cfg = accel_models::ModelConfig::from_path(fixture(name)).unwrap();
        let vb = candle_nn::VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
        let model = AutoModel::new(&cfg, vb).unwrap();
        model.loss(&ids, &ids).unwrap();
        let source = accel_bigmodel::CheckpointSource::open(fixture(name)).unwrap();
        for (n, var) in varmap.data().lock().unwrap().iter() {
            var.set(&source.tensor(n, &Device::Cpu, Some(DType::F32)).unwrap())
                .unwrap();
        }
        let loss: f32 = model.loss(&ids, &ids).unwrap().to_scalar().unwrap();
        let want = r["loss"].as_f64().unwrap() as f32;
        assert!(
            (loss - want).abs() < TOL,
            "{name}: loss {loss} after loading in place vs transformers' {want}"
        );
    }
}

#[test]
fn greedy_generate_with_kv_cache_equals_transformers() {
    for name in DECODERS {
        let model = AutoModel::load(fixture(name), DType::F32, &Device::Cpu).unwrap();
        check_generate(name, &model, "plain");
    }
}

#[test]
fn bert_hidden_states_pooler_and_mean_pooling_match_transformers() {
    let r = reference("bert");
    let bert = Bert::load(fixture("bert"), DType::F32, &Device::Cpu).unwrap();
    let ids = ids_tensor(&r["input_ids"]);
    let mask = ids_tensor(&r["attention_mask"]);
    let h = bert.forward(&ids, Some(&mask), None).unwrap();
    let d = max_diff(&h, &r["last_hidden_state"]);
    assert!(d < TOL, "last_hidden_state differs by {d}");
    let d = max_diff(&bert.pool(&h).unwrap(), &r["pooler_output"]);
    assert!(d < TOL, "pooler_output differs by {d}");
    let d = max_diff(
        &bert.sentence_embedding(&ids, &mask).unwrap(),
        &r["mean_pooled"],
    );
    assert!(d < TOL, "mean-pooled embedding differs by {d}");
}

#[test]
fn tokenizer_json_encodes_as_the_python_tokenizers_library() {
    let r = reference("llama");
    let tok = Tokenizer::for_model(fixture("llama"), 128).unwrap();
    let want: Vec<u32> = serde_json::from_value(r["tokenizer"]["prompt_ids"].clone()).unwrap();
    let prompt = r["tokenizer"]["prompt"].as_str().unwrap();
    assert_eq!(tok.encode(prompt, true).unwrap(), want);
    assert_eq!(tok.decode(&want, true).unwrap(), prompt);
}

/// A `tokenizer.json` that pads and truncates to a fixed length (as
/// sentence-transformers' exports do, to 128) encodes one text as
/// transformers' `tokenizer(text)` does: neither padded nor truncated.
#[test]
fn tokenizer_json_padding_and_truncation_are_not_applied_to_encode() {
    let r = reference("llama");
    let path = fixture("llama").join("tokenizer.json");
    let mut json: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    json["padding"] = serde_json::json!({"strategy": {"Fixed": 16}, "direction": "Right",
        "pad_to_multiple_of": null, "pad_id": 0, "pad_type_id": 0, "pad_token": "<pad>"});
    json["truncation"] = serde_json::json!({"direction": "Right", "max_length": 2,
        "strategy": "LongestFirst", "stride": 0});
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("tokenizer.json"), json.to_string()).unwrap();
    let tok = Tokenizer::from_file(dir.path()).unwrap();
    let want: Vec<u32> = serde_json::from_value(r["tokenizer"]["prompt_ids"].clone()).unwrap();
    let prompt = r["tokenizer"]["prompt"].as_str().unwrap();
    assert!(
        want.len() > 2,
        "the prompt must be longer than the truncation"
    );
    assert_eq!(tok.encode(prompt, true).unwrap(), want);
}

#[test]
fn a_tokenizer_larger_than_the_vocabulary_is_refused_naming_the_file() {
    let e = Tokenizer::for_model(fixture("llama"), 100).unwrap_err();
    assert!(
        matches!(
            e,
            Error::VocabMismatch {
                tokenizer_vocab: 128,
                model_vocab: 100,
                ..
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("tokenizer.json"), "{e}");
}

/// A copy of a fixture folder whose config.json is edited by `edit`.
fn edited(name: &str, edit: impl FnOnce(&mut serde_json::Map<String, Value>)) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(fixture(name)).unwrap() {
        let p = entry.unwrap().path();
        std::fs::copy(&p, dir.path().join(p.file_name().unwrap())).unwrap();
    }
    let path = dir.path().join("config.json");
    let mut cfg: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    edit(cfg.as_object_mut().unwrap());
    std::fs::write(&path, serde_json::to_string(&cfg).unwrap()).unwrap();
    dir
}

#[test]
fn bad_checkpoints_give_errors_naming_file_and_key_or_tensor() {
    let load = |dir: &Path| AutoModel::load(dir, DType::F32, &Device::Cpu).unwrap_err();

    let dir = edited("mistral", |c| {
        c.insert("model_type".into(), "mamba".into());
    });
    let e = load(dir.path());
    assert!(
        matches!(&e, Error::UnknownModelType { model_type, .. } if model_type == "mamba"),
        "{e}"
    );
    assert!(e.to_string().contains("config.json"), "{e}");

    let dir = edited("gpt2", |c| {
        c.remove("n_embd");
    });
    let e = load(dir.path());
    assert!(
        matches!(&e, Error::MissingKey { key, .. } if key == "n_embd"),
        "{e}"
    );
    assert!(
        e.to_string().contains("config.json") && e.to_string().contains("n_embd"),
        "{e}"
    );

    // A third layer the checkpoint does not have.
    let dir = edited("llama", |c| {
        c.insert("num_hidden_layers".into(), 3.into());
    });
    let msg = load(dir.path()).to_string();
    assert!(
        msg.contains("model.layers.2.") && msg.contains(&dir.path().display().to_string()),
        "{msg}"
    );

    // A width that does not match the stored tensors.
    let dir = edited("qwen2", |c| {
        c.insert("intermediate_size".into(), 48.into());
    });
    let msg = load(dir.path()).to_string();
    assert!(
        msg.contains("mlp.gate_proj.weight") && msg.contains("model.safetensors"),
        "{msg}"
    );

    // Missing tensors are also caught when dispatching onto an empty model.
    let dir = edited("gpt2", |c| {
        c.insert("n_layer".into(), 3.into());
    });
    let empty = AutoModel::empty(dir.path(), DType::F32).unwrap();
    let opts = LoadDispatchOptions::new(DeviceMapChoice::Map(cpu_disk_map(&empty)));
    let msg = accel_nn::load_checkpoint_and_dispatch(&empty, dir.path(), &opts)
        .unwrap_err()
        .to_string();
    assert!(msg.contains("transformer.h.2."), "{msg}");
}

#[test]
fn block_classes_are_transformers_names() {
    let classes = |name: &str| -> Vec<String> {
        let m = AutoModel::empty(fixture(name), DType::F32).unwrap();
        m.blocks()
            .iter()
            .map(|b| format!("{}:{}", b.name(), b.class_name()))
            .collect()
    };
    assert_eq!(
        classes("llama"),
        [
            "model.embed_tokens:Embedding",
            "model.layers.0:LlamaDecoderLayer",
            "model.layers.1:LlamaDecoderLayer",
            "model.norm:LlamaRMSNorm",
            "lm_head:Linear"
        ]
    );
    assert!(classes("mistral")[1].ends_with(":MistralDecoderLayer"));
    assert!(classes("qwen2")[1].ends_with(":Qwen2DecoderLayer"));
    assert_eq!(classes("gpt2")[2], "transformer.h.0:GPT2Block");
    assert_eq!(classes("bert")[1], "encoder.layer.0:BertLayer");
    assert_eq!(classes("bert").last().unwrap(), "pooler:BertPooler");
}

/// In bf16 (weights and activations) every decoder's loss stays within 2%
/// of transformers' fp32 loss, MoE routing and Gemma's f32 norms included.
#[test]
fn decoder_loss_in_bf16_is_within_two_percent_of_fp32() {
    for name in DECODERS {
        let r = reference(name);
        let model = AutoModel::load(fixture(name), DType::BF16, &Device::Cpu).unwrap();
        let ids = ids_tensor(&r["input_ids"]);
        let loss: f32 = model
            .loss(&ids, &ids)
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap()
            .to_scalar()
            .unwrap();
        let want = r["loss"].as_f64().unwrap() as f32;
        assert!(
            (loss - want).abs() < 0.02 * want,
            "{name}: bf16 loss {loss} vs transformers' fp32 {want}"
        );
    }
}
