//! The broadcast form of the skinny product (see the parent module): `x`'s
//! columns as vectors, `w`'s elements broadcast against them in place.

use pulp::{Simd, WithSimd};

use super::super::raw::{par, prefetch};

/// f32 elements per cache line.
const LINE: usize = 16;

/// How far ahead along a `w` row the tiles prefetch, in elements (2 to 16
/// lines measured the same; without a prefetch the tiles ran 10-25% slower).
const PREFETCH_AHEAD: usize = 4 * LINE;

/// The number of f32 lanes of the widest SIMD vectors this CPU has.
pub(super) struct Lanes;

impl WithSimd for Lanes {
    type Output = usize;

    #[inline(always)]
    fn with_simd<S: Simd>(self, _: S) -> usize {
        std::mem::size_of::<S::f32s>() / 4
    }
}

/// `x [m, k]` as column groups of `lanes` rows: group `g` is `[k, lanes]`,
/// holding rows `g * lanes ..` (zeros past `m`), so that one vector load
/// reads one column of `lanes` rows.
pub(super) fn x_columns(x: &[f32], m: usize, k: usize, lanes: usize) -> Vec<f32> {
    let columns = m.div_ceil(lanes) * k;
    // Columns in blocks, in parallel; within a block, squares of up to
    // `LINE` columns by `lanes` rows, so that each row is read a cache line
    // at a time (rows `k` floats apart can share L1 sets when `k` is a
    // large power of two).
    par::new_vec(columns * lanes, COLUMNS_PER_TASK * lanes, |i, block| {
        let n = block.len() / lanes;
        let mut t = 0;
        while t < n {
            let q = i * COLUMNS_PER_TASK + t;
            let (first, c) = (q / k * lanes, q % k);
            let len = LINE.min(k - c).min(n - t);
            for l in 0..lanes.min(m.saturating_sub(first)) {
                let row = &x[(first + l) * k + c..][..len];
                for (j, v) in row.iter().enumerate() {
                    block[(t + j) * lanes + l] = *v;
                }
            }
            t += len;
        }
    })
}

/// Below this many rows of `w` the dot-product form is used whatever the
/// rows of `x`: the broadcast form's transpose of `x` costs the same per
/// call, and with few outputs it is no longer small next to the product
/// (at 256 outputs the broadcast form ran 35-40% slower).
pub(super) const BROADCAST_MIN_OUT: usize = 512;

/// Columns of `x` per parallel task of `x_columns`.
const COLUMNS_PER_TASK: usize = 1024;

/// One task of the broadcast form: `yt [rows, m] = w [rows, k] @ x^T`, from
/// `x`'s column groups (`x_columns`).
///
/// A tile is RW rows of `w` against XV column groups of `x` (XV * lanes rows):
/// per element `c` of k it loads XV vectors of `x`'s column `c`, broadcasts
/// `w[o + r, c]` and does RW x XV multiply-adds, the register-tiled outer
/// product of a GEMM microkernel, but reading `w` in place, row by row, so
/// nothing is repacked. Each output is one multiply-add chain over `c` in
/// order, whatever the tile or the thread split.
pub(super) struct Broadcast<'a> {
    pub(super) xt: &'a [f32],
    pub(super) w: &'a [f32],
    pub(super) yt: &'a mut [f32],
    pub(super) m: usize,
    pub(super) k: usize,
}

impl WithSimd for Broadcast<'_> {
    type Output = ();

    #[inline(always)]
    fn with_simd<S: Simd>(self, simd: S) {
        // RW x XV accumulators, XV `x` vectors and one broadcast: 12 x 2
        // fits AVX-512's 32 registers, 6 x 2 AVX2's 16.
        if S::REGISTER_COUNT >= 32 {
            self.run::<S, 12, 2>(simd)
        } else {
            self.run::<S, 6, 2>(simd)
        }
    }
}

