//! Quantized bases against transformers + bitsandbytes (`tests/fixtures/quant`,
//! made by `scripts/make_quant_model_fixtures.py`): a full-precision Llama
//! loaded in 4 bits (each type and double-quantization setting) or 8 bits,
//! the folders transformers saved quantized, and a PEFT adapter on the 4-bit
//! base, each giving the reference logits.

use std::path::{Path, PathBuf};

use accel_core::bigmodel::quant::{BnbQuantizationConfig, QuantType};
use accel_core::models::AutoModel;
use candle_core::{DType, Device, Tensor};
use serde_json::Value;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures/quant")
        .join(name)
}

fn reference(dir: &Path) -> Value {
    let text = std::fs::read_to_string(dir.join("reference.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn rows(v: &Value) -> Vec<Vec<f32>> {
    serde_json::from_value(v.clone()).unwrap()
}

fn ids(r: &Value) -> Tensor {
    let ids: Vec<Vec<u32>> = serde_json::from_value(r["input_ids"].clone()).unwrap();
    Tensor::new(ids, &Device::Cpu).unwrap()
}

fn logits(model: &AutoModel, ids: &Tensor) -> Vec<Vec<f32>> {
    model
        .forward(ids)
        .unwrap()
        .get(0)
        .unwrap()
        .to_vec2()
        .unwrap()
}

fn max_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    a.iter()
        .flatten()
        .zip(b.iter().flatten())
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

fn four_bit(qt: QuantType, dq: bool, compute: DType) -> BnbQuantizationConfig {
    BnbQuantizationConfig {
        bnb_4bit_use_double_quant: dq,
        bnb_4bit_compute_dtype: compute,
        ..BnbQuantizationConfig::four_bit(qt)
    }
}

#[test]
fn four_bit_loading_gives_bitsandbytes_logits_for_every_setting() {
    let dir = fixture("llama");
    let r = reference(&dir);
    let ids = ids(&r);
    let fp32 = rows(&r["fp32"]);
    for qt in [QuantType::Nf4, QuantType::Fp4] {
        for dq in [false, true] {
            let key = format!("4bit_{}_{}", qt.name(), if dq { "dq" } else { "plain" });
            let q = four_bit(qt, dq, DType::F32);
            let model =
                AutoModel::load_quantized(&dir, Some(&q), None, DType::F32, &Device::Cpu).unwrap();
            let got = logits(&model, &ids);
            let want = rows(&r[&key]);
            let d = max_diff(&got, &want);
            assert!(d < 1e-3, "{key}: max |ours - bitsandbytes| = {d}");
            // The quantization itself moved the logits far more than that.
            assert!(max_diff(&want, &fp32) > 10.0 * d.max(1e-4), "{key}");
        }
    }
    // bf16 compute: bitsandbytes casts inputs and the dequantized weight to
    // bf16 and multiplies there; ours the same operands, f32 sums in another order.
    let q = four_bit(QuantType::Nf4, true, DType::BF16);
    let model = AutoModel::load_quantized(&dir, Some(&q), None, DType::F32, &Device::Cpu).unwrap();
    let d = max_diff(&logits(&model, &ids), &rows(&r["4bit_nf4_dq_bf16"]));
    assert!(d < 2e-2, "nf4 bf16 compute: {d}");
}

/// LLM.int8 quantizes activations too; ours multiplies the int8 weight in
/// the input's precision, which must be no further from fp32 than it (by
/// the mean and the root mean square of the logits' errors; one largest
/// error over 768 logits is too noisy a measure: there the two are within
/// 12% of each other either way).
#[test]
fn eight_bit_loading_is_no_further_from_fp32_than_llm_int8() {
    let dir = fixture("llama");
    let r = reference(&dir);
    let ids = ids(&r);
    let q = BnbQuantizationConfig::eight_bit();
    let model = AutoModel::load_quantized(&dir, Some(&q), None, DType::F32, &Device::Cpu).unwrap();
    let fp32 = rows(&r["fp32"]);
    let errors = |l: &[Vec<f32>]| -> (f64, f64) {
        let d: Vec<f64> = l
            .iter()
            .flatten()
            .zip(fp32.iter().flatten())
            .map(|(a, b)| f64::from(a - b))
            .collect();
        let n = d.len() as f64;
        (
            d.iter().map(|v| v.abs()).sum::<f64>() / n,
            (d.iter().map(|v| v * v).sum::<f64>() / n).sqrt(),
        )
    };
    let ours = errors(&logits(&model, &ids));
    let theirs = errors(&rows(&r["8bit"]));
    assert!(ours.0 > 0.0, "the weights are quantized");
    assert!(
        ours.0 <= theirs.0 && ours.1 <= theirs.1,
        "ours {ours:?}, bitsandbytes {theirs:?}"
    );
}

#[test]
fn folders_transformers_saved_quantized_load_without_flags() {
    for name in ["llama-nf4-dq", "llama-8bit"] {
        let dir = fixture(name);
        let r = reference(&dir);
        let model = AutoModel::load(&dir, DType::F32, &Device::Cpu).unwrap();
        let got = logits(&model, &ids(&r));
        let want = rows(&r["logits"]);
        let d = max_diff(&got, &want);
        // 8 bits: bitsandbytes quantizes the activations as well (see above).
        let tol = if name.ends_with("8bit") { 5e-2 } else { 1e-3 };
        assert!(d < tol, "{name}: {d}");
        let e = AutoModel::load_quantized(
            &dir,
            Some(&BnbQuantizationConfig::eight_bit()),
            None,
            DType::F32,
            &Device::Cpu,
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("already quantized"), "{e}");
    }
}

/// PEFT's adapter on the 4-bit base runs unmerged, with PEFT's logits.
#[test]
fn a_peft_adapter_on_the_four_bit_base_gives_peft_s_logits() {
    let adapter = fixture("qlora-adapter");
    let r = reference(&adapter);
    let q = four_bit(QuantType::Nf4, true, DType::F32);
    let model = AutoModel::load_quantized(
        fixture("llama"),
        Some(&q),
        Some(&adapter),
        DType::F32,
        &Device::Cpu,
    )
    .unwrap();
    let d = max_diff(&logits(&model, &ids(&r)), &rows(&r["logits"]));
    assert!(d < 1e-3, "{d}");
    // On the folder saved quantized, the same.
    let model = AutoModel::load_with_adapter(
        fixture("llama-nf4-dq"),
        Some(&adapter),
        DType::F32,
        &Device::Cpu,
    )
    .unwrap();
    let d = max_diff(&logits(&model, &ids(&r)), &rows(&r["logits"]));
    assert!(d < 1e-3, "saved base: {d}");
}
