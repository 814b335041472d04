//! Matrix products of bf16 operands with f32 sums, on CPUs with AMX
//! (`raw/amx/`) or AVX-512 BF16 (here): the linear layers' products under
//! bf16 mixed precision. AMX, where present, takes every product.
//!
//! Why: a bf16 tensor was converted to f32 and multiplied by the f32 gemm,
//! so bf16 training ran at f32 speed plus the conversions, slower than fp32
//! (0.39 s against 0.30 s a step for a 20 M parameter Llama on the 2-core
//! EPYC) while PyTorch's autocast ran 1.4x faster than its fp32 through
//! oneDNN's bf16 kernels. `vdpbf16ps` multiplies pairs of bf16 exactly and
//! adds them into f32 lanes at twice the rate of f32 FMAs (measured here:
//! 228 against 114 GFLOP/s on one core).
//!
//! GotoBLAS blocking with a 14 x 32 register tile ([`bf16_tile`]): per block
//! of `k`, `b` is packed once into panels of 32 columns, `[k / 2][32]` pairs
//! of consecutive `k` (the instruction's operand layout), and each task packs
//! its rows of `a` into panels of 14 the same way. Packing rounds the f32
//! values to bf16 (to nearest even); operands that were bf16 tensors come
//! back exactly. Each output element is summed over `k` in one fixed order
//! whatever the thread count, so results are reproducible.

use candle_core::DType;

use super::bf16_path::{bf16_path, Bf16Path};
use super::raw::amx::{self, bf16_bits, HalfRef, OutLayout};
use super::raw::{bf16_tile, bf16_tile_available, gemm_new, par, MatRef, TileA};
pub(crate) use super::raw::{BF16_MR as MR, BF16_NR as NR};

/// Pairs of `k` per block: a packed panel of `b` (128 bytes a pair) is then
/// 32 KiB, and a task's panels of `a` 56 bytes a pair per row.
pub(crate) const KC_PAIRS: usize = 256;

/// Rows of `a` per parallel task.
const MC: usize = 4 * MR;

/// Whether [`gemm_new_bf16`] can run on this CPU.
pub(crate) fn available() -> bool {
    amx::available() || bf16_tile_available()
}

/// Whether bf16 products run on AMX tiles here: then the linear layers hand
/// their bf16 tensors to [`amx_new`] as they lie, with no f32 copy.
fn amx() -> bool {
    amx::available()
}

/// `a [m, k] @ b [k, n]` on AMX tiles as a new row-major buffer.
///
/// When `b`'s columns are bf16 rows in memory (a weight `[n, k]` read as
/// its transpose) and `a` has fewer rows, this computes `c^T = b^T a^T`:
/// the weight is then read in place and only `a` is packed.
///
/// # Panics
/// When [`amx`] is false, or an operand overruns its slice.
pub(crate) fn amx_new((m, n, k): (usize, usize, usize), a: HalfRef, b: HalfRef) -> Vec<f32> {
    // Zeroed in parallel chunks, not one serial memset.
    let mut c = par::new_vec(m * n, 1 << 14, |_, _| {});
    if m < n && b.t().in_place_as_lhs(k) {
        let out = OutLayout {
            off: 0,
            rs: 1,
            cs: n,
        };
        amx::gemm((n, m, k), b.t(), a.t(), &mut c, out, false);
    } else {
        let out = OutLayout {
            off: 0,
            rs: n,
            cs: 1,
        };
        amx::gemm((m, n, k), a, b, &mut c, out, false);
    }
    c
}

/// Whether the products of an op on tensors of these dtypes take bf16
/// operands with f32 sums (this module): both bf16, on a CPU that has the
/// instructions. The operands are bf16 values already, so only the order of
/// the f32 sums differs from the f32 gemm (and the gradient before the
/// product, rounded to bf16 as autocast's bf16 backward has it).
pub(crate) fn bf16_products(x: DType, w: DType) -> bool {
    x == DType::BF16 && w == DType::BF16 && available() && bf16_path() != Bf16Path::F32
}

/// `a @ b` as a new buffer, with bf16 products when `bf16`.
pub(crate) fn product(bf16: bool, dims: (usize, usize, usize), a: MatRef, b: MatRef) -> Vec<f32> {
    if bf16 {
        gemm_new_bf16(dims, a, b)
    } else {
        gemm_new(dims, a, b, true)
    }
}

