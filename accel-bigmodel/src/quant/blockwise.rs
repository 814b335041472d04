//! Blockwise quantization exactly as bitsandbytes' CPU backend computes it:
//! 4-bit NF4/FP4 (`quantize_4bit`, the default torch kernel) and the 8-bit
//! dynamic-map blocks that double quantization keeps the maxima in
//! (`quantize_blockwise`, the C++ kernel with its 65536-bin lookup table).
//!
//! Each function takes the flattened values in f32 (a bf16 or f16 weight is
//! widened first, as bitsandbytes does) and returns what bitsandbytes stores.

use super::codes::{dynamic_map, FP4, FP4_ORDER, NF4};
use super::QuantType;

/// Values per block of the double quantization of the 4-bit maxima
/// (bitsandbytes' `quantize_blockwise(..., blocksize=256)`).
pub const NESTED_BLOCKSIZE: usize = 256;

/// The maxima of each `blocksize` values of `values` (the last block may be
/// short), as `A.abs().max(dim=-1)`.
fn block_absmax(values: &[f32], blocksize: usize) -> Vec<f32> {
    values
        .chunks(blocksize)
        .map(|b| b.iter().fold(0f32, |m, v| m.max(v.abs())))
        .collect()
}

/// Blocks per parallel task of [`quantize_4bit`].
const TASK_BLOCKS: usize = 256;

/// bitsandbytes' `quantize_4bit` on the flattened `values`: two codes a byte,
/// the first value of each pair in the high nibble (an odd count pads a zero
/// code), and the f32 maximum of each block.
///
/// A full block is scaled by `1 / absmax` and a short last block divided by
/// its maximum, both clamped to [-1, 1], as bitsandbytes does; each value
/// takes the code of the bucket between the sorted codes' midpoints that
/// holds it (`torch.bucketize`: a value on a midpoint goes below). Runs in
/// parallel over tasks of whole blocks, each value computed alone, so the
/// result is the same on any number of threads.
pub fn quantize_4bit(
    values: &[f32],
    quant_type: QuantType,
    blocksize: usize,
) -> (Vec<u8>, Vec<f32>) {
    let sorted = sorted_codes(quant_type);
    let bounds: [f32; 15] = std::array::from_fn(|i| (sorted[i] + sorted[i + 1]) / 2.0);
    let order: [u8; 16] = match quant_type {
        QuantType::Nf4 => std::array::from_fn(|i| i as u8),
        QuantType::Fp4 => FP4_ORDER,
    };
    let full = values.len() / blocksize * blocksize;
    // Tasks of whole blocks and an even count of values (a byte never
    // straddles two tasks; bitsandbytes' block sizes are even).
    let task = TASK_BLOCKS * blocksize.max(2) / 2 * 2;
    let tasks = values.len().div_ceil(task).max(1);
    let parts = std::sync::Mutex::new(vec![None; tasks]);
    accel_kernels::par::for_each(tasks, |t| {
        let lo = t * task;
        let chunk = &values[lo.min(values.len())..(lo + task).min(values.len())];
        let absmax = block_absmax(chunk, blocksize);
        let code = |i: usize| -> u8 {
            let Some(&v) = chunk.get(i) else {
                // The pad of an odd count: bucketize(0.0).
                return order[bucket(&bounds, 0.0)];
            };
            let am = absmax[i / blocksize].max(1e-38);
            let scaled = if lo + i < full {
                v * (1.0 / am)
            } else {
                v / am
            };
            order[bucket(&bounds, scaled.clamp(-1.0, 1.0))]
        };
        let packed: Vec<u8> = (0..chunk.len().div_ceil(2))
            .map(|p| (code(2 * p) << 4) | code(2 * p + 1))
            .collect();
        parts.lock().unwrap_or_else(|e| e.into_inner())[t] = Some((packed, absmax));
    });
    let mut packed = Vec::with_capacity(values.len().div_ceil(2));
    let mut absmax = Vec::with_capacity(values.len().div_ceil(blocksize.max(1)));
    for (p, a) in parts
        .into_inner()
        .unwrap_or_else(|e| e.into_inner())
        .into_iter()
        .flatten()
    {
        packed.extend(p);
        absmax.extend(a);
    }
    (packed, absmax)
}

/// The codes of `quant_type` by increasing value.
fn sorted_codes(quant_type: QuantType) -> [f32; 16] {
    match quant_type {
        QuantType::Nf4 => NF4,
        QuantType::Fp4 => FP4_ORDER.map(|c| FP4[c as usize]),
    }
}

/// `torch.bucketize(v, bounds)`: how many bounds lie strictly below `v`
/// (the bounds are sorted; counted branch-free, which vectorizes).
#[inline(always)]
fn bucket(bounds: &[f32; 15], v: f32) -> usize {
    bounds.iter().map(|&b| usize::from(b < v)).sum()
}

/// The value of 4-bit `code` of `quant_type`.
pub fn code_value(quant_type: QuantType, code: u8) -> f32 {
    match quant_type {
        QuantType::Nf4 => NF4[code as usize & 15],
        QuantType::Fp4 => FP4[code as usize & 15],
    }
}

