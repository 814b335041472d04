//! The tile kernel: the tile configuration, one 32 x 32 block of the
//! product over a run of `k`, and the block's way into the output.

use super::{OutLayout, SendPtr, BLOCK, PANEL_ROW_BYTES};

/// One call's output and shape, shared by its tasks.
pub(super) struct Job {
    /// (m, n, k rounded up to a tile step)
    pub(super) dims: (usize, usize, usize),
    pub(super) c: SendPtr<f32>,
    pub(super) out: OutLayout,
    pub(super) accumulate: bool,
}

impl Job {
    /// Block (ib, q) of the output from 32 rows of `a` and panel `q` of `b`,
    /// over `steps` steps of 32 along `k`, added to the output when
    /// `accumulate`.
    ///
    /// # Safety
    /// The tile configuration is loaded on this thread ([`with_tiles`]);
    /// `a` points at 32 rows of `32 * steps` bf16 with row stride `lda`
    /// bytes and `b` at `steps` packed steps of a panel (`b.1` bytes
    /// apart), both readable; the
    /// output was checked to hold the `m x n` product in distinct slots,
    /// and no other thread writes block (ib, q).
    pub(super) unsafe fn block(
        &self,
        (ib, q): (usize, usize),
        (a, lda): (*const u8, usize),
        b: (*const u8, usize),
        (steps, accumulate): (usize, bool),
    ) {
        let (m, n, _) = self.dims;
        let (i0, j0) = (ib * BLOCK, q * BLOCK);
        let (rows, cols) = (BLOCK.min(m - i0), BLOCK.min(n - j0));
        let OutLayout { off, rs, cs } = self.out;
        let c = self.c.get();
        if rows == BLOCK && cols == BLOCK && cs == 1 {
            let dst = c.add(off + i0 * rs + j0).cast::<u8>();
            tile_block(steps, (a, lda), b, (dst, 4 * rs), accumulate);
            return;
        }
        // An edge block, or one of a column-major output, goes through a
        // whole tile in `t`; when adding, it starts from the output's values
        // (not zeros added after), so the sums run in the same order as for
        // a whole block.
        // Not zeroed (4 KB a block, every block of a column-major output):
        // `tile_block` stores all of it, or, when adding, loads it after
        // the output's values were copied into the part that is read back.
        let mut t = std::mem::MaybeUninit::<[f32; BLOCK * BLOCK]>::uninit();
        let tp = t.as_mut_ptr().cast::<f32>();
        let corner = c.add(off + i0 * rs + j0 * cs);
        if cs != 1 {
            // Column-major (`y^T = w x^T` written as `y`): 16 x 16 AVX-512
            // transposes; element by element this was a sixth of the
            // forward's products.
            if accumulate {
                for_quarters((rows, cols), |(r0, j0), (h, w)| {
                    transpose16(
                        corner.add(r0 + j0 * cs),
                        cs,
                        tp.add(r0 * BLOCK + j0),
                        BLOCK,
                        (w, h),
                    )
                });
            }
            tile_block(steps, (a, lda), b, (tp.cast(), 4 * BLOCK), accumulate);
            for_quarters((rows, cols), |(r0, j0), (h, w)| {
                transpose16(
                    tp.add(r0 * BLOCK + j0),
                    BLOCK,
                    corner.add(r0 + j0 * cs),
                    cs,
                    (h, w),
                )
            });
            return;
        }
        let slot = |r: usize, j: usize| corner.add(r * rs + j);
        if accumulate {
            for r in 0..rows {
                for j in 0..cols {
                    *tp.add(r * BLOCK + j) = *slot(r, j);
                }
            }
        }
        tile_block(steps, (a, lda), b, (tp.cast(), 4 * BLOCK), accumulate);
        for r in 0..rows {
            for j in 0..cols {
                *slot(r, j) = *tp.add(r * BLOCK + j);
            }
        }
    }
}

/// `f((r0, j0), (rows, cols))` for the four 16 x 16 quarters of a 32 x 32
/// block that hold some of its first `rows x cols` elements.
fn for_quarters((rows, cols): (usize, usize), mut f: impl FnMut((usize, usize), (usize, usize))) {
    for r0 in (0..rows).step_by(16) {
        for j0 in (0..cols).step_by(16) {
            f((r0, j0), (16.min(rows - r0), 16.min(cols - j0)))
        }
    }
}

