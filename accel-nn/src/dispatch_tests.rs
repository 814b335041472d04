use std::collections::HashMap;

use candle_core::{DType, Device, Tensor};

use super::*;
use crate::block::{Block, Model, Sequential};
use crate::hooks::tests::{bits, block, input, model, plain_forward, Dyn};

fn empty_model() -> Sequential<Dyn> {
    let dims = [(8, 16), (16, 16), (16, 4)];
    let parts = dims.iter().enumerate().map(|(i, &(a, b))| {
        Block::empty(&format!("h.{i}"), "", DType::F32, &Device::Cpu, block(a, b)).unwrap()
    });
    Sequential::new(parts.collect())
}

fn map(entries: &[(&str, Placement)]) -> DeviceMap {
    let mut m = DeviceMap::new();
    for (k, p) in entries {
        m.insert(*k, *p);
    }
    m
}

/// Saves the plain model's weights as a checkpoint; returns the folder guard and file.
fn checkpoint() -> (tempfile::TempDir, std::path::PathBuf, Tensor) {
    let (model, plain, _map) = model();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.safetensors");
    let tensors: HashMap<String, Tensor> = model.named_tensors().into_iter().collect();
    candle_core::safetensors::save(&tensors, &path).unwrap();
    let expected = plain_forward(&plain, &input());
    (dir, path, expected)
}

#[test]
fn a_device_map_mixing_cpu_and_disk_gives_the_plain_models_output() {
    let (_dir, ckpt, expected) = checkpoint();
    let model = empty_model();
    let m = map(&[
        ("h.0", Placement::Cpu),
        ("h.1", Placement::Disk),
        ("h.2", Placement::Disk),
    ]);
    let opts = LoadDispatchOptions {
        device_map: DeviceMapChoice::Map(m),
        dtype: None,
        offload_folder: None,
        main_device: None,
        adapter: None,
    };
    let report = load_checkpoint_and_dispatch(&model, &ckpt, &opts).unwrap();
    assert_eq!(
        (report.count(Placement::Cpu), report.count(Placement::Disk)),
        (1, 2)
    );
    assert!(model.blocks[0].weights().resident_bytes() > 0);
    assert_eq!(model.blocks[1].weights().resident_bytes(), 0);
    assert_eq!(
        bits(&model.forward_hidden(&input()).unwrap()),
        bits(&expected)
    );
    assert_eq!(model.blocks[2].weights().resident_bytes(), 0);
}

#[test]
fn dispatch_model_writes_disk_parts_to_the_offload_folder() {
    let (model, plain, _map) = model();
    let dir = tempfile::tempdir().unwrap();
    let m = map(&[
        ("h.0", Placement::Disk),
        ("h.1", Placement::Cpu),
        ("h.2", Placement::Cpu),
    ]);
    let err = dispatch_model(&model, &m, &DispatchOptions::default()).unwrap_err();
    assert_eq!(
        err.to_string(),
        "module \"h.0\" is placed on disk but no offload folder (or weights map) was given"
    );
    let opts = DispatchOptions {
        offload_dir: Some(dir.path().to_path_buf()),
        ..Default::default()
    };
    dispatch_model(&model, &m, &opts).unwrap();
    assert!(dir.path().join("h.0.weight.dat").is_file());
    assert!(!dir.path().join("h.1.weight.dat").exists());
    assert_eq!(
        bits(&model.forward_hidden(&input()).unwrap()),
        bits(&plain_forward(&plain, &input()))
    );
}

#[test]
fn auto_planning_with_a_small_cpu_budget_sends_the_rest_to_disk() {
    let (_dir, ckpt, expected) = checkpoint();
    let model = empty_model();
    let plan = PlanOptions::new(vec![(Placement::Cpu, "1KB".into())]);
    let opts = LoadDispatchOptions {
        device_map: DeviceMapChoice::Auto(plan),
        dtype: None,
        offload_folder: None,
        main_device: None,
        adapter: None,
    };
    let report = load_checkpoint_and_dispatch(&model, &ckpt, &opts).unwrap();
    assert!(report.count(Placement::Disk) >= 1, "{report:?}");
    assert_eq!(
        bits(&model.forward_hidden(&input()).unwrap()),
        bits(&expected)
    );
}

#[test]
fn bad_maps_and_devices_are_named() {
    let (model, _, _) = model();
    let m = map(&[("h.0", Placement::Cpu), ("h.7", Placement::Cpu)]);
    let err = dispatch_model(&model, &m, &DispatchOptions::default()).unwrap_err();
    assert_eq!(
        err.to_string(),
        "device map: module \"h.7\": no module or weight of the model has this name"
    );
    let m = map(&[("h.0", Placement::Cpu), ("h.1", Placement::Cpu)]);
    let err = dispatch_model(&model, &m, &DispatchOptions::default()).unwrap_err();
    assert_eq!(
        err.to_string(),
        "device map: module \"h.2\": the device map gives this model part no device"
    );
    let m = map(&[
        ("h.0.weight", Placement::Cpu),
        ("h.0.bias", Placement::Disk),
        ("h.1", Placement::Cpu),
        ("h.2", Placement::Cpu),
    ]);
    let err = dispatch_model(&model, &m, &DispatchOptions::default()).unwrap_err();
    assert!(
        err.to_string()
            .starts_with("device map: module \"h.0\": the device map splits"),
        "{err}"
    );
    if !candle_core::utils::cuda_is_available() {
        let m = map(&[
            ("h.0", Placement::Gpu(0)),
            ("h.1", Placement::Cpu),
            ("h.2", Placement::Cpu),
        ]);
        let err = dispatch_model(&model, &m, &DispatchOptions::default()).unwrap_err();
        assert!(
            err.to_string()
                .starts_with("module \"h.0\": cannot execute on cuda:0: "),
            "{err}"
        );
    }
    // Nothing was attached by the failed calls.
    assert!(model.blocks.iter().all(|p| !p.has_hook()));
}

#[test]
fn a_checkpoint_missing_a_weight_is_refused_before_loading() {
    let (_dir, ckpt, _) = checkpoint();
    let mut model = empty_model();
    model
        .blocks
        .push(Block::empty("h.3", "", DType::F32, &Device::Cpu, block(4, 4)).unwrap());
    let opts = LoadDispatchOptions {
        device_map: DeviceMapChoice::Map(map(&[("", Placement::Cpu)])),
        dtype: None,
        offload_folder: None,
        main_device: None,
        adapter: None,
    };
    let err = load_checkpoint_and_dispatch(&model, &ckpt, &opts).unwrap_err();
    assert_eq!(
        err.to_string(),
        format!(
            "{}: no tensor named `h.3.weight` in this checkpoint",
            ckpt.display()
        )
    );
    assert!(model.blocks[0].weights().has_placeholders());
}
