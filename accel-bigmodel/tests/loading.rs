//! Loading big models through the public API: describe a checkpoint from its
//! headers, plan a model built without memory, load shards into candle `Var`s,
//! and refuse damaged input with errors naming the file, tensor or module.

#[path = "support/files.rs"]
mod files;

use std::path::Path;

use accel_bigmodel::{
    infer_auto_device_map, init_empty_weights, load_checkpoint_in_model, load_checkpoint_in_varmap,
    CheckpointSource, DTypeName, Error, LoadOptions, ModuleTree, Placement, PlanOptions,
};
use candle_core::{DType, Device, Module, Tensor, Var};
use candle_nn::{VarBuilder, VarMap};
use files::{craft, rss_bytes, write, write_sharded};

fn cpu() -> Device {
    Device::Cpu
}

/// Splits a safetensors error into (file, tensor, reason), or fails the test.
fn safetensors_error(err: Error) -> (std::path::PathBuf, Option<String>, String) {
    match err {
        Error::Safetensors {
            path,
            tensor,
            reason,
        } => (path, tensor, reason),
        other => panic!("expected a safetensors error, got: {other}"),
    }
}

// === planning without memory ===

#[test]
fn a_120_gb_model_is_built_empty_and_planned_without_ram() {
    let before = rss_bytes();
    let (weights, vb) = init_empty_weights(DType::F32, &cpu());
    let layers: Vec<candle_nn::Linear> = (0..3)
        .map(|i| candle_nn::linear(100_000, 100_000, vb.pp(format!("layers.{i}"))).unwrap())
        .collect();
    assert_eq!(layers[2].weight().dims(), &[100_000, 100_000]);
    let tree = weights.tree().unwrap();
    let budget = vec![
        (Placement::Gpu(0), "90GB".into()),
        (Placement::Cpu, "100GB".into()),
    ];
    let plan = infer_auto_device_map(&tree, &PlanOptions::new(budget)).unwrap();
    let grown = rss_bytes().saturating_sub(before);
    assert!(grown < 100 << 20, "RSS grew by {grown} bytes");

    // Each layer is 40.0004 GB (weight + bias). GPU 0 keeps room for the
    // largest layer, so it takes one; the CPU takes the rest, and no longer
    // reserves room once the last layer of that size is the one being placed
    // (Accelerate drops it from `max_layer_names` before sizing the device).
    let placed: Vec<_> = plan.device_map.iter().collect();
    assert_eq!(
        placed,
        [
            ("layers.0", Placement::Gpu(0)),
            ("layers.1", Placement::Cpu),
            ("layers.2", Placement::Cpu)
        ]
    );
}

#[test]
fn a_checkpoint_is_described_from_headers_even_when_its_data_is_garbage() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.safetensors");
    // 1 GiB of f32 and a bf16 vector; the data region is a hole with garbage
    // scribbled into it, which neither describing nor mapping may read.
    let header = r#"{"emb.weight":{"dtype":"F32","shape":[16384,16384],"data_offsets":[0,1073741824]},"h.0.w":{"dtype":"BF16","shape":[8],"data_offsets":[1073741824,1073741840]}}"#;
    let file = craft(&path, header, &[]);
    let data_start = 8 + header.len() as u64;
    let f = std::fs::OpenOptions::new().write(true).open(&file).unwrap();
    f.set_len(data_start + (1 << 30) + 16).unwrap();
    use std::os::unix::fs::FileExt;
    for at in [0u64, 12345, 1 << 29, (1 << 30) + 3] {
        f.write_at(&[0xFF; 7], data_start + at).unwrap();
    }

    let before = rss_bytes();
    let tree = ModuleTree::from_safetensors(dir.path()).unwrap();
    let emb = tree.tensor(tree.tensor_id("emb.weight").unwrap());
    assert_eq!(
        (&emb.shape[..], emb.dtype),
        (&[16384, 16384][..], DTypeName::FLOAT32)
    );
    let source = CheckpointSource::open(&path).unwrap();
    let at = source.locate("h.0.w").unwrap();
    assert_eq!(
        at.byte_range,
        data_start + (1 << 30)..data_start + (1 << 30) + 16
    );
    assert_eq!(at.dtype(), Some(DType::BF16));
    let grown = rss_bytes().saturating_sub(before);
    assert!(grown < 100 << 20, "RSS grew by {grown} bytes");
}

// === loading ===

