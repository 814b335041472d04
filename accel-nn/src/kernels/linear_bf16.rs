//! Products through a bf16 weight on AVX-512 BF16 (no AMX) without converting
//! the weight: its bf16 values are already the microkernel's operands, so
//! packing them is moving bits (two neighbours of a row are one pair; two
//! rows interleaved make the input gradient's pairs).
//!
//! Why: on such CPUs the linear layers converted every bf16 weight to f32
//! for each call (and packed the f32 back to bf16 for the products): at 128
//! rows of a LoRA step on a 0.5 B Llama, a fifth of the step went to
//! converting the frozen base and the f32 products that followed.

use half::bf16;

use super::gemm_bf16::{Packed, PackedB, MR, NR};
use super::gemm_bf16_t::gemm_new_bf16_packed_t;
use super::raw::{bf16_tile_available, pair_rows, par, prefetch, MatRef};

/// Rows of the weight ahead of the one being packed that are prefetched.
const PREFETCH_ROWS: usize = 16;

/// Rows of `x` from which the products take this path (fewer, decoding,
/// stay with the skinny kernels).
pub(super) const MIN_ROWS: usize = 9;

/// Whether the products run here: AVX-512 BF16 without AMX (AMX reads bf16
/// operands as they lie already).
pub(super) fn available() -> bool {
    bf16_tile_available() && super::bf16_path::bf16_path() == super::bf16_path::Bf16Path::Avx512Bf16
}

/// The pair of bf16 values `lo`, `hi` as the microkernel takes it.
#[inline(always)]
fn pair(lo: bf16, hi: bf16) -> u32 {
    u32::from(lo.to_bits()) | (u32::from(hi.to_bits()) << 16)
}

/// The rows of a product's activation operand (`x`, or the output's
/// gradient): bf16 values held in f32, or a bf16 tensor's own values, whose
/// neighbours are the microkernel's pairs already (no conversion pass).
#[derive(Clone, Copy)]
pub(super) enum Rows<'a> {
    F32(&'a [f32]),
    Bf16(&'a [bf16]),
}

impl Rows<'_> {
    /// These `[n, len]` rows as the right operand `[len, n]` of a product:
    /// packed from the f32 values, or moved as pairs from the bf16 ones.
    fn transposed<R>(self, len: usize, f: impl FnOnce(Packed) -> R) -> R {
        match self {
            Rows::Bf16(v) if len.is_multiple_of(2) => {
                let pairs: &[u32] = bytemuck::cast_slice(v);
                let rows = pairs.len() / (len / 2);
                let pack = |(k0, kc): (usize, usize)| {
                    columns_of_rows(pairs, len / 2, rows, (k0 / 2, kc.div_ceil(2)))
                };
                f(Packed::Rhs(&pack))
            }
            Rows::Bf16(v) => {
                let v: Vec<f32> = v.iter().map(|x| x.to_f32()).collect();
                f(Packed::Matrix(MatRef::rows_t(&v, 0, len)))
            }
            Rows::F32(v) => f(Packed::Matrix(MatRef::rows_t(v, 0, len))),
        }
    }
}

/// Pairs `p0..p0 + pairs` of each of the `rows` rows of `src` (`[rows][ld]`
/// pairs) as the columns of a right operand: panels of `NR` rows, each
/// `[pairs][NR]`, zero past the last row. In a reused packing buffer: a
/// fresh one per block of every product was 3% of a bf16 LoRA step's CPU
/// time in zero fills (and the page faults under them).
fn columns_of_rows(src: &[u32], ld: usize, rows: usize, (p0, pairs): (usize, usize)) -> PackedB {
    let panels = rows.div_ceil(NR);
    let mut packed = PackedB::reused(panels * pairs * NR);
    packed.pair_major = false;
    par::chunks_mut(
        &mut packed.data[..panels * pairs * NR],
        pairs * NR,
        |q, panel| {
            let live = NR.min(rows - q * NR);
            for j in 0..live {
                let row = &src[(q * NR + j) * ld + p0..][..pairs];
                for (dst, &v) in panel[j..].iter_mut().step_by(NR).zip(row) {
                    *dst = v;
                }
            }
            if live < NR {
                for pair in panel.chunks_exact_mut(NR) {
                    pair[live..].fill(0);
                }
            }
        },
    );
    packed
}

