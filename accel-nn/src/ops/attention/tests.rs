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
