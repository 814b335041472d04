//! Branch-free f32 approximations of exp, tanh and GELU.
//!
//! libm's `expf`/`tanhf` are scalar calls that block vectorisation; these
//! use only adds, multiplies, a division and bit casts, so loops over slices
//! compile to SIMD. The slice functions are built with `multiversion!` (see
//! the parent module) to use AVX-512 or AVX2 where the CPU has them.

/// `exp(x)` with a relative error below 3e-7 for `x` in [-87, 88]; inputs
/// outside are clamped (so the result is never 0 or inf, which the callers
/// rely on to avoid NaNs).
#[inline(always)]
pub(super) fn exp(x: f32) -> f32 {
    // 1.5 * 2^23: adding and subtracting it rounds to the nearest integer
    // without a (non-vectorisable) call to `round`.
    const ROUND: f32 = 12_582_912.0;
    // ln 2 split in two (Cody-Waite) so that `n * LN2_HI` is exact and the
    // reduced argument keeps full precision even for large |x|.
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    let x = x.clamp(-87.0, 88.0);
    let shifted = x * std::f32::consts::LOG2_E + ROUND;
    let n = shifted - ROUND;
    // The integer n also sits in the low mantissa bits of `shifted` (whose
    // exponent is fixed by ROUND): reading it from there instead of with
    // `n as i32` keeps the loop vectorised, since Rust's saturating float to
    // int cast is compiled to scalar code.
    let n_int = (shifted.to_bits() as i32).wrapping_sub(ROUND.to_bits() as i32);
    let r = x - n * LN2_HI - n * LN2_LO; // |r| <= ln(2) / 2
                                         // e^r: Taylor series to degree 7 (truncation error < 1e-8 on the range).
    let p = 1.0
        + r * (1.0
            + r * (0.5
                + r * (1.0 / 6.0
                    + r * (1.0 / 24.0
                        + r * (1.0 / 120.0 + r * (1.0 / 720.0 + r * (1.0 / 5040.0)))))));
    // 2^n by writing n into the exponent bits; n is in [-126, 127].
    let scale = f32::from_bits(((n_int + 127) as u32) << 23);
    p * scale
}

/// `tanh(x) = 1 - 2 / (exp(2x) + 1)`, absolute error below 3e-7.
#[inline(always)]
pub(super) fn tanh(x: f32) -> f32 {
    1.0 - 2.0 / (exp(2.0 * x) + 1.0)
}

/// sqrt(2 / pi), the slope of GELU's tanh approximation.
const GELU_C: f32 = 0.797_884_6;
/// Cubic coefficient of GELU's tanh approximation.
const GELU_A: f32 = 0.044_715;

/// GELU, tanh approximation (GPT-2's `gelu_new`, PyTorch
/// `approximate="tanh"`, candle's `Tensor::gelu`).
#[inline(always)]
pub(super) fn gelu(x: f32) -> f32 {
    0.5 * x * (1.0 + tanh(GELU_C * (x + GELU_A * x * x * x)))
}

/// Derivative of [`gelu`].
#[inline(always)]
pub(super) fn gelu_grad(x: f32) -> f32 {
    let t = tanh(GELU_C * (x + GELU_A * x * x * x));
    0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * GELU_C * (1.0 + 3.0 * GELU_A * x * x)
}

multiversion! {
    /// `y = gelu(h)` elementwise.
    fn gelu_slice(h: &[f32], y: &mut [f32]) {
        for (y, &h) in y.iter_mut().zip(h) {
            *y = gelu(h);
        }
    }
}

multiversion! {
    /// `g *= gelu'(h)` elementwise.
    fn gelu_backward_slice(h: &[f32], g: &mut [f32]) {
        for (g, &h) in g.iter_mut().zip(h) {
            *g *= gelu_grad(h);
        }
    }
}

multiversion! {
    /// Turns a row of logits into `(softmax - onehot(target)) * scale`,
    /// given the row's log-sum-exp.
    fn softmax_grad_row(row: &mut [f32], lse: f32, target: usize, scale: f32) {
        for x in row.iter_mut() {
            *x = exp(*x - lse) * scale;
        }
        row[target] -= scale;
    }
}

/// Sum of a slice in 16 independent lanes: a single accumulator would
/// serialise the adds (float addition is not reassociated by the compiler),
/// 16 lanes compile to one SIMD register's worth of parallel sums.
#[inline(always)]
pub(super) fn sum(x: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    let mut chunks = x.chunks_exact(16);
    for c in &mut chunks {
        for (a, &v) in acc.iter_mut().zip(c) {
            *a += v;
        }
    }
    acc.iter().sum::<f32>() + chunks.remainder().iter().sum::<f32>()
}

