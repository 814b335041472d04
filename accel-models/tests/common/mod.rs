//! Helpers shared by the test files of the Hugging Face fixtures.
#![allow(dead_code)] // each test file uses its own subset

use std::path::{Path, PathBuf};

use accel_bigmodel::{DeviceMap, Placement};
use accel_models::{AutoModel, Bert};
use accel_nn::block::Model;
use accel_nn::{DeviceMapChoice, LoadDispatchOptions};
use candle_core::{DType, Device, Tensor};
use serde_json::Value;

pub const DECODERS: [&str; 11] = [
    "llama",
    "llama3",
    "mistral",
    "qwen2",
    "gpt2",
    "qwen3",
    "gemma2",
    "gemma3",
    "phi3",
    "mixtral",
    "qwen3_moe",
];
pub const TOL: f32 = 1e-4;

pub fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/hf")
        .join(name)
}

pub fn reference(name: &str) -> Value {
    let text = std::fs::read_to_string(fixture(name).join("reference.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

pub fn ids_tensor(v: &Value) -> Tensor {
    let rows: Vec<Vec<u32>> = serde_json::from_value(v.clone()).unwrap();
    let (b, t) = (rows.len(), rows[0].len());
    Tensor::from_vec(rows.concat(), (b, t), &Device::Cpu).unwrap()
}

pub fn floats(v: &Value, out: &mut Vec<f32>) {
    match v {
        Value::Array(a) => a.iter().for_each(|x| floats(x, out)),
        Value::Number(n) => out.push(n.as_f64().unwrap() as f32),
        other => panic!("not a number: {other}"),
    }
}

/// Largest absolute difference between a tensor and nested JSON numbers.
pub fn max_diff(t: &Tensor, expected: &Value) -> f32 {
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

pub fn check_logits(name: &str, model: &AutoModel, how: &str) {
    let r = reference(name);
    let logits = model.forward(&ids_tensor(&r["input_ids"])).unwrap();
    let d = max_diff(&logits, &r["logits"]);
    assert!(
        d < TOL,
        "{name} ({how}): logits differ from transformers' by {d}"
    );
}

pub fn check_generate(name: &str, model: &AutoModel, how: &str) {
    let g = &reference(name)["generate"];
    let prompt: Vec<u32> = serde_json::from_value(g["prompt_ids"].clone()).unwrap();
    let want: Vec<u32> = serde_json::from_value(g["tokens"].clone()).unwrap();
    let n = g["max_new_tokens"].as_u64().unwrap() as usize;
    let got = model.generate(&prompt, n, &[]).unwrap();
    assert_eq!(got, want, "{name} ({how}): greedy tokens");
}

/// Blocks alternating between CPU and disk, so both hooks run in one forward.
pub fn cpu_disk_map(model: &AutoModel) -> DeviceMap {
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

/// The BERT fixture with every other block on disk, read from the checkpoint.
pub fn offloaded_bert() -> Bert {
    let empty = AutoModel::empty(fixture("bert"), DType::F32).unwrap();
    let opts = LoadDispatchOptions::new(DeviceMapChoice::Map(cpu_disk_map(&empty)));
    let (model, _) = AutoModel::load_dispatched(fixture("bert"), &opts).unwrap();
    let AutoModel::Bert(bert) = model else {
        panic!("the bert fixture loads as BERT")
    };
    bert
}
