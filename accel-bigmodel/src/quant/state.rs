//! How a quantized weight is stored: the tensors and the JSON that
//! bitsandbytes' `QuantState.as_dict(packed=True)` and `Linear8bitLt`'s
//! `_save_to_state_dict` write, under the names transformers saves and loads.

use candle_core::DType;
use serde_json::Value;

use super::blockwise::{NestedAbsmax, NESTED_BLOCKSIZE};
use super::QuantType;
use crate::error::{Error, Result};

/// Names of the parts of a 4-bit weight `w`, after `{module}.weight.`.
pub mod names {
    /// The block maxima: f32, or the 8-bit codes with double quantization.
    pub const ABSMAX: &str = "absmax";
    /// The 16 values of the 4-bit codes.
    pub const QUANT_MAP: &str = "quant_map";
    /// Double quantization: the maxima of the maxima's blocks.
    pub const NESTED_ABSMAX: &str = "nested_absmax";
    /// Double quantization: the 256 values of the 8-bit codes.
    pub const NESTED_QUANT_MAP: &str = "nested_quant_map";
    /// The JSON of the state's other fields, as u8 bytes; suffixed by the type.
    pub const QUANT_STATE_PREFIX: &str = "quant_state.bitsandbytes__";
    /// LLM.int8: each row's maximum, beside the module's `weight`.
    pub const SCB: &str = "SCB";
    /// LLM.int8: the layout of the int8 weight (0: row-major), beside `weight`.
    pub const WEIGHT_FORMAT: &str = "weight_format";
}

/// The JSON fields of a 4-bit weight's state (`quant_state.bitsandbytes__*`).
#[derive(Debug, Clone, PartialEq)]
pub struct State4bit {
    /// NF4 or FP4.
    pub quant_type: QuantType,
    /// Values per block (64 from transformers).
    pub blocksize: usize,
    /// The dtype the weight had, and dequantizes to.
    pub dtype: DType,
    /// The weight's shape, `[out, in]`.
    pub shape: Vec<usize>,
    /// Double quantization: the nested block size and the maxima's mean.
    pub nested: Option<(usize, f32)>,
}

impl State4bit {
    /// Elements of the weight.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// 4-bit blocks (the last may be short).
    pub fn blocks(&self) -> usize {
        self.numel().div_ceil(self.blocksize)
    }

    /// The JSON bytes bitsandbytes writes (`json.dumps` of the dict, keys in
    /// its order, Python's float repr), so a saved file is byte-equal.
    pub fn to_json(&self) -> String {
        let shape: Vec<String> = self.shape.iter().map(usize::to_string).collect();
        let mut s = format!(
            r#"{{"quant_type": "{}", "blocksize": {}, "dtype": "{}", "shape": [{}]"#,
            self.quant_type.name(),
            self.blocksize,
            torch_dtype_name(self.dtype),
            shape.join(", ")
        );
        if let Some((nb, offset)) = self.nested {
            s.push_str(&format!(
                r#", "nested_blocksize": {nb}, "nested_dtype": "float32", "nested_offset": {}"#,
                python_float_repr(f64::from(offset))
            ));
        }
        s.push('}');
        s
    }