/// `y [n, out] = x [n, inp] @ W^T` for a bf16 `W [out, inp]` (`x` bf16
/// values).
pub(super) fn forward(x: Rows, n: usize, w: &[bf16], out: usize, inp: usize) -> Vec<f32> {
    forward_as(x, n, w, (out, inp), |v| v)
}

/// [`forward`] with each output value made by `f` (the output's dtype) as
/// it is written: the product is `yT [out, n] = W x^T` (the weight's rows
/// read in place), stored transposed.
pub(super) fn forward_as<T: Copy + Default + Send>(
    x: Rows,
    n: usize,
    w: &[bf16],
    (out, inp): (usize, usize),
    f: impl Fn(f32) -> T + Sync,
) -> Vec<T> {
    x.transposed(inp, |x_t| {
        // Rows of an even length whose storage is 4-byte aligned are the
        // microkernel's pairs as they lie: no packing pass (it was 14% of a
        // bf16 LoRA step's CPU time on a Zen 4).
        match bytemuck::try_cast_slice::<bf16, u32>(w) {
            Ok(rows) if inp.is_multiple_of(2) => {
                gemm_new_bf16_packed_t((out, n, inp), Packed::LhsRows(rows), x_t, f)
            }
            _ => gemm_new_bf16_packed_t((out, n, inp), Packed::Lhs(&packer(w, inp)), x_t, f),
        }
    })
}

/// Packs a task's rows of `w [_, inp]`, each row's neighbours paired, as
/// [`gemm_new_bf16_packed`]'s left operand.
fn packer(w: &[bf16], inp: usize) -> impl Fn(usize, usize, (usize, usize)) -> Vec<u32> + Sync + '_ {
    move |i0: usize, rows: usize, (k0, kc): (usize, usize)| {
        let pairs = kc.div_ceil(2);
        let mut panels = vec![0u32; rows.div_ceil(MR) * pairs * MR];
        // A panel is written in order, one pair of each of its `MR` rows
        // at a time: the rows are read as `MR` forward streams. (Row by
        // row, every write landed `MR` pairs past the last, a cache line
        // apart: that packing was 18% of a bf16 LoRA step's CPU time.)
        for (b, panel) in panels.chunks_mut(pairs * MR).enumerate() {
            let live = MR.min(rows - b * MR);
            let mut src: Vec<_> = (0..live)
                .map(|r| w[(i0 + b * MR + r) * inp + k0..][..kc].chunks_exact(2))
                .collect();
            let mut dsts = panel.chunks_exact_mut(MR);
            for dst in dsts.by_ref().take(kc / 2) {
                for (d, s) in dst.iter_mut().zip(src.iter_mut()) {
                    let two = s.next().unwrap_or(&[bf16::ZERO; 2]);
                    *d = pair(two[0], two[1]);
                }
            }
            if kc % 2 == 1 {
                let last = dsts.next().expect("a panel holds every pair");
                for (d, s) in last.iter_mut().zip(&src) {
                    *d = pair(s.remainder()[0], bf16::ZERO);
                }
            }
        }
        panels
    }
}

/// `dx [n, inp] = dy [n, out] @ W` for a bf16 `W [out, inp]`, as
/// `dx^T [inp, n] = W^T dy^T`: each task packs its own columns of `W` (two
/// rows interleaved into pairs, read as contiguous runs) into a panel that
/// stays in cache while every row of `dy` passes it, so `W` is read once and
/// no packed copy of it is written to memory. (Packing all of `W` up front,
/// zeroed first, then reading it back from memory: the zeroing alone was 5%
/// of a bf16 LoRA step's CPU time.)
pub(super) fn backward_input(dy: Rows, n: usize, w: &[bf16], out: usize, inp: usize) -> Vec<f32> {
    backward_input_as(dy, n, w, (out, inp), |v| v)
}

