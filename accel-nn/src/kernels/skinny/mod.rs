//! `x @ w^T` for up to a few hundred rows of `x`, streaming `w` in its own
//! `[out, in]` layout: the linear layers of inference (a prompt, a decoding
//! step) and of small training batches.
//!
//! Why: `gemm` runs its microkernel on column panels of `w^T`, so a weight
//! stored `[out, in]` (PyTorch's layout, which checkpoints and our layers
//! keep) is repacked on every call. With many rows of `x` that repacking is
//! amortised; with 32 rows it is most of the work: a profile of a Llama
//! forward over 32 tokens spent ~37% of its time in gemm's packing loops
//! against ~9% in its microkernel. Both forms here read `w` once, straight
//! from where it lies (a checkpoint's mapped pages included):
//!
//! - [`dot`]: each output is a dot product of two contiguous rows, for a
//!   tile of `w` rows against a tile of `x` rows in registers. Best for a
//!   few rows of `x` (decoding), where the kernel streams `w` from memory.
//! - [`broadcast`]: a GEMM microkernel's register-tiled outer product,
//!   broadcasting `w`'s elements in place against vectors of `x`'s columns
//!   (a transposed copy of `x`, small next to `w`). It takes over from a
//!   vector's width of rows up when `w` has enough rows to pay for that copy.
//!
//! Measured with the 2-core AVX-512 EPYC's 221 GFLOP/s FMA peak, 32 rows and
//! the Llama shapes of `bench_bigmodel` (k x out = 1536 x 1536, 1536 x 4096,
//! 4096 x 1536, 1536 x 32000): dot 136-187 GFLOP/s, broadcast 180-205, and
//! `gemm` with its repacking 37-49. At 256 rows: broadcast 180-205, gemm
//! 130-156.
//!
//! Within a form, every output element is summed in one order whatever
//! the tile it falls in, the row count or the thread split, so a row's
//! result does not depend on the batch around it (the form itself depends
//! on the row count).

mod broadcast;
mod dot;

use broadcast::{Broadcast, Lanes, BROADCAST_MIN_OUT};
use dot::Tiles;

use super::raw::par;

/// Up to this many rows of `x` take these kernels; above it gemm's
/// repacking of `w` pays for itself (on the 2-core AVX-512 EPYC the
/// broadcast form still beat gemm at 256 rows for `k` of 784 and more, by
/// 10-35%, and tied it for `k` = 256; at 512 rows gemm won 3 of 4 shapes
/// with `k` of 784 or less).
pub(crate) const MAX_ROWS: usize = 256;

/// Bytes of `w` per parallel task: small enough to stay in a core's L2
/// cache while every tile of `x` rows passes over them.
const W_BYTES_PER_TASK: usize = 192 << 10;

/// Rows of `w` per parallel task for rows of `k` elements and `m` rows of
/// `x`: a multiple of 12, so that the tile heights of both forms (4 and 3
/// for dot products, 12 and 6 for broadcasts) divide it.
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
    let lanes = pulp::Arch::new().dispatch(Lanes);
    x_wt_in(x, w, (m, k, out), m >= lanes && out >= BROADCAST_MIN_OUT)
}

/// [`x_wt`] for a weight that is not an f32 matrix: each task asks `slab`
/// for its rows of `w` (`slab(o0, rows, buf)` fills `buf` with rows
/// `o0..o0 + rows`, row-major), then runs the form [`x_wt`] would choose on
/// them, so a quantized weight is dequantized a slab at a time into a buffer
/// that stays in L2.
pub(crate) fn x_wt_slabs(
    x: &[f32],
    (m, k, out): (usize, usize, usize),
    slab: &(dyn Fn(usize, usize, &mut [f32]) + Sync),
) -> Vec<f32> {
    assert_eq!(x.len(), m * k, "skinny linear: x is not [{m}, {k}]");
    if m == 0 || out == 0 {
        return Vec::new();
    }
    if k == 0 {
        return vec![0.0; m * out];
    }
    let lanes = pulp::Arch::new().dispatch(Lanes);
    let broadcast = m >= lanes && out >= BROADCAST_MIN_OUT;
    let xt = if broadcast {
        broadcast::x_columns(x, m, k, lanes)
    } else {
        Vec::new()
    };
    let rows = w_rows_per_task(k, m);
    let yt = par::new_vec(out * m, rows * m, |i, yt| {
        let r = yt.len() / m;
        let mut w = vec![0f32; r * k];
        slab(i * rows, r, &mut w);
        let w = &w;
        if broadcast {
            let xt = &xt;
            pulp::Arch::new().dispatch(Broadcast { xt, w, yt, m, k })
        } else {
            pulp::Arch::new().dispatch(Tiles { x, w, yt, m, k })
        }
    });
    par::new_vec(m * out, out, |i, row| {
        for (o, v) in row.iter_mut().enumerate() {
            *v = yt[o * m + i];
        }
    })
}

