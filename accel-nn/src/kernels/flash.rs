//! Tiled attention on the CPU, FlashAttention-2's algorithm: memory linear
//! in the sequence length, and causal tiles above the diagonal skipped.
//!
//! [`super::attention`] keeps the probabilities `[b*h, t, s]` for backward
//! (2 GiB per layer at t = s = 8192 with 8 heads) and runs its products over
//! the whole square. Here the forward walks key tiles of `BC` keys for each
//! tile of `BR` queries with an online softmax (running max and sum per row),
//! and keeps only the output and one log-sum-exp per query row. The backward
//! recomputes each tile's probabilities from the log-sum-exp. The largest
//! buffers are a tile of scores and a tile of their gradients, `BR x BC`.
//!
//! Work is split as the reference op splits it: the forward runs one task
//! per (batch, head, query tile); the backward one task per (batch, kv
//! head), which owns that head's dk/dv and its query group's dq, so tasks
//! write disjoint buffers. The same tiling (and test harness) serves the CUDA
//! kernel: one algorithm on both backends.

use std::sync::Mutex;

use candle_core::Result;

use super::attention::{Dims, Kernel, MaskSpec, View};
use super::math;
use super::raw::{gemm, par, MatRef};
use super::with_strided_f32;

/// Queries per tile (64, 128 and 256 measured with keys of 64 to 256 at
/// t = 1024-4096: 128 x 128 was never more than noise from the best).
pub(crate) const BR: usize = 128;
/// Keys per tile.
pub(crate) const BC: usize = 128;

/// The op's state: mask, scale, and what the forward keeps for backward.
pub(crate) struct Flash {
    pub(crate) mask: MaskSpec,
    pub(crate) scale: f32,
    /// The f32 output `[b, h, t, d]` and log-sum-exp `[b, h, t]` of the forward.
    saved: Mutex<Option<(Vec<f32>, Vec<f32>)>>,
}

/// The additive bias as a strided f32 view `[b, h, t, s]`.
type Bias<'a> = Option<(&'a [f32], usize, &'a [usize])>;

/// Where one (batch, head) reads its operands.
#[derive(Clone, Copy)]
struct Head {
    bi: usize,
    hi: usize,
    /// Offsets of its q, k and v rows.
    qo: usize,
    ko: usize,
    vo: usize,
}

impl Flash {
    /// Keys `0..end` that query rows `r0..r1` may see at all (causal tiles
    /// wholly above the diagonal are never visited).
    fn key_end(&self, r1: usize, s: usize) -> usize {
        match self.mask.causal_offset {
            Some(o) => (o + r1).min(s),
            None => s,
        }
    }

    /// The scores of query rows `r0..r0 + br` against keys `j0..j0 + bc`
    /// into `buf` (`[br, bc]`): scaled products, plus the bias, with keys
    /// past a row's causal limit set to -inf.
    #[allow(clippy::too_many_arguments)]
    fn scores(
        &self,
        buf: &mut [f32],
        (q, k): (View<'_>, View<'_>),
        head: Head,
        (r0, br): (usize, usize),
        (j0, bc): (usize, usize),
        d: usize,
        bias: Bias<'_>,
    ) {
        let qt = MatRef::rows(q.0, head.qo + r0 * q.2[2], q.2[2]);
        let kt = MatRef::rows_t(k.0, head.ko + j0 * k.2[2], k.2[2]);
        gemm((br, bc, d), buf, 0, bc, false, qt, kt, self.scale, false);
        for (r, row) in buf.chunks_exact_mut(bc).take(br).enumerate() {
            let i = r0 + r;
            if let Some((data, off, st)) = bias {
                let base = off + head.bi * st[0] + head.hi * st[1] + i * st[2];
                for (jj, v) in row.iter_mut().enumerate() {
                    *v += data[base + (j0 + jj) * st[3]];
                }
            }
            if let Some(o) = self.mask.causal_offset {
                // Key j is visible from row i when j <= o + i.
                let live = (o + i + 1).saturating_sub(j0).min(bc);
                row[live..].fill(f32::NEG_INFINITY);
            }
        }
    }

