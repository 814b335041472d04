//! `x @ w^T` for a few rows of `x`, streaming `w` in its own `[out, in]`
//! layout: the linear layers of inference (a prompt, a decoding step).
//!
//! Why: `gemm` runs its microkernel on column panels of `w^T`, so a weight
//! stored `[out, in]` (PyTorch's layout, which checkpoints and our layers
//! keep) is repacked on every call. With many rows of `x` that repacking is
//! amortised; with 32 rows it is most of the work: a profile of a Llama
//! forward over 32 tokens spent ~37% of its time in gemm's packing loops
//! against ~9% in its microkernel, and 32 x 1536 @ 1536 x 4096 ran at
//! 40-90 GFLOP/s on 2 cores against 160-250 with the weight pre-transposed.
//! Here each output is a dot product of two contiguous rows, computed for a
//! tile of `w` rows against a tile of `x` rows held in registers, so `w` is
//! read once, straight from where it lies.
//!
//! Every output element is summed in the same order whatever the tile it
//! falls in, the row count or the thread split (lane-wise over whole SIMD
//! vectors, then the vector's lanes, then the leftover elements in order),
//! so a row's result does not depend on the batch around it.

use pulp::{Simd, WithSimd};

use super::raw::par;

/// Up to this many rows of `x` take this kernel; above it gemm's repacking
/// of `w` pays for itself (measured on the 2-core AVX-512 EPYC: at 64 rows
/// this kernel still won 4 of 5 Llama shapes, at 128 gemm won most).
pub(crate) const MAX_ROWS: usize = 64;

/// Bytes of `w` per parallel task: small enough to stay in a core's L2
/// cache while every tile of `x` rows passes over them.
const W_BYTES_PER_TASK: usize = 192 << 10;

/// Rows of `w` per parallel task for rows of `k` elements and `m` rows of
/// `x`: a multiple of 12, so that every tile height (1 to 4) divides it.
fn w_rows_per_task(k: usize, m: usize) -> usize {
    // With one tile of `x` rows, `w` is read once: no reuse to keep in L2,
    // and larger tasks cost less scheduling.
    let bytes = if m <= 4 {
        4 * W_BYTES_PER_TASK
    } else {
        W_BYTES_PER_TASK
    };
    (bytes / (4 * k.max(1)) / 12 * 12).max(12)
}

/// `y [m, out] = x [m, k] @ w [out, k]^T`, both row-major.
pub(crate) fn x_wt(x: &[f32], w: &[f32], m: usize, k: usize, out: usize) -> Vec<f32> {
    assert_eq!(x.len(), m * k, "skinny linear: x is not [{m}, {k}]");
    assert_eq!(w.len(), out * k, "skinny linear: w is not [{out}, {k}]");
    if m == 0 || out == 0 {
        return Vec::new();
    }
    if k == 0 {
        return vec![0.0; m * out];
    }
    // Tasks own disjoint row blocks of y^T, then y^T is transposed back
    // (m * out elements: small next to the weight).
    let mut yt = vec![0f32; out * m];
    let rows = w_rows_per_task(k, m);
    par::chunks_mut(&mut yt, rows * m, |i, yt| {
        let w = &w[i * rows * k..][..yt.len() / m * k];
        pulp::Arch::new().dispatch(Tiles { x, w, yt, m, k })
    });
    let mut y = vec![0f32; m * out];
    par::chunks_mut(&mut y, out, |i, row| {
        for (o, v) in row.iter_mut().enumerate() {
            *v = yt[o * m + i];
        }
    });
    y
}

/// One task: `yt [rows, m] = w [rows, k] @ x [m, k]^T`.
struct Tiles<'a> {
    x: &'a [f32],
    w: &'a [f32],
    yt: &'a mut [f32],
    m: usize,
    k: usize,
}

impl WithSimd for Tiles<'_> {
    type Output = ();

    #[inline(always)]
    fn with_simd<S: Simd>(self, simd: S) {
        // A tile of RW `w` rows by RX `x` rows keeps RW x RX accumulators,
        // RW `w` vectors and one `x` vector in registers: 4 x 4 fits
        // AVX-512's 32, 3 x 4 AVX2's 16. Results are the same either way.
        if S::REGISTER_COUNT >= 32 {
            self.run::<S, 4, 4>(simd)
        } else {
            self.run::<S, 3, 4>(simd)
        }
    }
}

