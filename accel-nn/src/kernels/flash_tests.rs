//! The tiled kernel against the reference kernel (which keeps the whole
//! probabilities) on shapes that span several tiles, ragged last tiles,
//! every mask kind, grouped-query ratios 1/2/8, decoding (s != t with a
//! causal offset), rows with no visible key, bf16 and f16; and against
//! finite differences.

use candle_core::{DType, Device, Result, Tensor};

use super::{BC, BR};
use crate::kernels::{attention_reference, attention_tiled as attention, MaskSpec};
use crate::ops::testing::{assert_close, check_op, grads, randn};
use crate::ops::{composed, AttentionMask};

/// (b, h, kv_h, t, s, d)
type Shape6 = (usize, usize, usize, usize, usize, usize);

fn spec(causal: Option<usize>, bias: Option<&Tensor>, dims: Shape6) -> Result<MaskSpec> {
    let (b, h, _, t, s, _) = dims;
    Ok(MaskSpec {
        causal_offset: causal,
        window: None,
        bias: bias.map(|x| x.broadcast_as((b, h, t, s))).transpose()?,
    })
}

/// Values and the gradient of every input equal the reference's, with the
/// backward in one pass per (batch, kv head) (one thread) and split into a
/// key-tile and a query-tile pass (more threads than groups).
fn compare(dims: Shape6, causal: Option<usize>, bias: Option<&Tensor>, seed: u64) -> Result<()> {
    let groups = dims.0 * dims.2;
    crate::kernels::raw::par::with_threads(1, || compare_at(dims, causal, bias, seed))?;
    crate::kernels::raw::par::with_threads(groups + 1, || compare_at(dims, causal, bias, seed))
}

fn compare_at(dims: Shape6, causal: Option<usize>, bias: Option<&Tensor>, seed: u64) -> Result<()> {
    let (b, h, kvh, t, s, d) = dims;
    let scale = 1.0 / (d as f64).sqrt();
    let xs = [
        randn(&[b, h, t, d], seed, 1.0)?,
        randn(&[b, kvh, s, d], seed + 1, 1.0)?,
        randn(&[b, kvh, s, d], seed + 2, 1.0)?,
    ];
    let tiled = |x: &[Tensor]| attention(&x[0], &x[1], &x[2], spec(causal, bias, dims)?, scale);
    let reference =
        |x: &[Tensor]| attention_reference(&x[0], &x[1], &x[2], spec(causal, bias, dims)?, scale);
    let what = format!("{dims:?} causal {causal:?} bias {}", bias.is_some());
    for (dtype, tol) in [(DType::F32, 1e-5), (DType::BF16, 1e-2), (DType::F16, 1e-2)] {
        let xh: Vec<Tensor> = xs
            .iter()
            .map(|x| x.to_dtype(dtype))
            .collect::<Result<_>>()?;
        let (y, g) = grads(&tiled, &xh, dtype, seed)?;
        let (yr, gr) = grads(&reference, &xh, dtype, seed)?;
        let up = |x: &Tensor| x.to_dtype(DType::F32);
        assert_close(&up(&y)?, &up(&yr)?, tol, &format!("{what} {dtype:?} value"))?;
        for (i, (a, b)) in g.iter().zip(&gr).enumerate() {
            assert_close(&up(a)?, &up(b)?, tol, &format!("{what} {dtype:?} grad {i}"))?;
        }
    }
    Ok(())
}

#[test]
fn several_tiles_with_a_ragged_last_one() -> Result<()> {
    let t = 2 * BR + 3;
    compare((1, 2, 2, t, t, 16), Some(0), None, 1)?;
    compare((2, 2, 2, t, t + BC, 8), None, None, 2)
}

#[test]
fn grouped_query_ratios_one_two_and_eight() -> Result<()> {
    for (h, kvh) in [(2, 2), (4, 2), (8, 1)] {
        compare((1, h, kvh, BR + 5, BR + 5, 8), Some(0), None, 3 + h as u64)?;
    }
    Ok(())
}

/// A KV cache: new queries at positions `offset..offset + t` over `s` keys,
/// and one query (t = 1) over many.
#[test]
fn decoding_with_a_causal_offset() -> Result<()> {
    let s = 2 * BC + 11;
    compare((1, 4, 2, 70, s, 8), Some(s - 70), None, 20)?;
    compare((1, 2, 1, 1, s, 8), Some(s - 1), None, 21)?;
    compare((1, 2, 2, 1, 3, 8), Some(2), None, 22)
}