    /// One (batch, head, query tile) of the forward: the tile's output rows
    /// `[br, d]` and log-sum-exps `[br]`.
    fn forward_tile(
        &self,
        (q, k, v): (View<'_>, View<'_>, View<'_>),
        head: Head,
        r0: usize,
        dims: Dims,
        bias: Bias<'_>,
    ) -> (Vec<f32>, Vec<f32>) {
        let (s, d) = (dims.s, dims.d);
        let br = BR.min(dims.t - r0);
        let mut acc = vec![0f32; br * d];
        let mut m = vec![f32::NEG_INFINITY; br];
        let mut l = vec![0f32; br];
        let mut p = vec![0f32; br * BC];
        let end = self.key_end(r0 + br, s);
        for j0 in (0..end).step_by(BC) {
            let bc = BC.min(end - j0);
            let p = &mut p[..br * bc];
            self.scores(p, (q, k), head, (r0, br), (j0, bc), d, bias);
            for (r, row) in p.chunks_exact_mut(bc).enumerate() {
                let m_new = m[r].max(math::max(row));
                if m_new == f32::NEG_INFINITY {
                    // Nothing visible yet in this row: no contribution.
                    row.fill(0.0);
                    continue;
                }
                let alpha = if m[r] == f32::NEG_INFINITY {
                    0.0
                } else {
                    math::exp(m[r] - m_new)
                };
                exp_shifted(row, m_new);
                l[r] = l[r] * alpha + math::sum(row);
                if alpha != 1.0 {
                    acc[r * d..(r + 1) * d].iter_mut().for_each(|a| *a *= alpha);
                }
                m[r] = m_new;
            }
            let vt = MatRef::rows(v.0, head.vo + j0 * v.2[2], v.2[2]);
            gemm(
                (br, d, bc),
                &mut acc,
                0,
                d,
                true,
                MatRef::rows(p, 0, bc),
                vt,
                1.0,
                false,
            );
        }
        let mut lse = vec![f32::NEG_INFINITY; br];
        for r in 0..br {
            // A row with no visible key gives 0 (as the reference op).
            if l[r] > 0.0 {
                let inv = 1.0 / l[r];
                acc[r * d..(r + 1) * d].iter_mut().for_each(|a| *a *= inv);
                lse[r] = m[r] + l[r].ln();
            }
        }
        (acc, lse)
    }

    fn head(&self, (q, k, v): (View<'_>, View<'_>, View<'_>), dims: Dims, bh: usize) -> Head {
        let (bi, hi) = (bh / dims.h, bh % dims.h);
        let kv = hi / (dims.h / dims.kvh);
        Head {
            bi,
            hi,
            qo: q.1 + bi * q.2[0] + hi * q.2[1],
            ko: k.1 + bi * k.2[0] + kv * k.2[1],
            vo: v.1 + bi * v.2[0] + kv * v.2[1],
        }
    }

    fn forward(
        &self,
        qkv: (View<'_>, View<'_>, View<'_>),
        dims: Dims,
        bias: Bias<'_>,
    ) -> (Vec<f32>, Vec<f32>) {
        let Dims { b, h, t, d, .. } = dims;
        let tiles = t.div_ceil(BR);
        let parts = par::map(b * h * tiles, |n| {
            let (bh, i) = (n / tiles, n % tiles);
            self.forward_tile(qkv, self.head(qkv, dims, bh), i * BR, dims, bias)
        });
        // Tiles are in (head, tile) order: concatenated they are [b, h, t, ..].
        let mut y = Vec::with_capacity(b * h * t * d);
        let mut lse = Vec::with_capacity(b * h * t);
        for (ty, tl) in parts {
            y.extend_from_slice(&ty);
            lse.extend_from_slice(&tl);
        }
        (y, lse)
    }
}

impl Kernel for Flash {
    fn new(mask: MaskSpec, scale: f32) -> Self {
        Self {
            mask,
            scale,
            saved: Mutex::new(None),
        }
    }

    /// The forward pass with the mask's bias read in place: the output
    /// `[b, h, t, d]`; the output and log-sum-exps are kept for backward.
    fn run(&self, q: View<'_>, k: View<'_>, v: View<'_>, dims: Dims) -> Result<Vec<f32>> {
        let (y, lse) = match &self.mask.bias {
            Some(bias) => {
                if bias.dims() != [dims.b, dims.h, dims.t, dims.s] {
                    candle_core::bail!("attention: bias {:?} is not [b, h, t, s]", bias.dims())
                }
                with_strided_f32(bias, |data, off, st| {
                    Ok(self.forward((q, k, v), dims, Some((data, off, st))))
                })?
            }
            None => self.forward((q, k, v), dims, None),
        };
        *self.saved.lock().unwrap_or_else(|e| e.into_inner()) = Some((y.clone(), lse));
        Ok(y)
    }

    /// (dq, dk, dv), contiguous `[b, h, t, d]` / `[b, kv_h, s, d]`, from the
    /// saved output and log-sum-exps and the output gradient `g [b, h, t, d]`.
    fn backward(
        &self,
        q: View<'_>,
        k: View<'_>,
        v: View<'_>,
        g: &[f32],
        dims: Dims,
    ) -> Result<(Vec<f32>, Vec<f32>, Vec<f32>)> {
        match &self.mask.bias {
            Some(bias) => with_strided_f32(bias, |data, off, st| {
                self.backward_with((q, k, v), g, dims, Some((data, off, st)))
            }),
            None => self.backward_with((q, k, v), g, dims, None),
        }
    }
}

impl Flash {
    fn backward_with(
        &self,
        (q, k, v): (View<'_>, View<'_>, View<'_>),
        g: &[f32],
        dims: Dims,
        bias: Bias<'_>,
    ) -> Result<(Vec<f32>, Vec<f32>, Vec<f32>)> {
        let Dims { b, h, kvh, t, s, d } = dims;
        let n_rep = h / kvh;
        let guard = self.saved.lock().unwrap_or_else(|e| e.into_inner());
        let Some((y, lse)) = guard.as_ref() else {
            candle_core::bail!("attention backward without its forward state")
        };
        let mut dq = vec![0f32; b * h * t * d];
        let mut dk = vec![0f32; b * kvh * s * d];
        let mut dv = vec![0f32; b * kvh * s * d];
        if t == 0 || s == 0 || d == 0 {
            return Ok((dq, dk, dv));
        }
        // D = rowsum(dY * Y) per query row, f32 as the forward kept Y.
        let delta: Vec<f32> = g
            .chunks_exact(d)
            .zip(y.chunks_exact(d))
            .map(|(gr, yr)| math::dot(gr, yr))
            .collect();
        par::chunks_mut3(
            (&mut dq, n_rep * t * d),
            (&mut dk, s * d),
            (&mut dv, s * d),
            |group, dq, dk, dv| {
                let (bi, kv) = (group / kvh, group % kvh);
                let mut p = vec![0f32; BR * BC];
                let mut dp = vec![0f32; BR * BC];
                for r in 0..n_rep {
                    let bh = bi * h + kv * n_rep + r;
                    let head = self.head((q, k, v), dims, bh);
                    for r0 in (0..t).step_by(BR) {
                        let br = BR.min(t - r0);
                        let row0 = bh * t + r0;
                        let end = self.key_end(r0 + br, s);
                        for j0 in (0..end).step_by(BC) {
                            let bc = BC.min(end - j0);
                            let (p, dp) = (&mut p[..br * bc], &mut dp[..br * bc]);
                            self.scores(p, (q, k), head, (r0, br), (j0, bc), d, bias);
                            for (rr, row) in p.chunks_exact_mut(bc).enumerate() {
                                exp_shifted(row, lse[row0 + rr]);
                            }
                            let dy = MatRef::rows(g, row0 * d, d);
                            // dV_j += P^T dY
                            let p_t = MatRef::rows_t(p, 0, bc);
                            gemm((bc, d, br), dv, j0 * d, d, true, p_t, dy, 1.0, false);
                            // dP = dY V_j^T
                            let vt = MatRef::rows_t(v.0, head.vo + j0 * v.2[2], v.2[2]);
                            gemm((br, bc, d), dp, 0, bc, false, dy, vt, 1.0, false);
                            // dS = P * (dP - D) * scale
                            for (rr, (dr, pr)) in
                                dp.chunks_exact_mut(bc).zip(p.chunks_exact(bc)).enumerate()
                            {
                                let dl = delta[row0 + rr];
                                dr.iter_mut()
                                    .zip(pr)
                                    .for_each(|(a, &pv)| *a = pv * (*a - dl) * self.scale);
                            }
                            // dQ_i += dS K_j, dK_j += dS^T Q_i
                            let kt = MatRef::rows(k.0, head.ko + j0 * k.2[2], k.2[2]);
                            let ds = MatRef::rows(dp, 0, bc);
                            gemm(
                                (br, d, bc),
                                dq,
                                (r * t + r0) * d,
                                d,
                                true,
                                ds,
                                kt,
                                1.0,
                                false,
                            );
                            let qt = MatRef::rows(q.0, head.qo + r0 * q.2[2], q.2[2]);
                            let ds_t = MatRef::rows_t(dp, 0, bc);
                            gemm((bc, d, br), dk, j0 * d, d, true, ds_t, qt, 1.0, false);
                        }
                    }
                }
            },
        );
        Ok((dq, dk, dv))
    }
}

multiversion! {
    /// `row[j] = exp(row[j] - m)` in place, -inf (and a -inf `m`) giving 0.
    fn exp_shifted(row: &mut [f32], m: f32) {
        if m == f32::NEG_INFINITY {
            row.fill(0.0);
            return;
        }
        for v in row.iter_mut() {
            *v = if *v == f32::NEG_INFINITY { 0.0 } else { math::exp(*v - m) };
        }
    }
}

#[cfg(test)]
#[path = "flash_tests.rs"]
mod tests;
