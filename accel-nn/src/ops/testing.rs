//! Test harness shared by the op tests: deterministic inputs and one
//! check that runs an op through fused-vs-composed, finite differences and
//! half precision.

use candle_core::{DType, Device, Result, Tensor, Var};

/// A deterministic f32 CPU tensor with normal entries of std `scale`.
pub(crate) fn randn(shape: &[usize], seed: u64, scale: f64) -> Result<Tensor> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15).wrapping_add(1);
    let mut next = || {
        // SplitMix64.
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
    };
    let n: usize = shape.iter().product();
    let data: Vec<f32> = (0..n)
        .map(|_| {
            let (u, v) = (next().max(1e-12), next());
            ((-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos() * scale) as f32
        })
        .collect();
    Tensor::from_vec(data, shape, &Device::Cpu)
}

/// Largest absolute difference relative to the largest magnitude of `want`.
pub(crate) fn rel_err(got: &Tensor, want: &Tensor) -> Result<f64> {
    let (got, want) = (got.to_dtype(DType::F64)?, want.to_dtype(DType::F64)?);
    let err = (&got - &want)?
        .abs()?
        .flatten_all()?
        .max(0)?
        .to_scalar::<f64>()?;
    let scale = want.abs()?.flatten_all()?.max(0)?.to_scalar::<f64>()?;
    Ok(err / scale.max(1e-12))
}

/// Fails with the measured error when `got` and `want` differ in shape or
/// by more than `tol` relative to `want`'s largest magnitude.
pub(crate) fn assert_close(got: &Tensor, want: &Tensor, tol: f64, what: &str) -> Result<()> {
    assert_eq!(got.dims(), want.dims(), "{what}: shapes differ");
    let e = rel_err(got, want)?;
    assert!(e <= tol, "{what}: relative error {e:e} > {tol:e}");
    assert!(!e.is_nan(), "{what}: NaN");
    Ok(())
}

/// An op under test: takes its differentiable inputs, returns a tensor.
pub(crate) type Op<'a> = &'a dyn Fn(&[Tensor]) -> Result<Tensor>;

/// `sum(f(xs) * weights)` in f64, the scalar every gradient check
/// differentiates (random weights make every output element matter).
fn weighted(f: Op, xs: &[Tensor], seed: u64) -> Result<(Tensor, Tensor)> {
    let y = f(xs)?;
    let w = randn(y.dims(), seed ^ 0xABCD, 1.0)?.to_dtype(y.dtype())?;
    let loss = (y.to_dtype(DType::F64)? * w.to_dtype(DType::F64)?)?.sum_all()?;
    Ok((y, loss))
}

/// Gradients of the weighted loss of `f` at `xs` (as Vars of `dtype`).
pub(crate) fn grads(
    f: Op,
    xs: &[Tensor],
    dtype: DType,
    seed: u64,
) -> Result<(Tensor, Vec<Tensor>)> {
    let vars = xs
        .iter()
        .map(|x| Var::from_tensor(&x.to_dtype(dtype)?))
        .collect::<Result<Vec<_>>>()?;
    let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let (y, loss) = weighted(f, &ts, seed)?;
    let g = loss.backward()?;
    let gs = ts
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let g = g
                .get(t)
                .unwrap_or_else(|| panic!("input {i} got no gradient"));
            assert_eq!(g.dtype(), dtype, "gradient {i} dtype");
            Ok(g.clone())
        })
        .collect::<Result<Vec<_>>>()?;
    Ok((y, gs))
}

/// Central differences of the weighted loss of `f` in `dtype`, at up to
/// `limit` evenly spread coordinates of each input, compared with `analytic`.
fn finite_differences(
    f: Op,
    xs: &[Tensor],
    analytic: &[Tensor],
    dtype: DType,
    (eps, tol, limit): (f64, f64, usize),
    seed: u64,
) -> Result<()> {
    for (i, x) in xs.iter().enumerate() {
        let base: Vec<f64> = x.to_dtype(DType::F64)?.flatten_all()?.to_vec1()?;
        let g: Vec<f64> = analytic[i].to_dtype(DType::F64)?.flatten_all()?.to_vec1()?;
        let gmax = g.iter().fold(0f64, |m, v| m.max(v.abs())).max(1e-3);
        let step = (base.len() / limit).max(1);
        for j in (0..base.len()).step_by(step) {
            let at = |delta: f64| -> Result<f64> {
                let mut v = base.clone();
                v[j] += delta;
                let mut inputs = xs
                    .iter()
                    .map(|x| x.to_dtype(dtype))
                    .collect::<Result<Vec<_>>>()?;
                inputs[i] = Tensor::from_vec(v, x.shape(), &Device::Cpu)?.to_dtype(dtype)?;
                weighted(f, &inputs, seed)?.1.to_scalar::<f64>()
            };
            let num = (at(eps)? - at(-eps)?) / (2.0 * eps);
            assert!(
                (num - g[j]).abs() <= tol * gmax,
                "{dtype:?} input {i}[{j}]: analytic {} vs numeric {num} (tol {tol} x {gmax})",
                g[j]
            );
        }
    }
    Ok(())
}

/// The standard check of an op `op` with composed reference `composed`,
/// on random inputs of `shapes`:
/// * f32: op vs composed in value (1e-5) and gradients (1e-4);
/// * f64: the composed gradients vs central differences (1e-6);
/// * f32: the op's own gradients vs central differences (1e-2, the
///   f32 rounding of the loss over a 1e-3 step);
/// * bf16 and f16: op on half inputs vs composed in f32 on the same
///   (rounded) values, in value and gradient, with dtypes preserved.
pub(crate) fn check_op(shapes: &[Vec<usize>], seed: u64, op: Op, composed: Op) -> Result<()> {
    let xs = shapes
        .iter()
        .enumerate()
        .map(|(i, s)| randn(s, seed * 31 + i as u64, 1.0))
        .collect::<Result<Vec<_>>>()?;
    let (y, g) = grads(op, &xs, DType::F32, seed)?;
    let (yc, gc) = grads(composed, &xs, DType::F32, seed)?;
    assert_close(&y, &yc, 1e-5, "f32 value")?;
    for (i, (a, b)) in g.iter().zip(&gc).enumerate() {
        assert_close(a, b, 1e-4, &format!("f32 gradient {i}"))?;
    }
    let (_, g64) = grads(composed, &xs, DType::F64, seed)?;
    finite_differences(composed, &xs, &g64, DType::F64, (1e-5, 1e-6, 24), seed)?;
    finite_differences(op, &xs, &g, DType::F32, (1e-3, 1e-2, 8), seed)?;
    for (dtype, tol) in [(DType::BF16, 4e-2), (DType::F16, 6e-3)] {
        let xh = xs
            .iter()
            .map(|x| x.to_dtype(dtype))
            .collect::<Result<Vec<_>>>()?;
        let (yh, gh) = grads(op, &xh, dtype, seed)?;
        // Ops return their input dtype; losses (scalars) are always f32.
        let want = if yh.rank() == 0 { DType::F32 } else { dtype };
        assert_eq!(yh.dtype(), want, "{dtype:?} output dtype");
        let up = xh
            .iter()
            .map(|x| x.to_dtype(DType::F32))
            .collect::<Result<Vec<_>>>()?;
        let (yr, gr) = grads(composed, &up, DType::F32, seed)?;
        assert_close(&yh, &yr, tol, &format!("{dtype:?} value"))?;
        for (i, (a, b)) in gh.iter().zip(&gr).enumerate() {
            assert_close(a, b, 2.0 * tol, &format!("{dtype:?} gradient {i}"))?;
        }
    }
    Ok(())
}