/// bitsandbytes' `dequantize_4bit` in f32: `code * absmax` for each of the
/// first `n` values (the caller rounds to the state's dtype).
pub fn dequantize_4bit(
    packed: &[u8],
    absmax: &[f32],
    quant_type: QuantType,
    blocksize: usize,
    n: usize,
) -> Vec<f32> {
    (0..n)
        .map(|i| {
            let byte = packed[i / 2];
            let code = if i % 2 == 0 { byte >> 4 } else { byte & 15 };
            code_value(quant_type, code) * absmax[i / blocksize]
        })
        .collect()
}

/// The 4-bit block maxima kept as bitsandbytes' double quantization keeps
/// them (`compress_statistics=True`): their mean removed, then quantized in
/// blocks of [`NESTED_BLOCKSIZE`] to the 8-bit dynamic map.
#[derive(Debug, Clone, PartialEq)]
pub struct NestedAbsmax {
    /// One 8-bit code per 4-bit block.
    pub codes: Vec<u8>,
    /// The maximum of each nested block of `absmax - offset`.
    pub absmax: Vec<f32>,
    /// The mean of the maxima, added back on dequantization.
    pub offset: f32,
}

impl NestedAbsmax {
    /// Double quantization of `absmax`; the offset is their mean as torch
    /// computes it (see `torch_sum`).
    pub fn quantize(absmax: &[f32]) -> Self {
        let offset = super::torch_sum::torch_mean(absmax);
        let centred: Vec<f32> = absmax.iter().map(|&v| v - offset).collect();
        let (codes, absmax) = quantize_blockwise(&centred, NESTED_BLOCKSIZE);
        Self {
            codes,
            absmax,
            offset,
        }
    }

    /// The f32 maxima back, as bitsandbytes computes them before a 4-bit
    /// dequantization: `code * nested_absmax`, then `+ offset` (two
    /// roundings, no fused multiply-add).
    pub fn dequantize(&self) -> Vec<f32> {
        dequantize_nested(&self.codes, &self.absmax, self.offset)
    }
}

/// [`NestedAbsmax::dequantize`] on borrowed parts.
pub fn dequantize_nested(codes: &[u8], nested_absmax: &[f32], offset: f32) -> Vec<f32> {
    let map = dynamic_map();
    codes
        .iter()
        .enumerate()
        .map(|(i, &c)| map[c as usize] * nested_absmax[i / NESTED_BLOCKSIZE] + offset)
        .collect()
}

/// Bins of bitsandbytes' CPU lookup from a value in [-1, 1] to its code.
const LUT_SIZE: usize = 65536;

/// bitsandbytes' CPU `quantize_blockwise` with the 8-bit dynamic map:
/// each value times `1 / absmax` of its block, clamped, then looked up in a
/// table of 65536 equal bins over [-1, 1] (each bin holds the code whose
/// midpoints bracket the bin's left edge). This is the CPU kernel's
/// approximation of the nearest code, reproduced so the bytes match.
pub fn quantize_blockwise(values: &[f32], blocksize: usize) -> (Vec<u8>, Vec<f32>) {
    let lut = dynamic_lut();
    let absmax = block_absmax(values, blocksize);
    let mut out = vec![0u8; values.len()];
    for (b, (block, out)) in values
        .chunks(blocksize)
        .zip(out.chunks_mut(blocksize))
        .enumerate()
    {
        let am = absmax[b];
        if am == 0.0 {
            continue;
        }
        let inv = 1.0 / am;
        for (o, &v) in out.iter_mut().zip(block) {
            let v = (v * inv).clamp(-1.0, 1.0);
            let i = ((v + 1.0) * 0.5 * (LUT_SIZE - 1) as f32 + 0.5) as usize;
            *o = lut[i.min(LUT_SIZE - 1)];
        }
    }
    (out, absmax)
}

/// The CPU kernel's table over the dynamic map, built once.
fn dynamic_lut() -> &'static [u8] {
    static LUT: std::sync::OnceLock<Vec<u8>> = std::sync::OnceLock::new();
    LUT.get_or_init(|| {
        let code = dynamic_map();
        let mid: Vec<f32> = code.windows(2).map(|w| 0.5 * (w[0] + w[1])).collect();
        let mut idx = 0;
        (0..LUT_SIZE)
            .map(|i| {
                let val = -1.0f32 + (2.0 * i as f32) / (LUT_SIZE - 1) as f32;
                while idx < mid.len() && mid[idx] < val {
                    idx += 1;
                }
                idx as u8
            })
            .collect()
    })
}

/// bitsandbytes' `dequantize_blockwise` with the dynamic map, in f32.
pub fn dequantize_blockwise(codes: &[u8], absmax: &[f32], blocksize: usize) -> Vec<f32> {
    let map = dynamic_map();
    codes
        .iter()
        .enumerate()
        .map(|(i, &c)| map[c as usize] * absmax[i / blocksize])
        .collect()
}