#[test]
fn a_sharded_checkpoint_loads_into_a_candle_model_in_another_dtype() {
    let dir = tempfile::tempdir().unwrap();
    let w0 = Tensor::new(&[[1f32, 2.], [3., 4.]], &cpu()).unwrap();
    let b0 = Tensor::new(&[0.5f32, -0.5], &cpu()).unwrap();
    let w1 = Tensor::new(&[[0f32, 1.], [1., 0.]], &cpu()).unwrap();
    write_sharded(
        dir.path(),
        &[
            (
                "model-00001-of-00002.safetensors",
                vec![("l0.weight", w0), ("l0.bias", b0)],
            ),
            ("model-00002-of-00002.safetensors", vec![("l1.weight", w1)]),
        ],
    );
    // The tree the planner sees comes from the headers alone.
    let tree = ModuleTree::from_safetensors(dir.path()).unwrap();
    assert_eq!(tree.parameters().len(), 3);

    let map = VarMap::new();
    let vb = VarBuilder::from_varmap(&map, DType::BF16, &cpu());
    let l0 = candle_nn::linear(2, 2, vb.pp("l0")).unwrap();
    let l1 = candle_nn::linear_no_bias(2, 2, vb.pp("l1")).unwrap();
    let opts = LoadOptions::default()
        .with_dtype(Some(DType::BF16))
        .with_strict(true);
    let report = load_checkpoint_in_varmap(&map, dir.path(), &opts).unwrap();
    assert_eq!(report.loaded, ["l0.bias", "l0.weight", "l1.weight"]);
    assert_eq!(report.files.len(), 2);

    let x = Tensor::new(&[[1f32, 1.]], &cpu())
        .unwrap()
        .to_dtype(DType::BF16)
        .unwrap();
    let y = l1.forward(&l0.forward(&x).unwrap()).unwrap();
    let y = y.to_dtype(DType::F32).unwrap().to_vec2::<f32>().unwrap();
    // l0: [1+2+0.5, 3+4-0.5] = [3.5, 6.5]; l1 swaps them.
    assert_eq!(y, [[6.5, 3.5]]);
}

// === bad input ===

#[test]
fn a_truncated_file_names_the_file_and_the_tensor() {
    let dir = tempfile::tempdir().unwrap();
    let path = write(
        &dir.path().join("model.safetensors"),
        &[("w", Tensor::zeros(10, DType::F32, &cpu()).unwrap())],
    );
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..bytes.len() - 8]).unwrap();
    let var = Var::zeros(10, DType::F32, &cpu()).unwrap();
    let err = load_checkpoint_in_model(&[("w".into(), var)], dir.path(), &LoadOptions::default())
        .unwrap_err();
    let (file, tensor, reason) = safetensors_error(err);
    assert_eq!((file, tensor.as_deref()), (path, Some("w")));
    assert_eq!(
        reason,
        format!(
            "tensor `w` data ends at byte {} but the file has {}",
            bytes.len(),
            bytes.len() - 8
        )
    );
}

#[test]
fn header_lengths_past_the_file_or_absurdly_large_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.safetensors");
    let mut bytes = 1000u64.to_le_bytes().to_vec();
    bytes.extend_from_slice(b"{}");
    std::fs::write(&path, &bytes).unwrap();
    let (file, _, reason) = safetensors_error(CheckpointSource::open(&path).unwrap_err());
    assert_eq!(file, path);
    assert_eq!(
        reason,
        "header length is 1000 bytes but only 2 bytes follow the length prefix (truncated?)"
    );
    // 200 MB claimed by a 16-byte file: refused by the limit before any allocation,
    // on both the header-only path and the mapped one.
    let mut bytes = 200_000_000u64.to_le_bytes().to_vec();
    bytes.extend_from_slice(b"{}{}{}{}");
    std::fs::write(&path, &bytes).unwrap();
    let limit = "header length is 200000000 bytes, above the 100000000-byte limit";
    assert_eq!(
        safetensors_error(ModuleTree::from_safetensors(&path).unwrap_err()).2,
        limit
    );
    assert_eq!(
        safetensors_error(CheckpointSource::open(&path).unwrap_err()).2,
        limit
    );
}

#[test]
fn overlapping_offsets_name_both_tensors() {
    let dir = tempfile::tempdir().unwrap();
    let h = r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}"#;
    let path = craft(&dir.path().join("model.safetensors"), h, &[0; 12]);
    let err = ModuleTree::from_safetensors(dir.path()).unwrap_err();
    assert_eq!(
        err.to_string(),
        format!(
            "{}: invalid safetensors file: tensors `a` (data bytes 0..8) and `b` (data bytes 4..12) overlap",
            path.display()
        )
    );
}

