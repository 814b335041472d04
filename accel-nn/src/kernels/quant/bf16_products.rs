//! The products through a quantized weight with bf16 operands and f32 sums
//! (`vdpbf16ps`, twice the f32 rate), for bf16 inputs on CPUs with AVX-512
//! BF16: the weight is dequantized straight into the microkernel's packed
//! panels, a task's rows (forward) or a block of its rows (backward) at a
//! time, never whole.

use super::super::gemm_bf16::{gemm_new_bf16_packed, Packed, PackedB, MR, NR};
use super::super::gemm_bf16_t::gemm_new_bf16_packed_t;
use super::super::raw::quant::Simd;
use super::super::raw::{bf16_tile_available, par, MatRef};
use super::{dequant, QuantRef};

/// Whether [`forward`] and [`backward_input`] run here.
pub(super) fn available() -> bool {
    bf16_tile_available()
}

/// `y [n, out] = x [n, inp] @ W^T`, operands rounded to bf16.
pub(super) fn forward(x: &[f32], n: usize, w: &QuantRef) -> Vec<f32> {
    let (out, inp) = w.dims();
    // yT [out, n] = W [out, inp] @ x^T [inp, n]: a task's rows of W decoded
    // from the codes, each row's pairs where the microkernel reads them
    // (scattering them into panels cost a fifth of the forward).
    let pack = |i0: usize, rows: usize, (k0, kc): (usize, usize)| {
        let pairs = kc.div_ceil(2);
        let mut decoded = vec![0u32; rows.div_ceil(MR) * MR * pairs];
        let mut scratch = Vec::new();
        for (r, row) in decoded.chunks_mut(pairs).take(rows).enumerate() {
            dequant::row_pairs(w, i0 + r, (k0, kc), row, &mut scratch);
        }
        decoded
    };
    let x_t = Packed::Matrix(MatRef::rows_t(x, 0, inp));
    gemm_new_bf16_packed_t((out, n, inp), Packed::LhsPackedRows(&pack), x_t, |v| v)
}

/// `dx [n, inp] = dy [n, out] @ W`, operands rounded to bf16: `W` is the
/// right operand, its rows `k0..k0 + kc` packed a pair of rows at a time
/// (both dequantized whole, then interleaved into one row of pairs), pairs
/// in parallel; the microkernel reads each panel across the pair rows.
pub(super) fn backward_input(dy: &[f32], n: usize, w: &QuantRef) -> Vec<f32> {
    let (out, inp) = w.dims();
    let width = inp.div_ceil(NR) * NR;
    let pack = |(k0, kc): (usize, usize)| {
        let pairs = kc.div_ceil(2);
        let rows_per_task = (PAIR_ROWS_PER_TASK).min(pairs).max(1);
        let mut packed = PackedB::reused(pairs * width);
        par::chunks_mut(
            &mut packed.data[..pairs * width],
            rows_per_task * width,
            |t, chunk| {
                let (mut a, mut b) = (vec![0f32; inp], vec![0f32; inp]);
                for (i, dst) in chunk.chunks_mut(width).enumerate() {
                    let p = t * rows_per_task + i;
                    let o = k0 + 2 * p;
                    dequant::tile(w, (o, 1), (0, inp), &mut a, inp);
                    if 2 * p + 1 < kc {
                        dequant::tile(w, (o + 1, 1), (0, inp), &mut b, inp);
                    } else {
                        b.fill(0.0);
                    }
                    let (pairs, padding) = dst.split_at_mut(inp);
                    super::super::raw::quant::pair_rows(Simd::Avx512, &a, &b, pairs);
                    padding.fill(0);
                }
            },
        );
        packed
    };
    let dy_rows = Packed::Matrix(MatRef::rows(dy, 0, out));
    gemm_new_bf16_packed((n, inp, out), dy_rows, Packed::Rhs(&pack))
}

/// Pairs of rows of `W` per task of the backward's packing.
const PAIR_ROWS_PER_TASK: usize = 16;
