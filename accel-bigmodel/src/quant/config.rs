//! [`BnbQuantizationConfig`]: Accelerate's settings for loading a model in
//! 4 or 8 bits, read from and written as transformers' `quantization_config`.

use candle_core::DType;
use serde_json::{json, Value};

use super::state::{dtype_from_torch, torch_dtype_name};
use super::QuantType;
use crate::error::{Error, Result};

/// How linear layers are quantized on load (Accelerate's
/// `BnbQuantizationConfig`, transformers' `BitsAndBytesConfig`).
#[derive(Debug, Clone, PartialEq)]
pub struct BnbQuantizationConfig {
    /// LLM.int8: row-wise int8 weights.
    pub load_in_8bit: bool,
    /// LLM.int8's outlier threshold on activations (6.0).
    pub llm_int8_threshold: f32,
    /// 4-bit blocks (NF4 or FP4).
    pub load_in_4bit: bool,
    /// The 4-bit data type (transformers' default: FP4).
    pub bnb_4bit_quant_type: QuantType,
    /// Double quantization of the 4-bit block maxima.
    pub bnb_4bit_use_double_quant: bool,
    /// The dtype a 4-bit layer multiplies in.
    pub bnb_4bit_compute_dtype: DType,
    /// Modules kept in full precision (transformers' `llm_int8_skip_modules`):
    /// a name matches from its start to a module boundary, as a regex with
    /// the same boundary, or as a suffix.
    pub skip_modules: Option<Vec<String>>,
    /// Modules kept in fp32 (also not quantized).
    pub keep_in_fp32_modules: Option<Vec<String>>,
}

impl Default for BnbQuantizationConfig {
    fn default() -> Self {
        Self {
            load_in_8bit: false,
            llm_int8_threshold: 6.0,
            load_in_4bit: false,
            bnb_4bit_quant_type: QuantType::Fp4,
            bnb_4bit_use_double_quant: false,
            bnb_4bit_compute_dtype: DType::F32,
            skip_modules: None,
            keep_in_fp32_modules: None,
        }
    }
}

/// Which of the two ways a config quantizes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuantMethod {
    /// 4-bit NF4/FP4 blocks.
    FourBit,
    /// LLM.int8 rows.
    EightBit,
}

impl BnbQuantizationConfig {
    /// 4-bit loading of `quant_type`.
    pub fn four_bit(quant_type: QuantType) -> Self {
        Self {
            load_in_4bit: true,
            bnb_4bit_quant_type: quant_type,
            ..Self::default()
        }
    }

    /// 8-bit (LLM.int8) loading.
    pub fn eight_bit() -> Self {
        Self {
            load_in_8bit: true,
            ..Self::default()
        }
    }

    /// 4 or 8 bits.
    ///
    /// # Errors
    /// [`Error::BadQuantConfig`] when both or neither are set, or the
    /// compute dtype is not a float of 32 or 16 bits.
    pub fn method(&self) -> Result<QuantMethod> {
        let bad = |reason: &str| Error::BadQuantConfig {
            key: "load_in_4bit / load_in_8bit".into(),
            reason: reason.into(),
        };
        if !matches!(
            self.bnb_4bit_compute_dtype,
            DType::F32 | DType::BF16 | DType::F16
        ) {
            return Err(Error::BadQuantConfig {
                key: "bnb_4bit_compute_dtype".into(),
                reason: format!(
                    "{:?} is not float32, bfloat16 or float16",
                    self.bnb_4bit_compute_dtype
                ),
            });
        }
        match (self.load_in_4bit, self.load_in_8bit) {
            (true, true) => Err(bad(
                "load_in_4bit and load_in_8bit are both set; pick one (--load-in-4bit or --load-in-8bit)",
            )),
            (false, false) => Err(bad("neither load_in_4bit nor load_in_8bit is set")),
            (true, false) => Ok(QuantMethod::FourBit),
            (false, true) => Ok(QuantMethod::EightBit),
        }
    }

