//! bitsandbytes' quantized weights: 4-bit NF4/FP4 blocks (with double
//! quantization of their maxima) and LLM.int8 rows, computed byte for byte
//! as bitsandbytes computes them on the CPU and stored under the names
//! transformers saves (`*.weight.absmax`, `*.weight.quant_state.bitsandbytes__nf4`,
//! `*.SCB`, ...), so a folder transformers quantized loads here and one
//! written here loads in transformers.
//!
//! bitsandbytes' `functional.py` and its CPU backend are the specification;
//! `tests/fixtures/quant/` holds its outputs (`scripts/make_quant_fixtures.py`).
//! Double quantization's offset is torch's f32 mean in torch's own order of
//! additions on one thread; torch splits tensors of more than 32768 values
//! (weights over 2M parameters) between threads, and there the offset of a
//! multi-threaded bitsandbytes run can differ in its last bit.
//!
//! [`BnbQuantizationConfig`] says what to quantize; [`QuantizeOnLoad`] turns
//! a full-precision checkpoint into what a pre-quantized one holds, one
//! weight at a time, so quantizing a model never holds it whole in full
//! precision (see [`crate::CheckpointSource::with_quantization`]).

mod blockwise;
mod codes;
mod config;
mod int8;
mod on_load;
mod state;
mod stored;
mod torch_sum;

pub use blockwise::{
    code_value, dequantize_4bit, dequantize_blockwise, dequantize_nested, quantize_4bit,
    quantize_blockwise, NestedAbsmax, NESTED_BLOCKSIZE,
};
pub use codes::{dynamic_map, FP4, NF4};
pub use config::{parse_compute_dtype, BnbQuantizationConfig, QuantMethod};
pub use int8::{int8_dequant, int8_value, int8_vectorwise_quant, quantize_int8_weight, Int8Rows};
pub use on_load::{QuantizeOnLoad, Quantized};
pub use state::{
    dtype_from_torch, is_quant_part, names, python_float_repr, quant_state_name, torch_dtype_name,
    Packed4bit, State4bit,
};
pub use stored::dequantize_stored;

/// Values per 4-bit block, as transformers quantizes (bitsandbytes' default).
pub const BLOCKSIZE: usize = 64;

/// bitsandbytes' 4-bit data types.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum QuantType {
    /// NormalFloat: quantiles of a normal distribution (QLoRA).
    Nf4,
    /// A 4-bit float: 1 sign, 2 exponent and 1 mantissa bit.
    Fp4,
}

impl QuantType {
    /// bitsandbytes' name: `nf4` or `fp4`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Nf4 => "nf4",
            Self::Fp4 => "fp4",
        }
    }

    /// The type named `name`.
    ///
    /// # Errors
    /// A name other than `nf4` and `fp4`, saying which exist.
    pub fn parse(name: &str) -> std::result::Result<Self, String> {
        match name {
            "nf4" => Ok(Self::Nf4),
            "fp4" => Ok(Self::Fp4),
            other => Err(format!("{other:?} is not a 4-bit quant type (nf4 or fp4)")),
        }
    }

    /// The 16 values its codes stand for.
    pub fn codes(self) -> &'static [f32; 16] {
        match self {
            Self::Nf4 => &NF4,
            Self::Fp4 => &FP4,
        }
    }
}

impl std::str::FromStr for QuantType {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        Self::parse(s)
    }
}

#[cfg(test)]
mod tests;