/// Dot product of two equally long slices, in 16 lanes like [`sum`].
#[inline(always)]
pub(super) fn dot(x: &[f32], y: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    let (mut cx, mut cy) = (x.chunks_exact(16), y.chunks_exact(16));
    for (a16, b16) in (&mut cx).zip(&mut cy) {
        for ((a, &u), &v) in acc.iter_mut().zip(a16).zip(b16) {
            *a += u * v;
        }
    }
    let tail: f32 = cx
        .remainder()
        .iter()
        .zip(cy.remainder())
        .map(|(u, v)| u * v)
        .sum();
    acc.iter().sum::<f32>() + tail
}

multiversion! {
    /// `sum_i exp(x[i] - shift)`, accumulated in 16 lanes so the sum
    /// vectorises (a single float accumulator would force sequential adds).
    fn sum_exp_shifted(x: &[f32], shift: f32) -> f32 {
        let mut acc = [0f32; 16];
        let mut chunks = x.chunks_exact(16);
        for c in &mut chunks {
            for (a, &v) in acc.iter_mut().zip(c) {
                *a += exp(v - shift);
            }
        }
        let tail: f32 = chunks.remainder().iter().map(|&v| exp(v - shift)).sum();
        acc.iter().sum::<f32>() + tail
    }
}

multiversion! {
    /// The largest element (NEG_INFINITY for an empty slice), in 16 lanes.
    fn max(x: &[f32]) -> f32 {
        let mut acc = [f32::NEG_INFINITY; 16];
        let mut chunks = x.chunks_exact(16);
        for c in &mut chunks {
            for (a, &v) in acc.iter_mut().zip(c) {
                *a = a.max(v);
            }
        }
        let tail = chunks.remainder().iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
        acc.iter().fold(tail, |m, &v| m.max(v))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fast_exp_matches_libm_to_a_few_ulps() {
        let mut x = -87.0f32;
        while x < 88.0 {
            let (got, want) = (exp(x), x.exp());
            assert!(
                ((got - want) / want).abs() < 4e-7,
                "exp({x}) = {got}, want {want}"
            );
            x += 0.0137;
        }
        assert!(exp(-1000.0) > 0.0 && exp(1000.0).is_finite());
    }

    #[test]
    fn fast_tanh_and_gelu_match_the_reference_formulas() {
        let mut x = -12.0f32;
        while x < 12.0 {
            assert!((tanh(x) - x.tanh()).abs() < 5e-7, "tanh({x})");
            let t = (GELU_C * (x + GELU_A * x * x * x)).tanh();
            let want = 0.5 * x * (1.0 + t);
            assert!((gelu(x) - want).abs() < 1e-5 * (1.0 + x.abs()), "gelu({x})");
            // Central difference of the exact formula checks the derivative.
            let h = 1e-3f64;
            let f = |x: f64| {
                let c = (2.0 / std::f64::consts::PI).sqrt();
                0.5 * x * (1.0 + (c * (x + 0.044715 * x * x * x)).tanh())
            };
            let num = (f(x as f64 + h) - f(x as f64 - h)) / (2.0 * h);
            assert!((gelu_grad(x) as f64 - num).abs() < 1e-4, "gelu'({x})");
            x += 0.01;
        }
    }

    #[test]
    fn slice_kernels_agree_with_the_scalar_functions() {
        let h: Vec<f32> = (0..1000).map(|i| (i as f32 - 500.0) / 50.0).collect();
        let mut y = vec![0.0; h.len()];
        gelu_slice(&h, &mut y);
        let mut g = vec![1.0; h.len()];
        gelu_backward_slice(&h, &mut g);
        let mut e = h.clone();
        softmax_grad_row(&mut e, 1.0, 3, 0.5);
        let want: f32 = h.iter().map(|&v| exp(v - 1.0)).sum();
        assert!((sum_exp_shifted(&h, 1.0) - want).abs() < 1e-5 * want);
        assert_eq!(max(&h), h[999]);
        assert_eq!(max(&h[..7]), h[6]);
        for i in 0..h.len() {
            assert_eq!(y[i], gelu(h[i]));
            assert_eq!(g[i], gelu_grad(h[i]));
            let onehot = if i == 3 { 0.5 } else { 0.0 };
            assert_eq!(e[i], exp(h[i] - 1.0) * 0.5 - onehot);
        }
    }
}
