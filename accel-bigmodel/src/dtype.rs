//! Torch dtype names and Accelerate's per-element sizes for them.

/// Evaluates `$body` with `$T` bound to the element type of `$dtype` when
/// candle holds that dtype as a plain (`bytemuck::Pod`) Rust type, else
/// `$other`: the one table of those types for the crate's raw-byte paths
/// (reading offloaded weights, tensors over mapped files).
macro_rules! with_pod_type {
    ($dtype:expr, |$T:ident| $body:expr, _ => $other:expr) => {{
        use candle_core::DType as D;
        match $dtype {
            D::F32 => {
                type $T = f32;
                $body
            }
            D::F64 => {
                type $T = f64;
                $body
            }
            D::F16 => {
                type $T = half::f16;
                $body
            }
            D::BF16 => {
                type $T = half::bf16;
                $body
            }
            D::I64 => {
                type $T = i64;
                $body
            }
            D::I32 => {
                type $T = i32;
                $body
            }
            D::I16 => {
                type $T = i16;
                $body
            }
            D::U32 => {
                type $T = u32;
                $body
            }
            D::U8 => {
                type $T = u8;
                $body
            }
            _ => $other,
        }
    }};
}
pub(crate) use with_pod_type;

use crate::bytes::Bytes;
use crate::error::{Error, Result};
use std::fmt;

/// A torch dtype, named as torch names it without the `torch.` prefix (`float32`, `bfloat16`, `bool`).
///
/// Sizes are planned from these names because checkpoints, spec files and
/// Accelerate all speak torch's names; candle and safetensors dtypes convert in.
/// Accelerate's own `CustomDtype.INT2`, `CustomDtype.INT4` and `CustomDtype.FP8`
/// (which quantizers pass as `dtype`) are included under those names.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DTypeName(&'static str);

/// Every torch 2.15 dtype attribute and the canonical name `str(dtype)` gives for it.
const TORCH_DTYPES: &[(&str, &str)] = &[
    ("bcomplex32", "bcomplex32"),
    ("bfloat16", "bfloat16"),
    ("bit", "uint1"),
    ("bits16", "bits16"),
    ("bits1x8", "bits1x8"),
    ("bits2x4", "bits2x4"),
    ("bits4x2", "bits4x2"),
    ("bits8", "bits8"),
    ("bool", "bool"),
    ("cdouble", "complex128"),
    ("cfloat", "complex64"),
    ("chalf", "complex32"),
    ("complex128", "complex128"),
    ("complex32", "complex32"),
    ("complex64", "complex64"),
    ("double", "float64"),
    ("float", "float32"),
    ("float16", "float16"),
    ("float32", "float32"),
    ("float4_e2m1fn_x2", "float4_e2m1fn_x2"),
    ("float64", "float64"),
    ("float8_e4m3fn", "float8_e4m3fn"),
    ("float8_e4m3fnuz", "float8_e4m3fnuz"),
    ("float8_e5m2", "float8_e5m2"),
    ("float8_e5m2fnuz", "float8_e5m2fnuz"),
    ("float8_e8m0fnu", "float8_e8m0fnu"),
    ("half", "float16"),
    ("int", "int32"),
    ("int1", "int1"),
    ("int16", "int16"),
    ("int2", "int2"),
    ("int3", "int3"),
    ("int32", "int32"),
    ("int4", "int4"),
    ("int5", "int5"),
    ("int6", "int6"),
    ("int64", "int64"),
    ("int7", "int7"),
    ("int8", "int8"),
    ("long", "int64"),
    ("qint32", "qint32"),
    ("qint8", "qint8"),
    ("quint2x4", "quint2x4"),
    ("quint4x2", "quint4x2"),
    ("quint8", "quint8"),
    ("short", "int16"),
    ("uint1", "uint1"),
    ("uint16", "uint16"),
    ("uint2", "uint2"),
    ("uint3", "uint3"),
    ("uint32", "uint32"),
    ("uint4", "uint4"),
    ("uint5", "uint5"),
    ("uint6", "uint6"),
    ("uint64", "uint64"),
    ("uint7", "uint7"),
    ("uint8", "uint8"),
    ("CustomDtype.INT2", "CustomDtype.INT2"),
    ("CustomDtype.INT4", "CustomDtype.INT4"),
    ("CustomDtype.FP8", "CustomDtype.FP8"),
];