    /// Parses the JSON of `tensor` (named in errors), checking every field.
    ///
    /// # Errors
    /// [`Error::BadQuantState`] naming the tensor and the field.
    pub fn from_json(bytes: &[u8], tensor: &str) -> Result<Self> {
        let bad = |reason: String| Error::BadQuantState {
            tensor: tensor.to_string(),
            reason,
        };
        let v: Value = serde_json::from_slice(bytes).map_err(|e| bad(format!("not JSON: {e}")))?;
        let field = |k: &str| v.get(k).ok_or_else(|| bad(format!("no `{k}`")));
        let quant_type = field("quant_type")?
            .as_str()
            .and_then(|s| QuantType::parse(s).ok())
            .ok_or_else(|| bad(format!("quant_type {} is not nf4 or fp4", v["quant_type"])))?;
        let blocksize = field("blocksize")?
            .as_u64()
            .filter(|b| [32, 64, 128, 256, 512, 1024, 2048, 4096].contains(b))
            .ok_or_else(|| bad(format!("invalid blocksize {}", v["blocksize"])))?
            as usize;
        let dtype = field("dtype")?
            .as_str()
            .and_then(dtype_from_torch)
            .ok_or_else(|| {
                bad(format!(
                    "dtype {} is not float32, bfloat16 or float16",
                    v["dtype"]
                ))
            })?;
        let shape: Vec<usize> = field("shape")?
            .as_array()
            .and_then(|a| a.iter().map(|d| d.as_u64().map(|d| d as usize)).collect())
            .filter(|s: &Vec<usize>| s.len() == 2)
            .ok_or_else(|| bad(format!("shape {} is not [out, in]", v["shape"])))?;
        let nested = match v.get("nested_blocksize") {
            None => None,
            Some(nb) => {
                let nb = nb
                    .as_u64()
                    .filter(|&nb| nb as usize == NESTED_BLOCKSIZE)
                    .ok_or_else(|| {
                        bad(format!("nested_blocksize {nb} (bitsandbytes supports 256)"))
                    })?;
                let offset = field("nested_offset")?
                    .as_f64()
                    .ok_or_else(|| bad("nested_offset is not a number".into()))?;
                if field("nested_dtype")?.as_str() != Some("float32") {
                    return Err(bad(format!(
                        "nested_dtype {} is not float32",
                        v["nested_dtype"]
                    )));
                }
                Some((nb as usize, offset as f32))
            }
        };
        Ok(Self {
            quant_type,
            blocksize,
            dtype,
            shape,
            nested,
        })
    }
}

/// A weight quantized to 4 bits: what a pre-quantized checkpoint stores.
#[derive(Debug, Clone, PartialEq)]
pub struct Packed4bit {
    /// The JSON fields.
    pub state: State4bit,
    /// Two codes per byte, `ceil(numel / 2)` bytes.
    pub packed: Vec<u8>,
    /// f32 maxima, one per block, without double quantization.
    pub absmax: Vec<f32>,
    /// The maxima double-quantized, with it.
    pub nested: Option<NestedAbsmax>,
}

impl Packed4bit {
    /// Quantizes `values` (a weight of `shape`, `dtype` its dtype before
    /// widening to f32) as bitsandbytes' `quantize_4bit`.
    pub fn quantize(
        values: &[f32],
        shape: &[usize],
        dtype: DType,
        quant_type: QuantType,
        double_quant: bool,
    ) -> Self {
        let blocksize = super::BLOCKSIZE;
        let (packed, absmax) = super::blockwise::quantize_4bit(values, quant_type, blocksize);
        let nested = double_quant.then(|| NestedAbsmax::quantize(&absmax));
        Self {
            state: State4bit {
                quant_type,
                blocksize,
                dtype,
                shape: shape.to_vec(),
                nested: nested.as_ref().map(|n| (NESTED_BLOCKSIZE, n.offset)),
            },
            packed,
            absmax: if nested.is_some() { vec![] } else { absmax },
            nested,
        }
    }

    /// The f32 maxima, double quantization undone.
    pub fn absmax_f32(&self) -> Vec<f32> {
        match &self.nested {
            Some(n) => n.dequantize(),
            None => self.absmax.clone(),
        }
    }

    /// The weight back in f32 (before rounding to the state's dtype).
    pub fn dequantize(&self) -> Vec<f32> {
        super::blockwise::dequantize_4bit(
            &self.packed,
            &self.absmax_f32(),
            self.state.quant_type,
            self.state.blocksize,
            self.state.numel(),
        )
    }
}

/// Whether `name` is a part of a quantized weight other than its codes
/// (`*.weight.absmax`, `*.weight.quant_state.*`, `*.SCB`, ...): tensors a
/// quantized checkpoint holds that are no parameter of the original model.
pub fn is_quant_part(name: &str) -> bool {
    let four = [
        names::ABSMAX,
        names::QUANT_MAP,
        names::NESTED_ABSMAX,
        names::NESTED_QUANT_MAP,
    ];
    four.iter().any(|p| name.ends_with(&format!(".weight.{p}")))
        || name.contains(&format!(".weight.{}", names::QUANT_STATE_PREFIX))
        || name.ends_with(&format!(".{}", names::SCB))
        || name.ends_with(&format!(".{}", names::WEIGHT_FORMAT))
}

