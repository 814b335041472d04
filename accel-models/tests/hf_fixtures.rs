//! The models against transformers' own numbers for the tiny checkpoints in
//! `tests/fixtures/hf/` (written by `scripts/make_hf_fixtures.py`, which
//! stores transformers 5's fp32 logits, loss and greedy `generate` tokens in
//! each folder's `reference.json`).

use std::path::{Path, PathBuf};

use accel_bigmodel::{DeviceMap, MemorySize, Placement, PlanOptions};
use accel_models::{AutoModel, Bert, Error, Tokenizer};
use accel_nn::block::Model;
use accel_nn::{DeviceMapChoice, LoadDispatchOptions};
use candle_core::{DType, Device, Tensor};
use serde_json::Value;

// As the example programs do: weights in the checkpoint's dtype are its
// pages (accel_bigmodel::mapped), so every test here runs on mapped weights.
#[global_allocator]
static ALLOC: accel_bigmodel::MappedAlloc = accel_bigmodel::MappedAlloc::system();

const DECODERS: [&str; 5] = ["llama", "llama3", "mistral", "qwen2", "gpt2"];
const TOL: f32 = 1e-4;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/hf")
        .join(name)
}

fn reference(name: &str) -> Value {
    let text = std::fs::read_to_string(fixture(name).join("reference.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn ids_tensor(v: &Value) -> Tensor {
    let rows: Vec<Vec<u32>> = serde_json::from_value(v.clone()).unwrap();
    let (b, t) = (rows.len(), rows[0].len());
    Tensor::from_vec(rows.concat(), (b, t), &Device::Cpu).unwrap()
}

fn floats(v: &Value, out: &mut Vec<f32>) {
    match v {
        Value::Array(a) => a.iter().for_each(|x| floats(x, out)),
        Value::Number(n) => out.push(n.as_f64().unwrap() as f32),
        other => panic!("not a number: {other}"),
    }
}

/// Largest absolute difference between a tensor and nested JSON numbers.
fn max_diff(t: &Tensor, expected: &Value) -> f32 {
    let mut want = Vec::new();
    floats(expected, &mut want);
    let got: Vec<f32> = t
        .to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap();
    assert_eq!(got.len(), want.len(), "element count");
    got.iter()
        .zip(&want)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f32::max)
}

fn check_logits(name: &str, model: &AutoModel, how: &str) {
    let r = reference(name);
    let logits = model.forward(&ids_tensor(&r["input_ids"])).unwrap();
    let d = max_diff(&logits, &r["logits"]);
    assert!(
        d < TOL,
        "{name} ({how}): logits differ from transformers' by {d}"
    );
}

fn check_generate(name: &str, model: &AutoModel, how: &str) {
    let g = &reference(name)["generate"];
    let prompt: Vec<u32> = serde_json::from_value(g["prompt_ids"].clone()).unwrap();
    let want: Vec<u32> = serde_json::from_value(g["tokens"].clone()).unwrap();
    let n = g["max_new_tokens"].as_u64().unwrap() as usize;
    let got = model.generate(&prompt, n, &[]).unwrap();
    assert_eq!(got, want, "{name} ({how}): greedy tokens");
}

#[test]
fn a_plain_fp32_load_maps_each_checkpoint_tensor_and_a_bf16_load_converts() {
    for name in DECODERS {
        let model = AutoModel::load(fixture(name), DType::F32, &Device::Cpu).unwrap();
        let tensors = model.named_tensors();
        let mapped = tensors
            .iter()
            .filter(|(_, t)| accel_bigmodel::mapped::is_mapped(t));
        let source = accel_bigmodel::CheckpointSource::open(fixture(name)).unwrap();
        assert_eq!(mapped.count(), source.len(), "{name}");
        // A tied head holds the embeddings' own tensor.
        let mut keys: Vec<_> = model
            .blocks()
            .iter()
            .flat_map(|b| b.weights().tensors())
            .map(|(n, t)| (n, accel_kernels::storage_key(&t)))
            .collect();
        keys.sort();
        keys.dedup();
        let names: std::collections::BTreeSet<_> = keys.iter().map(|(n, _)| n).collect();
        assert_eq!(keys.len(), names.len(), "{name}: a name with two storages");
        let model = AutoModel::load(fixture(name), DType::BF16, &Device::Cpu).unwrap();
        let tensors = model.named_tensors();
        assert!(tensors
            .iter()
            .all(|(_, t)| !accel_bigmodel::mapped::is_mapped(t)));
    }
}

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

/// Blocks alternating between CPU and disk, so both hooks run in one forward.
fn cpu_disk_map(model: &AutoModel) -> DeviceMap {
    let mut map = DeviceMap::new();
    for (i, b) in model.blocks().iter().enumerate() {
        let p = if i % 2 == 0 {
            Placement::Disk
        } else {
            Placement::Cpu
        };
        map.insert(b.name(), p);
    }
    map
}

#[test]
fn dispatched_with_cpu_and_disk_offload_gives_transformers_logits_and_tokens() {
    for name in DECODERS {
        let empty = AutoModel::empty(fixture(name), DType::F32).unwrap();
        let offload = tempfile::tempdir().unwrap();
        let opts = LoadDispatchOptions {
            device_map: DeviceMapChoice::Map(cpu_disk_map(&empty)),
            dtype: None,
            offload_folder: Some(offload.path().to_path_buf()),
            main_device: None,
        };
        let (model, report) = AutoModel::load_dispatched(fixture(name), &opts).unwrap();
        assert!(report.count(Placement::Disk) >= 2, "{name}: {report:?}");
        // CPU blocks hold the checkpoint's pages; disk blocks hold nothing
        // between forwards.
        for (block, (_, placement)) in model.blocks().iter().zip(&report.placements) {
            for (n, t) in block.weights().tensors() {
                let mapped = accel_bigmodel::mapped::is_mapped(&t);
                let expected = *placement == Placement::Cpu;
                assert_eq!(mapped, expected, "{name}: {n} on {placement:?}");
            }
        }
        check_logits(name, &model, "dispatched");
        check_generate(name, &model, "dispatched");
    }
}

#[test]
fn a_tied_head_dispatched_to_the_cpu_shares_the_embeddings_tensor() {
    for name in ["qwen2", "gpt2"] {
        let empty = AutoModel::empty(fixture(name), DType::F32).unwrap();
        let mut map = DeviceMap::new();
        for b in empty.blocks() {
            map.insert(b.name(), Placement::Cpu);
        }
        let opts = LoadDispatchOptions {
            device_map: DeviceMapChoice::Map(map),
            dtype: None,
            offload_folder: None,
            main_device: None,
        };
        let (model, _) = AutoModel::load_dispatched(fixture(name), &opts).unwrap();
        // Each block's own handle: the embeddings' and the head's.
        let keys: Vec<_> = model
            .blocks()
            .iter()
            .flat_map(|b| b.weights().tensors())
            .filter(|(n, _)| n.ends_with("embed_tokens.weight") || n == "transformer.wte.weight")
            .map(|(_, t)| accel_kernels::storage_key(&t))
            .collect();
        assert_eq!(keys.len(), 2, "{name}: the embeddings and the tied head");
        assert_eq!(keys[0], keys[1], "{name}: one tensor, not a copy");
        check_logits(name, &model, "dispatched, tied head shared");
    }
}

#[test]
fn a_python_map_placing_buffer_only_modules_dispatches_and_an_unknown_key_is_named() {
    let empty = AutoModel::empty(fixture("llama"), DType::F32).unwrap();
    let mut map = cpu_disk_map(&empty);
    // transformers' LlamaRotaryEmbedding holds only non-persistent buffers.
    map.insert("model.rotary_emb".to_string(), Placement::Cpu);
    let opts = |map: DeviceMap| LoadDispatchOptions {
        device_map: DeviceMapChoice::Map(map),
        dtype: None,
        offload_folder: None,
        main_device: None,
    };
    accel_nn::load_checkpoint_and_dispatch(&empty, fixture("llama"), &opts(map.clone())).unwrap();
    check_logits(
        "llama",
        &empty,
        "dispatched from a map with model.rotary_emb",
    );
    let empty = AutoModel::empty(fixture("llama"), DType::F32).unwrap();
    map.insert("model.rotary".to_string(), Placement::Cpu);
    let err = accel_nn::load_checkpoint_and_dispatch(&empty, fixture("llama"), &opts(map));
    let err = err.unwrap_err().to_string();
    assert!(
        err.contains("model.rotary") && err.contains("no module"),
        "{err}"
    );
}

/// The BERT fixture with every other block on disk, read from the checkpoint.
fn offloaded_bert() -> Bert {
    let empty = AutoModel::empty(fixture("bert"), DType::F32).unwrap();
    let opts = LoadDispatchOptions {
        device_map: DeviceMapChoice::Map(cpu_disk_map(&empty)),
        dtype: None,
        offload_folder: None,
        main_device: None,
    };
    let (model, _) = AutoModel::load_dispatched(fixture("bert"), &opts).unwrap();
    let AutoModel::Bert(bert) = model else {
        panic!("the bert fixture loads as BERT")
    };
    bert
}

#[test]
fn bert_with_token_type_ids_matches_transformers_plain_and_offloaded() {
    let r = reference("bert");
    let ids = ids_tensor(&r["input_ids"]);
    let mask = ids_tensor(&r["attention_mask"]);
    let types = ids_tensor(&r["token_type_ids"]);
    let want = &r["last_hidden_state_with_token_types"];
    let bert = Bert::load(fixture("bert"), DType::F32, &Device::Cpu).unwrap();
    let h = bert.forward(&ids, Some(&mask), Some(&types)).unwrap();
    assert!(max_diff(&h, want) < TOL, "plain: {}", max_diff(&h, want));
    // The segment ids do matter: without them the states differ.
    let h0 = bert.forward(&ids, Some(&mask), None).unwrap();
    assert!(max_diff(&h0, want) > 1e-2);
    let bert = offloaded_bert();
    let h = bert.forward(&ids, Some(&mask), Some(&types)).unwrap();
    assert!(
        max_diff(&h, want) < TOL,
        "offloaded: {}",
        max_diff(&h, want)
    );
}

#[test]
fn bert_dispatched_with_disk_offload_matches() {
    let r = reference("bert");
    let bert = offloaded_bert();
    let h = bert
        .forward(
            &ids_tensor(&r["input_ids"]),
            Some(&ids_tensor(&r["attention_mask"])),
            None,
        )
        .unwrap();
    let d = max_diff(&h, &r["last_hidden_state"]);
    assert!(d < TOL, "dispatched BERT differs by {d}");
}

#[test]
fn planned_device_maps_equal_accelerates_and_dispatch_to_the_same_logits() {
    for name in ["llama", "llama3", "mistral", "qwen2", "gpt2", "bert"] {
        let r = reference(name);
        let empty = AutoModel::empty(fixture(name), DType::F32).unwrap();
        for case in r["device_maps"].as_array().unwrap() {
            let cpu = case["max_memory"]["cpu"].as_u64().unwrap();
            let budget = vec![
                (Placement::Cpu, MemorySize::from(cpu)),
                (Placement::Disk, MemorySize::Text("1GB".into())),
            ];
            let classes: Vec<String> =
                serde_json::from_value(case["no_split_module_classes"].clone()).unwrap();
            let plan = PlanOptions::new(budget).with_no_split_module_classes(classes);
            let map = empty.plan_device_map(&plan).unwrap();
            let got: Vec<(String, String)> = map
                .iter()
                .map(|(k, p)| (k.to_string(), p.to_string()))
                .collect();
            let want: Vec<(String, String)> =
                serde_json::from_value(case["device_map"].clone()).unwrap();
            assert_eq!(
                got, want,
                "{name} with cpu={cpu}: planned map (left) vs Accelerate's (right)"
            );
            if name == "bert" {
                continue;
            }
            let opts = LoadDispatchOptions {
                device_map: DeviceMapChoice::Auto(plan),
                dtype: None,
                offload_folder: None,
                main_device: None,
            };
            let (model, report) = AutoModel::load_dispatched(fixture(name), &opts).unwrap();
            assert!(report.count(Placement::Disk) > 0, "{name}: {report:?}");
            check_logits(name, &model, "auto-planned");
        }
    }
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
    let opts = LoadDispatchOptions {
        device_map: DeviceMapChoice::Map(cpu_disk_map(&empty)),
        dtype: None,
        offload_folder: None,
        main_device: None,
    };
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
