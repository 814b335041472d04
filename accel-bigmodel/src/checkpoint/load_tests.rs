//! Tests of `load_checkpoint_in_model`.

use super::*;
use crate::checkpoint::test_files::{write, write_sharded};
use candle_core::{Device, Tensor};

fn cpu() -> Device {
    Device::Cpu
}

fn var(values: &[f32], dtype: DType) -> Var {
    let t = Tensor::new(values, &cpu())
        .unwrap()
        .to_dtype(dtype)
        .unwrap();
    Var::from_tensor(&t).unwrap()
}

fn values(v: &Var) -> Vec<f32> {
    v.to_dtype(DType::F32).unwrap().to_vec1::<f32>().unwrap()
}

fn named(vars: &[(&str, &Var)]) -> Vec<(String, Var)> {
    vars.iter()
        .map(|(n, v)| (n.to_string(), (*v).clone()))
        .collect()
}

/// `body.w` f32[2], `head.w` f32[2], `step` u32[1], in one file.
fn checkpoint(dir: &Path) -> PathBuf {
    write(
        &dir.join("model.safetensors"),
        &[
            ("body.w", Tensor::new(&[1.5f32, 2.5], &cpu()).unwrap()),
            ("head.w", Tensor::new(&[3.25f32, -4.0], &cpu()).unwrap()),
            ("step", Tensor::new(&[9u32], &cpu()).unwrap()),
        ],
    )
}

#[test]
fn weights_load_into_vars_converted_to_each_vars_dtype() {
    let dir = tempfile::tempdir().unwrap();
    checkpoint(dir.path());
    let body = var(&[0., 0.], DType::BF16);
    let head = var(&[0., 0.], DType::F32);
    let step = Var::from_tensor(&Tensor::new(&[0u32], &cpu()).unwrap()).unwrap();
    let vars = named(&[("body.w", &body), ("head.w", &head), ("step", &step)]);
    let report = load_checkpoint_in_model(&vars, dir.path(), &LoadOptions::default()).unwrap();
    assert_eq!(report.loaded, ["body.w", "head.w", "step"]);
    assert!(report.missing_keys.is_empty() && report.unexpected_keys.is_empty());
    assert_eq!(report.files, [dir.path().join("model.safetensors")]);
    assert_eq!(body.dtype(), DType::BF16);
    assert_eq!(values(&body), [1.5, 2.5]);
    assert_eq!(values(&head), [3.25, -4.0]);
    assert_eq!(step.to_vec1::<u32>().unwrap(), [9]);
}

#[test]
fn strict_loading_lists_every_missing_and_unexpected_key_and_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let path = checkpoint(dir.path());
    let body = var(&[0., 0.], DType::F32);
    let extra = var(&[7.], DType::F32);
    let vars = named(&[("body.w", &body), ("z.w", &extra), ("a.w", &extra)]);
    let strict = LoadOptions::default().with_strict(true);
    match load_checkpoint_in_model(&vars, &path, &strict).unwrap_err() {
        Error::KeyMismatch {
            checkpoint,
            missing,
            unexpected,
        } => {
            assert_eq!(checkpoint, path);
            assert_eq!(missing, ["a.w", "z.w"]);
            assert_eq!(unexpected, ["head.w", "step"]);
        }
        other => panic!("{other}"),
    }
    assert_eq!(values(&body), [0., 0.]);
    // Non-strict (Accelerate's default) loads what both sides have and reports the rest.
    let report = load_checkpoint_in_model(&vars, &path, &LoadOptions::default()).unwrap();
    assert_eq!(report.loaded, ["body.w"]);
    assert_eq!(report.missing_keys, ["a.w", "z.w"]);
    assert_eq!(report.unexpected_keys, ["head.w", "step"]);
    assert_eq!((values(&body), values(&extra)), (vec![1.5, 2.5], vec![7.]));
}