impl DTypeName {
    /// `torch.float32`.
    pub const FLOAT32: DTypeName = DTypeName("float32");
    /// `torch.float16`.
    pub const FLOAT16: DTypeName = DTypeName("float16");
    /// `torch.bfloat16`.
    pub const BFLOAT16: DTypeName = DTypeName("bfloat16");
    /// `torch.float64`.
    pub const FLOAT64: DTypeName = DTypeName("float64");
    /// `torch.int64`.
    pub const INT64: DTypeName = DTypeName("int64");
    /// `torch.int32`.
    pub const INT32: DTypeName = DTypeName("int32");
    /// `torch.int8`.
    pub const INT8: DTypeName = DTypeName("int8");
    /// `torch.uint8`.
    pub const UINT8: DTypeName = DTypeName("uint8");
    /// `torch.bool`, sized 1/8 byte per element by Accelerate.
    pub const BOOL: DTypeName = DTypeName("bool");
    /// `torch.float8_e4m3fn`.
    pub const FLOAT8_E4M3FN: DTypeName = DTypeName("float8_e4m3fn");
    /// Accelerate's `CustomDtype.INT4` (bitsandbytes 4-bit), 1/2 byte per element.
    pub const CUSTOM_INT4: DTypeName = DTypeName("CustomDtype.INT4");
    /// Accelerate's `CustomDtype.INT2`, 1/4 byte per element.
    pub const CUSTOM_INT2: DTypeName = DTypeName("CustomDtype.INT2");
    /// Accelerate's `CustomDtype.FP8`, 1 byte per element.
    pub const CUSTOM_FP8: DTypeName = DTypeName("CustomDtype.FP8");

    /// Resolves a dtype name as Accelerate's `_get_proper_dtype` does: an optional
    /// `torch.` prefix, then any torch attribute that is a dtype (`float`, `half`, `long` alias their canonical names).
    ///
    /// # Errors
    /// [`Error::UnknownDtype`] when torch has no such dtype.
    pub fn parse(name: &str) -> Result<Self> {
        let bare = name.replace("torch.", "");
        TORCH_DTYPES
            .iter()
            .find(|(alias, _)| *alias == bare)
            .map(|(_, canonical)| DTypeName(canonical))
            .ok_or(Error::UnknownDtype { dtype: bare })
    }

    /// The canonical name, as `str(dtype)` prints it without `torch.`.
    pub fn name(self) -> &'static str {
        self.0
    }

    /// Bytes per element, as Accelerate's `dtype_byte_size`.
    ///
    /// `bool` is 1/8 (a Python float), the custom INT2/INT4 1/4 and 1/2, float8
    /// kinds 1; everything else is the trailing bit count floor-divided by 8, so
    /// sub-byte torch dtypes such as `int4` or `float4_e2m1fn_x2` size to 0, as in Accelerate.
    pub fn byte_size(self) -> Bytes {
        match self.0 {
            "bool" => Bytes::from_bits(1, true),
            "CustomDtype.INT2" => Bytes::from_bits(2, true),
            "CustomDtype.INT4" => Bytes::from_bits(4, true),
            "CustomDtype.FP8" => Bytes::new(1),
            n if n.starts_with("float8_") => Bytes::new(1),
            n => {
                // `re.search(r"[^\d](\d+)$", str(dtype))`; every torch name ends in digits.
                let digits = n.len() - n.trim_end_matches(|c: char| c.is_ascii_digit()).len();
                let bits: i64 = n[n.len() - digits..].parse().unwrap_or(0);
                Bytes::new(bits / 8)
            }
        }
    }

    /// Whether a target `dtype` leaves tensors of this dtype at their own size:
    /// Accelerate never converts integer and bool tensors (`torch.uint*`, `torch.int*`, `torch.bool`).
    pub fn keeps_own_size(self) -> bool {
        self.0.starts_with("uint") || self.0.starts_with("int") || self.0.starts_with("bool")
    }
}