/// Whether an op whose products take bf16 operands (`bf16`) hands its bf16
/// tensors to [`product_of`] as they lie: where AMX takes the products.
/// Elsewhere they are converted to f32 first (a weight of the LM head at a
/// 32 K vocabulary is a 200 MB buffer per pass).
pub(crate) fn keep_bf16(bf16: bool) -> bool {
    bf16 && amx() && bf16_path() == Bf16Path::Amx
}

/// `a @ b` as a new buffer, with bf16 products when `bf16`; bf16 operands
/// (which [`crate::kernels::values_of`] hands out only where AMX takes the
/// products) are read as they lie.
///
/// # Panics
/// When an operand holds bf16 values and the products do not run on AMX.
pub(crate) fn product_of(
    bf16: bool,
    dims: (usize, usize, usize),
    a: HalfRef,
    b: HalfRef,
) -> Vec<f32> {
    if keep_bf16(bf16) {
        return amx_new(dims, a, b);
    }
    let (Some(a), Some(b)) = (a.as_f32(), b.as_f32()) else {
        panic!("bf16 operands are read on AMX only")
    };
    product(bf16, dims, a, b)
}

/// Two values as the instruction's pair: `lo` in the low half.
#[inline(always)]
pub(crate) fn pair(lo: f32, hi: f32) -> u32 {
    u32::from(bf16_bits(lo)) | (u32::from(bf16_bits(hi)) << 16)
}

/// `c [m, n] = a [m, k] @ b [k, n]` with both operands rounded to bf16 and
/// f32 sums: a new row-major buffer.
///
/// # Panics
/// When [`available`] is false, or an operand is out of its slice.
pub(crate) fn gemm_new_bf16((m, n, k): (usize, usize, usize), a: MatRef, b: MatRef) -> Vec<f32> {
    if amx() {
        return amx_new((m, n, k), a.half(), b.half());
    }
    avx512_new((m, n, k), a, b)
}

/// [`gemm_new_bf16`] on AVX-512 BF16.
fn avx512_new((m, n, k): (usize, usize, usize), a: MatRef, b: MatRef) -> Vec<f32> {
    a.check(m, k, "lhs");
    b.check(k, n, "rhs");
    let pack_lhs = |i0, rows, ks| pack_a(&a, i0, rows, ks);
    let pack_rhs = |ks| PackedB {
        data: pack_b(&b, ks, n),
        pair_major: false,
        reused: false,
    };
    avx512_new_with((m, n, k), Lhs::Pack(&pack_lhs), &pack_rhs)
}

/// Packs rows `i0..i0 + rows` and columns `k0..k0 + kc` of a product's left
/// operand as [`pack_a`] lays them out (`[pairs][MR]` panels of `MR` rows).
pub(crate) type PackA<'a> = dyn Fn(usize, usize, (usize, usize)) -> Vec<u32> + Sync + 'a;

/// Packs rows `k0..k0 + kc` of a product's right operand, every column:
/// panel by panel as [`pack_b`] lays them out (`[pairs][NR]` panels of `NR`
/// columns), or pair by pair ([`PackedB::pair_major`]).
pub(crate) type PackB<'a> = dyn Fn((usize, usize)) -> PackedB + Sync + 'a;

/// A block of the right operand, packed.
pub(crate) struct PackedB {
    /// The packed pairs.
    pub data: Vec<u32>,
    /// `[pairs][panels * NR]`: each pair's values for every column side by
    /// side (what a packer writing a whole pair of rows at once makes),
    /// instead of `[panels][pairs][NR]`.
    pub pair_major: bool,
    /// Whether `data` is this thread's packing buffer, given back on drop.
    pub reused: bool,
}

impl PackedB {
    /// A pair-major block of at least `len` pairs in this thread's reused
    /// packing buffer (given back when dropped; it may be longer). Its
    /// contents are stale: the packer writes every pair of `..len`, padding
    /// included. (A fresh zeroed block per call was a tenth of a QLoRA
    /// step's CPU time in `memset`.)
    pub(crate) fn reused(len: usize) -> Self {
        let data = amx::take_pack_buffer(len);
        Self {
            data,
            pair_major: true,
            reused: true,
        }
    }
}

