//! Tests of sharded model saving and loading.

use super::*;
use candle_core::{DType, Device, Tensor};

fn cpu() -> Device {
    Device::Cpu
}

fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    v.sort();
    v
}

/// a: f32[2] (8 B), b: f32[2] (8 B), c: f16[4] (8 B).
fn small_model() -> BTreeMap<String, Tensor> {
    BTreeMap::from([
        ("a".to_string(), Tensor::new(&[1f32, 2.], &cpu()).unwrap()),
        ("b".to_string(), Tensor::new(&[3f32, 4.], &cpu()).unwrap()),
        (
            "c".to_string(),
            Tensor::ones(4, DType::F16, &cpu()).unwrap(),
        ),
    ])
}

#[test]
fn plan_fills_shards_in_order_and_splits_before_the_limit_is_passed() {
    let plan = ShardPlan::new(
        "model",
        [("a", 4), ("b", 4), ("c", 4), ("d", 4), ("e", 1)],
        8,
    );
    let files: Vec<(&str, Vec<&str>)> = plan
        .files
        .iter()
        .map(|(f, n)| (f.as_str(), n.iter().map(String::as_str).collect()))
        .collect();
    assert_eq!(
        files,
        vec![
            ("model-00001-of-00003.safetensors", vec!["a", "b"]),
            ("model-00002-of-00003.safetensors", vec!["c", "d"]),
            ("model-00003-of-00003.safetensors", vec!["e"]),
        ]
    );
    assert_eq!(plan.total_size, 17);
}

#[test]
fn a_tensor_larger_than_the_limit_gets_its_own_shard_ahead_of_the_open_one() {
    // As in huggingface_hub: the big tensor's shard is appended immediately,
    // while `a` and `c` keep filling the shard still open.
    let plan = ShardPlan::new("model", [("a", 4), ("big", 20), ("c", 4)], 10);
    assert_eq!(
        plan.files,
        vec![
            (
                "model-00001-of-00002.safetensors".to_string(),
                vec!["big".to_string()]
            ),
            (
                "model-00002-of-00002.safetensors".to_string(),
                vec!["a".to_string(), "c".to_string()]
            ),
        ]
    );
    assert_eq!(plan.total_size, 28);
}

#[test]
fn one_shard_is_model_safetensors_without_index() {
    let plan = ShardPlan::new("model", [("a", 4), ("b", 4)], 8);
    assert_eq!(
        plan.files,
        vec![(
            "model.safetensors".to_string(),
            vec!["a".to_string(), "b".to_string()]
        )]
    );
    assert!(!plan.is_sharded());
    let empty = ShardPlan::new("model", [], 8);
    assert_eq!(empty.files, vec![("model.safetensors".to_string(), vec![])]);
}

#[test]
fn sharded_save_writes_exact_files_shards_and_index_text() {
    let dir = tempfile::tempdir().unwrap();
    let model = small_model();
    let written = save_model(dir.path(), &model, 16).unwrap();
    assert_eq!(
        written,
        vec![
            dir.path().join("model-00001-of-00002.safetensors"),
            dir.path().join("model-00002-of-00002.safetensors"),
            dir.path().join("model.safetensors.index.json"),
        ]
    );
    assert_eq!(
        names(dir.path()),
        vec![
            "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors",
            "model.safetensors.index.json"
        ]
    );
    let s1 = read_safetensors(&written[0], &cpu()).unwrap();
    let s2 = read_safetensors(&written[1], &cpu()).unwrap();
    assert_eq!(s1.keys().collect::<Vec<_>>(), vec!["a", "b"]);
    assert_eq!(s2.keys().collect::<Vec<_>>(), vec!["c"]);
    // Python: json.dumps(index, indent=2, sort_keys=True) + "\n"
    let expected = r#"{
  "metadata": {
    "total_size": 24
  },
  "weight_map": {
    "a": "model-00001-of-00002.safetensors",
    "b": "model-00001-of-00002.safetensors",
    "c": "model-00002-of-00002.safetensors"
  }
}
"#;
    assert_eq!(std::fs::read_to_string(&written[2]).unwrap(), expected);

    let back = load_model_tensors(dir.path(), &cpu()).unwrap();
    assert_eq!(back.keys().collect::<Vec<_>>(), vec!["a", "b", "c"]);
    assert_eq!(back["b"].to_vec1::<f32>().unwrap(), vec![3., 4.]);
    assert_eq!(back["c"].dtype(), DType::F16);
}

#[test]
fn a_second_save_removes_stale_shards_single_file_and_index() {
    let dir = tempfile::tempdir().unwrap();
    let model = small_model();
    std::fs::write(dir.path().join("optimizer.safetensors"), b"keep").unwrap();
    std::fs::write(dir.path().join("model_1.safetensors"), b"keep").unwrap();
    save_model(dir.path(), &model, 8).unwrap();
    assert_eq!(
        names(dir.path()),
        vec![
            "model-00001-of-00003.safetensors",
            "model-00002-of-00003.safetensors",
            "model-00003-of-00003.safetensors",
            "model.safetensors.index.json",
            "model_1.safetensors",
            "optimizer.safetensors",
        ]
    );
    save_model(dir.path(), &model, 16).unwrap();
    assert_eq!(
        names(dir.path()),
        vec![
            "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors",
            "model.safetensors.index.json",
            "model_1.safetensors",
            "optimizer.safetensors",
        ]
    );
    save_model(dir.path(), &model, 1 << 20).unwrap();
    assert_eq!(
        names(dir.path()),
        vec![
            "model.safetensors",
            "model_1.safetensors",
            "optimizer.safetensors"
        ]
    );
    save_model(dir.path(), &model, 16).unwrap();
    assert!(!dir.path().join("model.safetensors").exists());
    assert_eq!(load_model_tensors(dir.path(), &cpu()).unwrap().len(), 3);
}

