//! The products through a quantized weight with bf16 operands and f32 sums
//! (`vdpbf16ps`, twice the f32 rate), for bf16 inputs on CPUs with AVX-512
//! BF16: the weight is dequantized straight into the microkernel's packed
//! panels, a task's rows at a time, never whole.

use super::super::gemm_bf16::{gemm_new_bf16_packed, pair, to_pairs, MR};
use super::super::raw::{bf16_tile_available, MatRef};
use super::{dequant, transpose, QuantRef};

/// Whether [`forward`] and [`backward_input`] run here.
pub(super) fn available() -> bool {
    bf16_tile_available()
}

/// `y [n, out] = x [n, inp] @ W^T`, operands rounded to bf16.
pub(super) fn forward(x: &[f32], n: usize, w: &QuantRef) -> Vec<f32> {
    let (out, inp) = w.dims();
    // yT [out, n] = W [out, inp] @ x^T [inp, n]: W's rows packed from codes.
    let pack = |i0: usize, rows: usize, (k0, kc): (usize, usize)| {
        let pairs = kc.div_ceil(2);
        let mut panels = vec![0u32; rows.div_ceil(MR) * pairs * MR];
        let (mut row, mut row_pairs) = (vec![0f32; kc], vec![0u32; pairs]);
        for r in 0..rows {
            dequant::tile(w, (i0 + r, 1), (k0, kc), &mut row, kc);
            to_pairs(&row, &mut row_pairs);
            let panel = &mut panels[r / MR * pairs * MR..][..pairs * MR];
            for (dst, &v) in panel[r % MR..].iter_mut().step_by(MR).zip(&row_pairs) {
                *dst = v;
            }
        }
        panels
    };
    let yt = gemm_new_bf16_packed((out, n, inp), &pack, MatRef::rows_t(x, 0, inp));
    transpose(&yt, out, n)
}

/// `dx [n, inp] = dy [n, out] @ W`, operands rounded to bf16.
pub(super) fn backward_input(dy: &[f32], n: usize, w: &QuantRef) -> Vec<f32> {
    let (out, inp) = w.dims();
    // dxT [inp, n] = W^T [inp, out] @ dy^T [out, n]: columns of W packed as
    // rows, pairs of consecutive rows of W.
    let pack = |i0: usize, rows: usize, (k0, kc): (usize, usize)| {
        let pairs = kc.div_ceil(2);
        let mut panels = vec![0u32; rows.div_ceil(MR) * pairs * MR];
        let mut tile = vec![0f32; kc * rows];
        dequant::tile(w, (k0, kc), (i0, rows), &mut tile, rows);
        for r in 0..rows {
            let panel = &mut panels[r / MR * pairs * MR..][..pairs * MR];
            for p in 0..pairs {
                let lo = tile[2 * p * rows + r];
                let hi = if 2 * p + 1 < kc {
                    tile[(2 * p + 1) * rows + r]
                } else {
                    0.0
                };
                panel[p * MR + r % MR] = pair(lo, hi);
            }
        }
        panels
    };
    let dxt = gemm_new_bf16_packed((inp, n, out), &pack, MatRef::rows_t(dy, 0, out));
    transpose(&dxt, inp, n)
}
