//! Attention through every mask kind, grouped-query heads, fully masked
//! rows and strided inputs, against the composed path and finite
//! differences.

use candle_core::{Device, Var};

use super::*;
use crate::ops::testing::*;

/// check_op for attention with q `[b, h, t, d]`, k/v `[b, kvh, s, d]`.
fn check_mask(
    dims: (usize, usize, usize, usize, usize, usize),
    mask: AttentionMask,
    seed: u64,
) -> Result<()> {
    let (b, h, kvh, t, s, d) = dims;
    let scale = 1.0 / (d as f64).sqrt();
    check_op(
        &[vec![b, h, t, d], vec![b, kvh, s, d], vec![b, kvh, s, d]],
        seed,
        &|xs| scaled_dot_product_attention(&xs[0], &xs[1], &xs[2], &mask, scale),
        &|xs| composed_attention(&xs[0], &xs[1], &xs[2], &mask, scale),
    )
}

/// A BERT-style padding mask `[b, 1, 1, s]`: batch row `i` has its last
/// `i + 1` keys masked with `fill`.
fn padding(b: usize, s: usize, fill: f32) -> Result<Tensor> {
    let v: Vec<f32> = (0..b)
        .flat_map(|i| (0..s).map(move |j| if j + i + 1 >= s { fill } else { 0.0 }))
        .collect();
    Tensor::from_vec(v, (b, 1, 1, s), &Device::Cpu)
}

#[test]
fn attention_without_mask_and_with_causal_masks() -> Result<()> {
    check_mask((2, 2, 2, 5, 5, 4), AttentionMask::None, 60)?;
    check_mask((2, 2, 2, 5, 5, 4), AttentionMask::Causal { offset: 0 }, 61)?;
    // A KV cache: 3 cached positions, 4 new queries.
    check_mask((1, 2, 2, 4, 7, 4), AttentionMask::Causal { offset: 3 }, 62)
}

#[test]
fn attention_with_additive_masks() -> Result<()> {
    check_mask(
        (3, 2, 2, 4, 6, 4),
        AttentionMask::Additive(padding(3, 6, f32::NEG_INFINITY)?),
        63,
    )?;
    check_mask(
        (3, 2, 2, 4, 6, 4),
        AttentionMask::Additive(padding(3, 6, -1e9)?),
        64,
    )?;
    // A full [b, h, t, s] bias (ALiBi-like), finite everywhere.
    check_mask(
        (2, 2, 2, 3, 3, 4),
        AttentionMask::Additive(randn(&[2, 2, 3, 3], 5, 1.0)?),
        65,
    )?;
    let bias = padding(2, 5, f32::NEG_INFINITY)?;
    check_mask(
        (2, 2, 2, 5, 5, 4),
        AttentionMask::CausalAndAdditive { offset: 0, bias },
        66,
    )
}

#[test]
fn attention_with_grouped_query_heads() -> Result<()> {
    check_mask((2, 4, 2, 3, 5, 4), AttentionMask::None, 67)?;
    check_mask((1, 6, 1, 4, 4, 8), AttentionMask::Causal { offset: 0 }, 68)?;
    let bias = padding(2, 5, f32::NEG_INFINITY)?;
    check_mask(
        (2, 4, 2, 3, 5, 4),
        AttentionMask::CausalAndAdditive { offset: 2, bias },
        69,
    )
}

