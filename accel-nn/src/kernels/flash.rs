//! Tiled attention on the CPU, FlashAttention-2's algorithm: memory linear
//! in the sequence length, causal tiles above the diagonal skipped, and with
//! a sliding window the tiles before it too (work `O(t * window)`).
//!
//! The materialising kernel (`attention.rs`) keeps the probabilities
//! `[b*h, t, s]` for backward (2 GiB per layer at t = s = 8192 with 8 heads)
//! and runs its products over the whole square. Here the forward walks key tiles of `BC` keys for each
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

use std::ops::Range;
use std::sync::Mutex;

use candle_core::Result;

use super::attention_kernel::{Bias, Dims, Kernel, MaskSpec, View};
use super::math;
use super::raw::{gemm, huge_vec, huge_zeroed, par, MatRef};

/// Queries per tile (64, 128 and 256 measured with keys of 64 to 256 at
/// t = 1024-4096: 128 x 128 was never more than noise from the best).
pub(crate) const BR: usize = 128;
/// Keys per tile.
pub(crate) const BC: usize = 128;
/// Query rows per group in a tile the mask cuts through (the diagonal's, a
/// window's first): each group's products run over the keys it sees only.
const RG: usize = 64;

/// The op's state: mask, scale, and what the forward keeps for backward.
pub(crate) struct Flash {
    pub(crate) mask: MaskSpec,
    pub(crate) scale: f32,
    /// The log-sum-exp `[b, h, t]` of the forward (its output is the op's
    /// result, which the backward is handed).
    saved: Mutex<Option<Vec<f32>>>,
}

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
    /// Keys `start..end` that query rows `r0..r1` may see at all (causal
    /// tiles wholly above the diagonal, and those wholly before a sliding
    /// window, are never visited).
    fn key_range(&self, r0: usize, r1: usize, s: usize) -> std::ops::Range<usize> {
        let end = match self.mask.causal_offset {
            Some(o) => (o + r1).min(s),
            None => s,
        };
        self.mask.window_start(r0).min(end)..end
    }

    /// Query rows `first..last` that see any of keys `j0..j1` (all rows
    /// without a mask).
    fn query_range(&self, j0: usize, j1: usize, t: usize) -> std::ops::Range<usize> {
        let Some(o) = self.mask.causal_offset else {
            return 0..t;
        };
        let first = j0.saturating_sub(o).min(t);
        let last = match self.mask.window {
            // Row i sees key j while o + i - j < w: up to j1 - 1 + w - o.
            Some(w) => (j1 - 1 + w).saturating_sub(o).min(t),
            None => t,
        };
        first..last.max(first)
    }

    /// Calls `f(rows, keys)`, both relative to the tile, over the parts of
    /// the tile of query rows `r0..r0 + br` and keys `j0..j0 + bc` that the
    /// mask leaves visible: the whole tile when every group of `RG` rows sees
    /// all its keys, else each group with the keys any of its rows sees (a
    /// causal diagonal tile, or a window's first, is about half visible: its
    /// products then do 3/4 of a tile's work).
    fn for_live(
        &self,
        (r0, br): (usize, usize),
        (j0, bc): (usize, usize),
        mut f: impl FnMut(Range<usize>, Range<usize>),
    ) {
        let keys = |a: usize, rows: usize| -> Range<usize> {
            let end = match self.mask.causal_offset {
                Some(o) => (o + a + rows).clamp(j0, j0 + bc),
                None => j0 + bc,
            };
            let start = self.mask.window_start(a).clamp(j0, end);
            start - j0..end - j0
        };
        let last = (br.max(1) - 1) / RG * RG;
        // Visible ranges only widen down the rows at the end and narrow at
        // the start: the first group has the fewest trailing keys, the last
        // the fewest leading ones.
        if keys(r0, RG.min(br)).end == bc && keys(r0 + last, br - last).start == 0 {
            return f(0..br, 0..bc);
        }
        for a in (0..br).step_by(RG) {
            let rows = RG.min(br - a);
            let cols = keys(r0 + a, rows);
            if !cols.is_empty() {
                f(a..a + rows, cols);
            }
        }
    }

    /// [`Self::for_live`] writing into `buf` (`[br, bc]`), whose values
    /// outside the visible parts are set to `hidden` (their products are
    /// not computed). `f` gets `buf` too.
    fn for_live_into(
        &self,
        buf: &mut [f32],
        hidden: f32,
        (r0, br): (usize, usize),
        (j0, bc): (usize, usize),
        mut f: impl FnMut(&mut [f32], Range<usize>, Range<usize>),
    ) {
        let mut seen = 0;
        self.for_live((r0, br), (j0, bc), |rows, cols| {
            buf[seen * bc..rows.start * bc].fill(hidden);
            for row in buf[rows.start * bc..rows.end * bc].chunks_exact_mut(bc) {
                row[..cols.start].fill(hidden);
                row[cols.end..].fill(hidden);
            }
            seen = rows.end;
            f(buf, rows, cols);
        });
        buf[seen * bc..br * bc].fill(hidden);
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
        let hidden = f32::NEG_INFINITY;
        self.for_live_into(buf, hidden, (r0, br), (j0, bc), |buf, rows, cols| {
            let qt = MatRef::rows(q.0, head.qo + (r0 + rows.start) * q.2[2], q.2[2]);
            let kt = MatRef::rows_t(k.0, head.ko + (j0 + cols.start) * k.2[2], k.2[2]);
            let dims = (rows.len(), cols.len(), d);
            let off = rows.start * bc + cols.start;
            gemm(dims, buf, off, bc, false, qt, kt, self.scale, false);
        });
        for (r, row) in buf.chunks_exact_mut(bc).take(br).enumerate() {
            let i = r0 + r;
            if let Some((data, off, st)) = bias {
                let base = off + head.bi * st[0] + head.hi * st[1] + i * st[2];
                for (jj, v) in row.iter_mut().enumerate() {
                    *v += data[base + (j0 + jj) * st[3]];
                }
            }
            if let Some(o) = self.mask.causal_offset {
                // Key j is visible from row i when j <= o + i (and, with a
                // window, j >= window_start(i)).
                let live = (o + i + 1).saturating_sub(j0).min(bc);
                row[live..].fill(f32::NEG_INFINITY);
                let dead = self.mask.window_start(i).saturating_sub(j0).min(live);
                row[..dead].fill(f32::NEG_INFINITY);
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
        let keys = self.key_range(r0, r0 + br, s);
        for j0 in keys.clone().step_by(BC) {
            let bc = BC.min(keys.end - j0);
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
            self.for_live((r0, br), (j0, bc), |rows, cols| {
                let vt = MatRef::rows(v.0, head.vo + (j0 + cols.start) * v.2[2], v.2[2]);
                let pr = MatRef::rows(p, rows.start * bc + cols.start, bc);
                let dims = (rows.len(), d, cols.len());
                gemm(dims, &mut acc, rows.start * d, d, true, pr, vt, 1.0, false);
            });
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
        let mut y = huge_vec(b * h * t * d);
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
    /// `[b, h, t, d]`; the log-sum-exps are kept for backward.
    fn run(&self, q: View<'_>, k: View<'_>, v: View<'_>, dims: Dims) -> Result<Vec<f32>> {
        let (y, lse) = self
            .mask
            .with_bias(dims, |bias| Ok(self.forward((q, k, v), dims, bias)))?;
        *self.saved.lock().unwrap_or_else(|e| e.into_inner()) = Some(lse);
        Ok(y)
    }

    /// (dq, dk, dv), contiguous `[b, h, t, d]` / `[b, kv_h, s, d]`, from the
    /// saved log-sum-exps, the output `y` and its gradient `g [b, h, t, d]`.
    fn backward(
        &self,
        q: View<'_>,
        k: View<'_>,
        v: View<'_>,
        yg: (&[f32], &[f32]),
        dims: Dims,
    ) -> Result<(Vec<f32>, Vec<f32>, Vec<f32>)> {
        self.mask
            .with_bias(dims, |bias| self.backward_with((q, k, v), yg, dims, bias))
    }
}

impl Flash {
    fn backward_with(
        &self,
        (q, k, v): (View<'_>, View<'_>, View<'_>),
        (y, g): (&[f32], &[f32]),
        dims: Dims,
        bias: Bias<'_>,
    ) -> Result<(Vec<f32>, Vec<f32>, Vec<f32>)> {
        let Dims { b, h, kvh, t, s, d } = dims;
        let n_rep = h / kvh;
        let guard = self.saved.lock().unwrap_or_else(|e| e.into_inner());
        let Some(lse) = guard.as_ref() else {
            candle_core::bail!("attention backward without its forward state")
        };
        let (q_len, kv_len) = (b * h * t * d, b * kvh * s * d);
        if t == 0 || s == 0 || d == 0 {
            return Ok((vec![0f32; q_len], vec![0f32; kv_len], vec![0f32; kv_len]));
        }
        // D = rowsum(dY * Y) per query row, f32 as the forward kept Y.
        let delta: Vec<f32> = g
            .chunks_exact(d)
            .zip(y.chunks_exact(d))
            .map(|(gr, yr)| math::dot(gr, yr))
            .collect();
        let c = Back {
            qkv: (q, k, v),
            g,
            lse,
            delta: &delta,
            dims,
            bias,
        };
        if b * kvh < par::threads() {
            return Ok(self.backward_split(&c));
        }
        // Zeroed only on this path (the split one builds its own).
        let mut dq = huge_zeroed(q_len);
        let mut dk = huge_zeroed(kv_len);
        let mut dv = huge_zeroed(kv_len);
        par::chunks_mut3(
            (&mut dq, n_rep * t * d),
            (&mut dk, s * d),
            (&mut dv, s * d),
            |group, dq, dk, dv| {
                let (bi, kv) = (group / kvh, group % kvh);
                let mut p = vec![0f32; BR * BC];
                let mut ds = vec![0f32; BR * BC];
                for r in 0..n_rep {
                    let bh = bi * h + kv * n_rep + r;
                    let head = self.head((q, k, v), dims, bh);
                    for r0 in (0..t).step_by(BR) {
                        let br = BR.min(t - r0);
                        let keys = self.key_range(r0, r0 + br, s);
                        for j0 in keys.clone().step_by(BC) {
                            let bc = BC.min(keys.end - j0);
                            let (p, ds) = (&mut p[..br * bc], &mut ds[..br * bc]);
                            self.tile_grads(&c, head, bh, (r0, br), (j0, bc), p, ds);
                            let (p, ds) = (&*p, &*ds);
                            self.for_live((r0, br), (j0, bc), |rows, cols| {
                                let (i0, c0) = (r0 + rows.start, j0 + cols.start);
                                let dy = MatRef::rows(g, (bh * t + i0) * d, d);
                                let kt = MatRef::rows(k.0, head.ko + c0 * k.2[2], k.2[2]);
                                let qt = MatRef::rows(q.0, head.qo + i0 * q.2[2], q.2[2]);
                                let at = rows.start * bc + cols.start;
                                let (p_t, ds_r, ds_t) = (
                                    MatRef::rows_t(p, at, bc),
                                    MatRef::rows(ds, at, bc),
                                    MatRef::rows_t(ds, at, bc),
                                );
                                let (m, n) = (rows.len(), cols.len());
                                // dV_j += P^T dY, dQ_i += dS K_j, dK_j += dS^T Q_i
                                gemm((n, d, m), dv, c0 * d, d, true, p_t, dy, 1.0, false);
                                let dq_off = (r * t + i0) * d;
                                gemm((m, d, n), dq, dq_off, d, true, ds_r, kt, 1.0, false);
                                gemm((n, d, m), dk, c0 * d, d, true, ds_t, qt, 1.0, false);
                            });
                        }
                    }
                }
            },
        );
        Ok((dq, dk, dv))
    }
}

/// What every backward tile reads besides its position.
struct Back<'a> {
    qkv: (View<'a>, View<'a>, View<'a>),
    /// The output gradient `[b, h, t, d]`.
    g: &'a [f32],
    /// The forward's log-sum-exp per query row.
    lse: &'a [f32],
    /// `rowsum(dY * Y)` per query row.
    delta: &'a [f32],
    dims: Dims,
    bias: Bias<'a>,
}

impl Flash {
    /// The probabilities `P` (into `p`) and score gradients
    /// `dS = P * (dY V^T - D) * scale` (into `ds`) of query rows
    /// `r0..r0 + br` of head `bh` against keys `j0..j0 + bc`.
    #[allow(clippy::too_many_arguments)]
    fn tile_grads(
        &self,
        c: &Back<'_>,
        head: Head,
        bh: usize,
        (r0, br): (usize, usize),
        (j0, bc): (usize, usize),
        p: &mut [f32],
        ds: &mut [f32],
    ) {
        let (q, k, v) = c.qkv;
        let (t, d) = (c.dims.t, c.dims.d);
        let row0 = bh * t + r0;
        self.scores(p, (q, k), head, (r0, br), (j0, bc), d, c.bias);
        for (rr, row) in p.chunks_exact_mut(bc).enumerate() {
            exp_shifted(row, c.lse[row0 + rr]);
        }
        // dY V^T where P is visible; 0 elsewhere (P is 0 there too).
        self.for_live_into(ds, 0.0, (r0, br), (j0, bc), |ds, rows, cols| {
            let dy = MatRef::rows(c.g, (row0 + rows.start) * d, d);
            let vt = MatRef::rows_t(v.0, head.vo + (j0 + cols.start) * v.2[2], v.2[2]);
            let (dims, off) = ((rows.len(), cols.len(), d), rows.start * bc + cols.start);
            gemm(dims, ds, off, bc, false, dy, vt, 1.0, false);
        });
        for (rr, (dr, pr)) in ds.chunks_exact_mut(bc).zip(p.chunks_exact(bc)).enumerate() {
            let dl = c.delta[row0 + rr];
            dr.iter_mut()
                .zip(pr)
                .for_each(|(a, &pv)| *a = pv * (*a - dl) * self.scale);
        }
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

#[path = "flash_split.rs"]
mod split;

#[cfg(test)]
#[path = "flash_tests.rs"]
mod tests;