/// Left padding with causal masking: the first rows see no key at all and
/// give 0 with zero gradients; a full finite bias on every score.
#[test]
fn padding_with_fully_masked_rows_and_a_full_bias() -> Result<()> {
    let (b, t) = (2, BR + 9);
    let pad: Vec<f32> = (0..b)
        .flat_map(|i| {
            (0..t).map(move |j| {
                if j < 10 + 30 * i {
                    f32::NEG_INFINITY
                } else {
                    0.0
                }
            })
        })
        .collect();
    let pad = Tensor::from_vec(pad, (b, 1, 1, t), &Device::Cpu)?;
    compare((b, 2, 1, t, t, 8), Some(0), Some(&pad), 30)?;
    compare((b, 2, 1, t, t, 8), None, Some(&pad), 31)?;
    let full = randn(&[1, 2, BR + 1, BC + 2], 32, 1.0)?;
    compare((1, 2, 2, BR + 1, BC + 2, 8), None, Some(&full), 33)?;
    // The masked rows are exactly 0.
    let q = randn(&[b, 2, t, 8], 34, 1.0)?;
    let kv = randn(&[b, 1, t, 8], 35, 1.0)?;
    let y = attention(
        &q,
        &kv,
        &kv,
        spec(Some(0), Some(&pad), (b, 2, 1, t, t, 8))?,
        0.3,
    )?;
    let first = y.narrow(0, 1, 1)?.narrow(2, 0, 40)?;
    assert_eq!(first.abs()?.sum_all()?.to_scalar::<f32>()?, 0.0);
    Ok(())
}

/// The tiled kernel against the composed ops and finite differences (f64
/// and f32), in f32, bf16 and f16, over two query tiles and two key tiles.
#[test]
fn finite_differences_over_several_tiles() -> Result<()> {
    let (t, s) = (BR + 2, BC + 3);
    let dims = (1, 2, 1, t, s, 4);
    let mask = AttentionMask::Causal { offset: s - t };
    let scale = 0.5;
    check_op(
        &[vec![1, 2, t, 4], vec![1, 1, s, 4], vec![1, 1, s, 4]],
        40,
        &|x| attention(&x[0], &x[1], &x[2], spec(Some(s - t), None, dims)?, scale),
        &|x| composed::scaled_dot_product_attention(&x[0], &x[1], &x[2], &mask, scale),
    )
}

/// Sliding windows: the tiled kernel (which skips the key tiles before a
/// window) and the reference one against the composed ops' windowed mask
/// and finite differences, over several tiles, from position 0 and after a
/// cache, with the backward in one pass and split.
#[test]
fn sliding_windows_skip_the_tiles_before_them() -> Result<()> {
    let cases = [
        (BR + 3, BR + 3, 37),
        (BR + 3, BR + 3, BC + 10),
        (40, 2 * BC + 7, 50),
        (1, 2 * BC + 7, 100),
        // Groups of rows that see none of a tile's keys, and groups cut at
        // both ends, in tiles the window's edge crosses.
        (2 * BR + 5, 2 * BR + 5, 45),
    ];
    for (t, s, window) in cases {
        let offset = s - t;
        let spec = || -> Result<MaskSpec> {
            Ok(MaskSpec {
                causal_offset: Some(offset),
                window: Some(window),
                bias: None,
            })
        };
        let mask = AttentionMask::SlidingWindow {
            offset,
            window,
            bias: None,
        };
        let shapes = [vec![1, 2, t, 4], vec![1, 1, s, 4], vec![1, 1, s, 4]];
        let composed =
            |x: &[Tensor]| composed::scaled_dot_product_attention(&x[0], &x[1], &x[2], &mask, 0.5);
        for threads in [1, 3] {
            crate::kernels::raw::par::with_threads(threads, || {
                check_op(
                    &shapes,
                    60,
                    &|x| attention(&x[0], &x[1], &x[2], spec()?, 0.5),
                    &composed,
                )?;
                check_op(
                    &shapes,
                    61,
                    &|x| attention_reference(&x[0], &x[1], &x[2], spec()?, 0.5),
                    &composed,
                )
            })?;
        }
    }
    Ok(())
}