/// [`x_wt`] in the form given: broadcasts or dot products.
fn x_wt_in(x: &[f32], w: &[f32], (m, k, out): (usize, usize, usize), broadcast: bool) -> Vec<f32> {
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
    let rows = w_rows_per_task(k, m);
    let yt = if broadcast {
        let lanes = pulp::Arch::new().dispatch(Lanes);
        let xt = broadcast::x_columns(x, m, k, lanes);
        par::new_vec(out * m, rows * m, |i, yt| {
            let w = &w[i * rows * k..][..yt.len() / m * k];
            let xt = &xt;
            pulp::Arch::new().dispatch(Broadcast { xt, w, yt, m, k })
        })
    } else {
        par::new_vec(out * m, rows * m, |i, yt| {
            let w = &w[i * rows * k..][..yt.len() / m * k];
            pulp::Arch::new().dispatch(Tiles { x, w, yt, m, k })
        })
    };
    par::new_vec(m * out, out, |i, row| {
        for (o, v) in row.iter_mut().enumerate() {
            *v = yt[o * m + i];
        }
    })
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
        // leftover past the last SIMD vector and past a chunk of the
        // broadcast form, rows of `x` past a column group, and tasks split
        // mid-way; each in both forms.
        let shapes = [
            (1, 1, 1),
            (3, 5, 7),
            (5, 37, 130),
            (64, 100, 9),
            (7, 0, 3),
            (17, 33, 29),
            (40, 1100, 45),
            (33, 2050, 530),
        ];
        for (m, k, out) in shapes {
            let (x, w) = (data(m * k, 1), data(out * k, 2));
            let want = reference(&x, &w, m, k, out);
            for broadcast in [false, true] {
                let y = x_wt_in(&x, &w, (m, k, out), broadcast);
                assert_eq!(y.len(), m * out);
                for (a, b) in y.iter().zip(&want) {
                    assert!(
                        (*a as f64 - b).abs() <= 1e-5 * (k as f64).max(1.0),
                        "{m} {k} {out} broadcast {broadcast}: {a} vs {b}"
                    );
                }
            }
        }
    }

    #[test]
    fn the_entry_point_takes_the_broadcast_form_for_many_rows_and_outputs() {
        // Its results are the broadcast form's, bit for bit (the two forms
        // sum in different orders, so this tells them apart).
        let (m, k, out) = (40, 300, 600);
        let (x, w) = (data(m * k, 5), data(out * k, 6));
        let bits = |v: Vec<f32>| v.into_iter().map(f32::to_bits).collect::<Vec<_>>();
        let chosen = bits(x_wt(&x, &w, m, k, out));
        let (dot, broadcast) = (
            bits(x_wt_in(&x, &w, (m, k, out), false)),
            bits(x_wt_in(&x, &w, (m, k, out), true)),
        );
        assert_ne!(dot, broadcast, "the forms should differ in the last bits");
        assert_eq!(chosen, broadcast);
        // Few outputs: the dot form.
        let w = &w[..100 * k];
        assert_eq!(
            bits(x_wt(&x, w, m, k, 100)),
            bits(x_wt_in(&x, w, (m, k, 100), false))
        );
    }

    #[test]
    fn a_rows_result_does_not_depend_on_the_rows_around_it() {
        // In each form, a row computed alone equals the same row computed
        // in a batch, wherever it falls among the tiles and column groups.
        let (m, k, out) = (37, 131, 70);
        let (x, w) = (data(m * k, 3), data(out * k, 4));
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        for broadcast in [false, true] {
            let all = x_wt_in(&x, &w, (m, k, out), broadcast);
            for i in 0..m {
                let one = x_wt_in(&x[i * k..(i + 1) * k], &w, (1, k, out), broadcast);
                assert_eq!(
                    bits(&one),
                    bits(&all[i * out..(i + 1) * out]),
                    "row {i}, broadcast {broadcast}"
                );
            }
        }
    }
}