#[test]
fn fully_masked_rows_output_zero_with_finite_gradients() -> Result<()> {
    // Batch row 0 masks every key; row 1 none.
    let mut m = vec![f32::NEG_INFINITY; 4];
    m.extend([0f32; 4]);
    let mask = AttentionMask::Additive(Tensor::from_vec(m, (2, 1, 1, 4), &Device::Cpu)?);
    check_mask((2, 2, 1, 3, 4, 4), mask.clone(), 70)?;
    let q = Var::from_tensor(&randn(&[2, 2, 3, 4], 1, 1.0)?)?;
    let k = Var::from_tensor(&randn(&[2, 1, 4, 4], 2, 1.0)?)?;
    let v = Var::from_tensor(&randn(&[2, 1, 4, 4], 3, 1.0)?)?;
    for composed in [false, true] {
        let f = if composed {
            composed_attention
        } else {
            scaled_dot_product_attention
        };
        let y = f(&q, &k, &v, &mask, 0.5)?;
        let dead = y.get(0)?.abs()?.sum_all()?.to_scalar::<f32>()?;
        assert_eq!(dead, 0.0, "composed={composed}");
        let grads = y.sqr()?.sum_all()?.backward()?;
        for var in [&q, &k, &v] {
            let g = grads.get(var.as_tensor()).unwrap();
            let sum = g.abs()?.sum_all()?.to_scalar::<f32>()?;
            assert!(sum.is_finite(), "composed={composed}: gradient {sum}");
        }
    }
    Ok(())
}

#[test]
fn composed_attention_matches_a_naive_loop() -> Result<()> {
    let (t, s, d) = (3, 4, 2);
    let q = randn(&[1, 2, t, d], 1, 1.0)?;
    let k = randn(&[1, 1, s, d], 2, 1.0)?;
    let v = randn(&[1, 1, s, d], 3, 1.0)?;
    let y = composed_attention(&q, &k, &v, &AttentionMask::Causal { offset: 1 }, 0.7)?;
    let qv = q.flatten_all()?.to_vec1::<f32>()?;
    let kv = k.flatten_all()?.to_vec1::<f32>()?;
    let vv = v.flatten_all()?.to_vec1::<f32>()?;
    let mut want = vec![0f32; 2 * t * d];
    for h in 0..2 {
        for i in 0..t {
            let live = i + 2;
            let sc: Vec<f32> = (0..live)
                .map(|j| {
                    (0..d)
                        .map(|c| qv[(h * t + i) * d + c] * kv[j * d + c])
                        .sum::<f32>()
                        * 0.7
                })
                .collect();
            let m = sc.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
            let z: f32 = sc.iter().map(|x| (x - m).exp()).sum();
            for c in 0..d {
                want[(h * t + i) * d + c] = (0..live)
                    .map(|j| (sc[j] - m).exp() / z * vv[j * d + c])
                    .sum();
            }
        }
    }
    let want = Tensor::from_vec(want, (1, 2, t, d), &Device::Cpu)?;
    assert_close(&y, &want, 1e-5, "naive")
}

#[test]
fn strided_heads_of_a_fused_qkv_projection_are_read_in_place() -> Result<()> {
    let (b, t, h, hd) = (2, 5, 3, 4);
    let qkv = Var::from_tensor(&randn(&[b, t, 3 * h * hd], 8, 1.0)?)?;
    let split = |qkv: &Tensor| -> Result<Vec<Tensor>> {
        let x = qkv.reshape((b, t, 3, h, hd))?;
        (0..3)
            .map(|i| x.narrow(2, i, 1)?.squeeze(2)?.transpose(1, 2))
            .collect()
    };
    let mask = AttentionMask::Causal { offset: 0 };
    let run = |contiguous: bool| -> Result<(Tensor, Tensor)> {
        let p = split(qkv.as_tensor())?;
        let p: Vec<Tensor> = if contiguous {
            p.iter().map(|t| t.contiguous()).collect::<Result<_>>()?
        } else {
            p
        };
        assert!(contiguous || !p[0].is_contiguous());
        let y = scaled_dot_product_attention(&p[0], &p[1], &p[2], &mask, 0.5)?;
        let g = y.sqr()?.sum_all()?.backward()?;
        Ok((y, g.get(qkv.as_tensor()).unwrap().clone()))
    };
    let ((y1, g1), (y2, g2)) = (run(false)?, run(true)?);
    assert_close(&y1, &y2, 1e-6, "value")?;
    assert_close(&g1, &g2, 1e-6, "gradient")
}