impl Broadcast<'_> {
    /// In chunks of `K_CHUNK` columns, so that the chunk of `x`'s columns
    /// stays in L2 while the task's `w` rows pass over it: each tile of `w`
    /// rows against every pair of column groups, then the rows left over in
    /// tiles of 4 and 1 (a lone accumulator chain waits on its own latency).
    #[inline(always)]
    fn run<S: Simd, const RW: usize, const XV: usize>(mut self, simd: S) {
        let rows = self.w.len() / self.k;
        for c0 in (0..self.k).step_by(K_CHUNK) {
            let cs = (c0, (c0 + K_CHUNK).min(self.k));
            let mut o = 0;
            while o + RW <= rows {
                self.tiles::<S, RW, XV>(simd, o, cs);
                o += RW;
            }
            while o + 4 <= rows {
                self.tiles::<S, 4, XV>(simd, o, cs);
                o += 4;
            }
            while o < rows {
                self.tiles::<S, 1, XV>(simd, o, cs);
                o += 1;
            }
        }
    }

    /// `w` rows `o..o + RW` against every column group, XV at a time.
    #[inline(always)]
    fn tiles<S: Simd, const RW: usize, const XV: usize>(
        &mut self,
        simd: S,
        o: usize,
        cs: (usize, usize),
    ) {
        let Broadcast { xt, w, m, k, .. } = *self;
        let (xt, _) = S::as_simd_f32s(xt);
        let groups = xt.len() / k;
        let full_g = groups / XV * XV;
        for g in (0..full_g).step_by(XV) {
            bcast_tile::<S, RW, XV>(simd, xt, w, self.yt, (o, g), cs, m, k);
        }
        for g in full_g..groups {
            bcast_tile::<S, RW, 1>(simd, xt, w, self.yt, (o, g), cs, m, k);
        }
    }
}

/// Columns of `x` per chunk of the broadcast form: 1024 keeps a chunk of
/// 64 rows of `x` (256 KiB) in a core's L2 with the `w` tile.
const K_CHUNK: usize = 1024;

/// `yt[o + r, rows of groups g..g + XV] (+)= w[o + r, c0..c1] . x[those
/// rows, c0..c1]`: a chunk after the first continues the sums the earlier
/// chunks stored, so each output is still one chain over `c` in order.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn bcast_tile<S: Simd, const RW: usize, const XV: usize>(
    simd: S,
    xt: &[S::f32s],
    w: &[f32],
    yt: &mut [f32],
    (o, g): (usize, usize),
    (c0, c1): (usize, usize),
    m: usize,
    k: usize,
) {
    let lanes = std::mem::size_of::<S::f32s>() / 4;
    let wr: [&[f32]; RW] = core::array::from_fn(|r| &w[(o + r) * k..][..k]);
    let xs: [&[S::f32s]; XV] = core::array::from_fn(|v| &xt[(g + v) * k..][..k]);
    let out = |r: usize, v: usize| {
        let lo = (g + v) * lanes;
        (o + r) * m + lo..(o + r) * m + lo + lanes.min(m - lo)
    };
    let mut acc = [[simd.splat_f32s(0.0); XV]; RW];
    if c0 > 0 {
        for (r, acc) in acc.iter_mut().enumerate() {
            for (v, acc) in acc.iter_mut().enumerate() {
                *acc = simd.partial_load_f32s(&yt[out(r, v)]);
            }
        }
    }
    for cl in (c0..c1).step_by(LINE) {
        for row in wr {
            prefetch(row.as_ptr().wrapping_add(cl + PREFETCH_AHEAD));
        }
        for c in cl..(cl + LINE).min(c1) {
            let b: [S::f32s; XV] = core::array::from_fn(|v| xs[v][c]);
            for r in 0..RW {
                let a = simd.splat_f32s(wr[r][c]);
                for v in 0..XV {
                    acc[r][v] = simd.mul_add_f32s(a, b[v], acc[r][v]);
                }
            }
        }
    }
    for (r, acc) in acc.iter().enumerate() {
        for (v, acc) in acc.iter().enumerate() {
            simd.partial_store_f32s(&mut yt[out(r, v)], *acc);
        }
    }
}
