//! Causal multi-head self-attention as one op, from the fused `qkv`
//! projection straight to the merged heads.
//!
//! The composed version needs a permute-and-copy to split heads, a copy to
//! merge them, a mask add and a softmax, and in backward the zero-padded
//! `cat`s of three `narrow`s plus the softmax chain. Here every (batch,
//! head) pair is one rayon task whose gemms read q, k and v in place inside
//! `qkv [B*T, 3*d]` (row stride `3*d`) and write the output and the
//! gradients in place too, so no layout copies happen at all.

use std::sync::Mutex;

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp1, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use super::{as_f32, from_f32, gemm, math, tensor_from_f32, with_f32, Mat, SendPtr};

/// The op; it keeps the attention probabilities `[B*H, T, T]` for the
/// backward pass (2 MiB per layer at the bench shape), which is cheaper
/// than recomputing them.
struct CausalAttention {
    b: usize,
    t: usize,
    n_head: usize,
    probs: Mutex<Option<Vec<f32>>>,
}

/// `softmax(q k^T / sqrt(hd) + causal mask) v` for every head, with q, k,
/// v the three `d`-wide column blocks of `qkv [B*T, 3*d]` (heads `hd`
/// wide inside each), returning `[B*T, d]` with heads concatenated like
/// GPT-2's `merge_heads`.
pub(crate) fn causal_attention(qkv: &Tensor, b: usize, t: usize, n_head: usize) -> Result<Tensor> {
    qkv.contiguous()?.apply_op1(CausalAttention {
        b,
        t,
        n_head,
        probs: Mutex::new(None),
    })
}

impl CausalAttention {
    /// (d, hd, 1/sqrt(hd)) for a `qkv` of width `three_d`.
    fn dims(&self, rows: usize, three_d: usize) -> Result<(usize, usize, f32)> {
        let d = three_d / 3;
        let hd = d.checked_div(self.n_head).unwrap_or(0);
        if rows != self.b * self.t || hd == 0 || 3 * self.n_head * hd != three_d {
            bail!(
                "attention: qkv is [{rows}, {three_d}], expected [{}, 3 * {} * head_dim]",
                self.b * self.t,
                self.n_head
            )
        }
        Ok((d, hd, 1.0 / (hd as f32).sqrt()))
    }
}

multiversion! {
    /// Turns the scores of a `t x t` block into causal softmax probabilities
    /// in place: row `i` keeps columns `0..=i`, scaled, and the rest become 0.
    fn causal_softmax_rows(s: &mut [f32], t: usize, scale: f32) {
        for (i, row) in s.chunks_exact_mut(t).enumerate() {
            let (live, dead) = row.split_at_mut(i + 1);
            let max = live.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v)) * scale;
            for v in live.iter_mut() {
                *v = math::exp(*v * scale - max);
            }
            let inv = 1.0 / math::sum(live);
            live.iter_mut().for_each(|v| *v *= inv);
            dead.fill(0.0);
        }
    }
}

multiversion! {
    /// Softmax backward in place: `ds = p * (ds - rowsum(ds * p)) * scale`
    /// for `t x t` blocks, where `ds` holds dP on entry.
    fn softmax_backward_rows(ds: &mut [f32], p: &[f32], t: usize, scale: f32) {
        for (dp, pr) in ds.chunks_exact_mut(t).zip(p.chunks_exact(t)) {
            let dot = math::dot(dp, pr);
            dp.iter_mut().zip(pr).for_each(|(a, &b)| *a = b * (*a - dot) * scale);
        }
    }
}