#[test]
fn a_shape_mismatch_names_tensor_and_file_before_any_var_is_set() {
    let dir = tempfile::tempdir().unwrap();
    let a = Tensor::new(&[1f32, 2.], &cpu()).unwrap();
    let b = Tensor::new(&[3f32, 4., 5.], &cpu()).unwrap();
    write_sharded(
        dir.path(),
        &[
            ("model-00001-of-00002.safetensors", vec![("a", a)]),
            ("model-00002-of-00002.safetensors", vec![("b", b)]),
        ],
    );
    let va = var(&[0., 0.], DType::F32);
    let vb = var(&[0., 0.], DType::F32);
    let err = load_checkpoint_in_model(
        &named(&[("a", &va), ("b", &vb)]),
        dir.path(),
        &LoadOptions::default(),
    )
    .unwrap_err();
    assert_eq!(
        err.to_string(),
        format!(
            "{}: tensor `b` has shape [3], expected [2]",
            dir.path()
                .join("model-00002-of-00002.safetensors")
                .display()
        )
    );
    assert_eq!(
        values(&va),
        [0., 0.],
        "`a` was valid but nothing may change"
    );
}

#[test]
fn dtype_rules_follow_accelerate_and_are_checked_against_the_vars() {
    let opts = LoadOptions::default()
        .with_dtype(Some(DType::F16))
        .with_keep_in_fp32_modules(["head"]);
    assert_eq!(
        opts.target_dtype("body.w", DType::F32),
        Some((DType::F16, "LoadOptions::dtype"))
    );
    assert_eq!(
        opts.target_dtype("model.head.w", DType::F32),
        Some((DType::F32, "keep_in_fp32_modules"))
    );
    assert_eq!(
        opts.target_dtype("head", DType::BF16),
        Some((DType::F32, "keep_in_fp32_modules"))
    );
    // Neither a bare substring nor an integer tensor is affected.
    assert_eq!(
        opts.target_dtype("header.w", DType::F32),
        Some((DType::F16, "LoadOptions::dtype"))
    );
    assert_eq!(opts.target_dtype("step", DType::U32), None);
    // Accelerate keeps modules in f32 only when loading in f16.
    let bf16 = opts.clone().with_dtype(Some(DType::BF16));
    assert_eq!(
        bf16.target_dtype("head.w", DType::F32),
        Some((DType::BF16, "LoadOptions::dtype"))
    );

    let dir = tempfile::tempdir().unwrap();
    checkpoint(dir.path());
    let body = var(&[0., 0.], DType::F16);
    let head = var(&[0., 0.], DType::F16);
    let step = Var::from_tensor(&Tensor::new(&[0u32], &cpu()).unwrap()).unwrap();
    let vars = named(&[("body.w", &body), ("head.w", &head), ("step", &step)]);
    let err = load_checkpoint_in_model(&vars, dir.path(), &opts).unwrap_err();
    assert_eq!(
        err.to_string(),
        "load_checkpoint_in_model: `head.w` is a F16 Var but keep_in_fp32_modules asks for F32; build the model in the dtype you load"
    );
    assert_eq!(values(&body), [0., 0.]);
    let head = var(&[0., 0.], DType::F32);
    let vars = named(&[("body.w", &body), ("head.w", &head), ("step", &step)]);
    load_checkpoint_in_model(&vars, dir.path(), &opts).unwrap();
    assert_eq!(
        (values(&body), values(&head)),
        (vec![1.5, 2.5], vec![3.25, -4.0])
    );
}

#[test]
fn a_varmap_loads_in_place_and_duplicate_names_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    checkpoint(dir.path());
    let map = VarMap::new();
    let vb = candle_nn::VarBuilder::from_varmap(&map, DType::F32, &cpu());
    let w = vb.pp("body").get(2, "w").unwrap();
    let report = load_checkpoint_in_varmap(&map, dir.path(), &LoadOptions::default()).unwrap();
    assert_eq!(report.loaded, ["body.w"]);
    // The model's tensor shares the Var's storage, so it sees the loaded values.
    assert_eq!(w.to_vec1::<f32>().unwrap(), [1.5, 2.5]);

    let v = var(&[0., 0.], DType::F32);
    let err = load_checkpoint_in_model(
        &named(&[("body.w", &v), ("body.w", &v)]),
        dir.path(),
        &LoadOptions::default(),
    )
    .unwrap_err();
    assert!(matches!(err, Error::DuplicateName { name } if name == "body.w"));
}
