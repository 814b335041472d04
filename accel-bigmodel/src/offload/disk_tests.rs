use candle_core::{DType, Device, Tensor};

use super::*;
use crate::offload::StagingPool;
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

fn bits32(t: &Tensor) -> Vec<u32> {
    let v = t.to_dtype(DType::F32).unwrap().flatten_all().unwrap();
    v.to_vec1::<f32>()
        .unwrap()
        .into_iter()
        .map(f32::to_bits)
        .collect()
}

#[test]
fn load_staged_equals_load_then_convert_for_dat_and_shard_entries() {
    let dir = tempfile::tempdir().unwrap();
    let base = (Tensor::arange(0f32, 12., &Device::Cpu).unwrap() * 0.371).unwrap();
    let base = base.reshape((3, 4)).unwrap();
    let tensors = [
        ("w32".to_string(), base.clone()),
        ("w16".to_string(), base.to_dtype(DType::BF16).unwrap()),
    ];
    offload_state_dict(dir.path(), tensors.iter().map(|(n, t)| (n.as_str(), t))).unwrap();
    let shard = dir.path().join("model.safetensors");
    candle_core::safetensors::save(&tensors.iter().cloned().collect(), &shard).unwrap();
    // Read, not mapped: what this test checks is reading into pool buffers.
    let folder = OffloadedWeightsLoader::open(dir.path())
        .unwrap()
        .with_mapping(false);
    let source = crate::CheckpointSource::open(&shard).unwrap();
    let in_shards = OffloadedWeightsLoader::from_checkpoint(&source, ["w32", "w16"], None)
        .unwrap()
        .with_mapping(false);
    let pool = StagingPool::new();
    for loader in [&folder, &in_shards] {
        for name in ["w32", "w16"] {
            // Same dtype (a straight read) and the other one (read, then cast).
            for dtype in [DType::F32, DType::BF16] {
                let want =
                    crate::checkpoint::convert(loader.load(name, &Device::Cpu).unwrap(), dtype)
                        .unwrap();
                let dst = loader.load_staged(name, &[3, 4], dtype, &pool).unwrap();
                let dst = dst.expect("read into a pool buffer");
                assert_eq!(bits32(&dst), bits32(&want), "{name} as {dtype:?}");
                pool.give_back(vec![dst]);
            }
        }
    }
    // An in-memory tensor is handed out as it is: nothing to read into.
    let memory = OffloadedWeightsLoader::default()
        .with_state_dict([("m".to_string(), base.clone())].into_iter().collect());
    let staged = memory.load_staged("m", &[3, 4], DType::F32, &pool).unwrap();
    assert!(staged.is_none());
    // A shape of another size is refused rather than half filled.
    let staged = folder
        .load_staged("w32", &[2, 4], DType::F32, &pool)
        .unwrap();
    assert!(staged.is_none());
    // After the first reads, the pool's buffers came back round.
    assert!(pool.stats().reused > 0, "{:?}", pool.stats());
}
