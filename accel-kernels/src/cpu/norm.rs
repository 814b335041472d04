//! Reductions for gradient clipping: the sum of squares behind the global
//! L2 norm and the largest magnitude behind the inf-norm.
//!
//! Sums accumulate in f64 so that millions of f32 squares lose nothing that
//! matters, over several independent lanes so the loop vectorises (a single
//! f64 accumulator is a serial dependency chain). The lane layout and the
//! bundle order are fixed, so the result is the same bits on any number of
//! threads.

use super::{map_bundles, read_float_as_f32, Plan};
use crate::slices::FloatSlice;

/// Independent f64 accumulators per sum.
const LANES: usize = 8;

/// Sum of squares of `x` in f64, lanes combined in a fixed order.
fn sum_sq_f32(x: &[f32]) -> f64 {
    let mut acc = [0f64; LANES];
    let mut chunks = x.chunks_exact(LANES);
    for c in &mut chunks {
        for k in 0..LANES {
            let v = c[k] as f64;
            acc[k] += v * v;
        }
    }
    for (k, v) in chunks.remainder().iter().enumerate() {
        let v = *v as f64;
        acc[k] += v * v;
    }
    acc.iter().sum()
}

/// Sum of the squares of every element of every slice, accumulated in f64.
pub(crate) fn sum_of_squares(slices: Vec<FloatSlice<'_>>, plan: Plan) -> f64 {
    let partial = map_bundles(slices, plan, |bundle| {
        let mut sum = 0f64;
        for s in bundle {
            read_float_as_f32(s, |_, b| sum += sum_sq_f32(b));
        }
        sum
    });
    partial.into_iter().sum()
}

/// Largest `|x|` over every slice; NaN if any element is NaN, like
/// `torch.linalg.vector_norm(ord=inf)`.
///
/// The running maximum is a compare-and-select that compiles to `maxps`
/// (which drops NaN), so NaN is tracked beside it with `v != v`.
pub(crate) fn max_abs(slices: Vec<FloatSlice<'_>>, plan: Plan) -> f64 {
    let partial = map_bundles(slices, plan, |bundle| {
        let (mut best, mut nan) = (0f32, false);
        for s in bundle {
            read_float_as_f32(s, |_, b| {
                for v in b {
                    let a = v.abs();
                    best = if a > best { a } else { best };
                    nan |= v.is_nan();
                }
            });
        }
        if nan {
            f32::NAN
        } else {
            best
        }
    });
    partial.into_iter().fold(0f64, |acc, m| {
        if m.is_nan() || acc.is_nan() {
            f64::NAN
        } else {
            acc.max(m as f64)
        }
    })
}