/// The suffix of the JSON state tensor of `quant_type`, after `weight.`.
pub fn quant_state_name(quant_type: QuantType) -> String {
    format!("{}{}", names::QUANT_STATE_PREFIX, quant_type.name())
}

/// torch's name of a float dtype (`str(dtype)` without `torch.`).
pub fn torch_dtype_name(dtype: DType) -> &'static str {
    match dtype {
        DType::BF16 => "bfloat16",
        DType::F16 => "float16",
        _ => "float32",
    }
}

/// The float dtype torch names `name`, if any of f32, bf16 or f16.
pub fn dtype_from_torch(name: &str) -> Option<DType> {
    Some(match name {
        "float32" => DType::F32,
        "bfloat16" => DType::BF16,
        "float16" => DType::F16,
        _ => return None,
    })
}

/// Python's `repr(float)`: the shortest digits that read back, in
/// scientific notation below 1e-4 or from 1e16 (`1e-05`, `1.5e+16`).
pub fn python_float_repr(v: f64) -> String {
    if v == 0.0 {
        return if v.is_sign_negative() { "-0.0" } else { "0.0" }.into();
    }
    if !v.is_finite() {
        return if v.is_nan() {
            "NaN".into()
        } else if v > 0.0 {
            "Infinity".into()
        } else {
            "-Infinity".into()
        };
    }
    // Rust's `{:e}` is the shortest round-trip digits too: 1.2345e-5.
    let sci = format!("{v:e}");
    let (mantissa, e) = sci.split_once('e').expect("`{:e}` has an exponent");
    let e: i32 = e.parse().expect("`{:e}` exponent is an integer");
    if (-4..16).contains(&e) {
        let s = format!("{v}");
        if s.contains('.') {
            s
        } else {
            format!("{s}.0")
        }
    } else {
        let sign = if e < 0 { '-' } else { '+' };
        format!("{mantissa}e{sign}{:02}", e.abs())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn floats_print_as_python_prints_them() {
        for (v, want) in [
            (0.13252240419387817, "0.13252240419387817"),
            (1e-5, "1e-05"),
            (1.5e-5, "1.5e-05"),
            (0.0001, "0.0001"),
            (-0.00012345, "-0.00012345"),
            (1.0, "1.0"),
            (123456.0, "123456.0"),
            (1e16, "1e+16"),
            (0.0, "0.0"),
            (f64::from(0.017_852_3_f32), "0.01785230077803135"),
        ] {
            assert_eq!(python_float_repr(v), want, "{v}");
        }
    }

    #[test]
    fn the_state_json_reads_back_and_bad_fields_are_named() {
        let s = State4bit {
            quant_type: QuantType::Nf4,
            blocksize: 64,
            dtype: DType::BF16,
            shape: vec![96, 64],
            nested: Some((256, 0.132_522_4)),
        };
        let json = s.to_json();
        assert_eq!(
            json,
            r#"{"quant_type": "nf4", "blocksize": 64, "dtype": "bfloat16", "shape": [96, 64], "nested_blocksize": 256, "nested_dtype": "float32", "nested_offset": 0.13252240419387817}"#
        );
        assert_eq!(State4bit::from_json(json.as_bytes(), "t").unwrap(), s);
        for (text, want) in [
            (r#"{"quant_type": "int4"}"#, "quant_type"),
            (
                r#"{"quant_type": "nf4", "blocksize": 63, "dtype": "float32", "shape": [2, 2]}"#,
                "blocksize 63",
            ),
            (
                r#"{"quant_type": "nf4", "blocksize": 64, "dtype": "int8", "shape": [2, 2]}"#,
                "dtype",
            ),
            (
                r#"{"quant_type": "nf4", "blocksize": 64, "dtype": "float32", "shape": [4]}"#,
                "shape",
            ),
            ("{", "not JSON"),
        ] {
            let e = State4bit::from_json(text.as_bytes(), "l.weight.quant_state.x")
                .unwrap_err()
                .to_string();
            assert!(
                e.contains("l.weight.quant_state.x") && e.contains(want),
                "{e}"
            );
        }
    }
}
