//! Element-wise in-place kernels for gradient handling: loss-scale
//! unscaling with overflow detection, plain scaling, clamping, accumulation.
//!
//! Non-finite checks work on bit patterns: a float is inf or NaN exactly when
//! its exponent bits are all ones, and adding one to an all-ones exponent
//! field carries into the sign bit. OR-ing `(bits & EXP) + EXP_LSB` over a
//! slice and testing the sign bit at the end answers "any non-finite?" with
//! integer and/add/or only — branch-free and vectorised even on baseline
//! SSE2, which has no unsigned 32-bit `max`.

use half::{bf16, f16};

use super::{map_bundles, read_float_as_f32, update_as_f32, Plan};
use crate::slices::{FloatSlice, FloatSliceMut};

/// Exponent bits of an f32.
const F32_EXP: u32 = 0x7F80_0000;
/// Lowest exponent bit of an f32.
const F32_EXP_LSB: u32 = 0x0080_0000;

/// Sign-bit-set accumulator term for one f32 (see the module comment).
#[inline(always)]
fn non_finite_term(bits: u32) -> u32 {
    (bits & F32_EXP) + F32_EXP_LSB
}

/// True if any element of `x` is inf or NaN.
fn any_non_finite(x: &[f32]) -> bool {
    x.iter()
        .fold(0, |acc, v| acc | non_finite_term(v.to_bits()))
        & 0x8000_0000
        != 0
}

/// Multiplies `x` by `s` in place and reports whether any input was
/// non-finite, like PyTorch's `_amp_foreach_non_finite_check_and_unscale_`
/// (which tests the value before scaling and skips the multiply for 1.0).
fn unscale_f32(x: &mut [f32], s: f32) -> bool {
    if s == 1.0 {
        return any_non_finite(x);
    }
    let mut acc = 0u32;
    for v in x.iter_mut() {
        acc |= non_finite_term(v.to_bits());
        *v *= s;
    }
    acc & 0x8000_0000 != 0
}

/// Unscales every slice in place in one pass; true if any element was inf
/// or NaN. Half types are computed in f32 and rounded once.
pub(crate) fn unscale_and_check(
    slices: Vec<FloatSliceMut<'_>>,
    inv_scale: f32,
    plan: Plan,
) -> bool {
    let found = map_bundles(slices, plan, |bundle| {
        let mut found = false;
        for s in bundle {
            match s {
                FloatSliceMut::F32(x) => found |= unscale_f32(x, inv_scale),
                FloatSliceMut::BF16(x) => update_as_f32(x, |b| found |= unscale_f32(b, inv_scale)),
                FloatSliceMut::F16(x) => update_as_f32(x, |b| found |= unscale_f32(b, inv_scale)),
            }
        }
        found
    });
    found.into_iter().any(|f| f)
}

/// True if any 16-bit float with exponent mask `exp` (and lowest exponent
/// bit `lsb`) is inf or NaN; the same carry trick on narrow bits.
fn half_non_finite(bits: impl Iterator<Item = u16>, exp: u16, lsb: u16) -> bool {
    bits.fold(0u16, |acc, b| acc | ((b & exp) + lsb)) & 0x8000 != 0
}

/// True if any element of any slice is inf or NaN.
pub(crate) fn has_non_finite(slices: Vec<FloatSlice<'_>>, plan: Plan) -> bool {
    let found = map_bundles(slices, plan, |bundle| {
        bundle.into_iter().any(|s| match s {
            FloatSlice::F32(x) => any_non_finite(x),
            FloatSlice::BF16(x) => {
                half_non_finite(x.iter().map(|v| bf16::to_bits(*v)), 0x7F80, 0x0080)
            }
            FloatSlice::F16(x) => {
                half_non_finite(x.iter().map(|v| f16::to_bits(*v)), 0x7C00, 0x0400)
            }
        })
    });
    found.into_iter().any(|f| f)
}

/// Applies `f` to every element of every slice in place, in f32.
fn map_in_place(slices: Vec<FloatSliceMut<'_>>, plan: Plan, f: impl Fn(f32) -> f32 + Sync + Send) {
    let f = &f;
    let apply = move |x: &mut [f32]| x.iter_mut().for_each(|v| *v = f(*v));
    map_bundles(slices, plan, |bundle| {
        for s in bundle {
            match s {
                FloatSliceMut::F32(x) => apply(x),
                FloatSliceMut::BF16(x) => update_as_f32(x, apply),
                FloatSliceMut::F16(x) => update_as_f32(x, apply),
            }
        }
    });
}

/// Multiplies every element by `factor` (clip_grad_norm's rescale).
pub(crate) fn scale(slices: Vec<FloatSliceMut<'_>>, factor: f32, plan: Plan) {
    map_in_place(slices, plan, move |v| v * factor);
}

/// Clamps every element to `[lo, hi]` like `torch.clamp_`: `min(max(x, lo),
/// hi)`, so NaN stays NaN and `lo > hi` yields `hi` everywhere.
pub(crate) fn clamp(slices: Vec<FloatSliceMut<'_>>, lo: f32, hi: f32, plan: Plan) {
    map_in_place(slices, plan, move |v| {
        let v = if v < lo { lo } else { v };
        if v > hi {
            hi
        } else {
            v
        }
    });
}

/// `dst += src` for each pair; `dst` is f32, `src` any float type, widened
/// exactly on the fly (gradient accumulation without a temporary tensor).
pub(crate) fn add(pairs: Vec<(&mut [f32], FloatSlice<'_>)>, plan: Plan) {
    map_bundles(pairs, plan, |bundle| {
        for (d, s) in bundle {
            read_float_as_f32(s, |off, b| {
                for (d, s) in d[off..off + b.len()].iter_mut().zip(b) {
                    *d += *s;
                }
            });
        }
    });
}
