//! Each fused kernel against the composed candle ops it replaces, in value
//! and gradient.

use candle_core::{DType, Device, Result, Tensor, Var, D};

use super::*;

/// A deterministic `Var` with entries spread over roughly [-scale, scale].
fn var(shape: &[usize], seed: u64, scale: f64) -> Result<Var> {
    let mut rng = accel_core::rng::SplitMix64::new(seed);
    let n: usize = shape.iter().product();
    let data: Vec<f32> = (0..n).map(|_| (rng.next_normal() * scale) as f32).collect();
    Var::from_tensor(&Tensor::from_vec(data, shape, &Device::Cpu)?)
}

/// Largest absolute difference relative to the largest magnitude of `want`.
fn rel_err(got: &Tensor, want: &Tensor) -> Result<f32> {
    let err = (got - want)?.abs()?.max_all()?.to_scalar::<f32>()?;
    let scale = want.abs()?.max_all()?.to_scalar::<f32>()?;
    Ok(err / scale.max(1e-12))
}

/// Compares two scalar-producing closures in value and in the gradients of
/// `vars`, using a fixed random weighting of the output so every element's
/// gradient matters.
fn check(
    vars: &[&Var],
    fused: impl Fn() -> Result<Tensor>,
    composed: impl Fn() -> Result<Tensor>,
) -> Result<()> {
    let (a, b) = (fused()?, composed()?);
    assert_eq!(a.dims(), b.dims());
    assert!(
        rel_err(&a, &b)? < 1e-5,
        "values differ: {}",
        rel_err(&a, &b)?
    );
    let w = var(a.dims(), 99, 1.0)?;
    let (ga, gb) = (
        (a * w.as_tensor())?.sum_all()?.backward()?,
        (b * w.as_tensor())?.sum_all()?.backward()?,
    );
    for (i, v) in vars.iter().enumerate() {
        let (x, y) = (
            ga.get(v.as_tensor()).unwrap(),
            gb.get(v.as_tensor()).unwrap(),
        );
        assert!(
            rel_err(x, y)? < 1e-4,
            "gradient {i} differs: {}",
            rel_err(x, y)?
        );
    }
    Ok(())
}

#[test]
fn linear_matches_matmul_plus_bias_for_every_activation() -> Result<()> {
    let (x, w, b) = (
        var(&[37, 24], 1, 1.0)?,
        var(&[19, 24], 2, 0.3)?,
        var(&[19], 3, 0.3)?,
    );
    for act in [Activation::None, Activation::Relu, Activation::Gelu] {
        check(
            &[&x, &w, &b],
            || linear(&x, &w, Some(&b), act),
            || crate::nn::dense(&x, &w, Some(&b), act, false),
        )?;
    }
    check(
        &[&x, &w],
        || linear(&x, &w, None, Activation::None),
        || x.matmul(&w.t()?),
    )
}

#[test]
fn linear_skips_the_input_gradient_of_plain_data() -> Result<()> {
    let x = Tensor::ones((4, 3), DType::F32, &Device::Cpu)?;
    let w = var(&[2, 3], 1, 1.0)?;
    let grads = linear(&x, &w, None, Activation::None)?
        .sum_all()?
        .backward()?;
    assert!(grads.get(&x).is_none());
    // d(sum(x w^T))/dw = column sums of x = 4 everywhere.
    assert_eq!(
        grads.get(w.as_tensor()).unwrap().to_vec2::<f32>()?,
        vec![vec![4f32; 3]; 2]
    );
    Ok(())
}

#[test]
fn layer_norm_matches_the_composed_formula() -> Result<()> {
    let (x, w, b) = (
        var(&[13, 32], 4, 3.0)?,
        var(&[32], 5, 1.0)?,
        var(&[32], 6, 1.0)?,
    );
    check(
        &[&x, &w, &b],
        || layer_norm(&x, &w, &b, 1e-5),
        || crate::nn::layer_norm(&x, &w, &b, 1e-5),
    )
}