/// [`backward_input`] with each value made by `f` as it is written.
pub(super) fn backward_input_as<T: Copy + Default + Send>(
    dy: Rows,
    n: usize,
    w: &[bf16],
    (out, inp): (usize, usize),
    f: impl Fn(f32) -> T + Sync,
) -> Vec<T> {
    let pack = |c0: usize, cols: usize, (k0, kc): (usize, usize)| {
        let pairs = kc.div_ceil(2);
        let mut panels = vec![0u32; cols.div_ceil(MR) * pairs * MR];
        let bits: &[u16] = bytemuck::cast_slice(w);
        for p in 0..pairs {
            let o = k0 + 2 * p;
            // Rows lie pages apart, past where the hardware's prefetchers
            // follow a stream: every line of the rows a few pairs on is
            // asked for now, into the next block of `k` too (a task packs
            // its blocks one after the other).
            for ahead in [o + PREFETCH_ROWS, o + PREFETCH_ROWS + 1] {
                if ahead < out {
                    let row = bits[ahead * inp + c0..][..cols].as_ptr_range();
                    let mut line = row.start.cast::<u8>();
                    while line < row.end.cast() {
                        prefetch(line.cast());
                        line = line.wrapping_add(64);
                    }
                    prefetch(row.end.wrapping_sub(1).cast());
                }
            }
            for (b, panel) in panels.chunks_mut(pairs * MR).enumerate() {
                let p0 = c0 + b * MR;
                let live = MR.min(c0 + cols - p0);
                let lo = &bits[o * inp + p0..][..live];
                let hi = (o + 1 < k0 + kc).then(|| &bits[(o + 1) * inp + p0..][..live]);
                pair_rows(lo, hi, &mut panel[p * MR..][..MR]);
            }
        }
        panels
    };
    dy.transposed(out, |dy_t| {
        gemm_new_bf16_packed_t((inp, n, out), Packed::Lhs(&pack), dy_t, f)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Both products against f64 sums of the same bf16 values.
    #[test]
    fn products_of_a_bf16_weight_are_its_values_products() {
        if !bf16_tile_available() {
            return; // the layer keeps to its f32 products there
        }
        let val = |i: usize, s: u32| {
            let v =
                ((i as u32).wrapping_mul(2654435761).wrapping_add(s) % 2001) as f32 / 1000.0 - 1.0;
            bf16::from_f32(v)
        };
        // Rows read in place (even `inp`) with a short last tile and `k`
        // past a block, and packed (odd `inp`).
        for (n, out, inp) in [(37, 70, 130), (12, 33, 64), (20, 45, 1100), (200, 9, 511)] {
            let w: Vec<bf16> = (0..out * inp).map(|i| val(i, 1)).collect();
            let x: Vec<f32> = (0..n * inp).map(|i| val(i, 2).to_f32()).collect();
            let dy: Vec<f32> = (0..n * out).map(|i| val(i, 3).to_f32()).collect();
            let (xb, dyb): (Vec<bf16>, Vec<bf16>) = (
                x.iter().map(|&v| bf16::from_f32(v)).collect(),
                dy.iter().map(|&v| bf16::from_f32(v)).collect(),
            );
            let (y, dx) = (
                forward(Rows::F32(&x), n, &w, out, inp),
                backward_input(Rows::F32(&dy), n, &w, out, inp),
            );
            // The activations as bf16 tensors give the same sums.
            assert_eq!(y, forward(Rows::Bf16(&xb), n, &w, out, inp));
            assert_eq!(dx, backward_input(Rows::Bf16(&dyb), n, &w, out, inp));
            for i in 0..n {
                for o in 0..out {
                    let want: f64 = (0..inp)
                        .map(|k| f64::from(x[i * inp + k]) * f64::from(w[o * inp + k].to_f32()))
                        .sum();
                    assert!(
                        (f64::from(y[i * out + o]) - want).abs() < 1e-3,
                        "y {n} {out} {inp}"
                    );
                }
                for k in 0..inp {
                    let want: f64 = (0..out)
                        .map(|o| f64::from(dy[i * out + o]) * f64::from(w[o * inp + k].to_f32()))
                        .sum();
                    assert!(
                        (f64::from(dx[i * inp + k]) - want).abs() < 1e-3,
                        "dx {n} {out} {inp}"
                    );
                }
            }
        }
    }
}