#[test]
fn a_shard_missing_from_disk_or_from_its_index_entry_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let t = || Tensor::new(&[1f32], &cpu()).unwrap();
    let index = write_sharded(
        dir.path(),
        &[
            ("model-00001-of-00002.safetensors", vec![("a", t())]),
            (
                "model-00002-of-00002.safetensors",
                vec![("b", t()), ("c", t())],
            ),
        ],
    );
    let second = dir.path().join("model-00002-of-00002.safetensors");
    let saved = std::fs::read(&second).unwrap();
    std::fs::remove_file(&second).unwrap();
    let expected = format!(
        "{}: missing checkpoint file (shard listed in {} for 2 tensor(s), e.g. `b`)",
        second.display(),
        index.display()
    );
    assert_eq!(
        CheckpointSource::open(dir.path()).unwrap_err().to_string(),
        expected
    );
    assert_eq!(
        ModuleTree::from_safetensors(&index)
            .unwrap_err()
            .to_string(),
        expected
    );

    // Back on disk, but the index now sends `a` to the shard that lacks it.
    std::fs::write(&second, saved).unwrap();
    let text = std::fs::read_to_string(&index).unwrap();
    std::fs::write(
        &index,
        text.replace("\"a\": \"model-00001", "\"a\": \"model-00002"),
    )
    .unwrap();
    let (file, tensor, reason) = safetensors_error(CheckpointSource::open(dir.path()).unwrap_err());
    assert_eq!((file, tensor.as_deref()), (second, Some("a")));
    assert_eq!(
        reason,
        format!(
            "{} maps tensor `a` to this shard, but the shard does not hold it",
            index.display()
        )
    );
}

#[test]
fn a_budget_nothing_fits_sends_everything_to_disk_and_says_which_device_was_too_small() {
    // Accelerate always appends "disk" to the devices, so infer_auto_device_map
    // never leaves a module out or raises: what fits nowhere goes to disk, and
    // an INFO log names each device that got nothing with the memory it needed.
    // Python: infer_auto_device_map(model, max_memory={0: 100}) on two 1000-byte layers.
    let tree = ModuleTree::from_tensors([
        ("a.weight", vec![250], DTypeName::FLOAT32),
        ("b.weight", vec![250], DTypeName::FLOAT32),
    ])
    .unwrap();
    let plan = infer_auto_device_map(
        &tree,
        &PlanOptions::new(vec![(Placement::Gpu(0), 100u64.into())]),
    )
    .unwrap();
    let placed: Vec<_> = plan.device_map.iter().collect();
    assert_eq!(placed, [("", Placement::Disk)]);
    assert_eq!(
        plan.logs,
        ["Based on the current allocation process, no modules could be assigned to the following devices due to \
          insufficient memory:\n  - 0: 2000 bytes required\nThese minimum requirements are specific to this \
          allocation attempt and may vary. Consider increasing the available memory for these devices to at least \
          the specified minimum, or adjusting the model config."]
    );
    // A map that then leaves a module without any device is refused naming it.
    let mut partial = accel_bigmodel::DeviceMap::new();
    partial.insert("a", Placement::Gpu(0));
    let err = accel_bigmodel::check_device_map(&tree, &partial).unwrap_err();
    assert_eq!(
        err.to_string(),
        "The device_map provided does not give any device for the following parameters: b.weight"
    );
}

#[test]
fn a_shape_mismatch_names_the_tensor_and_the_shard() {
    let dir = tempfile::tempdir().unwrap();
    write_sharded(
        dir.path(),
        &[(
            "model-00001-of-00001.safetensors",
            vec![("w", Tensor::zeros((2, 3), DType::F32, &cpu()).unwrap())],
        )],
    );
    let var = Var::zeros((3, 2), DType::F32, &cpu()).unwrap();
    let err = load_checkpoint_in_model(&[("w".into(), var)], dir.path(), &LoadOptions::default())
        .unwrap_err();
    let shard = Path::new(dir.path()).join("model-00001-of-00001.safetensors");
    assert_eq!(
        err.to_string(),
        format!(
            "{}: tensor `w` has shape [2, 3], expected [3, 2]",
            shard.display()
        )
    );
}
