//! Tests of single-file safetensors/JSON I/O (kept apart to keep the module short).

use super::*;
use candle_core::{DType, Device, Tensor, Var};
use half::{bf16, f16};

fn cpu() -> Device {
    Device::Cpu
}

/// A safetensors file assembled by hand: length prefix, header, data.
fn craft(header: &str, data: &[u8]) -> Vec<u8> {
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(header.as_bytes());
    out.extend_from_slice(data);
    out
}

fn reason_of(err: Error) -> (PathBuf, String) {
    match err {
        Error::Safetensors { path, reason } => (path, reason),
        other => panic!("expected a Safetensors error, got: {other}"),
    }
}

fn read_err(bytes: &[u8]) -> (PathBuf, String, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bad.safetensors");
    std::fs::write(&path, bytes).unwrap();
    let (p, r) = reason_of(read_safetensors(&path, &cpu()).unwrap_err());
    assert_eq!(p, path);
    (p, r, dir)
}

#[test]
fn f32_bf16_f16_round_trip_bit_for_bit() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.safetensors");
    // Values chosen to catch lossy paths: -0, inf, NaN payloads, subnormals.
    let f32_bits: Vec<u32> = vec![
        0x8000_0000,
        0x7f80_0000,
        0x7fc0_1234,
        0x0000_0001,
        0x3f80_0000,
        0xc2f6_e979,
    ];
    let f16_bits: Vec<u16> = vec![0x8000, 0x7c00, 0x7e01, 0x0001, 0x3c00, 0xd5a5];
    let w32 = Tensor::from_vec(
        f32_bits
            .iter()
            .map(|b| f32::from_bits(*b))
            .collect::<Vec<_>>(),
        (2, 3),
        &cpu(),
    )
    .unwrap();
    let wbf = Tensor::from_vec(
        f16_bits
            .iter()
            .map(|b| bf16::from_bits(*b))
            .collect::<Vec<_>>(),
        (3, 2),
        &cpu(),
    )
    .unwrap();
    let wf16 = Tensor::from_vec(
        f16_bits
            .iter()
            .map(|b| f16::from_bits(*b))
            .collect::<Vec<_>>(),
        6,
        &cpu(),
    )
    .unwrap();
    let mut m = BTreeMap::new();
    m.insert("a.f32".to_string(), w32);
    m.insert("b.bf16".to_string(), wbf);
    m.insert("c.f16".to_string(), wf16);
    write_safetensors(&path, &m, None).unwrap();
    let back = read_safetensors(&path, &cpu()).unwrap();
    assert_eq!(
        back.keys().collect::<Vec<_>>(),
        vec!["a.f32", "b.bf16", "c.f16"]
    );
    let a: Vec<u32> = back["a.f32"]
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
        .iter()
        .map(|x| x.to_bits())
        .collect();
    let b: Vec<u16> = back["b.bf16"]
        .flatten_all()
        .unwrap()
        .to_vec1::<bf16>()
        .unwrap()
        .iter()
        .map(|x| x.to_bits())
        .collect();
    let c: Vec<u16> = back["c.f16"]
        .to_vec1::<f16>()
        .unwrap()
        .iter()
        .map(|x| x.to_bits())
        .collect();
    assert_eq!(a, f32_bits);
    assert_eq!(b, f16_bits);
    assert_eq!(c, f16_bits);
    assert_eq!(back["a.f32"].dims(), &[2, 3]);
    assert_eq!(back["b.bf16"].dims(), &[3, 2]);
    assert_eq!(
        (back["b.bf16"].dtype(), back["c.f16"].dtype()),
        (DType::BF16, DType::F16)
    );
}

#[test]
fn f64_u8_u32_i64_scalars_empty_and_strided_tensors_round_trip() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.safetensors");
    let strided = Tensor::arange(0f32, 6., &cpu())
        .unwrap()
        .reshape((2, 3))
        .unwrap()
        .t()
        .unwrap();
    assert!(!strided.is_contiguous());
    let m: Vec<(&str, Tensor)> = vec![
        ("d", Tensor::new(&[1.5f64, -2.25], &cpu()).unwrap()),
        ("u8", Tensor::new(&[0u8, 255], &cpu()).unwrap()),
        ("u32", Tensor::new(&[u32::MAX, 7], &cpu()).unwrap()),
        ("i64", Tensor::new(&[i64::MIN, -1], &cpu()).unwrap()),
        ("scalar", Tensor::new(3.5f32, &cpu()).unwrap()),
        ("empty", Tensor::zeros((0, 4), DType::F32, &cpu()).unwrap()),
        ("strided", strided),
    ];
    write_safetensors(&path, m.iter().map(|(n, t)| (*n, t)), None).unwrap();
    let back = read_safetensors(&path, &cpu()).unwrap();
    assert_eq!(back["d"].to_vec1::<f64>().unwrap(), vec![1.5, -2.25]);
    assert_eq!(back["u8"].to_vec1::<u8>().unwrap(), vec![0, 255]);
    assert_eq!(back["u32"].to_vec1::<u32>().unwrap(), vec![u32::MAX, 7]);
    assert_eq!(back["i64"].to_vec1::<i64>().unwrap(), vec![i64::MIN, -1]);
    assert_eq!(back["scalar"].dims(), &[] as &[usize]);
    assert_eq!(back["scalar"].to_scalar::<f32>().unwrap(), 3.5);
    assert_eq!(back["empty"].dims(), &[0, 4]);
    // The transposed view is saved as its logical (row-major) values.
    assert_eq!(
        back["strided"].to_vec2::<f32>().unwrap(),
        vec![vec![0., 3.], vec![1., 4.], vec![2., 5.]]
    );
}

