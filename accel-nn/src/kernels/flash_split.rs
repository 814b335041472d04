//! The tiled attention's backward for fewer (batch, kv head) groups than
//! threads (one batch row of an MQA model): split into a pass of tasks per
//! (group, key tile) for dK and dV and one per (head, query tile) for dQ.

use super::gemm;
use super::{huge_vec, par, Back, Dims, Flash, MatRef, BC, BR};

impl Flash {
    /// The backward for fewer (batch, kv head) groups than threads: one pass
    /// of tasks per (group, key tile) for dK and dV, and one per (head,
    /// query tile) for dQ. Each recomputes the tile's `P` and `dS`, two
    /// products more per tile than one pass, but every thread has work.
    pub(super) fn backward_split(&self, c: &Back<'_>) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        let Dims { b, h, kvh, t, s, d } = c.dims;
        let n_rep = h / kvh;
        let (q, k, _) = c.qkv;
        let key_tiles = s.div_ceil(BC);
        let kv_parts = par::map(b * kvh * key_tiles, |n| {
            let (group, j0) = (n / key_tiles, (n % key_tiles) * BC);
            let (bi, kv) = (group / kvh, group % kvh);
            let bc = BC.min(s - j0);
            let (mut dk, mut dv) = (vec![0f32; bc * d], vec![0f32; bc * d]);
            let (mut p, mut ds) = (vec![0f32; BR * bc], vec![0f32; BR * bc]);
            // The queries that see any of these keys.
            let rows = self.query_range(j0, j0 + bc, t);
            for r in 0..n_rep {
                let bh = bi * h + kv * n_rep + r;
                let head = self.head(c.qkv, c.dims, bh);
                for r0 in ((rows.start / BR) * BR..rows.end).step_by(BR) {
                    let br = BR.min(t - r0);
                    let (p, ds) = (&mut p[..br * bc], &mut ds[..br * bc]);
                    self.tile_grads(c, head, bh, (r0, br), (j0, bc), p, ds);
                    let (p, ds) = (&*p, &*ds);
                    self.for_live((r0, br), (j0, bc), |rows, cols| {
                        let i0 = r0 + rows.start;
                        let dy = MatRef::rows(c.g, (bh * t + i0) * d, d);
                        let qt = MatRef::rows(q.0, head.qo + i0 * q.2[2], q.2[2]);
                        let at = rows.start * bc + cols.start;
                        let (p_t, ds_t) = (MatRef::rows_t(p, at, bc), MatRef::rows_t(ds, at, bc));
                        let (dims, off) = ((cols.len(), d, rows.len()), cols.start * d);
                        gemm(dims, &mut dv, off, d, true, p_t, dy, 1.0, false);
                        gemm(dims, &mut dk, off, d, true, ds_t, qt, 1.0, false);
                    });
                }
            }
            (dk, dv)
        });
        let query_tiles = t.div_ceil(BR);
        let dq_parts = par::map(b * h * query_tiles, |n| {
            let (bh, r0) = (n / query_tiles, (n % query_tiles) * BR);
            let head = self.head(c.qkv, c.dims, bh);
            let br = BR.min(t - r0);
            let mut dq = vec![0f32; br * d];
            let (mut p, mut ds) = (vec![0f32; br * BC], vec![0f32; br * BC]);
            let keys = self.key_range(r0, r0 + br, s);
            for j0 in keys.clone().step_by(BC) {
                let bc = BC.min(keys.end - j0);
                let (p, ds) = (&mut p[..br * bc], &mut ds[..br * bc]);
                self.tile_grads(c, head, bh, (r0, br), (j0, bc), p, ds);
                let ds = &*ds;
                self.for_live((r0, br), (j0, bc), |rows, cols| {
                    let kt = MatRef::rows(k.0, head.ko + (j0 + cols.start) * k.2[2], k.2[2]);
                    let ds_r = MatRef::rows(ds, rows.start * bc + cols.start, bc);
                    let dims = (rows.len(), d, cols.len());
                    gemm(dims, &mut dq, rows.start * d, d, true, ds_r, kt, 1.0, false);
                });
            }
            dq
        });
        // Parts are in (group, tile) order: concatenated, they are the layouts.
        let (mut dk, mut dv) = (huge_vec(b * kvh * s * d), huge_vec(b * kvh * s * d));
        for (pk, pv) in kv_parts {
            dk.extend_from_slice(&pk);
            dv.extend_from_slice(&pv);
        }
        let mut dq = huge_vec(b * h * t * d);
        for part in dq_parts {
            dq.extend_from_slice(&part);
        }
        (dq, dk, dv)
    }
}
