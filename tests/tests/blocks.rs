//! One model struct, every way of running it: pretrained weights loaded in
//! every precision and under FSDP (after building, or instead of the random
//! draw), writes behind the Accelerator's back taken
//! up, and the example GPT dispatched with half its blocks on disk.

use std::collections::HashMap;

use accel_core::bigmodel::{init_empty_weights, DeviceMap, Placement};
use accel_core::fsdp::{AutoWrapPolicy, FullyShardedDataParallelPlugin, ShardingStrategy};
use accel_core::nn::{load_checkpoint_and_dispatch, DeviceMapChoice, LoadDispatchOptions, Model};
use accel_core::optim::{AdamW, AdamWConfig};
use accel_core::{Accelerator, AcceleratorConfig, PrecisionType};
use accel_examples::{Gpt, GptConfig};
use candle_core::{DType, Device, Tensor};
use candle_nn::VarMap;

// As the example programs do: weights are mapped from checkpoint files, so
// these tests check the mapped path end to end.
#[global_allocator]
static ALLOC: accel_core::bigmodel::MappedAlloc = accel_core::bigmodel::MappedAlloc::system();

fn cfg() -> GptConfig {
    GptConfig {
        vocab_size: 40,
        n_embd: 32,
        n_layer: 4,
        n_head: 2,
        block_size: 16,
    }
}

fn batch() -> (Tensor, Tensor) {
    let ids: Vec<u32> = (0..2 * 16).map(|i| (i * 7 + 3) % 40).collect();
    let y: Vec<u32> = ids.iter().map(|i| (i * 3 + 1) % 40).collect();
    let x = Tensor::from_vec(ids, (2, 16), &Device::Cpu).unwrap();
    (x, Tensor::from_vec(y, (2, 16), &Device::Cpu).unwrap())
}

/// A "pretrained" checkpoint: a GPT drawn from seed 11, saved as transformers
/// would (`model.safetensors` in a folder); returns the folder and its loss.
fn pretrained() -> (tempfile::TempDir, f32, HashMap<String, Tensor>) {
    let acc = Accelerator::new(AcceleratorConfig::default().with_seed(11)).unwrap();
    let varmap = VarMap::new();
    let gpt = Gpt::new(cfg(), acc.var_builder(&varmap)).unwrap();
    let (x, y) = batch();
    let loss = gpt.loss(&x, &y).unwrap().to_scalar::<f32>().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let tensors: HashMap<String, Tensor> = varmap
        .data()
        .lock()
        .unwrap()
        .iter()
        .map(|(k, v)| (k.clone(), v.as_tensor().clone()))
        .collect();
    candle_core::safetensors::save(&tensors, dir.path().join("model.safetensors")).unwrap();
    (dir, loss, tensors)
}

fn bits(t: &Tensor) -> Vec<u32> {
    let v: Vec<f32> = t
        .flatten_all()
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap()
        .to_vec1()
        .unwrap();
    v.into_iter().map(f32::to_bits).collect()
}

#[test]
fn pretrained_weights_reach_masters_and_compute_copies_in_every_precision_and_under_fsdp() {
    let (dir, fp32_loss, file) = pretrained();
    let (x, y) = batch();
    for (precision, tol) in [
        (PrecisionType::No, 0.0),
        (PrecisionType::Bf16, 2e-2),
        (PrecisionType::Fp16, 2e-3),
    ] {
        // Another seed: nothing but the checkpoint can give the same loss.
        let config = AcceleratorConfig::default()
            .with_seed(5)
            .with_mixed_precision(precision);
        let mut acc = Accelerator::new(config).unwrap();
        let varmap = VarMap::new();
        let gpt = Gpt::new(cfg(), acc.var_builder(&varmap)).unwrap();
        let params = acc.prepare_model(&varmap).unwrap();
        params.load_checkpoint(dir.path()).unwrap();
        for (name, master) in params.master_weights() {
            assert!(
                bits(&master) == bits(&file[&name]),
                "{precision:?} master {name}"
            );
        }
        let mut opt = acc.prepare_optimizer(
            &params,
            AdamW::new(AdamWConfig {
                lr: 1e-3,
                ..Default::default()
            }),
        );
        let loss = gpt.loss(&x, &y).unwrap();
        let first = loss.to_scalar::<f32>().unwrap();
        assert!(
            (first - fp32_loss).abs() <= tol * fp32_loss,
            "{precision:?}: first loss {first} vs fp32 {fp32_loss}"
        );
        acc.backward(&loss).unwrap();
        opt.step().unwrap();
        // The step moved the loaded weights a little; it did not bring back seed 5's.
        let second = gpt.loss(&x, &y).unwrap().to_scalar::<f32>().unwrap();
        assert!(
            (second - first).abs() < 0.05 * first,
            "{precision:?}: {first} -> {second}"
        );
    }
    // FSDP: each rank's pieces stream from the file; the same loss bit for bit.
    let plugin = FullyShardedDataParallelPlugin::new(ShardingStrategy::FullShard)
        .with_auto_wrap_policy(AutoWrapPolicy::Transformer {
            patterns: vec!["GPT2Block".into()],
        });
    let mut acc =
        Accelerator::new(AcceleratorConfig::default().with_seed(5).with_fsdp(plugin)).unwrap();
    let (gpt, fsdp) = acc.prepare_fsdp_model(|vb| Gpt::new(cfg(), vb)).unwrap();
    assert_eq!(
        fsdp.unit_names(),
        ["h.0", "h.1", "h.2", "h.3"],
        "units by block class"
    );
    fsdp.params().load_checkpoint(dir.path()).unwrap();
    let loss = gpt.loss(&x, &y).unwrap().to_scalar::<f32>().unwrap();
    assert_eq!(loss.to_bits(), fp32_loss.to_bits());
}