#[test]
fn missing_shard_names_the_shard_and_the_index() {
    let dir = tempfile::tempdir().unwrap();
    save_model(dir.path(), &small_model(), 16).unwrap();
    let shard = dir.path().join("model-00002-of-00002.safetensors");
    std::fs::remove_file(&shard).unwrap();
    match load_model_tensors(dir.path(), &cpu()).unwrap_err() {
        Error::MissingFile { path, what } => {
            assert_eq!(path, shard);
            let index = dir.path().join("model.safetensors.index.json");
            assert_eq!(
                what,
                format!(
                    "shard listed in {} for 1 tensor(s), e.g. `c`",
                    index.display()
                )
            );
        }
        other => panic!("{other}"),
    }
}

#[test]
fn index_entry_absent_from_its_shard_names_tensor_shard_and_index() {
    let dir = tempfile::tempdir().unwrap();
    save_model(dir.path(), &small_model(), 16).unwrap();
    let index = dir.path().join("model.safetensors.index.json");
    let text = std::fs::read_to_string(&index).unwrap();
    // Point `c` at the first shard, which does not hold it.
    let text = text.replace("\"c\": \"model-00002", "\"c\": \"model-00001");
    std::fs::write(&index, text).unwrap();
    let err = load_model_tensors(dir.path(), &cpu()).unwrap_err();
    let shard = dir.path().join("model-00001-of-00002.safetensors");
    assert_eq!(
        err.to_string(),
        format!(
            "{}: invalid safetensors file: {} maps tensor `c` to this shard, but the shard does not hold it",
            shard.display(),
            index.display()
        )
    );
}

#[test]
fn shard_tensor_missing_from_the_index_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    save_model(dir.path(), &small_model(), 16).unwrap();
    let index = dir.path().join("model.safetensors.index.json");
    let text = std::fs::read_to_string(&index).unwrap();
    std::fs::write(
        &index,
        text.replace("    \"b\": \"model-00001-of-00002.safetensors\",\n", ""),
    )
    .unwrap();
    match load_model_tensors(dir.path(), &cpu()).unwrap_err() {
        Error::Safetensors { path, reason } => {
            assert_eq!(path, dir.path().join("model-00001-of-00002.safetensors"));
            assert_eq!(
                reason,
                format!(
                    "the shard holds tensor `b`, which {} does not map to it",
                    index.display()
                )
            );
        }
        other => panic!("{other}"),
    }
}

#[test]
fn index_pointing_outside_the_folder_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let index = dir.path().join("model.safetensors.index.json");
    std::fs::write(&index, r#"{"weight_map": {"w": "../evil.safetensors"}}"#).unwrap();
    match load_model_tensors(dir.path(), &cpu()).unwrap_err() {
        Error::Json { path, reason } => {
            assert_eq!(path, index);
            assert_eq!(reason, "`weight_map` maps `w` to `../evil.safetensors`, which is not a file in this folder");
        }
        other => panic!("{other}"),
    }
}

#[test]
fn no_weights_at_all_is_missing_file() {
    let dir = tempfile::tempdir().unwrap();
    match load_model_tensors(dir.path(), &cpu()).unwrap_err() {
        Error::MissingFile { path, .. } => assert_eq!(path, dir.path().join("model.safetensors")),
        other => panic!("{other}"),
    }
}

#[test]
fn an_empty_model_saves_and_loads_as_one_empty_file() {
    let dir = tempfile::tempdir().unwrap();
    let empty: BTreeMap<String, Tensor> = BTreeMap::new();
    assert_eq!(
        save_model(dir.path(), &empty, 8).unwrap(),
        vec![dir.path().join("model.safetensors")]
    );
    assert!(load_model_tensors(dir.path(), &cpu()).unwrap().is_empty());
}

#[test]
fn parse_size_follows_accelerate_convert_file_size_to_int() {
    let cases: [(&str, u64); 13] = [
        ("10GB", 10_000_000_000),
        ("10GiB", 10 << 30),
        ("1.5MiB", 1_572_864),
        ("2kib", 2048),
        ("100KB", 100_000),
        ("5MB", 5_000_000),
        ("0.1GB", 100_000_000),
        ("5Gb", 625_000_000),
        ("5gb", 625_000_000),
        ("5GBit", 625_000_000),
        ("8kbit", 1000),
        ("1000", 1000),
        (" 3 GB ", 3_000_000_000),
    ];
    for (text, want) in cases {
        assert_eq!(parse_size(text).unwrap(), want, "{text}");
    }
    for bad in ["", "GB", "ten GB", "5TB", "-1GB", "inf GB", "5 G", "1e30GB"] {
        match parse_size(bad).unwrap_err() {
            Error::Config { key, reason } => {
                assert_eq!(key, "max_shard_size");
                assert!(
                    reason.starts_with(&format!("`{bad}` is not a valid size")),
                    "{reason}"
                );
            }
            other => panic!("{other}"),
        }
    }
}
