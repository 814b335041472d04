//! Dtype conversion kernels, bitwise identical to candle's `to_dtype`.
//!
//! candle converts element by element with `half`'s `f16::from_f32`,
//! `bf16::from_f32` and `to_f32`. For f16 we use `half`'s slice conversions,
//! which pick the same F16C instructions at run time as the scalar ones (or
//! the same software fallback), so the bits agree. `half` has no SIMD path
//! for bf16 — its slice conversion is a branchy scalar loop, 3x slower — so
//! bf16 gets a branch-free formulation of the very same rounding that the
//! compiler vectorises; the tests check it against `half` bit for bit.

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

use super::{map_bundles, Plan, BLOCK};
use crate::slices::{FloatSlice, FloatSliceMut};

/// A 16-bit float type that kernels compute on through f32.
pub(crate) trait Half: Copy + Send + Sync + 'static {
    /// Exact widening to f32 (`dst.len() == src.len()`).
    fn widen(src: &[Self], dst: &mut [f32]);
    /// Round-to-nearest-even narrowing from f32 (`dst.len() == src.len()`).
    fn narrow(src: &[f32], dst: &mut [Self]);
}

impl Half for f16 {
    fn widen(src: &[Self], dst: &mut [f32]) {
        src.convert_to_f32_slice(dst);
    }
    fn narrow(src: &[f32], dst: &mut [Self]) {
        dst.convert_from_f32_slice(src);
    }
}

impl Half for bf16 {
    fn widen(src: &[Self], dst: &mut [f32]) {
        bf16_to_f32_slice(src, dst);
    }
    fn narrow(src: &[f32], dst: &mut [Self]) {
        f32_to_bf16_slice(src, dst);
    }
}

/// `bf16::from_f32` for one value, as selects instead of branches.
///
/// Same rules as `half`: NaN keeps its top mantissa bits and gets the quiet
/// bit set; everything else rounds to nearest, ties to even, by adding
/// `0x7FFF + lsb` before truncating (overflow to ±inf falls out of the
/// add). The final arithmetic shift and `i16` truncation let the compiler
/// narrow whole vectors with one saturating pack instead of shuffles.
#[inline(always)]
fn f32_bits_to_bf16_bits(x: u32) -> u16 {
    let is_nan = (x & 0x7FFF_FFFF) > 0x7F80_0000;
    let rounded = x.wrapping_add(0x7FFF + ((x >> 16) & 1));
    let v = if is_nan { x | 0x0040_0000 } else { rounded };
    ((v as i32) >> 16) as i16 as u16
}

/// `bf16::to_f32` for one value: a shift, except that NaN gets the quiet
/// bit set as `half` does.
#[inline(always)]
fn bf16_bits_to_f32_bits(h: u16) -> u32 {
    let is_nan = (h & 0x7FFF) > 0x7F80;
    let h = if is_nan { h | 0x0040 } else { h };
    (h as u32) << 16
}

/// Round-to-nearest-even narrowing for a value known not to be NaN.
#[inline(always)]
fn f32_bits_to_bf16_bits_not_nan(x: u32) -> u16 {
    ((x.wrapping_add(0x7FFF + ((x >> 16) & 1)) as i32) >> 16) as i16 as u16
}

/// Elements per block of the NaN-free fast path.
const NARROW_BLOCK: usize = 64;

/// f32 -> bf16 over a slice, bitwise equal to `bf16::from_f32` per element.
///
/// NaN needs a select that costs a third of the loop, and real data has
/// none, so each block is narrowed without it while OR-ing a non-finite
/// flag (all-ones exponent plus one carries into the sign bit); the rare
/// block that holds an inf or NaN is redone with the exact formula.
pub(crate) fn f32_to_bf16_slice(src: &[f32], dst: &mut [bf16]) {
    assert_eq!(src.len(), dst.len(), "f32_to_bf16_slice: length mismatch");
    let exact = |s: &[f32], d: &mut [bf16]| {
        for (d, s) in d.iter_mut().zip(s) {
            *d = bf16::from_bits(f32_bits_to_bf16_bits(s.to_bits()));
        }
    };
    let mut s = src.chunks_exact(NARROW_BLOCK);
    let mut d = dst.chunks_exact_mut(NARROW_BLOCK);
    for (s, d) in (&mut s).zip(&mut d) {
        let mut flag = 0u32;
        for (d, s) in d.iter_mut().zip(s) {
            let x = s.to_bits();
            flag |= (x & 0x7F80_0000) + 0x0080_0000;
            *d = bf16::from_bits(f32_bits_to_bf16_bits_not_nan(x));
        }
        if flag & 0x8000_0000 != 0 {
            exact(s, d);
        }
    }
    exact(s.remainder(), d.into_remainder());
}