#[test]
fn a_trainable_bias_gets_its_gradient() -> Result<()> {
    let bias = Var::from_tensor(&randn(&[1, 2, 3, 3], 4, 1.0)?)?;
    let q = randn(&[1, 2, 3, 4], 1, 1.0)?;
    let k = randn(&[1, 2, 3, 4], 2, 1.0)?;
    let mask = AttentionMask::Additive(bias.as_tensor().clone());
    let y = scaled_dot_product_attention(&q, &k, &k, &mask, 0.5)?;
    let g = y.sum_all()?.backward()?;
    assert!(g.get(bias.as_tensor()).is_some());
    Ok(())
}

#[test]
fn packed_qkv_attention_matches_composed_through_every_mask() -> Result<()> {
    let (b, t, h, hd) = (2, 5, 3, 4);
    let masks = [
        AttentionMask::None,
        AttentionMask::Causal { offset: 0 },
        AttentionMask::Additive(padding(b, t, f32::NEG_INFINITY)?),
        AttentionMask::CausalAndAdditive {
            offset: 0,
            bias: padding(b, t, -1e9)?,
        },
    ];
    for (i, mask) in masks.iter().enumerate() {
        check_op(
            &[vec![b, t, 3 * h * hd]],
            90 + i as u64,
            &|xs| attention_qkv(&xs[0], h, mask, 0.5),
            &|xs| composed_attention_qkv(&xs[0], h, mask, 0.5),
        )?;
    }
    // And the packed op equals the split-view op exactly in value.
    let qkv = randn(&[b, t, 3 * h * hd], 3, 1.0)?;
    let x = qkv.reshape((b, t, 3, h, hd))?;
    let part = |i| x.narrow(2, i, 1)?.squeeze(2)?.transpose(1, 2);
    let mask = AttentionMask::Causal { offset: 0 };
    let split = scaled_dot_product_attention(&part(0)?, &part(1)?, &part(2)?, &mask, 0.5)?;
    let split = split.transpose(1, 2)?.reshape((b, t, h * hd))?;
    assert_close(
        &attention_qkv(&qkv, h, &mask, 0.5)?,
        &split,
        0.0,
        "packed vs split",
    )
}

/// One case of the CUDA check: shapes, mask, dtype and tolerance.
struct CudaCase {
    dims: (usize, usize, usize, usize, usize, usize),
    causal: Option<usize>,
    /// Padding fill for a `[b, 1, 1, s]` bias (see [`padding`]).
    pad: Option<f32>,
    dtype: candle_core::DType,
    /// q, k and v as head views of one fused `[b, t, 3 * h * d]` buffer.
    strided: bool,
    /// With `causal`, a sliding window.
    window: Option<usize>,
}