#[test]
fn metadata_always_has_format_pt_plus_extras() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.safetensors");
    let t = Tensor::new(&[1f32], &cpu()).unwrap();
    let extra = HashMap::from([
        ("step".to_string(), "3".to_string()),
        ("format".to_string(), "np".to_string()),
    ]);
    write_safetensors(&path, [("w", &t)], Some(extra)).unwrap();
    let (_, meta) = read_safetensors_with_metadata(&path, &cpu()).unwrap();
    let expect = HashMap::from([
        ("format".to_string(), "pt".to_string()),
        ("step".to_string(), "3".to_string()),
    ]);
    assert_eq!(meta, expect);
    write_safetensors(&path, [("w", &t)], None).unwrap();
    let (_, meta) = read_safetensors_with_metadata(&path, &cpu()).unwrap();
    assert_eq!(
        meta,
        HashMap::from([("format".to_string(), "pt".to_string())])
    );
    // No temp file left behind.
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
}

#[test]
fn duplicate_names_are_rejected() {
    let dir = tempfile::tempdir().unwrap();
    let t = Tensor::new(&[1f32], &cpu()).unwrap();
    let err = write_safetensors(
        dir.path().join("t.safetensors"),
        [("w", &t), ("w", &t)],
        None,
    )
    .unwrap_err();
    assert!(
        err.to_string().ends_with("tensor name `w` given twice"),
        "{err}"
    );
}

#[test]
fn truncated_data_error_names_the_file_and_tensor() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.safetensors");
    let t = Tensor::zeros(10, DType::F32, &cpu()).unwrap();
    write_safetensors(&path, [("w", &t)], None).unwrap();
    let bytes = std::fs::read(&path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    assert_eq!(bytes.len(), 8 + n + 40);
    std::fs::write(&path, &bytes[..bytes.len() - 8]).unwrap();
    let err = read_safetensors(&path, &cpu()).unwrap_err();
    let msg = err.to_string();
    let (p, reason) = reason_of(err);
    assert_eq!(p, path);
    assert_eq!(
        reason,
        format!(
            "tensor `w` data ends at byte {} but the file has {}",
            8 + n + 40,
            8 + n + 32
        )
    );
    assert!(msg.starts_with(&path.display().to_string()), "{msg}");
}

#[test]
fn file_shorter_than_the_length_prefix_is_reported() {
    let (_, r, _d) = read_err(&[1, 2, 3]);
    assert_eq!(
        r,
        "the file has 3 bytes, too few for the 8-byte header length (truncated?)"
    );
}

#[test]
fn header_length_larger_than_the_file_is_reported() {
    let mut bytes = 1000u64.to_le_bytes().to_vec();
    bytes.extend_from_slice(b"{}");
    let (_, r, _d) = read_err(&bytes);
    assert_eq!(
        r,
        "header length is 1000 bytes but only 2 bytes follow the length prefix (truncated?)"
    );
    let (_, r, _d) = read_err(&u64::MAX.to_le_bytes());
    assert_eq!(
        r,
        format!(
            "header length is {} bytes, above the 100000000-byte limit",
            u64::MAX
        )
    );
}

#[test]
fn bad_json_header_is_reported() {
    let (_, r, _d) = read_err(&craft("{\"a\": ", &[]));
    assert!(r.starts_with("header is not valid JSON: "), "{r}");
}

#[test]
fn overlapping_offsets_name_both_tensors() {
    let h = r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}"#;
    let (_, r, _d) = read_err(&craft(h, &[0; 12]));
    assert_eq!(
        r,
        "tensors `a` (data bytes 0..8) and `b` (data bytes 4..12) overlap"
    );
}

#[test]
fn offsets_past_the_end_name_the_tensor() {
    let h = r#"{"w":{"dtype":"F32","shape":[100],"data_offsets":[0,400]}}"#;
    let bytes = craft(h, &[0; 40]);
    let file_len = bytes.len();
    let (_, r, _d) = read_err(&bytes);
    assert_eq!(
        r,
        format!(
            "tensor `w` data ends at byte {} but the file has {file_len}",
            8 + h.len() + 400
        )
    );
}

