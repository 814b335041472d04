//! A frozen quantized weight whose parts are CUDA storages, as the CUDA
//! products (`cuda::quantized_matmul`) take it. The types stand apart from
//! the `cuda` module so that CPU-only builds (where `cuda` is the stand-in
//! of `cuda_off.rs`) name the same ones.

use candle_core::{CudaStorage, DType, Layout};

/// Elements of the largest band of the weight dequantized at once.
pub const QUANT_TILE_ELEMS: usize = 1 << 24;

/// A CUDA storage and its layout: a tensor's data as a `CustomOp` sees it.
pub type Operand<'a> = (&'a CudaStorage, &'a Layout);

/// The block maxima of a 4-bit weight.
pub enum QuantMaxima<'a> {
    /// One f32 per block.
    F32(Operand<'a>),
    /// Double quantization: u8 codes of the maxima (`map[code] * nested +
    /// offset`), one f32 `nested` maximum per `per` blocks.
    Nested {
        /// u8 `[blocks]`.
        codes: Operand<'a>,
        /// f32 `[blocks / per]` (rounded up).
        nested: Operand<'a>,
        /// Blocks per nested maximum.
        per: usize,
        /// Added back to each block maximum.
        offset: f32,
        /// bitsandbytes' 8-bit dynamic map.
        map: &'a [f32; 256],
    },
}

/// A quantized weight `[out, inp]` whose parts are on one CUDA device.
pub enum QuantWeight<'a> {
    /// bitsandbytes 4-bit: u8 `packed` codes, two a byte (the even element
    /// in the high nibble), over the flattened weight in blocks of
    /// `blocksize`; `store` is the dtype it was quantized from (values are
    /// rounded to it, as bitsandbytes dequantizes to it).
    FourBit {
        /// u8 `[ceil(out * inp / 2)]`.
        packed: Operand<'a>,
        /// The block maxima.
        maxima: QuantMaxima<'a>,
        /// The type's code book (NF4 or FP4).
        codes: &'a [f32; 16],
        /// Elements per block.
        blocksize: usize,
        /// The dtype quantized from (f32, bf16 or f16).
        store: DType,
        /// Rows.
        out: usize,
        /// Columns.
        inp: usize,
    },
    /// LLM.int8: int8 codes as u8 `[out, inp]`, f32 row maxima `[out]`.
    EightBit {
        /// u8 `[out, inp]` (int8 two's complement).
        codes: Operand<'a>,
        /// f32 `[out]` (`SCB`).
        row_max: Operand<'a>,
        /// Rows.
        out: usize,
        /// Columns.
        inp: usize,
    },
}

impl QuantWeight<'_> {
    /// `(out, inp)`.
    pub fn dims(&self) -> (usize, usize) {
        match *self {
            Self::FourBit { out, inp, .. } | Self::EightBit { out, inp, .. } => (out, inp),
        }
    }
}
