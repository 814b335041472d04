//! LLM.int8's row-wise quantization, as bitsandbytes' `int8_vectorwise_quant`
//! and `int8_vectorwise_dequant` compute it.

use half::f16;

/// bitsandbytes' factor from an int8 code and its row maximum back to the
/// value: `1 / 127` as the f32 its Python literal becomes.
const INV_127: f32 = 7.874_016e-3;

/// A matrix `[rows, cols]` quantized row by row to int8.
#[derive(Debug, Clone, PartialEq)]
pub struct Int8Rows {
    /// `round(a * 127 / row_max)` (round half to even), row-major.
    pub codes: Vec<i8>,
    /// Each row's largest magnitude (bitsandbytes' `SCB` for a weight).
    pub row_max: Vec<f32>,
    /// Columns holding a value of magnitude `threshold` or more, when a
    /// threshold was given: their codes are zero in every row (LLM.int8
    /// multiplies them in full precision instead).
    pub outlier_cols: Vec<usize>,
}

/// `int8_vectorwise_quant(a, threshold)` on a row-major `[rows, cols]`.
///
/// With `threshold > 0`, values of that magnitude or more are left out of
/// the row maxima, and (for more than one row) their whole columns get code
/// zero. A row of zeros gets zero codes.
pub fn int8_vectorwise_quant(a: &[f32], cols: usize, threshold: f32) -> Int8Rows {
    let rows = a.len() / cols.max(1);
    let outlier = |v: f32| threshold > 0.0 && v.abs() >= threshold;
    let mut outlier_cols: Vec<usize> = (0..cols)
        .filter(|&c| (0..rows).any(|r| outlier(a[r * cols + c])))
        .collect();
    outlier_cols.sort_unstable();
    let kept = |v: f32| if outlier(v) { 0.0 } else { v };
    let mut codes = Vec::with_capacity(a.len());
    let mut row_max = Vec::with_capacity(rows);
    for row in a.chunks(cols.max(1)) {
        let m = row.iter().fold(0f32, |m, &v| m.max(kept(v).abs()));
        // `127.0 / row_stats` in torch is `row_stats.reciprocal() * 127.0`
        // (a Python scalar over a tensor): two roundings, not one.
        let scale = (1.0 / m) * 127.0;
        codes.extend(row.iter().map(|&v| {
            let q = (kept(v) * scale).round_ties_even();
            // 0 * inf (a row of zeros) is NaN, which torch casts to 0.
            if q.is_nan() {
                0
            } else {
                q as i8
            }
        }));
        row_max.push(m);
    }
    if rows > 1 {
        for r in 0..rows {
            for &c in &outlier_cols {
                codes[r * cols + c] = 0;
            }
        }
    }
    if threshold <= 0.0 {
        outlier_cols.clear();
    }
    Int8Rows {
        codes,
        row_max,
        outlier_cols,
    }
}

/// A weight `[out, in]` as bitsandbytes' `Int8Params` quantizes it: rounded
/// to f16 first, then [`int8_vectorwise_quant`] with no threshold.
pub fn quantize_int8_weight(w: &[f32], cols: usize) -> Int8Rows {
    let w16: Vec<f32> = w.iter().map(|&v| f16::from_f32(v).to_f32()).collect();
    int8_vectorwise_quant(&w16, cols, 0.0)
}

/// `int8_vectorwise_dequant`: `code * row_max * (1 / 127)`, two f32 products.
pub fn int8_dequant(codes: &[i8], row_max: &[f32], cols: usize) -> Vec<f32> {
    codes
        .iter()
        .enumerate()
        .map(|(i, &c)| f32::from(c) * row_max[i / cols] * INV_127)
        .collect()
}

/// The value of code `c` in a row whose maximum is `row_max`, as
/// [`int8_dequant`] computes it.
#[inline]
pub fn int8_value(c: i8, row_max: f32) -> f32 {
    f32::from(c) * row_max * INV_127
}
