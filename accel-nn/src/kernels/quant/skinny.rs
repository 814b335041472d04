//! `x W^T` for a few rows of `x` (decoding). A 4-bit weight whose rows are
//! whole blocks runs straight off its codes on AVX-512 or AVX2 (16 or 8 codes a
//! permute, the products summed block by block, then scaled), reading each
//! byte once; other weights are dequantized a slab of rows at a time into a
//! buffer that stays in L2 and multiplied with the skinny dot-product kernel.

use super::super::raw::{par, quant as simd_quant};
use super::super::skinny::x_wt_slabs;
use super::{dequant, QuantRef, Store};

/// `y [n, out] = x [n, inp] @ W^T` for small `n`.
pub(super) fn x_wt(x: &[f32], n: usize, w: &QuantRef) -> Vec<f32> {
    let (out, _) = w.dims();
    if n == 0 || out == 0 {
        return Vec::new();
    }
    if let Some(yt) = fused(x, n, w) {
        return super::transpose(&yt, out, n);
    }
    slabs(x, n, w)
}

/// `x W^T` with the skinny kernels on slabs of `W` dequantized a task's rows
/// at a time (up to [`super::super::skinny::MAX_ROWS`] rows of `x`).
pub(super) fn slabs(x: &[f32], n: usize, w: &QuantRef) -> Vec<f32> {
    let (out, inp) = w.dims();
    let slab = |o0: usize, rows: usize, buf: &mut [f32]| {
        dequant::tile(w, (o0, rows), (0, inp), buf, inp);
    };
    x_wt_slabs(x, (n, inp, out), &slab)
}

/// Rows of a 4-bit weight per task of the fused form.
const FUSED_ROWS: usize = 32;

/// `yT [out, n]` straight off a 4-bit weight's codes, where the fused form
/// applies: AVX-512 or AVX2, rows of whole blocks of a multiple of 32, values that
/// are `code * scale` exactly or rounded to bf16 once.
fn fused(x: &[f32], n: usize, w: &QuantRef) -> Option<Vec<f32>> {
    let QuantRef::FourBit {
        packed,
        scales,
        codes,
        blocksize,
        store,
        compute,
        simd,
        out,
        inp,
    } = *w
    else {
        return None;
    };
    let round_bf16 = match (store, compute) {
        (Store::F32, Store::F32) => false,
        (Store::F32 | Store::Bf16, Store::F32 | Store::Bf16) => true,
        _ => return None,
    };
    if !simd_quant::dot_available(simd) || blocksize % 32 != 0 || inp % blocksize != 0 || inp == 0 {
        return None;
    }
    let half = inp / 2;
    let (mut even, mut odd) = (Vec::with_capacity(n * half), Vec::with_capacity(n * half));
    for row in x.chunks_exact(inp) {
        even.extend(row.iter().step_by(2));
        odd.extend(row.iter().skip(1).step_by(2));
    }
    let blocks = inp / blocksize;
    Some(par::new_vec(out * n, FUSED_ROWS * n, |t, yt| {
        let r0 = t * FUSED_ROWS;
        let rows = yt.len() / n;
        let mut s = vec![0f32; rows * blocks];
        scales.fill(r0 * blocks, &mut s);
        let bytes = &packed[r0 * half..(r0 + rows) * half];
        simd_quant::dot_4bit(
            simd,
            bytes,
            &s,
            codes,
            (&even, &odd),
            (rows, n, inp, blocksize),
            round_bf16,
            yt,
        );
    }))
}
