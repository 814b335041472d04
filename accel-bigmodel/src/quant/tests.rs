//! Byte-for-byte checks against bitsandbytes' own outputs
//! (`tests/fixtures/quant/primitives.*`, `scripts/make_quant_fixtures.py`).

use std::collections::HashMap;
use std::path::PathBuf;

use candle_core::{DType, Device, Tensor};

use super::*;

fn fixture() -> HashMap<String, Tensor> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/quant/primitives.safetensors");
    candle_core::safetensors::load(path, &Device::Cpu).unwrap()
}

fn f32s(t: &Tensor) -> Vec<f32> {
    t.to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

fn u8s(t: &Tensor) -> Vec<u8> {
    t.flatten_all().unwrap().to_vec1().unwrap()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

const WEIGHTS: [&str; 6] = [
    "w_96x64",
    "w_33x70",
    "w_7x9",
    "w_200x90",
    "w_bf16_64x48",
    "w_zero_8x32",
];

#[test]
fn code_books_are_bitsandbytes_own() {
    let t = fixture();
    assert_eq!(bits(&dynamic_map()), bits(&f32s(&t["dynamic_map"])));
    for qt in [QuantType::Nf4, QuantType::Fp4] {
        let key = format!("w_96x64.{}.plain.weight.quant_map", qt.name());
        assert_eq!(bits(qt.codes()), bits(&f32s(&t[&key])), "{}", qt.name());
    }
}

/// Packed bytes, maxima (f32, or 8-bit codes with their nested maxima) and
/// the JSON state equal bitsandbytes' for every weight and setting, and the
/// dequantized weight equals its `dequantize_4bit`.
#[test]
fn four_bit_quantization_is_bitsandbytes_byte_for_byte() {
    let t = fixture();
    for name in WEIGHTS {
        let w = &t[name];
        let values = f32s(w);
        for qt in [QuantType::Nf4, QuantType::Fp4] {
            for dq in [false, true] {
                let key = format!("{name}.{}.{}", qt.name(), if dq { "dq" } else { "plain" });
                let q = Packed4bit::quantize(&values, w.dims(), w.dtype(), qt, dq);
                assert_eq!(q.packed, u8s(&t[&format!("{key}.weight")]), "{key} packed");
                let absmax = &t[&format!("{key}.weight.absmax")];
                match &q.nested {
                    None => assert_eq!(bits(&q.absmax), bits(&f32s(absmax)), "{key} absmax"),
                    Some(n) => {
                        assert_eq!(n.codes, u8s(absmax), "{key} absmax codes");
                        let nested = f32s(&t[&format!("{key}.weight.nested_absmax")]);
                        assert_eq!(bits(&n.absmax), bits(&nested), "{key} nested absmax");
                    }
                }
                let state = &t[&format!("{key}.weight.quant_state.bitsandbytes__{}", qt.name())];
                let json = String::from_utf8(u8s(state)).unwrap();
                assert_eq!(q.state.to_json(), json, "{key} state");
                assert_eq!(
                    State4bit::from_json(json.as_bytes(), &key).unwrap(),
                    q.state
                );
                if let Some(want) = t.get(&format!("{key}.dequantized")) {
                    let got = Tensor::new(q.dequantize(), &Device::Cpu)
                        .unwrap()
                        .to_dtype(w.dtype())
                        .unwrap();
                    let (got, want) = (f32s(&got), f32s(want));
                    // Exact values; bitsandbytes' C kernel decodes FP4's code 8 as -0.0 and
                    // its torch fallback (odd last dims) as +0.0, so zeros compare by value.
                    let bad = got.iter().zip(&want).position(|(a, b)| a != b);
                    assert!(
                        bad.is_none(),
                        "{key} dequantized: first mismatch at {bad:?}: {:?}",
                        bad.map(|i| (got[i], want[i]))
                    );
                }
            }
        }
    }
}

#[test]
fn int8_rows_are_bitsandbytes_byte_for_byte() {
    let t = fixture();
    let a = f32s(&t["int8_in"]);
    for threshold in [0.0f32, 6.0] {
        let tag = format!("int8.t{threshold}");
        let q = int8_vectorwise_quant(&a, 40, threshold);
        let cb: Vec<i8> = u8s(&t[&format!("{tag}.CB")])
            .into_iter()
            .map(|b| b as i8)
            .collect();
        assert_eq!(q.codes, cb, "{tag} CB");
        assert_eq!(
            bits(&q.row_max),
            bits(&f32s(&t[&format!("{tag}.SCB")])),
            "{tag} SCB"
        );
        let cols: Vec<usize> = match t.get(&format!("{tag}.outlier_cols")) {
            Some(c) => c
                .to_vec1::<i64>()
                .unwrap()
                .into_iter()
                .map(|c| c as usize)
                .collect(),
            None => vec![],
        };
        assert_eq!(q.outlier_cols, cols, "{tag} outlier columns");
        let deq = int8_dequant(&q.codes, &q.row_max, 40);
        assert_eq!(
            bits(&deq),
            bits(&f32s(&t[&format!("{tag}.dequantized")])),
            "{tag}"
        );
    }
}

/// A full-precision weight served as its quantized parts: the same bytes
/// as quantizing it directly, only for modules the config quantizes and
/// only for the u8 request of `weight`.
#[test]
fn quantize_on_load_serves_the_parts_of_what_it_quantizes() {
    let mut c = BnbQuantizationConfig::four_bit(QuantType::Nf4);
    c.bnb_4bit_use_double_quant = true;
    c.skip_modules = Some(vec!["skip".into()]);
    let q = QuantizeOnLoad::new(c).unwrap();
    let values: Vec<f32> = (0..96 * 64)
        .map(|i| ((i * 37 % 101) as f32 - 50.0) / 70.0)
        .collect();
    let weight =
        |n: &str| (n == "m.weight" || n == "skip.weight").then(|| (vec![96, 64], DType::F32));
    let serves = |name: &str, dt| q.serves(name, dt, weight).unwrap();
    assert!(serves("m.weight.quant_state.bitsandbytes__nf4", None));
    assert!(serves("m.weight.absmax", None));
    assert!(serves("m.weight.nested_absmax", None));
    assert!(serves("m.weight", Some(DType::U8)));
    assert!(!serves("m.weight", Some(DType::F32)));
    assert!(!serves("m.weight.quant_state.bitsandbytes__fp4", None));
    assert!(!serves("m.SCB", None));
    assert!(!serves("skip.weight.absmax", None));
    assert!(!serves("other.weight.absmax", None));
    let direct = Packed4bit::quantize(&values, &[96, 64], DType::F32, QuantType::Nf4, true);
    let mut reads = 0;
    let mut get = |name: &str, dt| {
        q.tensor(name, dt, &Device::Cpu, |w| {
            assert_eq!(w, "m.weight");
            reads += 1;
            Ok((values.clone(), vec![96, 64], DType::F32))
        })
        .unwrap()
        .unwrap()
    };
    assert_eq!(u8s(&get("m.weight", Some(DType::U8))), direct.packed);
    let state = get("m.weight.quant_state.bitsandbytes__nf4", Some(DType::U8));
    assert_eq!(
        String::from_utf8(u8s(&state)).unwrap(),
        direct.state.to_json()
    );
    let absmax = get("m.weight.absmax", Some(DType::U8));
    assert_eq!(u8s(&absmax), direct.nested.as_ref().unwrap().codes);
    assert_eq!(
        reads, 1,
        "one read and quantization for all parts of a weight"
    );
}