#[test]
fn offsets_disagreeing_with_shape_gaps_and_trailing_bytes_are_reported() {
    let h = r#"{"w":{"dtype":"F32","shape":[2,3],"data_offsets":[0,20]}}"#;
    let (_, r, _d) = read_err(&craft(h, &[0; 20]));
    assert_eq!(r, "tensor `w` has dtype F32 and shape [2, 3] (24 bytes) but data_offsets [0, 20] span 20 bytes");
    let h = r#"{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},"b":{"dtype":"U8","shape":[2],"data_offsets":[4,6]}}"#;
    let (_, r, _d) = read_err(&craft(h, &[0; 6]));
    assert_eq!(
        r,
        "data bytes 2..4 belong to no tensor (gap before tensor `b`)"
    );
    let h = r#"{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}}"#;
    let (_, r, _d) = read_err(&craft(h, &[0; 5]));
    assert_eq!(
        r,
        "the file has 3 bytes after the end of the last tensor's data"
    );
    let h = r#"{"a":{"dtype":"Q7","shape":[2],"data_offsets":[0,2]}}"#;
    let (_, r, _d) = read_err(&craft(h, &[0; 2]));
    assert_eq!(r, "tensor `a` has unknown dtype `Q7`");
    let h = r#"{"a":{"dtype":"U8","shape":[2]}}"#;
    let (_, r, _d) = read_err(&craft(h, &[0; 2]));
    assert_eq!(r, "tensor `a` has no `data_offsets` in the header");
}

#[test]
fn dtypes_candle_cannot_hold_are_named() {
    let h = r#"{"mask":{"dtype":"BOOL","shape":[2],"data_offsets":[0,2]}}"#;
    let (_, r, _d) = read_err(&craft(h, &[1, 0]));
    assert_eq!(r, "tensor `mask` has dtype BOOL, which candle cannot hold");
}

#[test]
fn missing_file_is_missing_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("nope.safetensors");
    match read_safetensors(&path, &cpu()).unwrap_err() {
        Error::MissingFile { path: p, what } => {
            assert_eq!(p, path);
            assert_eq!(what, "safetensors tensor file");
        }
        other => panic!("{other}"),
    }
}

fn two_tensor_file(dir: &Path) -> PathBuf {
    let path = dir.join("w.safetensors");
    let a = Tensor::new(&[[1f32, 2.], [3., 4.]], &cpu()).unwrap();
    let b = Tensor::new(&[5f32, 6.], &cpu()).unwrap();
    write_safetensors(&path, [("a", &a), ("b", &b)], None).unwrap();
    path
}

fn spec(name: &str, shape: &[usize], dtype: DType) -> TensorSpec {
    TensorSpec {
        name: name.into(),
        shape: shape.into(),
        dtype,
    }
}

#[test]
fn key_mismatch_lists_all_missing_and_unexpected_sorted() {
    let dir = tempfile::tempdir().unwrap();
    let path = two_tensor_file(dir.path());
    let specs = [
        spec("z", &[1], DType::F32),
        spec("b", &[2], DType::F32),
        spec("c", &[1], DType::F32),
    ];
    match load_into(&path, &specs, true, &cpu()).unwrap_err() {
        Error::KeyMismatch {
            path: p,
            missing,
            unexpected,
        } => {
            assert_eq!(p, path);
            assert_eq!(missing, vec!["c", "z"]);
            assert_eq!(unexpected, vec!["a"]);
        }
        other => panic!("{other}"),
    }
    // Non-strict loads only the names both sides have.
    let got = load_into(&path, &specs, false, &cpu()).unwrap();
    assert_eq!(got.keys().collect::<Vec<_>>(), vec!["b"]);
    assert_eq!(got["b"].to_vec1::<f32>().unwrap(), vec![5., 6.]);
}

#[test]
fn shape_and_dtype_mismatches_name_file_and_tensor() {
    let dir = tempfile::tempdir().unwrap();
    let path = two_tensor_file(dir.path());
    let specs = [spec("a", &[4], DType::F32), spec("b", &[2], DType::F32)];
    match load_into(&path, &specs, true, &cpu()).unwrap_err() {
        Error::ShapeMismatch {
            path: p,
            tensor,
            expected,
            got,
        } => {
            assert_eq!((p, tensor.as_str()), (path.clone(), "a"));
            assert_eq!((expected, got), (vec![4], vec![2, 2]));
        }
        other => panic!("{other}"),
    }
    let specs = [spec("a", &[2, 2], DType::F32), spec("b", &[2], DType::BF16)];
    let err = load_into(&path, &specs, true, &cpu()).unwrap_err();
    assert_eq!(
        err.to_string(),
        format!(
            "{}: tensor `b` has dtype F32, expected BF16",
            path.display()
        )
    );
    let ok = load_into(
        &path,
        &specs_of(&read_safetensors(&path, &cpu()).unwrap()),
        true,
        &cpu(),
    )
    .unwrap();
    assert_eq!(
        ok["a"].to_vec2::<f32>().unwrap(),
        vec![vec![1., 2.], vec![3., 4.]]
    );
}