/// The tiled kernels of `attention.cu` against the CPU's tiled kernel,
/// output and the three gradients: causal and not, a KV cache's offset,
/// decode (one query), grouped-query heads (2:1 and 4:1), padding biases
/// with -inf (whole rows masked) and -1e9, head dims 64, 80 and 128, sizes
/// that are no multiple of a tile, strided views of a fused projection, and
/// bf16/f16. What must pass before `CUDA_ATTENTION_CHECKED`.
#[test]
#[ignore = "needs a CUDA GPU (run scripts/gpu_check.sh)"]
fn cuda_attention_matches_the_cpu_kernel_and_its_gradients() -> Result<()> {
    use candle_core::DType::{BF16, F16, F32};
    let gpu = accel_kernels::cuda_device(0)
        .unwrap_or_else(|e| panic!("needs a CUDA device (build with --features cuda): {e}"));
    let case = |dims, causal, pad, dtype, strided| CudaCase {
        dims,
        causal,
        pad,
        dtype,
        strided,
        window: None,
    };
    let cases = [
        case((2, 4, 4, 37, 37, 64), Some(0), None, F32, false),
        case((1, 8, 2, 130, 130, 128), Some(0), None, F32, false),
        case((2, 4, 1, 33, 70, 64), None, Some(-1e9), F32, false),
        case(
            (4, 2, 2, 3, 3, 64),
            None,
            Some(f32::NEG_INFINITY),
            F32,
            false,
        ),
        case((1, 4, 4, 5, 133, 64), Some(128), None, F32, false),
        case((3, 2, 2, 1, 50, 80), Some(49), None, F32, false),
        case((2, 3, 3, 65, 65, 64), Some(0), Some(-1e9), F32, true),
        case((1, 8, 2, 130, 130, 128), Some(0), None, BF16, false),
        case((2, 4, 4, 100, 100, 64), Some(0), None, F16, true),
        // Sliding windows: over several key tiles, and after a KV cache.
        CudaCase {
            window: Some(16),
            ..case((1, 4, 2, 70, 70, 64), Some(0), None, F32, false)
        },
        CudaCase {
            window: Some(40),
            ..case((1, 4, 4, 5, 133, 128), Some(128), None, BF16, false)
        },
    ];
    for (n, c) in cases.iter().enumerate() {
        let (b, h, kvh, t, s, d) = c.dims;
        let what = format!(
            "case {n} {:?} {:?} window {:?} pad {:?} {:?}",
            c.dims, c.causal, c.window, c.pad, c.dtype
        );
        let scale = 1.0 / (d as f64).sqrt();
        let seed = 300 + 10 * n as u64;
        let (q, k, v) = if c.strided {
            (randn(&[b, t, 3 * h * d], seed, 1.0)?, None, None)
        } else {
            let q = randn(&[b, h, t, d], seed, 1.0)?;
            let k = randn(&[b, kvh, s, d], seed + 1, 1.0)?;
            (q, Some(k), Some(randn(&[b, kvh, s, d], seed + 2, 1.0)?))
        };
        let g = randn(&[b, h, t, d], seed + 3, 1.0)?;
        let bias = c.pad.map(|fill| padding(b, s, fill)).transpose()?;
        let run = |dev: &Device, cuda: bool| -> Result<Vec<Tensor>> {
            let vars = [Some(&q), k.as_ref(), v.as_ref()]
                .into_iter()
                .flatten()
                .map(|x| Var::from_tensor(&x.to_dtype(c.dtype)?.to_device(dev)?))
                .collect::<Result<Vec<_>>>()?;
            let (qt, kt, vt) = if c.strided {
                let x = vars[0].as_tensor().reshape((b, t, 3, h, d))?;
                let part = |i| x.narrow(2, i, 1)?.squeeze(2)?.transpose(1, 2);
                (part(0)?, part(1)?, part(2)?)
            } else {
                let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
                (ts[0].clone(), ts[1].clone(), ts[2].clone())
            };
            let spec = MaskSpec {
                causal_offset: c.causal,
                window: c.window,
                bias: bias
                    .as_ref()
                    .map(|x| x.to_device(dev)?.broadcast_as((b, h, t, s)))
                    .transpose()?,
            };
            let y = if cuda {
                kernels::attention_cuda(&qt, &kt, &vt, spec, scale)?
            } else {
                kernels::attention_tiled(&qt, &kt, &vt, spec, scale)?
            };
            let loss = (y.to_dtype(F32)? * g.to_device(dev)?)?.sum_all()?;
            let grads = loss.backward()?;
            let mut out = vec![y.to_dtype(F32)?.to_device(&Device::Cpu)?];
            for var in &vars {
                let dx = grads.get(var).expect("a gradient");
                out.push(dx.to_dtype(F32)?.to_device(&Device::Cpu)?);
            }
            Ok(out)
        };
        let (want, got) = (run(&Device::Cpu, false)?, run(&gpu, true)?);
        let tol = if c.dtype == F32 { 1e-5 } else { 1e-2 };
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_close(g, w, tol, &format!("{what}: output {i}"))?;
        }
    }
    Ok(())
}