    /// Whether the linear layer `module` is quantized: transformers'
    /// `should_convert_module` over the skip and fp32 lists. (The output
    /// embedding `lm_head`, which transformers skips by default, is never a
    /// linear layer of accel-rs' models.)
    ///
    /// # Errors
    /// A skip pattern that is not a valid regex.
    pub fn quantizes(&self, module: &str) -> Result<bool> {
        let patterns = self
            .skip_modules
            .iter()
            .chain(&self.keep_in_fp32_modules)
            .flatten();
        for p in patterns {
            if module_matches(module, p)? {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// transformers' `quantization_config` as `BitsAndBytesConfig.to_dict()`
    /// writes it into `config.json` (keys in its order).
    pub fn to_transformers_json(&self) -> Value {
        let skip = self.skip_modules.as_ref().map_or(Value::Null, |s| json!(s));
        json!({
            "quant_method": "bitsandbytes",
            "_load_in_8bit": self.load_in_8bit,
            "_load_in_4bit": self.load_in_4bit,
            "llm_int8_threshold": self.llm_int8_threshold,
            "llm_int8_skip_modules": skip,
            "llm_int8_enable_fp32_cpu_offload": false,
            "llm_int8_has_fp16_weight": false,
            "bnb_4bit_quant_type": self.bnb_4bit_quant_type.name(),
            "bnb_4bit_use_double_quant": self.bnb_4bit_use_double_quant,
            "bnb_4bit_compute_dtype": torch_dtype_name(self.bnb_4bit_compute_dtype),
            "bnb_4bit_quant_storage": "uint8",
            "load_in_4bit": self.load_in_4bit,
            "load_in_8bit": self.load_in_8bit,
        })
    }

    /// Reads transformers' `quantization_config` (from a pre-quantized
    /// folder's `config.json`, named `file` in errors).
    ///
    /// # Errors
    /// [`Error::BadQuantConfig`] for another `quant_method`, a value of the
    /// wrong type, or a setting accel-rs does not run (fp32 CPU offload,
    /// fp16 int8 weights, a storage other than uint8), naming the key.
    pub fn from_transformers_json(v: &Value, file: &str) -> Result<Self> {
        let bad = |key: &str, reason: String| Error::BadQuantConfig {
            key: format!("{file}: quantization_config.{key}"),
            reason,
        };
        let method = v.get("quant_method").and_then(Value::as_str);
        if method != Some("bitsandbytes") {
            return Err(bad(
                "quant_method",
                format!(
                    "{} is not bitsandbytes (the only method accel-rs reads)",
                    v["quant_method"]
                ),
            ));
        }
        let flag = |key: &str| -> Result<bool> {
            match v.get(key) {
                None | Some(Value::Null) => Ok(false),
                Some(Value::Bool(b)) => Ok(*b),
                Some(other) => Err(bad(key, format!("{other} is not true or false"))),
            }
        };
        let mut c = Self {
            load_in_4bit: flag("load_in_4bit")? || flag("_load_in_4bit")?,
            load_in_8bit: flag("load_in_8bit")? || flag("_load_in_8bit")?,
            bnb_4bit_use_double_quant: flag("bnb_4bit_use_double_quant")?,
            ..Self::default()
        };
        if let Some(t) = v.get("llm_int8_threshold").filter(|t| !t.is_null()) {
            c.llm_int8_threshold = t
                .as_f64()
                .ok_or_else(|| bad("llm_int8_threshold", format!("{t} is not a number")))?
                as f32;
        }
        if let Some(t) = v.get("bnb_4bit_quant_type").filter(|t| !t.is_null()) {
            c.bnb_4bit_quant_type = t
                .as_str()
                .ok_or_else(|| bad("bnb_4bit_quant_type", format!("{t} is not a string")))
                .and_then(|s| QuantType::parse(s).map_err(|e| bad("bnb_4bit_quant_type", e)))?;
        }
        if let Some(t) = v.get("bnb_4bit_compute_dtype").filter(|t| !t.is_null()) {
            c.bnb_4bit_compute_dtype =
                t.as_str().and_then(parse_compute_dtype).ok_or_else(|| {
                    bad(
                        "bnb_4bit_compute_dtype",
                        format!("{t} is not float32, bfloat16 or float16"),
                    )
                })?;
        }
        c.skip_modules =
            string_list(v, "llm_int8_skip_modules").map_err(|r| bad("llm_int8_skip_modules", r))?;
        for (key, default) in [
            ("llm_int8_enable_fp32_cpu_offload", json!(false)),
            ("llm_int8_has_fp16_weight", json!(false)),
            ("bnb_4bit_quant_storage", json!("uint8")),
        ] {
            if let Some(val) = v.get(key).filter(|x| !x.is_null() && **x != default) {
                return Err(bad(
                    key,
                    format!("{val} is not supported (accel-rs runs {default})"),
                ));
            }
        }
        c.method()?;
        Ok(c)
    }
}

/// `key` of `v` as a list of strings, or None when absent or null.
fn string_list(v: &Value, key: &str) -> std::result::Result<Option<Vec<String>>, String> {
    match v.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Array(a)) => a
            .iter()
            .map(|s| {
                s.as_str()
                    .map(str::to_string)
                    .ok_or_else(|| format!("{s} is not a string"))
            })
            .collect::<std::result::Result<_, _>>()
            .map(Some),
        Some(other) => Err(format!("{other} is not a list of module names")),
    }
}

/// A compute dtype by transformers' (`float32`) or Accelerate's (`fp32`) name.
pub fn parse_compute_dtype(name: &str) -> Option<DType> {
    dtype_from_torch(name).or(match name {
        "fp32" => Some(DType::F32),
        "bf16" => Some(DType::BF16),
        "fp16" => Some(DType::F16),
        _ => None,
    })
}

/// transformers' `should_convert_module` match of one pattern: from the start
/// of `module` up to a module boundary (as a regex, so `layers.*` works),
/// or as a literal suffix.
fn module_matches(module: &str, pattern: &str) -> Result<bool> {
    if module.ends_with(pattern) {
        return Ok(true);
    }
    let re = regex::Regex::new(&format!("^(?:{pattern})$")).map_err(|e| Error::BadQuantConfig {
        key: "llm_int8_skip_modules".into(),
        reason: format!("{pattern:?} is not a regex: {e}"),
    })?;
    // Python's `re.match(key + boundary)`: some prefix the pattern matches
    // ends at the name's end, before a '.', or just after one.
    let b = module.as_bytes();
    Ok((0..=b.len())
        .filter(|&p| p == b.len() || b[p] == b'.' || (p > 0 && b[p - 1] == b'.'))
        .any(|p| re.is_match(&module[..p])))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn skip_patterns_match_as_transformers_matches_them() {
        let c = BnbQuantizationConfig {
            skip_modules: Some(vec!["model.layers.1".into(), "mlp.gate".into()]),
            keep_in_fp32_modules: Some(vec!["o_proj".into(), "layers\\.[2-3]\\.self".into()]),
            ..BnbQuantizationConfig::four_bit(QuantType::Nf4)
        };
        for (m, quantized) in [
            ("model.layers.1.self_attn.q_proj", false),
            ("model.layers.11.self_attn.q_proj", true),
            ("model.layers.0.mlp.gate_proj", true),
            ("model.layers.0.mlp.gate", false),
            ("model.layers.0.self_attn.o_proj", false),
            ("model.layers.0.self_attn.q_proj", true),
        ] {
            assert_eq!(c.quantizes(m).unwrap(), quantized, "{m}");
        }
        let c = BnbQuantizationConfig {
            skip_modules: Some(vec!["model\\.layers\\.[2-3]".into()]),
            ..BnbQuantizationConfig::four_bit(QuantType::Nf4)
        };
        assert!(!c.quantizes("model.layers.2.mlp.up_proj").unwrap());
        assert!(c.quantizes("model.layers.21.mlp.up_proj").unwrap());
        let bad = BnbQuantizationConfig {
            skip_modules: Some(vec!["(".into()]),
            ..BnbQuantizationConfig::four_bit(QuantType::Nf4)
        };
        assert!(bad
            .quantizes("x")
            .unwrap_err()
            .to_string()
            .contains("llm_int8_skip_modules"));
    }

    #[test]
    fn transformers_json_reads_back_and_bad_settings_are_named() {
        let mut c = BnbQuantizationConfig::four_bit(QuantType::Nf4);
        c.bnb_4bit_use_double_quant = true;
        c.bnb_4bit_compute_dtype = DType::BF16;
        let v = c.to_transformers_json();
        assert_eq!(v["bnb_4bit_compute_dtype"], "bfloat16");
        assert_eq!(
            BnbQuantizationConfig::from_transformers_json(&v, "config.json").unwrap(),
            c
        );
        let mut both = v.clone();
        both["load_in_8bit"] = json!(true);
        let e = BnbQuantizationConfig::from_transformers_json(&both, "config.json").unwrap_err();
        assert!(e.to_string().contains("pick one"), "{e}");
        for (key, val, want) in [
            ("quant_method", json!("gptq"), "not bitsandbytes"),
            ("bnb_4bit_quant_type", json!("int4"), "int4"),
            ("bnb_4bit_compute_dtype", json!("int8"), "float32, bfloat16"),
            ("bnb_4bit_quant_storage", json!("bfloat16"), "not supported"),
            ("llm_int8_has_fp16_weight", json!(true), "not supported"),
        ] {
            let mut w = v.clone();
            w[key] = val;
            let e = BnbQuantizationConfig::from_transformers_json(&w, "q/config.json")
                .unwrap_err()
                .to_string();
            assert!(
                e.contains("q/config.json") && e.contains(key) && e.contains(want),
                "{e}"
            );
        }
    }
}
