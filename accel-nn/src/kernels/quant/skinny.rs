//! `x W^T` for a few rows of `x` (decoding): each task dequantizes a slab of
//! `W`'s rows into a buffer that stays in L2 and runs the skinny dot-product
//! kernel on it, so the weight's bytes are read from memory once.

use super::super::raw::par;
use super::super::skinny::{slab_rows, slab_x_wt};
use super::{dequant, QuantRef};

/// `y [n, out] = x [n, inp] @ W^T` for small `n`.
pub(super) fn x_wt(x: &[f32], n: usize, w: &QuantRef) -> Vec<f32> {
    let (out, inp) = w.dims();
    if n == 0 || out == 0 {
        return Vec::new();
    }
    let rows = slab_rows(inp, n);
    let yt = par::new_vec(out * n, rows * n, |t, yt| {
        let o0 = t * rows;
        let r = yt.len() / n;
        let mut buf = vec![0f32; r * inp];
        dequant::tile(w, (o0, r), (0, inp), &mut buf, inp);
        slab_x_wt(x, &buf, yt, n, inp);
    });
    super::transpose(&yt, out, n)
}