#[test]
fn prepare_pretrained_starts_where_prepare_then_load_checkpoint_ends() {
    let (dir, fp32_loss, file) = pretrained();
    let (x, y) = batch();
    let weights = |m: &Gpt| -> HashMap<String, Vec<u32>> {
        m.named_tensors()
            .into_iter()
            .map(|(n, t)| (n, bits(&t)))
            .collect()
    };
    for precision in [PrecisionType::No, PrecisionType::Bf16, PrecisionType::Fp16] {
        let config = AcceleratorConfig::default()
            .with_seed(5)
            .with_mixed_precision(precision);
        let mut acc = Accelerator::new(config.clone()).unwrap();
        let (loaded, loaded_params) = acc.prepare(|vb| Gpt::new(cfg(), vb)).unwrap();
        loaded_params.load_checkpoint(dir.path()).unwrap();
        let mut acc = Accelerator::new(config).unwrap();
        let (gpt, params) = acc
            .prepare_pretrained(dir.path(), |vb| Gpt::new(cfg(), vb))
            .unwrap();
        assert_eq!(
            params.len(),
            file.len(),
            "{precision:?}: one parameter per tensor"
        );
        for (name, master) in params.master_weights() {
            assert!(
                bits(&master) == bits(&file[&name]),
                "{precision:?} master {name}"
            );
        }
        assert!(
            weights(&gpt) == weights(&loaded),
            "{precision:?}: compute copies differ from prepare + load_checkpoint"
        );
        let (a, b) = (gpt.loss(&x, &y).unwrap(), loaded.loss(&x, &y).unwrap());
        assert_eq!(bits(&a), bits(&b), "{precision:?} loss");
    }
    let plugin = FullyShardedDataParallelPlugin::new(ShardingStrategy::FullShard)
        .with_auto_wrap_policy(AutoWrapPolicy::Transformer {
            patterns: vec!["GPT2Block".into()],
        });
    let mut acc =
        Accelerator::new(AcceleratorConfig::default().with_seed(5).with_fsdp(plugin)).unwrap();
    let (gpt, fsdp) = acc
        .prepare_fsdp_pretrained(dir.path(), |vb| Gpt::new(cfg(), vb))
        .unwrap();
    assert_eq!(fsdp.unit_names(), ["h.0", "h.1", "h.2", "h.3"]);
    let loss = gpt.loss(&x, &y).unwrap().to_scalar::<f32>().unwrap();
    assert_eq!(loss.to_bits(), fp32_loss.to_bits());
}

#[test]
fn prepare_pretrained_names_a_missing_or_misshapen_tensor_and_its_file() {
    let (_dir, _, file) = pretrained();
    let build = |vb| Gpt::new(cfg(), vb);
    let name = "h.1.mlp.c_fc.weight";
    assert!(
        file.contains_key(name),
        "the GPT names its weights {:?}",
        file.keys()
    );
    // The tensor missing from the checkpoint.
    let missing = tempfile::tempdir().unwrap();
    let mut tensors = file.clone();
    tensors.remove(name);
    candle_core::safetensors::save(&tensors, missing.path().join("model.safetensors")).unwrap();
    let mut acc = Accelerator::new(AcceleratorConfig::default()).unwrap();
    let err = format!(
        "{:#}",
        acc.prepare_pretrained(missing.path(), build).unwrap_err()
    );
    assert!(
        err.contains(name) && err.contains(&missing.path().display().to_string()),
        "{err}"
    );
    // The tensor in another shape.
    let bad = tempfile::tempdir().unwrap();
    let mut tensors = file.clone();
    let w = &file[name];
    tensors.insert(name.into(), w.flatten_all().unwrap());
    let path = bad.path().join("model.safetensors");
    candle_core::safetensors::save(&tensors, &path).unwrap();
    let mut acc = Accelerator::new(AcceleratorConfig::default()).unwrap();
    let err = format!(
        "{:#}",
        acc.prepare_pretrained(bad.path(), build).unwrap_err()
    );
    assert!(
        err.contains(name) && err.contains(&path.display().to_string()) && err.contains("shape"),
        "{err}"
    );
}