#[test]
fn causal_attention_matches_masked_softmax_attention() -> Result<()> {
    let (b, t, nh, hd) = (2, 7, 3, 4);
    let d = nh * hd;
    let qkv = var(&[b * t, 3 * d], 7, 1.0)?;
    let composed = || -> Result<Tensor> {
        let x = qkv
            .as_tensor()
            .reshape((b, t, 3, nh, hd))?
            .permute((2, 0, 3, 1, 4))?
            .contiguous()?;
        let (q, k, v) = (x.get(0)?, x.get(1)?, x.get(2)?);
        let att = (q.matmul(&k.t()?)? / (hd as f64).sqrt())?;
        let mask: Vec<f32> = (0..t)
            .flat_map(|i| (0..t).map(move |j| if j <= i { 0.0 } else { f32::NEG_INFINITY }))
            .collect();
        let att = att.broadcast_add(&Tensor::from_vec(mask, (t, t), &Device::Cpu)?)?;
        let att = candle_nn::ops::softmax(&att, D::Minus1)?;
        att.matmul(&v)?
            .transpose(1, 2)?
            .contiguous()?
            .reshape((b * t, d))
    };
    check(&[&qkv], || causal_attention(&qkv, b, t, nh), composed)
}

#[test]
fn linear_cross_entropy_matches_candle_and_supports_a_second_backward() -> Result<()> {
    let (x, w) = (var(&[9, 8], 8, 1.0)?, var(&[21, 8], 9, 1.0)?);
    let targets = Tensor::new(&[0u32, 5, 20, 3, 3, 7, 19, 1, 0], &Device::Cpu)?;
    let fused = linear_cross_entropy(&x, &w, &targets)?;
    let composed = candle_nn::loss::cross_entropy(&x.matmul(&w.t()?)?, &targets)?;
    let (a, b) = (fused.to_scalar::<f32>()?, composed.to_scalar::<f32>()?);
    assert!((a - b).abs() < 1e-5 * b, "{a} vs {b}");
    let want = composed.backward()?;
    // The first backward consumes the saved logits; the second recomputes them.
    for _ in 0..2 {
        let got = fused.backward()?;
        for v in [&x, &w] {
            let (g, e) = (
                got.get(v.as_tensor()).unwrap(),
                want.get(v.as_tensor()).unwrap(),
            );
            assert!(rel_err(g, e)? < 1e-5, "{}", rel_err(g, e)?);
        }
    }
    assert!(linear_cross_entropy(&x, &w, &Tensor::new(&[21u32; 9], &Device::Cpu)?).is_err());
    Ok(())
}

#[test]
fn kernels_keep_half_precision_dtypes_for_outputs_and_gradients() -> Result<()> {
    for dtype in [DType::BF16, DType::F16] {
        let x = Var::from_tensor(&var(&[6, 8], 1, 1.0)?.to_dtype(dtype)?)?;
        let w = Var::from_tensor(&var(&[8, 8], 2, 0.3)?.to_dtype(dtype)?)?;
        let b = Var::from_tensor(&var(&[8], 3, 0.3)?.to_dtype(dtype)?)?;
        let h = linear(&x, &w, Some(&b), Activation::Gelu)?;
        let h = layer_norm(&h, &w.get(0)?, &b, 1e-5)?;
        let h = causal_attention(
            &h.reshape((6, 8))?.repeat((1, 3))?.reshape((6, 24))?,
            2,
            3,
            2,
        )?;
        assert_eq!(h.dtype(), dtype);
        let loss =
            linear_cross_entropy(&h, &w, &Tensor::new(&[1u32, 2, 3, 4, 5, 6], &Device::Cpu)?)?;
        assert_eq!(loss.dtype(), DType::F32);
        let grads = loss.backward()?;
        for v in [&x, &w, &b] {
            assert_eq!(grads.get(v.as_tensor()).unwrap().dtype(), dtype);
        }
    }
    Ok(())
}