/// Writes the transpose of the `rows x cols` matrix at `src` (row stride
/// `ss` floats) to `dst` (row stride `ds`): `dst[j][i] = src[i][j]`, for
/// `rows, cols <= 16`.
///
/// # Safety
/// `src` readable and `dst` writable at those elements; AVX-512F present
/// (every CPU with AMX has it).
unsafe fn transpose16(
    src: *const f32,
    ss: usize,
    dst: *mut f32,
    ds: usize,
    (rows, cols): (usize, usize),
) {
    #[cfg(target_arch = "x86_64")]
    transpose16_avx512(src, ss, dst, ds, (rows, cols));
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn transpose16_avx512(
    src: *const f32,
    ss: usize,
    dst: *mut f32,
    ds: usize,
    (rows, cols): (usize, usize),
) {
    use core::arch::x86_64::*;
    let lanes = |n: usize| {
        if n >= 16 {
            0xffff
        } else {
            (1u32 << n) as u16 - 1
        }
    };
    let (load, store) = (lanes(cols), lanes(rows));
    let mut r = [_mm512_setzero_ps(); 16];
    for (i, v) in r.iter_mut().enumerate().take(rows) {
        *v = _mm512_maskz_loadu_ps(load, src.add(i * ss));
    }
    // Pairs of rows interleaved (32-bit), then pairs of pairs (64-bit):
    // each 128-bit lane of b[4g + c] then holds column `4 lane + c` of rows
    // 4g..4g + 4.
    let mut a = [_mm512_setzero_ps(); 16];
    for i in 0..8 {
        a[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        a[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    let mut b = [_mm512_setzero_pd(); 16];
    for g in 0..4 {
        let pd = |v: __m512| _mm512_castps_pd(v);
        let (x0, x1, y0, y1) = (
            pd(a[4 * g]),
            pd(a[4 * g + 1]),
            pd(a[4 * g + 2]),
            pd(a[4 * g + 3]),
        );
        b[4 * g] = _mm512_unpacklo_pd(x0, y0);
        b[4 * g + 1] = _mm512_unpackhi_pd(x0, y0);
        b[4 * g + 2] = _mm512_unpacklo_pd(x1, y1);
        b[4 * g + 3] = _mm512_unpackhi_pd(x1, y1);
    }
    // Lanes gathered across the four groups: output row `4 lane + c`.
    for c in 0..4 {
        let ps = |v: __m512d| _mm512_castpd_ps(v);
        let (b0, b1, b2, b3) = (ps(b[c]), ps(b[4 + c]), ps(b[8 + c]), ps(b[12 + c]));
        let e0 = _mm512_shuffle_f32x4::<0x44>(b0, b1);
        let e1 = _mm512_shuffle_f32x4::<0xee>(b0, b1);
        let f0 = _mm512_shuffle_f32x4::<0x44>(b2, b3);
        let f1 = _mm512_shuffle_f32x4::<0xee>(b2, b3);
        let out = [
            _mm512_shuffle_f32x4::<0x88>(e0, f0),
            _mm512_shuffle_f32x4::<0xdd>(e0, f0),
            _mm512_shuffle_f32x4::<0x88>(e1, f1),
            _mm512_shuffle_f32x4::<0xdd>(e1, f1),
        ];
        for (lane, v) in out.into_iter().enumerate() {
            let j = 4 * lane + c;
            if j < cols {
                _mm512_mask_storeu_ps(dst.add(j * ds), store, v);
            }
        }
    }
}

/// How many steps of `k` ahead [`tile_block`] fetches its operands.
const PREFETCH_STEPS: usize = 2;

/// Hints the cache line at `p` into L1: a hint, never a read the program
/// sees, and never a fault, whatever the address.
#[inline(always)]
fn prefetch_l1(p: *const u8) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `prefetcht0` dereferences nothing and cannot fault.
    unsafe {
        core::arch::x86_64::_mm_prefetch::<{ core::arch::x86_64::_MM_HINT_T0 }>(p.cast())
    }
}

/// The tile configuration: palette 1, eight tiles of 16 rows x 64 bytes.
#[repr(C, align(64))]
struct TileConfig([u8; 64]);

static TILE_CONFIG: TileConfig = {
    let mut cfg = [0u8; 64];
    cfg[0] = 1;
    let mut t = 0;
    while t < 8 {
        cfg[16 + 2 * t] = 64; // bytes per row (little-endian u16)
        cfg[48 + t] = 16; // rows
        t += 1;
    }
    TileConfig(cfg)
};

/// Runs `f` with the tile configuration loaded on this thread, and releases
/// the tile state after (so the OS does not save it on every switch).
pub(super) fn with_tiles<R>(f: impl FnOnce() -> R) -> R {
    // SAFETY: `available()` was asserted by the caller (`gemm`); the
    // configuration is a valid palette-1 layout, 64-byte aligned.
    unsafe { std::arch::asm!("ldtilecfg [{}]", in(reg) TILE_CONFIG.0.as_ptr(), options(nostack)) };
    let r = f();
    // SAFETY: as above; releasing leaves the tiles in their init state.
    unsafe { std::arch::asm!("tilerelease", options(nostack, nomem)) };
    r
}

/// `c[32 x 32] (+)= a[32 x 32 chunks] . b` over `chunks` steps of 32 along
/// `k`: `a` rows of `64 * chunks` bytes at stride `lda`, `b` a packed panel
/// (16 rows of 128 bytes per step, steps `b_step` bytes apart), `c` 32 rows
/// of 128 bytes at `ldc`.
///
/// # Safety
/// The tile configuration is loaded ([`with_tiles`]); the three regions
/// are valid for the reads (and writes to `c`) described above.
#[inline(always)]
pub(super) unsafe fn tile_block(
    chunks: usize,
    (a, lda): (*const u8, usize),
    (b, b_step): (*const u8, usize),
    (c, ldc): (*mut u8, usize),
    load_c: bool,
) {
    use std::arch::asm;
    let a1 = a.add(16 * lda);
    let c1 = c.add(16 * ldc);
    if load_c {
        asm!(
            "tileloadd tmm0, [{c} + {s}*1]",
            "tileloadd tmm1, [{c} + {s}*1 + 64]",
            "tileloadd tmm2, [{c1} + {s}*1]",
            "tileloadd tmm3, [{c1} + {s}*1 + 64]",
            c = in(reg) c, c1 = in(reg) c1, s = in(reg) ldc,
            options(nostack, readonly),
        );
    } else {
        asm!(
            "tilezero tmm0",
            "tilezero tmm1",
            "tilezero tmm2",
            "tilezero tmm3",
            options(nostack, nomem)
        );
    }
    for i in 0..chunks {
        // The rows of the tiles two steps on, into L1. Tile registers are
        // not renamed, so a load waits for the last instruction reading its
        // tile, and loads from L2 then stall the products: 690 against 980
        // GFLOP/s on one core with the operands in L2. (Past the end of the
        // operands these hint at addresses never read: harmless.)
        let ahead = i + PREFETCH_STEPS;
        for r in 0..16 {
            prefetch_l1(a.wrapping_add(64 * ahead + r * lda));
            prefetch_l1(a1.wrapping_add(64 * ahead + r * lda));
            let row = b.wrapping_add(b_step * ahead + r * PANEL_ROW_BYTES);
            prefetch_l1(row);
            prefetch_l1(row.wrapping_add(64));
        }
        asm!(
            "tileloadd tmm4, [{a0} + {sa}*1]",
            "tileloadd tmm6, [{b} + {sb}*1]",
            "tileloadd tmm7, [{b} + {sb}*1 + 64]",
            "tdpbf16ps tmm0, tmm4, tmm6",
            "tileloadd tmm5, [{a1} + {sa}*1]",
            "tdpbf16ps tmm1, tmm4, tmm7",
            "tdpbf16ps tmm2, tmm5, tmm6",
            "tdpbf16ps tmm3, tmm5, tmm7",
            a0 = in(reg) a.add(64 * i),
            a1 = in(reg) a1.add(64 * i),
            b = in(reg) b.add(b_step * i),
            sa = in(reg) lda,
            sb = in(reg) PANEL_ROW_BYTES,
            options(nostack, readonly),
        );
    }
    asm!(
        "tilestored [{c} + {s}*1], tmm0",
        "tilestored [{c} + {s}*1 + 64], tmm1",
        "tilestored [{c1} + {s}*1], tmm2",
        "tilestored [{c1} + {s}*1 + 64], tmm3",
        c = in(reg) c, c1 = in(reg) c1, s = in(reg) ldc,
        options(nostack),
    );
}
