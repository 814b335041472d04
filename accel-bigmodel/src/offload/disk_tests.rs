use candle_core::{DType, Device, Tensor};

use super::*;
use crate::offload::WeightSource;

#[test]
fn dat_files_round_trip_f32_bf16_f16_and_scalars_in_accelerates_format() {
    let dir = tempfile::tempdir().unwrap();
    let base = Tensor::arange(0f32, 6., &Device::Cpu)
        .unwrap()
        .reshape((2, 3))
        .unwrap();
    let base = (base * 1.37).unwrap();
    let tensors: Vec<(String, Tensor)> = [DType::F32, DType::BF16, DType::F16]
        .iter()
        .map(|&d| (format!("w.{d:?}"), base.to_dtype(d).unwrap()))
        .chain([("s".to_string(), Tensor::new(2.5f32, &Device::Cpu).unwrap())])
        .collect();
    offload_state_dict(dir.path(), tensors.iter().map(|(n, t)| (n.as_str(), t))).unwrap();
    // bf16 is stored as its raw 16-bit patterns: 6 elements, 12 bytes.
    assert_eq!(
        std::fs::metadata(dir.path().join("w.BF16.dat"))
            .unwrap()
            .len(),
        12
    );
    assert_eq!(
        std::fs::metadata(dir.path().join("s.dat")).unwrap().len(),
        4
    );
    let index: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("index.json")).unwrap())
            .unwrap();
    assert_eq!(
        index["w.BF16"],
        serde_json::json!({"dtype": "bfloat16", "shape": [2, 3]})
    );
    assert_eq!(index["w.F16"]["dtype"], "float16");
    assert_eq!(
        index["s"],
        serde_json::json!({"dtype": "float32", "shape": []})
    );
    let loader = OffloadedWeightsLoader::open(dir.path()).unwrap();
    for (name, t) in &tensors {
        let back = loader.load(name, &Device::Cpu).unwrap();
        assert_eq!(back.dtype(), t.dtype());
        assert_eq!(back.dims(), t.dims());
        let (a, b) = (
            back.to_dtype(DType::F32).unwrap(),
            t.to_dtype(DType::F32).unwrap(),
        );
        assert_eq!(
            a.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            b.flatten_all().unwrap().to_vec1::<f32>().unwrap()
        );
    }
    let err = loader.load("nope", &Device::Cpu).unwrap_err().to_string();
    assert_eq!(
        err,
        format!("{}: no offloaded weight `nope`", dir.path().display())
    );
}