/// bf16 -> f32 over a slice, bitwise equal to `bf16::to_f32` per element.
pub(crate) fn bf16_to_f32_slice(src: &[bf16], dst: &mut [f32]) {
    assert_eq!(src.len(), dst.len(), "bf16_to_f32_slice: length mismatch");
    for (d, s) in dst.iter_mut().zip(src) {
        *d = f32::from_bits(bf16_bits_to_f32_bits(s.to_bits()));
    }
}

/// Half -> other half through an on-stack f32 block, which is how candle
/// defines bf16 <-> f16 (`to_f32` then `from_f32`).
fn half_to_half<A: Half, B: Half>(src: &[A], dst: &mut [B]) {
    let mut buf = [0f32; BLOCK];
    for (s, d) in src.chunks(BLOCK).zip(dst.chunks_mut(BLOCK)) {
        let wide = &mut buf[..s.len()];
        A::widen(s, wide);
        B::narrow(wide, d);
    }
}

/// Converts `src` into `dst` (equal lengths), for every supported pair.
pub(crate) fn convert(src: FloatSlice<'_>, dst: FloatSliceMut<'_>) {
    match (src, dst) {
        (FloatSlice::F32(s), FloatSliceMut::F32(d)) => d.copy_from_slice(s),
        (FloatSlice::BF16(s), FloatSliceMut::BF16(d)) => d.copy_from_slice(s),
        (FloatSlice::F16(s), FloatSliceMut::F16(d)) => d.copy_from_slice(s),
        (FloatSlice::F32(s), FloatSliceMut::BF16(d)) => bf16::narrow(s, d),
        (FloatSlice::F32(s), FloatSliceMut::F16(d)) => f16::narrow(s, d),
        (FloatSlice::BF16(s), FloatSliceMut::F32(d)) => bf16::widen(s, d),
        (FloatSlice::F16(s), FloatSliceMut::F32(d)) => f16::widen(s, d),
        (FloatSlice::BF16(s), FloatSliceMut::F16(d)) => half_to_half(s, d),
        (FloatSlice::F16(s), FloatSliceMut::BF16(d)) => half_to_half(s, d),
    }
}

/// Converts every `src[i]` into `dst[i]` in one pass over the whole list.
pub(crate) fn convert_all(pairs: Vec<(FloatSlice<'_>, FloatSliceMut<'_>)>, plan: Plan) {
    map_bundles(pairs, plan, |bundle| {
        for (s, d) in bundle {
            convert(s, d);
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn branch_free_bf16_matches_half_on_every_bf16_and_many_f32() {
        for h in 0..=u16::MAX {
            let want = bf16::from_bits(h).to_f32().to_bits();
            assert_eq!(bf16_bits_to_f32_bits(h), want, "bf16 bits {h:#06x}");
        }
        // Every f32 whose low 16 bits are one of the rounding-relevant
        // patterns, over all 65536 high halves (sign, exponent, NaN, inf).
        let lows = [
            0u32, 1, 0x3FFF, 0x7FFF, 0x8000, 0x8001, 0xBFFF, 0xC000, 0xFFFF,
        ];
        for hi in 0..=0xFFFFu32 {
            for &lo in &lows {
                let x = (hi << 16) | lo;
                let want = bf16::from_f32(f32::from_bits(x)).to_bits();
                assert_eq!(f32_bits_to_bf16_bits(x), want, "f32 bits {x:#010x}");
            }
        }
        // And a pseudo-random sweep of the rest.
        let mut x = 0x1234_5678u32;
        for _ in 0..1_000_000 {
            x = x.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            let want = bf16::from_f32(f32::from_bits(x)).to_bits();
            assert_eq!(f32_bits_to_bf16_bits(x), want, "f32 bits {x:#010x}");
        }
    }

    #[test]
    fn slice_loops_match_half_around_block_edges() {
        // Special values at every position relative to the 64-element
        // blocks, in otherwise finite data: both the fast path and the
        // redo path run, and the remainder loop too.
        let specials = [
            f32::NAN,
            f32::from_bits(0xFF81_2345),
            f32::INFINITY,
            f32::NEG_INFINITY,
            3.4e38,
            -0.0,
        ];
        for &sp in &specials {
            for pos in [0usize, 1, 63, 64, 65, 127, 128, 150, 199] {
                let mut src: Vec<f32> = (0..200).map(|i| i as f32 * 0.37 - 31.0).collect();
                src[pos] = sp;
                let mut mid = vec![bf16::ZERO; 200];
                f32_to_bf16_slice(&src, &mut mid);
                let mut back = vec![0f32; 200];
                bf16_to_f32_slice(&mid, &mut back);
                for i in 0..200 {
                    assert_eq!(
                        mid[i].to_bits(),
                        bf16::from_f32(src[i]).to_bits(),
                        "{sp} at {pos}, element {i}"
                    );
                    assert_eq!(back[i].to_bits(), mid[i].to_f32().to_bits());
                }
            }
        }
    }
}
