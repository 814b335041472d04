//! Layer normalisation over the last dimension with a backward pass.
//!
//! `candle_nn::ops::layer_norm` is fast but registered without backward,
//! and the composed version is eight elementwise ops and their gradients.
//! This op does one pass forward and one pass backward per row; the mean
//! and reciprocal standard deviation are recomputed in backward rather than
//! stored, since that is a cheap pass over data that is read anyway.

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp3, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use super::{as_f32, from_f32, math, rows_per_task, tensor_from_f32, with_f32};

struct LayerNorm {
    eps: f32,
}

/// `(x - mean) / sqrt(var + eps) * w + b` over the last dimension of `x`,
/// differentiable in all three inputs.
pub(crate) fn layer_norm(x: &Tensor, w: &Tensor, b: &Tensor, eps: f64) -> Result<Tensor> {
    x.contiguous()?.apply_op3(
        &w.contiguous()?,
        &b.contiguous()?,
        LayerNorm { eps: eps as f32 },
    )
}

/// Mean and 1/std of one row.
#[inline(always)]
fn stats(row: &[f32], eps: f32) -> (f32, f32) {
    let n = row.len() as f32;
    let mean = math::sum(row) / n;
    let mut dev = [0f32; 16];
    let mut chunks = row.chunks_exact(16);
    for c in &mut chunks {
        for (a, &v) in dev.iter_mut().zip(c) {
            *a += (v - mean) * (v - mean);
        }
    }
    let tail: f32 = chunks
        .remainder()
        .iter()
        .map(|&v| (v - mean) * (v - mean))
        .sum();
    let var = (dev.iter().sum::<f32>() + tail) / n;
    (mean, 1.0 / (var + eps).sqrt())
}

multiversion! {
    /// Normalises every `w.len()`-wide row of `x` into `y`.
    fn forward_rows(x: &[f32], w: &[f32], b: &[f32], y: &mut [f32], eps: f32) {
        let d = w.len();
        for (y, x) in y.chunks_exact_mut(d).zip(x.chunks_exact(d)) {
            let (mean, rstd) = stats(x, eps);
            for j in 0..d {
                y[j] = (x[j] - mean) * rstd * w[j] + b[j];
            }
        }
    }
}

multiversion! {
    /// Writes the input gradient of every row into `dx` and adds the rows'
    /// contributions to the weight and bias gradients, which are the first
    /// two `d`-wide parts of `acc`; its third part is scratch.
    fn backward_rows(x: &[f32], w: &[f32], g: &[f32], dx: &mut [f32], acc: &mut [f32], eps: f32) {
        let d = w.len();
        let (dw, rest) = acc.split_at_mut(d);
        let (db, xhat) = rest.split_at_mut(d);
        for (dx, (x, g)) in dx.chunks_exact_mut(d).zip(x.chunks_exact(d).zip(g.chunks_exact(d))) {
            let (mean, rstd) = stats(x, eps);
            for j in 0..d {
                xhat[j] = (x[j] - mean) * rstd;
                dx[j] = g[j] * w[j]; // dxhat, finished below
                dw[j] += g[j] * xhat[j];
                db[j] += g[j];
            }
            let m1 = math::sum(dx) / d as f32;
            let m2 = math::dot(dx, xhat) / d as f32;
            for j in 0..d {
                dx[j] = rstd * (dx[j] - m1 - xhat[j] * m2);
            }
        }
    }
}

impl CustomOp3 for LayerNorm {
    fn name(&self) -> &'static str {
        "accel-layer-norm"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let x = as_f32(s1, l1)?;
        let (w, b) = (as_f32(s2, l2)?, as_f32(s3, l3)?);
        let d = w.len();
        if b.len() != d || l1.dims().last() != Some(&d) {
            bail!(
                "layer_norm: x {:?}, weight {:?}, bias {:?}",
                l1.dims(),
                l2.dims(),
                l3.dims()
            )
        }
        let mut y = vec![0f32; x.len()];
        let chunk = rows_per_task(x.len() / d, d) * d;
        y.par_chunks_mut(chunk)
            .zip(x.par_chunks(chunk))
            .for_each(|(y, x)| forward_rows(x, &w, &b, y, self.eps));
        Ok((from_f32(y, s1.dtype())?, l1.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _b: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let d = w.dim(0)?;
        let mut dx = vec![0f32; x.elem_count()];
        let (dw, db) = with_f32(x, |xs| {
            with_f32(w, |ws| {
                with_f32(grad, |g| {
                    let chunk = rows_per_task(xs.len() / d, d) * d;
                    // Each task writes its rows of dx and returns partial sums
                    // [dw | db | scratch]; the partials are then added up.
                    let acc = dx
                        .par_chunks_mut(chunk)
                        .zip(xs.par_chunks(chunk).zip(g.par_chunks(chunk)))
                        .map(|(dx, (x, g))| {
                            let mut acc = vec![0f32; 3 * d];
                            backward_rows(x, ws, g, dx, &mut acc, self.eps);
                            acc
                        })
                        .reduce(
                            || vec![0f32; 3 * d],
                            |mut a, b| {
                                a.iter_mut().zip(&b).for_each(|(a, b)| *a += b);
                                a
                            },
                        );
                    Ok((acc[..d].to_vec(), acc[d..2 * d].to_vec()))
                })
            })
        })?;
        let dx = tensor_from_f32(dx, x.shape(), x.dtype())?;
        let dw = tensor_from_f32(dw, d, w.dtype())?;
        let db = tensor_from_f32(db, d, w.dtype())?;
        Ok((Some(dx), Some(dw), Some(db)))
    }
}