impl Drop for PackedB {
    fn drop(&mut self) {
        if self.reused {
            amx::keep_pack_buffer(std::mem::take(&mut self.data));
        }
    }
}

/// `c [m, n] = a [m, k] @ b [k, n]` with bf16 operands and f32 sums (as
/// [`gemm_new_bf16`]), an operand packed by the caller: one that is not an
/// f32 matrix (a quantized weight, dequantized while packed) hands its
/// values over in the microkernel's layout, the left operand a task's rows
/// at a time, the right one a block of `k` at a time.
///
/// # Panics
/// When the CPU lacks AVX-512 BF16 ([`super::raw::bf16_tile_available`]),
/// or an operand or a packed panel is out of its slice.
pub(crate) fn gemm_new_bf16_packed(
    dims: (usize, usize, usize),
    a: Packed<'_, '_>,
    b: Packed<'_, '_>,
) -> Vec<f32> {
    with_operands(dims, a, b, |lhs, pack_b| avx512_new_with(dims, lhs, pack_b))
}

/// `run(lhs, pack_b)` with [`gemm_new_bf16_packed`]'s operands resolved:
/// checked, and an f32 matrix given its packer.
pub(super) fn with_operands<R>(
    (m, n, k): (usize, usize, usize),
    a: Packed<'_, '_>,
    b: Packed<'_, '_>,
    run: impl FnOnce(Lhs, &PackB) -> R,
) -> R {
    let lhs;
    let pack_lhs = match a {
        Packed::Lhs(f) => Lhs::Pack(f),
        Packed::LhsPackedRows(f) => Lhs::PackRows(f),
        Packed::LhsRows(rows) => {
            assert!(
                k.is_multiple_of(2) && rows.len() >= m * k / 2,
                "rows in place: {m} x {k} pairs from {}",
                rows.len()
            );
            Lhs::Rows(rows)
        }
        Packed::Matrix(a) => {
            a.check(m, k, "lhs");
            lhs = move |i0, rows, ks| pack_a(&a, i0, rows, ks);
            Lhs::Pack(&lhs)
        }
        Packed::Rhs(_) => panic!("a right operand's packer given for the left"),
    };
    let rhs;
    let pack_rhs: &PackB = match b {
        Packed::Rhs(f) => f,
        Packed::Matrix(b) => {
            b.check(k, n, "rhs");
            rhs = move |ks| PackedB {
                data: pack_b(&b, ks, n),
                pair_major: false,
                reused: false,
            };
            &rhs
        }
        Packed::Lhs(_) | Packed::LhsRows(_) | Packed::LhsPackedRows(_) => {
            panic!("a left operand given for the right")
        }
    };
    run(pack_lhs, pack_rhs)
}

