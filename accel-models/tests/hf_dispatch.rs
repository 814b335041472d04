//! The Hugging Face fixtures dispatched with CPU/disk offload, and loaded
//! with weights mapped from their files: against transformers' numbers and
//! Accelerate's device maps (each folder's `reference.json`).

use accel_bigmodel::{DeviceMap, MemorySize, Placement, PlanOptions};
use accel_models::{AutoModel, Bert};
use accel_nn::block::Model;
use accel_nn::{DeviceMapChoice, LoadDispatchOptions};
use candle_core::{DType, Device};

mod common;

use common::*;

// As the example programs do: weights in the checkpoint's dtype are its
// pages (accel_bigmodel::mapped), so every test here runs on mapped weights.
#[global_allocator]
static ALLOC: accel_bigmodel::MappedAlloc = accel_bigmodel::MappedAlloc::system();

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
fn dispatched_with_cpu_and_disk_offload_gives_transformers_logits_and_tokens() {
    for name in DECODERS {
        let empty = AutoModel::empty(fixture(name), DType::F32).unwrap();
        let offload = tempfile::tempdir().unwrap();
        let opts = LoadDispatchOptions::new(DeviceMapChoice::Map(cpu_disk_map(&empty)))
            .with_offload_folder(offload.path());
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
        let opts = LoadDispatchOptions::new(DeviceMapChoice::Map(map));
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
    let opts = |map: DeviceMap| LoadDispatchOptions::new(DeviceMapChoice::Map(map));
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
    for name in [
        "llama",
        "llama3",
        "mistral",
        "qwen2",
        "gpt2",
        "bert",
        "qwen3",
        "gemma2",
        "gemma3",
        "phi3",
        "mixtral",
        "qwen3_moe",
    ] {
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
            let opts = LoadDispatchOptions::new(DeviceMapChoice::Auto(plan));
            let (model, report) = AutoModel::load_dispatched(fixture(name), &opts).unwrap();
            assert!(report.count(Placement::Disk) > 0, "{name}: {report:?}");
            check_logits(name, &model, "auto-planned");
        }
    }
}