impl fmt::Display for DTypeName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.0)
    }
}

impl fmt::Debug for DTypeName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "torch.{}", self.0)
    }
}

impl std::str::FromStr for DTypeName {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        DTypeName::parse(s)
    }
}

impl TryFrom<candle_core::DType> for DTypeName {
    type Error = Error;
    fn try_from(dtype: candle_core::DType) -> Result<Self> {
        use candle_core::DType as D;
        Ok(match dtype {
            D::U8 => DTypeName::UINT8,
            D::U32 => DTypeName("uint32"),
            D::I16 => DTypeName("int16"),
            D::I32 => DTypeName::INT32,
            D::I64 => DTypeName::INT64,
            D::BF16 => DTypeName::BFLOAT16,
            D::F16 => DTypeName::FLOAT16,
            D::F32 => DTypeName::FLOAT32,
            D::F64 => DTypeName::FLOAT64,
            D::F8E4M3 => DTypeName::FLOAT8_E4M3FN,
            D::F8E8M0 => DTypeName("float8_e8m0fnu"),
            // Sub-byte MX formats have no unpacked torch dtype.
            other => {
                return Err(Error::NoTorchDtype {
                    dtype: format!("{other:?}"),
                })
            }
        })
    }
}

impl TryFrom<safetensors::Dtype> for DTypeName {
    type Error = Error;
    fn try_from(dtype: safetensors::Dtype) -> Result<Self> {
        use safetensors::Dtype as D;
        Ok(match dtype {
            D::BOOL => DTypeName::BOOL,
            D::U8 => DTypeName::UINT8,
            D::I8 => DTypeName::INT8,
            D::F8_E5M2 => DTypeName("float8_e5m2"),
            D::F8_E4M3 => DTypeName::FLOAT8_E4M3FN,
            D::F8_E8M0 => DTypeName("float8_e8m0fnu"),
            D::I16 => DTypeName("int16"),
            D::U16 => DTypeName("uint16"),
            D::F16 => DTypeName::FLOAT16,
            D::BF16 => DTypeName::BFLOAT16,
            D::I32 => DTypeName::INT32,
            D::U32 => DTypeName("uint32"),
            D::F32 => DTypeName::FLOAT32,
            D::F64 => DTypeName::FLOAT64,
            D::I64 => DTypeName::INT64,
            D::U64 => DTypeName("uint64"),
            other => {
                return Err(Error::NoTorchDtype {
                    dtype: format!("{other:?}"),
                })
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_resolve_like_get_proper_dtype() {
        assert_eq!(DTypeName::parse("torch.float").unwrap(), DTypeName::FLOAT32);
        assert_eq!(DTypeName::parse("half").unwrap().name(), "float16");
        assert!(DTypeName::parse("float17").is_err());
    }

    #[test]
    fn byte_sizes_match_dtype_byte_size() {
        // Values printed by accelerate 1.15.0 `dtype_byte_size(getattr(torch, n))`.
        let cases = [
            ("float32", "4"),
            ("bfloat16", "2"),
            ("bool", "0.125"),
            ("int4", "0"),
            ("float4_e2m1fn_x2", "0"),
            ("bits1x8", "1"),
            ("quint4x2", "0"),
            ("complex64", "8"),
            ("float8_e5m2", "1"),
            ("CustomDtype.INT4", "0.5"),
            ("CustomDtype.INT2", "0.25"),
        ];
        for (name, size) in cases {
            assert_eq!(
                DTypeName::parse(name).unwrap().byte_size().to_string(),
                size,
                "{name}"
            );
        }
    }

    #[test]
    fn only_integer_and_bool_tensors_keep_their_size() {
        assert!(DTypeName::BOOL.keeps_own_size());
        assert!(DTypeName::parse("uint4").unwrap().keeps_own_size());
        assert!(!DTypeName::parse("qint8").unwrap().keeps_own_size());
        assert!(!DTypeName::FLOAT16.keeps_own_size());
    }
}