impl Tiles<'_> {
    /// Each tile of `x` rows (RX x k, in L1) passes over all of the task's
    /// `w` rows (in L2, see `W_BYTES_PER_TASK`): per step a tile loads RW
    /// vectors from L2 and RX from L1 for RW x RX multiply-adds. The other
    /// order (a `w` tile against every `x` row) streams both from L2.
    #[inline(always)]
    fn run<S: Simd, const RW: usize, const RX: usize>(mut self, simd: S) {
        let full_x = self.m / RX * RX;
        for i in (0..full_x).step_by(RX) {
            self.x_rows::<S, RW, RX>(simd, i);
        }
        // The rows left over: two at a time, then one.
        let pairs = full_x + (self.m - full_x) / 2 * 2;
        for i in (full_x..pairs).step_by(2) {
            self.x_rows::<S, RW, 2>(simd, i);
        }
        for i in pairs..self.m {
            self.x_rows::<S, RW, 1>(simd, i);
        }
    }

    /// `x` rows `i..i + RX` against all of the task's `w` rows: RW at a time,
    /// then the ones left over.
    #[inline(always)]
    fn x_rows<S: Simd, const RW: usize, const RX: usize>(&mut self, simd: S, i: usize) {
        let Tiles { x, w, m, k, .. } = *self;
        let rows = w.len() / k;
        let full_w = rows / RW * RW;
        for o in (0..full_w).step_by(RW) {
            tile::<S, RW, RX>(simd, x, w, self.yt, (o, i), m, k);
        }
        for o in full_w..rows {
            tile::<S, 1, RX>(simd, x, w, self.yt, (o, i), m, k);
        }
    }
}

/// `yt[o + r, i + j] = w[o + r] . x[i + j]` for `r < RW`, `j < RX`.
#[inline(always)]
fn tile<S: Simd, const RW: usize, const RX: usize>(
    simd: S,
    x: &[f32],
    w: &[f32],
    yt: &mut [f32],
    (o, i): (usize, usize),
    m: usize,
    k: usize,
) {
    let wv: [(&[S::f32s], &[f32]); RW] =
        core::array::from_fn(|r| S::as_simd_f32s(&w[(o + r) * k..(o + r + 1) * k]));
    let xv: [(&[S::f32s], &[f32]); RX] =
        core::array::from_fn(|j| S::as_simd_f32s(&x[(i + j) * k..(i + j + 1) * k]));
    let mut acc = [[simd.splat_f32s(0.0); RX]; RW];
    for c in 0..wv[0].0.len() {
        let a: [S::f32s; RW] = core::array::from_fn(|r| wv[r].0[c]);
        for j in 0..RX {
            let b = xv[j].0[c];
            for r in 0..RW {
                acc[r][j] = simd.mul_add_f32s(a[r], b, acc[r][j]);
            }
        }
    }
    for r in 0..RW {
        for j in 0..RX {
            let mut s = simd.reduce_sum_f32s(acc[r][j]);
            for (p, q) in wv[r].1.iter().zip(xv[j].1) {
                s += p * q;
            }
            yt[(o + r) * m + i + j] = s;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| {
                ((i as u32).wrapping_mul(2654435761).wrapping_add(seed) % 1000) as f32 / 500.0 - 1.0
            })
            .collect()
    }

    fn reference(x: &[f32], w: &[f32], m: usize, k: usize, out: usize) -> Vec<f64> {
        let mut y = vec![0f64; m * out];
        for i in 0..m {
            for o in 0..out {
                y[i * out + o] = (0..k)
                    .map(|t| x[i * k + t] as f64 * w[o * k + t] as f64)
                    .sum();
            }
        }
        y
    }

    #[test]
    fn products_match_a_plain_loop_for_ragged_shapes() {
        // Rows and columns that are not multiples of the tiles, k with a
        // leftover past the last SIMD vector, and tasks split mid-way.
        for (m, k, out) in [(1, 1, 1), (3, 5, 7), (5, 37, 130), (64, 100, 9), (7, 0, 3)] {
            let (x, w) = (data(m * k, 1), data(out * k, 2));
            let y = x_wt(&x, &w, m, k, out);
            let want = reference(&x, &w, m, k, out);
            for (a, b) in y.iter().zip(&want) {
                assert!(
                    (*a as f64 - b).abs() <= 1e-5 * (k as f64).max(1.0),
                    "{m} {k} {out}: {a} vs {b}"
                );
            }
        }
    }

    #[test]
    fn a_rows_result_does_not_depend_on_the_rows_around_it() {
        let (m, k, out) = (9, 131, 70);
        let (x, w) = (data(m * k, 3), data(out * k, 4));
        let all = x_wt(&x, &w, m, k, out);
        for i in 0..m {
            let one = x_wt(&x[i * k..(i + 1) * k], &w, 1, k, out);
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&one), bits(&all[i * out..(i + 1) * out]), "row {i}");
        }
    }
}