#[test]
fn restore_vars_sets_all_or_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let path = two_tensor_file(dir.path());
    let a = Var::zeros((2, 2), DType::F32, &cpu()).unwrap();
    let b_wrong = Var::zeros(3, DType::F32, &cpu()).unwrap();
    let vars = vec![
        ("a".to_string(), a.clone()),
        ("b".to_string(), b_wrong.clone()),
    ];
    let err = restore_vars(&path, &vars, true).unwrap_err();
    assert!(
        matches!(&err, Error::ShapeMismatch { tensor, .. } if tensor == "b"),
        "{err}"
    );
    // `a` validated fine but must not have been written.
    assert_eq!(
        a.to_vec2::<f32>().unwrap(),
        vec![vec![0., 0.], vec![0., 0.]]
    );
    assert_eq!(b_wrong.to_vec1::<f32>().unwrap(), vec![0., 0., 0.]);

    let b = Var::zeros(2, DType::F32, &cpu()).unwrap();
    let vars = vec![("a".to_string(), a.clone()), ("b".to_string(), b.clone())];
    restore_vars(&path, &vars, true).unwrap();
    assert_eq!(
        a.to_vec2::<f32>().unwrap(),
        vec![vec![1., 2.], vec![3., 4.]]
    );
    assert_eq!(b.to_vec1::<f32>().unwrap(), vec![5., 6.]);
}

#[test]
fn json_round_trips_and_reports_missing_and_bad_files() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.json");
    let v = serde_json::json!({"step": 3, "lr": [0.5, 1e-3], "name": "é"});
    write_json(&path, &v).unwrap();
    assert_eq!(
        std::fs::read_to_string(&path).unwrap(),
        "{\n  \"lr\": [\n    0.5,\n    0.001\n  ],\n  \"name\": \"\\u00e9\",\n  \"step\": 3\n}\n"
    );
    assert_eq!(read_json(&path).unwrap(), v);
    assert!(matches!(
        read_json(dir.path().join("x.json")),
        Err(Error::MissingFile { .. })
    ));
    std::fs::write(&path, "{\"a\": }").unwrap();
    match read_json(&path).unwrap_err() {
        Error::Json { path: p, reason } => {
            assert_eq!(p, path);
            assert_eq!(reason, "expected value at line 1 column 7");
        }
        other => panic!("{other}"),
    }
}

#[test]
fn state_dicts_round_trip_through_safetensors_and_json() {
    let dir = tempfile::tempdir().unwrap();
    let mut sd = StateDict::from_meta(serde_json::json!({"step": 7}));
    sd.tensors
        .insert("m".into(), Tensor::new(&[1f32, 2.], &cpu()).unwrap());
    let files = save_state_dict(dir.path(), "optimizer", &sd).unwrap();
    assert_eq!(
        files,
        vec![
            dir.path().join("optimizer.safetensors"),
            dir.path().join("optimizer.json")
        ]
    );
    let back = load_state_dict(dir.path(), "optimizer", &cpu()).unwrap();
    assert_eq!(back.meta, serde_json::json!({"step": 7}));
    assert_eq!(back.tensors["m"].to_vec1::<f32>().unwrap(), vec![1., 2.]);

    // Tensors only: no JSON file; meta comes back Null.
    let files = save_state_dict(
        dir.path(),
        "model",
        &StateDict::from_tensors(sd.tensors.clone()),
    )
    .unwrap();
    assert_eq!(files, vec![dir.path().join("model.safetensors")]);
    assert!(load_state_dict(dir.path(), "model", &cpu())
        .unwrap()
        .meta
        .is_null());

    // Entirely empty state still leaves a file so loading it succeeds.
    let files = save_state_dict(dir.path(), "sched", &StateDict::new()).unwrap();
    assert_eq!(files, vec![dir.path().join("sched.json")]);
    assert!(load_state_dict(dir.path(), "sched", &cpu())
        .unwrap()
        .is_empty());

    match load_state_dict(dir.path(), "scaler", &cpu()).unwrap_err() {
        Error::MissingFile { path, what } => {
            assert_eq!(path, dir.path().join("scaler.safetensors"));
            assert_eq!(
                what,
                "saved state of `scaler` (scaler.safetensors and/or scaler.json)"
            );
        }
        other => panic!("{other}"),
    }
}
