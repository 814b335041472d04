//! Branch-free f32 approximations of exp, tanh, erf, GELU and SiLU.
//!
//! libm's `expf`/`tanhf` are scalar calls that block vectorisation; these
//! use only adds, multiplies, a division and bit casts, so loops over slices
//! compile to SIMD. The slice functions are built with `multiversion!` (see
//! `raw.rs`) to use AVX-512 or AVX2 where the CPU has them.

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
pub(super) fn gelu_tanh(x: f32) -> f32 {
    0.5 * x * (1.0 + tanh(GELU_C * (x + GELU_A * x * x * x)))
}

/// Derivative of [`gelu_tanh`].
#[inline(always)]
pub(super) fn gelu_tanh_grad(x: f32) -> f32 {
    let t = tanh(GELU_C * (x + GELU_A * x * x * x));
    0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * GELU_C * (1.0 + 3.0 * GELU_A * x * x)
}

/// `erf(x)`: Abramowitz & Stegun 7.1.26 (absolute error below 1.5e-7,
/// about one f32 ulp of 1) away from 0, a Taylor series near it.
#[inline(always)]
pub(super) fn erf(x: f32) -> f32 {
    let a = x.abs();
    let t = 1.0 / (1.0 + 0.327_591_1 * a);
    let poly = t
        * (0.254_829_6
            + t * (-0.284_496_72 + t * (1.421_413_8 + t * (-1.453_152_1 + t * 1.061_405_4))));
    let r = (1.0 - poly * exp(-a * a)).copysign(x);
    // Near 0 the subtraction above cancels; the Taylor series (truncation
    // below 2e-8 for |x| < 0.5) is exact there. Both are computed and one
    // selected, which keeps the function branch-free.
    let x2 = x * x;
    let series = x
        * (std::f32::consts::FRAC_2_SQRT_PI
            + x2 * (-0.376_126_4
                + x2 * (0.112_837_9
                    + x2 * (-0.026_866_17 + x2 * (0.005_223_977 - x2 * 0.000_854_832_7)))));
    if a < 0.5 {
        series
    } else {
        r
    }
}

/// 1/sqrt(2).
const FRAC_1_SQRT_2: f32 = std::f32::consts::FRAC_1_SQRT_2;
/// 1/sqrt(2 pi), the standard normal density at 0.
const INV_SQRT_2PI: f32 = 0.398_942_3;

/// Exact GELU, `x * Phi(x)` (PyTorch `gelu`, HF `"gelu"`).
#[inline(always)]
pub(super) fn gelu_erf(x: f32) -> f32 {
    0.5 * x * (1.0 + erf(x * FRAC_1_SQRT_2))
}

/// Derivative of [`gelu_erf`]: `Phi(x) + x * phi(x)`.
#[inline(always)]
pub(super) fn gelu_erf_grad(x: f32) -> f32 {
    0.5 * (1.0 + erf(x * FRAC_1_SQRT_2)) + x * INV_SQRT_2PI * exp(-0.5 * x * x)
}

/// `1 / (1 + exp(-x))`; exact 0 and 1 are never reached since [`exp`]
/// clamps, which keeps SiLU's backward finite.
#[inline(always)]
pub(super) fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + exp(-x))
}

/// SiLU (swish), `x * sigmoid(x)`.
#[inline(always)]
pub(super) fn silu(x: f32) -> f32 {
    x * sigmoid(x)
}

/// Derivative of [`silu`].
#[inline(always)]
pub(super) fn silu_grad(x: f32) -> f32 {
    let s = sigmoid(x);
    s * (1.0 + x * (1.0 - s))
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

    /// erf in f64, an independent reference: the Taylor series for
    /// |x| < 2.5 (no cancellation there) and the continued fraction of
    /// erfc beyond.
    fn erf64(x: f64) -> f64 {
        let a = x.abs();
        if a >= 2.5 {
            let mut t = a;
            for k in (1..=80).rev() {
                t = a + (k as f64 / 2.0) / t;
            }
            let erfc = (-a * a).exp() / std::f64::consts::PI.sqrt() / t;
            return (1.0 - erfc).copysign(x);
        }
        let (mut term, mut sum, mut n) = (x, x, 0.0);
        while term.abs() > 1e-18 {
            n += 1.0;
            term *= -x * x / n;
            sum += term / (2.0 * n + 1.0);
        }
        2.0 / std::f64::consts::PI.sqrt() * sum
    }

    #[test]
    fn activations_and_their_derivatives_match_f64_references() {
        let mut x = -12.0f32;
        while x < 12.0 {
            let xd = x as f64;
            assert!((tanh(x) - x.tanh()).abs() < 5e-7, "tanh({x})");
            assert!((erf(x) as f64 - erf64(xd)).abs() < 3e-7, "erf({x})");
            let c = (2.0 / std::f64::consts::PI).sqrt();
            let gt = |x: f64| 0.5 * x * (1.0 + (c * (x + 0.044715 * x * x * x)).tanh());
            let ge = |x: f64| 0.5 * x * (1.0 + erf64(x / 2f64.sqrt()));
            let si = |x: f64| x / (1.0 + (-x).exp());
            let tol = |v: f64| 1e-6 * (1.0 + v.abs());
            assert!(
                (gelu_tanh(x) as f64 - gt(xd)).abs() < 10.0 * tol(xd),
                "gelu_tanh({x})"
            );
            assert!(
                (gelu_erf(x) as f64 - ge(xd)).abs() < 10.0 * tol(xd),
                "gelu({x})"
            );
            assert!(
                (silu(x) as f64 - si(xd)).abs() < 10.0 * tol(xd),
                "silu({x})"
            );
            // Central differences of the f64 formulas check the derivatives.
            let h = 1e-4f64;
            let num = |f: &dyn Fn(f64) -> f64| (f(xd + h) - f(xd - h)) / (2.0 * h);
            assert!(
                (gelu_tanh_grad(x) as f64 - num(&gt)).abs() < 1e-5,
                "gelu_tanh'({x})"
            );
            assert!(
                (gelu_erf_grad(x) as f64 - num(&ge)).abs() < 1e-5,
                "gelu'({x})"
            );
            assert!((silu_grad(x) as f64 - num(&si)).abs() < 1e-5, "silu'({x})");
            x += 0.01;
        }
    }

    #[test]
    fn slice_kernels_agree_with_the_scalar_functions() {
        let h: Vec<f32> = (0..1000).map(|i| (i as f32 - 500.0) / 50.0).collect();
        let mut e = h.clone();
        softmax_grad_row(&mut e, 1.0, 3, 0.5);
        let want: f32 = h.iter().map(|&v| exp(v - 1.0)).sum();
        assert!((sum_exp_shifted(&h, 1.0) - want).abs() < 1e-5 * want);
        assert_eq!(max(&h), h[999]);
        assert_eq!(max(&h[..7]), h[6]);
        for i in 0..h.len() {
            let onehot = if i == 3 { 0.5 } else { 0.0 };
            assert_eq!(e[i], exp(h[i] - 1.0) * 0.5 - onehot);
        }
    }
}
