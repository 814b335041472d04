//! The dot-product form of the skinny product (see the parent module).

use pulp::{Simd, WithSimd};

/// One task: `yt [rows, m] = w [rows, k] @ x [m, k]^T`.
pub(super) struct Tiles<'a> {
    pub(super) x: &'a [f32],
    pub(super) w: &'a [f32],
    pub(super) yt: &'a mut [f32],
    pub(super) m: usize,
    pub(super) k: usize,
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
