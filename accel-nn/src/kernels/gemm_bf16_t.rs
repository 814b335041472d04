//! A bf16 product written out transposed: `out [n, m] = (a [m, k] @ b [k, n])^T`,
//! each value through the caller's conversion as it is stored.
//!
//! Why: the linear layers multiply with the weight as the left operand (its
//! rows read in place, or decoded from 4-bit codes, where the microkernel
//! reads them), which makes `y^T`. Writing `y^T` to memory and transposing
//! it in a second pass, after a zero fill of `y^T` and a pass over it per
//! block of `k`, was ~15% of a bf16 LoRA step's CPU time on a Zen 4 (the
//! transpose alone 8.7%, zero fills 6%). Here each task sums its rows over
//! every block of `k` in a buffer of its own (`[rows][n]`, cache-resident at
//! the row counts of a step) and writes them once, transposed, into its
//! columns of the output; one parallel section instead of one per block.

use super::gemm_bf16::{task_block, task_rows, with_operands, Packed, PackedB, KC_PAIRS};
use super::raw::par;

/// `out [n, m] = (a @ b)^T`, `f` of each sum, for [`gemm_new_bf16_packed`]'s
/// operands (`a [m, k]`, `b [k, n]`). Every block of `b` is packed before
/// the products: `b` is the activations' side of a layer's product (`n`
/// rows of `k`), not a weight.
///
/// [`gemm_new_bf16_packed`]: super::gemm_bf16::gemm_new_bf16_packed
///
/// # Panics
/// As [`gemm_new_bf16_packed`](super::gemm_bf16::gemm_new_bf16_packed).
pub(crate) fn gemm_new_bf16_packed_t<T: Copy + Default + Send>(
    (m, n, k): (usize, usize, usize),
    a: Packed<'_, '_>,
    b: Packed<'_, '_>,
    f: impl Fn(f32) -> T + Sync,
) -> Vec<T> {
    with_operands((m, n, k), a, b, |lhs, pack_b| {
        if m == 0 || n == 0 {
            return Vec::new();
        }
        let blocks: Vec<(usize, usize, PackedB)> = (0..k)
            .step_by(2 * KC_PAIRS)
            .map(|k0| {
                let kc = (2 * KC_PAIRS).min(k - k0);
                (k0, kc, pack_b((k0, kc)))
            })
            .collect();
        // Zeroed in parallel chunks (every value is written below).
        let mut out = par::new_vec(n * m, 1 << 14, |_, _| {});
        let mc = task_rows(m);
        par::column_bands(&mut out, m, mc, |t, band| {
            let rows = band.width();
            // Zeros stay zeros where `k` is 0 (no blocks).
            let mut c = vec![0f32; rows * n];
            for (k0, kc, packed) in &blocks {
                task_block(lhs, (t * mc, k), (*k0, *kc), packed, &mut c, n);
            }
            for j in 0..n {
                for (r, o) in band.row(j).iter_mut().enumerate() {
                    *o = f(c[r * n + j]);
                }
            }
        });
        out
    })
}

#[cfg(test)]
mod tests {
    use super::super::gemm_bf16::gemm_new_bf16_packed;
    use super::super::raw::{bf16_tile_available, MatRef};
    use super::*;

    /// Every layout of the left operand gives the transpose of the
    /// untransposed product, bit for bit (the same sums in the same order).
    #[test]
    fn the_transposed_product_is_the_product_transposed() {
        if !bf16_tile_available() {
            return; // the linear layers keep to the f32 products there
        }
        let val = |i: usize, s: u32| {
            let v = ((i as u32).wrapping_mul(2654435761).wrapping_add(s) % 2001) as f32;
            half::bf16::from_f32(v / 1000.0 - 1.0).to_f32()
        };
        // Rows past a task and a tile, columns past a panel, k odd, past a
        // block, and zero.
        for (m, n, k) in [
            (1, 1, 1),
            (15, 33, 7),
            (130, 65, 1100),
            (57, 3, 513),
            (9, 4, 0),
        ] {
            let a: Vec<f32> = (0..m * k).map(|i| val(i, 1)).collect();
            let b: Vec<f32> = (0..k * n).map(|i| val(i, 2)).collect();
            let (ar, br) = (MatRef::rows(&a, 0, k), MatRef::rows(&b, 0, n));
            let want = gemm_new_bf16_packed((m, n, k), Packed::Matrix(ar), Packed::Matrix(br));
            let got =
                gemm_new_bf16_packed_t((m, n, k), Packed::Matrix(ar), Packed::Matrix(br), |v| v);
            assert_eq!(got.len(), m * n, "{m} {n} {k}");
            for i in 0..m {
                for j in 0..n {
                    let (g, w) = (got[j * m + i], want[i * n + j]);
                    assert_eq!(g.to_bits(), w.to_bits(), "{m} {n} {k} at {i},{j}");
                }
            }
            let halves = gemm_new_bf16_packed_t(
                (m, n, k),
                Packed::Matrix(ar),
                Packed::Matrix(br),
                half::bf16::from_f32,
            );
            assert!(halves
                .iter()
                .zip(&got)
                .all(|(h, g)| *h == half::bf16::from_f32(*g)));
        }
    }
}
