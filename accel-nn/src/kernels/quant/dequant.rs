//! Tiles of a quantized weight as f32 values.

use super::super::raw::quant::{self as simd_quant, Simd};
#[cfg(test)]
use super::Scales;
use super::{QuantRef, Store};

/// `dst[r * ld + c] = W[r0 + r, k0 + c]` for `r < rows`, `c < kc`: the
/// values bitsandbytes multiplies with (4-bit: `code * block maximum`
/// rounded to the dtype the weight was quantized from; 8-bit:
/// `code * row maximum / 127`).
///
/// # Panics
/// When the tile is outside the weight or `dst` (the weight's slices were
/// checked by [`QuantRef::check`] when the op was built).
pub(super) fn tile(
    w: &QuantRef,
    (r0, rows): (usize, usize),
    (k0, kc): (usize, usize),
    dst: &mut [f32],
    ld: usize,
) {
    let (out, inp) = w.dims();
    assert!(
        r0 + rows <= out && k0 + kc <= inp && (rows == 0 || (rows - 1) * ld + kc <= dst.len()),
        "dequant tile [{r0}+{rows}, {k0}+{kc}] of [{out}, {inp}] into {} (ld {ld})",
        dst.len()
    );
    match *w {
        QuantRef::FourBit {
            packed,
            scales,
            codes,
            blocksize,
            store,
            compute,
            simd,
            ..
        } => {
            let round = |v: f32| compute.round(store.round(v));
            // Values the vector kernels make: `code * s` exactly, or
            // rounded to bf16 once (from either side, the same rounding).
            let vector = match (store, compute) {
                (Store::F32, Store::F32) => Some(false),
                (Store::F32 | Store::Bf16, Store::F32 | Store::Bf16) => Some(true),
                _ => None,
            };
            let mut maxima = Vec::new();
            for r in 0..rows {
                let base = (r0 + r) * inp;
                let row = &mut dst[r * ld..][..kc];
                // The maxima of the blocks this row's span touches, at once.
                let (b0, b1) = (
                    (base + k0) / blocksize,
                    (base + k0 + kc).div_ceil(blocksize),
                );
                maxima.resize(b1 - b0, 0.0);
                scales.fill(b0, &mut maxima);
                let mut k = k0;
                // One block (or the part of it in the tile) at a time.
                while k < k0 + kc {
                    let b = (base + k) / blocksize;
                    let end = ((b + 1) * blocksize - base).min(k0 + kc);
                    let out = &mut row[k - k0..end - k0];
                    let how = Values {
                        simd,
                        vector,
                        round: &round,
                    };
                    span(packed, codes, maxima[b - b0], &how, base + k, out);
                    k = end;
                }
            }
        }
        QuantRef::EightBit {
            codes,
            row_max,
            compute,
            ..
        } => {
            for r in 0..rows {
                let m = row_max[r0 + r];
                let src = &codes[(r0 + r) * inp + k0..][..kc];
                for (d, &c) in dst[r * ld..][..kc].iter_mut().zip(src) {
                    *d = compute.round(accel_bigmodel::quant::int8_value(c as i8, m));
                }
            }
        }
    }
}

/// How [`span`] makes a block's values.
struct Values<'a, R: Fn(f32) -> f32> {
    simd: Simd,
    /// `Some(round_bf16)` where the vector kernels make the values.
    vector: Option<bool>,
    /// The rounding otherwise.
    round: &'a R,
}

/// The values of flattened elements `e0..e0 + out.len()` of one block
/// (scale `s`): pairs of codes a byte, the even element in the high nibble,
/// each `code * s` then rounded as `how` says.
#[inline(always)]
fn span<R: Fn(f32) -> f32>(
    packed: &[u8],
    codes: &[f32; 16],
    s: f32,
    how: &Values<R>,
    e0: usize,
    out: &mut [f32],
) {
    let round = how.round;
    let mut i = 0;
    if e0 % 2 == 1 && !out.is_empty() {
        out[0] = round(codes[(packed[e0 / 2] & 15) as usize] * s);
        i = 1;
    }
    let pairs = (out.len() - i) / 2;
    let bytes = &packed[(e0 + i) / 2..][..pairs];
    match how.vector {
        Some(round_bf16) => {
            let dst = &mut out[i..i + 2 * pairs];
            simd_quant::span_f32(how.simd, bytes, codes, (s, round_bf16), dst);
        }
        None => {
            for (o, &byte) in out[i..i + 2 * pairs].chunks_exact_mut(2).zip(bytes) {
                o[0] = round(codes[(byte >> 4) as usize] * s);
                o[1] = round(codes[(byte & 15) as usize] * s);
            }
        }
    }
    i += 2 * pairs;
    if i < out.len() {
        let e = e0 + i;
        out[i] = round(codes[(packed[e / 2] >> 4) as usize] * s);
    }
}

/// The f32 maximum of block `b` (for the tests' reference).
#[cfg(test)]
pub(super) fn scale(s: &Scales, b: usize) -> f32 {
    let mut one = [0f32];
    s.fill(b, &mut one);
    one[0]
}

/// Row `r` of the weight, columns `k0..k0 + kc`, as the bf16 products'
/// pairs (`pair(W[r, k0 + 2p], W[r, k0 + 2p + 1])`, zero past an odd end):
/// straight from the codes for a 4-bit weight stored in f32 or bf16 (one
/// rounding to bf16 either way), else through [`tile`].
pub(super) fn row_pairs(
    w: &QuantRef,
    r: usize,
    (k0, kc): (usize, usize),
    out: &mut [u32],
    scratch: &mut Vec<f32>,
) {
    let (_, inp) = w.dims();
    match *w {
        QuantRef::FourBit {
            packed,
            scales,
            codes,
            blocksize,
            store: Store::F32 | Store::Bf16,
            simd,
            ..
        } if k0 % 2 == 0 && inp % 2 == 0 && blocksize % 2 == 0 => {
            let base = r * inp;
            let whole = kc / 2 * 2;
            let (b0, b1) = (
                (base + k0) / blocksize,
                (base + k0 + kc).div_ceil(blocksize),
            );
            scratch.resize(b1 - b0, 0.0);
            scales.fill(b0, scratch);
            let mut k = k0;
            while k < k0 + whole {
                let b = (base + k) / blocksize;
                let end = ((b + 1) * blocksize - base).min(k0 + whole);
                let bytes = &packed[(base + k) / 2..(base + end) / 2];
                let s = scratch[b - b0];
                simd_quant::span_pairs(
                    simd,
                    bytes,
                    codes,
                    s,
                    &mut out[(k - k0) / 2..(end - k0) / 2],
                );
                k = end;
            }
            if whole < kc {
                let e = base + k0 + whole;
                let v = codes[(packed[e / 2] >> 4) as usize] * scratch[e / blocksize - b0];
                out[whole / 2] = super::super::gemm_bf16::pair(v, 0.0);
            }
        }
        _ => {
            scratch.resize(kc, 0.0);
            tile(w, (r, 1), (k0, kc), scratch, kc);
            super::super::gemm_bf16::to_pairs(scratch, out);
        }
    }
}