#[test]
fn a_bf16_copy_written_behind_the_accelerators_back_is_taken_up_not_overwritten() {
    let (_dir, _, file) = pretrained();
    let config = AcceleratorConfig::default()
        .with_seed(5)
        .with_mixed_precision(PrecisionType::Bf16);
    let mut acc = Accelerator::new(config).unwrap();
    let varmap = VarMap::new();
    let gpt = Gpt::new(cfg(), acc.var_builder(&varmap)).unwrap();
    // Written before prepare_model ...
    let wte = varmap.data().lock().unwrap()["wte.weight"].clone();
    wte.set(&file["wte.weight"].to_dtype(DType::BF16).unwrap())
        .unwrap();
    let params = acc.prepare_model(&varmap).unwrap();
    let master = |name: &str| {
        let all = params.master_weights();
        all.into_iter().find(|(n, _)| n == name).unwrap().1
    };
    let want = file["wte.weight"].to_dtype(DType::BF16).unwrap();
    assert!(bits(&master("wte.weight")) == bits(&want));
    // ... and after it, before a step.
    let mut opt = acc.prepare_optimizer(
        &params,
        AdamW::new(AdamWConfig {
            lr: 0.0,
            weight_decay: 0.0,
            ..Default::default()
        }),
    );
    let h = varmap.data().lock().unwrap()["h.0.mlp.c_fc.weight"].clone();
    let written = file["h.0.mlp.c_fc.weight"].to_dtype(DType::BF16).unwrap();
    h.set(&written).unwrap();
    let (x, y) = batch();
    acc.backward(&gpt.loss(&x, &y).unwrap()).unwrap();
    opt.step().unwrap();
    assert!(bits(&master("h.0.mlp.c_fc.weight")) == bits(&written));
    assert!(
        bits(h.as_tensor()) == bits(&written),
        "the step kept the written copy"
    );
}

#[test]
fn the_gpt_dispatched_with_half_its_blocks_on_disk_gives_the_plain_logits() {
    let (dir, _, file) = pretrained();
    let (x, _) = batch();
    let varmap = VarMap::new();
    let plain = Gpt::new(
        cfg(),
        candle_nn::VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu),
    )
    .unwrap();
    for (name, var) in varmap.data().lock().unwrap().iter() {
        var.set(&file[name]).unwrap();
    }
    let want = plain.forward(&x).unwrap();

    let (_recorder, vb) = init_empty_weights(DType::F32, &Device::Cpu);
    let empty = Gpt::new(cfg(), vb).unwrap();
    let names: Vec<String> = empty.blocks().iter().map(|b| b.name()).collect();
    assert_eq!(names, ["wte", "wpe", "h.0", "h.1", "h.2", "h.3", "ln_f"]);
    let mut map = DeviceMap::new();
    for (i, name) in names.iter().enumerate() {
        let on_disk = i >= names.len() / 2;
        map.insert(
            name.clone(),
            if on_disk {
                Placement::Disk
            } else {
                Placement::Cpu
            },
        );
    }
    let opts = LoadDispatchOptions {
        device_map: DeviceMapChoice::Map(map),
        dtype: None,
        offload_folder: None,
        main_device: None,
        adapter: None,
    };
    let report = load_checkpoint_and_dispatch(&empty, dir.path(), &opts).unwrap();
    assert_eq!(report.count(Placement::Disk), 4);
    let got = empty.forward(&x).unwrap();
    assert!(bits(&got) == bits(&want));
    // Disk blocks hold placeholders again after the forward.
    let head = empty.blocks()[6].weights().tensor("ln_f.weight").unwrap();
    assert!(accel_core::bigmodel::is_placeholder(&head));
}

#[test]
fn a_class_to_wrap_that_no_block_declares_is_an_error_naming_the_key_and_the_classes() {
    let plugin = FullyShardedDataParallelPlugin::new(ShardingStrategy::FullShard)
        .with_auto_wrap_policy(AutoWrapPolicy::Transformer {
            patterns: vec!["LlamaDecoderLayer".into()],
        });
    let mut acc = Accelerator::new(AcceleratorConfig::default().with_fsdp(plugin)).unwrap();
    let err = match acc.prepare(|vb| Gpt::new(cfg(), vb)) {
        Ok(_) => panic!("a class no block has must be refused"),
        Err(e) => e.to_string(),
    };
    assert!(err.contains("fsdp_transformer_layer_cls_to_wrap"), "{err}");
    assert!(
        err.contains("LlamaDecoderLayer") && err.contains("GPT2Block"),
        "{err}"
    );
}