/// An operand of [`gemm_new_bf16_packed`]: an f32 matrix, or its packer.
pub(crate) enum Packed<'a, 'f> {
    /// Packed here from an f32 matrix.
    Matrix(MatRef<'a>),
    /// The left operand's packer.
    Lhs(&'f PackA<'f>),
    /// The left operand's rows as pairs in place (`[m][k / 2]`, `k` even):
    /// a bf16 weight read as it lies, no packing pass (see [`TileA::Rows`]).
    LhsRows(&'a [u32]),
    /// The left operand's packer writing a task's rows row by row
    /// (`[rows rounded up to MR][pairs]`, each row's pairs contiguous, the
    /// rows past the task's zero): for a packer that makes a row at a time
    /// (a quantized weight's codes), with no scatter into panels.
    LhsPackedRows(&'f PackA<'f>),
    /// The right operand's packer.
    Rhs(&'f PackB<'f>),
}

/// Rows of `c` per parallel task for `m` rows: up to `MC`, fewer (down to
/// one panel of `MR`) when there are few rows, so every thread gets some.
pub(super) fn task_rows(m: usize) -> usize {
    let panels = m.div_ceil(MR);
    let per = panels.div_ceil(4 * par::threads()).clamp(1, MC / MR);
    per * MR
}

/// Where [`avx512_new_with`] takes its left operand's tiles from.
#[derive(Clone, Copy)]
pub(super) enum Lhs<'a, 'f> {
    /// Packed a task's rows at a time, into panels.
    Pack(&'f PackA<'f>),
    /// Packed a task's rows at a time, row by row.
    PackRows(&'f PackA<'f>),
    /// Rows of pairs in place, `[m][k / 2]`.
    Rows(&'a [u32]),
}

/// Rows `r0..r0 + rows` (fewer than a tile) of `a` (`[m][ld]` pairs) from
/// pair `p0`, `pairs` of them, as a zero-padded `[pairs][MR]` panel.
fn panel_of_rows(
    a: &[u32],
    ld: usize,
    r0: usize,
    rows: usize,
    (p0, pairs): (usize, usize),
) -> Vec<u32> {
    let mut out = vec![0u32; pairs * MR];
    for r in 0..rows {
        let src = &a[(r0 + r) * ld + p0..][..pairs];
        for (dst, &v) in out[r..].iter_mut().step_by(MR).zip(src) {
            *dst = v;
        }
    }
    out
}

/// [`avx512_new`] with both operands' packers given.
fn avx512_new_with((m, n, k): (usize, usize, usize), lhs: Lhs, pack_b: &PackB) -> Vec<f32> {
    if m == 0 || n == 0 {
        return Vec::new();
    }
    // Zeroed in parallel chunks, not one serial memset.
    let mut c = par::new_vec(m * n, 1 << 14, |_, _| {});
    let mc = task_rows(m);
    for k0 in (0..k).step_by(2 * KC_PAIRS) {
        let kc = (2 * KC_PAIRS).min(k - k0);
        let packed_b = pack_b((k0, kc));
        par::chunks_mut(&mut c, mc * n, |t, c| {
            task_block(lhs, (t * mc, k), (k0, kc), &packed_b, c, n)
        });
    }
    c
}

/// The products of block `k0..k0 + kc` of `k` for the task whose rows of
/// `c` start at `i0`: `c` (`[rows][n]`) overwritten when `k0` is 0, added
/// to after.
pub(super) fn task_block(
    lhs: Lhs,
    (i0, k): (usize, usize),
    (k0, kc): (usize, usize),
    packed_b: &PackedB,
    c: &mut [f32],
    n: usize,
) {
    let (panels, pairs) = (n.div_ceil(NR), kc.div_ceil(2));
    let (bp, pair_major) = (&packed_b.data, packed_b.pair_major);
    assert!(bp.len() >= panels * pairs * NR, "packed rhs is short");
    // Where panel `q` starts and the stride between its pairs.
    let panel = |q: usize| {
        if pair_major {
            (&bp[q * NR..], panels * NR)
        } else {
            (&bp[q * pairs * NR..][..pairs * NR], NR)
        }
    };
    let rows = c.len() / n;
    let tiles = rows.div_ceil(MR);
    let packed = match lhs {
        Lhs::Pack(pack_a) | Lhs::PackRows(pack_a) => pack_a(i0, rows, (k0, kc)),
        Lhs::Rows(a) => {
            // Only a tile short of `MR` rows (the last) is packed.
            let short = rows % MR;
            match short {
                0 => Vec::new(),
                _ => panel_of_rows(a, k / 2, i0 + rows - short, short, (k0 / 2, pairs)),
            }
        }
    };
    let a_tile = |s: usize| match lhs {
        Lhs::Pack(_) => TileA::Panel(&packed[s * pairs * MR..][..pairs * MR]),
        Lhs::PackRows(_) => TileA::Rows(&packed[s * MR * pairs..], pairs),
        Lhs::Rows(a) if (s + 1) * MR <= rows => {
            TileA::Rows(&a[(i0 + s * MR) * (k / 2) + k0 / 2..], k / 2)
        }
        Lhs::Rows(_) => TileA::Panel(&packed),
    };
    if let Lhs::Pack(_) | Lhs::PackRows(_) = lhs {
        assert!(packed.len() >= tiles * pairs * MR, "packed lhs is short");
    }
    for q in 0..panels {
        let j0 = q * NR;
        let bq = panel(q);
        for s in 0..tiles {
            let r0 = s * MR;
            let tile = (MR.min(rows - r0), NR.min(n - j0));
            bf16_tile(pairs, a_tile(s), bq, &mut c[r0 * n + j0..], n, tile, k0 > 0);
        }
    }
}

/// Consecutive values as pairs: `out[p] = pair(v[2p], v[2p + 1])`, zero
/// past the end of an odd `v`.
pub(crate) fn to_pairs(v: &[f32], out: &mut [u32]) {
    let whole = v.chunks_exact(2);
    let odd = whole.remainder().first().copied();
    for (o, two) in out.iter_mut().zip(whole) {
        *o = pair(two[0], two[1]);
    }
    if let Some(x) = odd {
        out[v.len() / 2] = pair(x, 0.0);
    }
}

/// Rows `k0..k0 + kc` of `b` as panels of `NR` columns, each `[pairs][NR]`
/// (zeros past `n` and past an odd `kc`).
fn pack_b(b: &MatRef, (k0, kc): (usize, usize), n: usize) -> Vec<u32> {
    let (panels, pairs) = (n.div_ceil(NR), kc.div_ceil(2));
    let mut out = vec![0u32; panels * pairs * NR];
    par::chunks_mut(&mut out, pairs * NR, |q, panel| {
        let j0 = q * NR;
        let cols = NR.min(n - j0);
        if b.line((k0, j0), kc, false).is_some() {
            // Columns of `b` are contiguous along `k` (a weight `[out, in]`
            // read as its transpose): each column's pairs lie in place.
            // Converted into a contiguous buffer first (a loop that
            // vectorises), then spread into the panel's column.
            let mut col_pairs = vec![0u32; pairs];
            for j in 0..cols {
                let col = b.line((k0, j0 + j), kc, false).expect("same strides");
                to_pairs(col, &mut col_pairs);
                for (dst, &v) in panel[j..].iter_mut().step_by(NR).zip(&col_pairs) {
                    *dst = v;
                }
            }
            return;
        }
        for p in 0..pairs {
            let k = k0 + 2 * p;
            let second = 2 * p + 1 < kc;
            let dst = &mut panel[p * NR..][..cols];
            match (b.line((k, j0), cols, true), second) {
                // Rows of `b` are contiguous: two rows side by side.
                (Some(r0), true) => {
                    let r1 = b.line((k + 1, j0), cols, true).expect("same strides");
                    for ((d, &x), &y) in dst.iter_mut().zip(r0).zip(r1) {
                        *d = pair(x, y);
                    }
                }
                _ => {
                    for (j, d) in dst.iter_mut().enumerate() {
                        let y = if second { b.at(k + 1, j0 + j) } else { 0.0 };
                        *d = pair(b.at(k, j0 + j), y);
                    }
                }
            }
        }
    });
    out
}

/// Rows `i0..i0 + rows` and columns `k0..k0 + kc` of `a` as panels of `MR`
/// rows, each `[pairs][MR]` (zeros past `rows` and past an odd `kc`).
fn pack_a(a: &MatRef, i0: usize, rows: usize, (k0, kc): (usize, usize)) -> Vec<u32> {
    let pairs = kc.div_ceil(2);
    let mut out = vec![0u32; rows.div_ceil(MR) * pairs * MR];
    let mut row_pairs = vec![0u32; pairs];
    for (s, panel) in out.chunks_mut(pairs * MR).enumerate() {
        let r0 = i0 + s * MR;
        let height = MR.min(i0 + rows - r0);
        for r in 0..height {
            match a.line((r0 + r, k0), kc, true) {
                // Rows of `a` are contiguous along `k`: pairs in place.
                Some(row) => {
                    to_pairs(row, &mut row_pairs);
                    for (dst, &v) in panel[r..].iter_mut().step_by(MR).zip(&row_pairs) {
                        *dst = v;
                    }
                }
                None => {
                    for p in 0..pairs {
                        let k = k0 + 2 * p;
                        let y = if 2 * p + 1 < kc {
                            a.at(r0 + r, k + 1)
                        } else {
                            0.0
                        };
                        panel[p * MR + r] = pair(a.at(r0 + r, k), y);
                    }
                }
            }
        }
    }
    out
}

#[cfg(test)]
#[path = "gemm_bf16_tests.rs"]
mod tests;