impl CustomOp1 for CausalAttention {
    fn name(&self) -> &'static str {
        "accel-causal-attention"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let (rows, three_d) = l.shape().dims2()?;
        let (d, hd, scale) = self.dims(rows, three_d)?;
        let (t, nh) = (self.t, self.n_head);
        let qkv = as_f32(s, l)?;
        let mut y = vec![0f32; rows * d];
        let mut probs = vec![0f32; self.b * nh * t * t];
        let y_ptr = SendPtr(y.as_mut_ptr());
        let q_ptr = qkv.as_ptr() as usize;
        probs.par_chunks_mut(t * t).enumerate().for_each(|(bh, p)| {
            let (bi, h) = (bh / nh, bh % nh);
            let q = q_ptr as *const f32;
            let base = bi * t * three_d + h * hd;
            // SAFETY: q, k, v of this (batch, head) lie inside qkv; each task
            // writes only the columns h*hd..(h+1)*hd of its own batch rows
            // of y, which no other task touches.
            unsafe {
                let (q, k, v) = (q.add(base), q.add(base + d), q.add(base + 2 * d));
                gemm(
                    t,
                    t,
                    hd,
                    p.as_mut_ptr(),
                    t,
                    false,
                    Mat::rows(q, three_d),
                    Mat::rows_t(k, three_d),
                    false,
                );
                causal_softmax_rows(p, t, scale);
                let y = y_ptr.ptr().add(bi * t * d + h * hd);
                gemm(
                    t,
                    hd,
                    t,
                    y,
                    d,
                    false,
                    Mat::rows(p.as_ptr(), t),
                    Mat::rows(v, three_d),
                    false,
                );
            }
        });
        *self.probs.lock().unwrap() = Some(probs);
        Ok((from_f32(y, s.dtype())?, Shape::from((rows, d))))
    }

    fn bwd(&self, qkv: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let (rows, three_d) = qkv.dims2()?;
        let (d, hd, scale) = self.dims(rows, three_d)?;
        let (t, nh) = (self.t, self.n_head);
        let guard = self.probs.lock().unwrap();
        let Some(probs) = guard.as_ref() else {
            bail!("attention backward without its forward state")
        };
        let mut dqkv = vec![0f32; rows * three_d];
        let dst = SendPtr(dqkv.as_mut_ptr());
        with_f32(qkv, |qkv| {
            with_f32(grad, |g| {
                let (q_ptr, g_ptr) = (qkv.as_ptr() as usize, g.as_ptr() as usize);
                probs.par_chunks(t * t).enumerate().for_each(|(bh, p)| {
                    let (bi, h) = (bh / nh, bh % nh);
                    let base = bi * t * three_d + h * hd;
                    let mut ds = vec![0f32; t * t];
                    // SAFETY: reads stay inside qkv, g and p; each task writes
                    // only its own head's columns of its own batch rows of
                    // dqkv (in the q, k and v blocks), disjoint across tasks.
                    unsafe {
                        let q = (q_ptr as *const f32).add(base);
                        let (k, v) = (q.add(d), q.add(2 * d));
                        let dy = (g_ptr as *const f32).add(bi * t * d + h * hd);
                        let out = dst.ptr().add(base);
                        // dP = dY V^T
                        gemm(
                            t,
                            t,
                            hd,
                            ds.as_mut_ptr(),
                            t,
                            false,
                            Mat::rows(dy, d),
                            Mat::rows_t(v, three_d),
                            false,
                        );
                        // dV = P^T dY
                        gemm(
                            t,
                            hd,
                            t,
                            out.add(2 * d),
                            three_d,
                            false,
                            Mat::rows_t(p.as_ptr(), t),
                            Mat::rows(dy, d),
                            false,
                        );
                        // dS = P * (dP - rowsum(dP * P)) * scale; P is 0 above the diagonal.
                        softmax_backward_rows(&mut ds, p, t, scale);
                        // dQ = dS K, dK = dS^T Q
                        gemm(
                            t,
                            hd,
                            t,
                            out,
                            three_d,
                            false,
                            Mat::rows(ds.as_ptr(), t),
                            Mat::rows(k, three_d),
                            false,
                        );
                        gemm(
                            t,
                            hd,
                            t,
                            out.add(d),
                            three_d,
                            false,
                            Mat::rows_t(ds.as_ptr(), t),
                            Mat::rows(q, three_d),
                            false,
                        );
                    }
                });
                Ok(())
            })
        })?;
        Ok(Some(tensor_from_f32(dqkv, (rows, three_d), qkv.dtype())?))
    }
}
