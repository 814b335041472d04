//! The one audited module of `unsafe` in accel-nn (this file, `amx/`, the
//! AMX tile kernel's inline assembly, and `quant.rs`, 4-bit codes expanded
//! with AVX-512 permutes).
//!
//! Why it exists: the fused kernels call `gemm` with the strides their data
//! already has (so head splits and weight transposes cost no copies), and
//! `gemm::gemm` takes raw pointers. Everything else (`Vec` allocation
//! without a zero fill, AVX-512/AVX2 dispatch, AMX tiles) is here for the
//! same reason: one place to audit. Every entry point is a safe function that checks the
//! bounds the unsafe code relies on, so a shape bug in a kernel is a panic,
//! never an out-of-bounds access.

pub(crate) mod amx;
pub(crate) mod quant;

/// A read-only strided matrix over a slice: element (i, j) lives at
/// `data[off + i * rs + j * cs]`.
#[derive(Clone, Copy)]
pub(crate) struct MatRef<'a> {
    data: &'a [f32],
    off: usize,
    rs: usize,
    cs: usize,
}

impl<'a> MatRef<'a> {
    /// The row-major matrix starting at `data[off]` with row stride `rs`.
    pub(crate) fn rows(data: &'a [f32], off: usize, rs: usize) -> Self {
        Self {
            data,
            off,
            rs,
            cs: 1,
        }
    }

    /// The transpose of the row-major matrix at `data[off]` with row stride `rs`.
    pub(crate) fn rows_t(data: &'a [f32], off: usize, rs: usize) -> Self {
        Self {
            data,
            off,
            rs: 1,
            cs: rs,
        }
    }

    /// Element `(i, j)` (a panic when out of bounds).
    #[inline(always)]
    pub(crate) fn at(&self, i: usize, j: usize) -> f32 {
        self.data[self.off + i * self.rs + j * self.cs]
    }

    /// `len` elements from `(i, j)` along a row when `along_row`, else
    /// along a column, as a slice when that direction has unit stride.
    pub(crate) fn line(
        &self,
        (i, j): (usize, usize),
        len: usize,
        along_row: bool,
    ) -> Option<&'a [f32]> {
        let unit = if along_row { self.cs } else { self.rs };
        (unit == 1).then(|| &self.data[self.off + i * self.rs + j * self.cs..][..len])
    }

    /// The same matrix as an operand of the AMX kernel (rounded to bf16 as
    /// it is packed).
    pub(crate) fn half(&self) -> amx::HalfRef<'a> {
        amx::HalfRef::new(amx::Values::F32(self.data), self.off, (self.rs, self.cs))
    }

    /// Panics unless every element of a `rows x cols` matrix is in bounds.
    pub(crate) fn check(&self, rows: usize, cols: usize, what: &str) {
        if rows == 0 || cols == 0 {
            return;
        }
        let last = self.off + (rows - 1) * self.rs + (cols - 1) * self.cs;
        assert!(
            last < self.data.len(),
            "gemm: {what} [{rows}, {cols}] (offset {}, strides {}, {}) overruns a slice of {}",
            self.off,
            self.rs,
            self.cs,
            self.data.len()
        );
    }
}

/// `dst[m, n] = [dst +] beta * a[m, k] @ b[k, n]`, with `dst` row-major at
/// `dst[dst_off..]` with row stride `dst_rs`.
///
/// Bounds are checked (a panic names the operand) and `dst_rs >= n` is
/// required so no two output elements share a slot; `&mut` already rules
/// out aliasing with `a` and `b`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemm(
    (m, n, k): (usize, usize, usize),
    dst: &mut [f32],
    dst_off: usize,
    dst_rs: usize,
    accumulate: bool,
    a: MatRef<'_>,
    b: MatRef<'_>,
    beta: f32,
    parallel: bool,
) {
    a.check(m, k, "lhs");
    b.check(k, n, "rhs");
    if m == 0 || n == 0 {
        return;
    }
    assert!(dst_rs >= n, "gemm: dst row stride {dst_rs} < {n} columns");
    let last = dst_off + (m - 1) * dst_rs + n - 1;
    assert!(
        last < dst.len(),
        "gemm: dst [{m}, {n}] overruns {}",
        dst.len()
    );
    // With k == 0 the operands are never read, so their offsets may sit at
    // the end of their slices; point them at the start instead.
    let (a, b) = if k == 0 {
        (MatRef { off: 0, ..a }, MatRef { off: 0, ..b })
    } else {
        (a, b)
    };
    let dst_ptr = SendPtr(dst.as_mut_ptr());
    // SAFETY: the checks above keep every element gemm reads (a: m x k,
    // b: k x n) and writes (dst: m x n, distinct slots since dst_rs >= n)
    // inside its slice; `dst` is a unique borrow, so it aliases neither
    // operand.
    unsafe {
        gemm_split(
            (m, n, k),
            dst_ptr,
            dst_off,
            dst_rs,
            accumulate,
            a,
            b,
            beta,
            parallel,
        )
    }
}

/// A raw pointer that may cross to the pool's threads; each thread writes
/// a disjoint block through it.
struct SendPtr<T>(*mut T);

impl<T> Clone for SendPtr<T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for SendPtr<T> {}

impl<T> SendPtr<T> {
    /// The pointer (a method, so closures capture the `Sync` wrapper).
    fn get(self) -> *mut T {
        self.0
    }
}
// SAFETY: only used to hand disjoint blocks of a buffer to the pool's
// threads while the owner of the buffer waits for them (`par::for_each`
// returns after every thread is done); the blocks move `T`s across threads,
// hence `T: Send`.
unsafe impl<T: Send> Send for SendPtr<T> {}
unsafe impl<T: Send> Sync for SendPtr<T> {}

/// Runs one gemm, split into blocks of output rows (or columns, whichever
/// dimension is longer) over candle's CPU pool when `parallel`.
///
/// Why candle's pool and not gemm's rayon parallelism: candle runs its own
/// element-wise ops (the residual adds, and every gradient accumulation of
/// its backward) on that pool, whose workers spin for a while after each
/// op. A gemm on rayon's threads then shares the cores with a spinning
/// worker; on the pool's own threads it uses them.
///
/// # Safety
/// `a` and `b` must be in bounds for `m x k` and `k x n` (checked by the
/// callers), and `dst` must be valid for writes of the `m x n` block at
/// `dst_off` with row stride `dst_rs >= n`, not aliasing `a` or `b`.
#[allow(clippy::too_many_arguments)]
unsafe fn gemm_split(
    (m, n, k): (usize, usize, usize),
    dst: SendPtr<f32>,
    dst_off: usize,
    dst_rs: usize,
    accumulate: bool,
    a: MatRef<'_>,
    b: MatRef<'_>,
    beta: f32,
    parallel: bool,
) {
    let threads = if parallel && 2 * m * n * k >= PAR_MIN_FLOPS {
        par::threads()
    } else {
        1
    };
    let one = |(i0, i1): (usize, usize), (j0, j1): (usize, usize)| {
        // SAFETY (caller's contract): the block [i0, i1) x [j0, j1) lies
        // inside the checked m x n problem.
        unsafe {
            gemm::gemm(
                i1 - i0,
                j1 - j0,
                k,
                dst.get().add(dst_off + i0 * dst_rs + j0),
                1,
                dst_rs as isize,
                accumulate,
                a.data.as_ptr().add((a.off + i0 * a.rs).min(a.data.len())),
                a.cs as isize,
                a.rs as isize,
                b.data.as_ptr().add((b.off + j0 * b.cs).min(b.data.len())),
                b.cs as isize,
                b.rs as isize,
                1.0,
                beta,
                false,
                false,
                false,
                gemm::Parallelism::None,
            )
        }
    };
    if threads <= 1 {
        one((0, m), (0, n));
        return;
    }
    let split_rows = m >= n;
    let len = if split_rows { m } else { n };
    // One block per thread (each packs its own operands, so more blocks
    // would pack the shared one more often), in multiples of 16 rows or
    // columns: a whole AVX-512 register or two AVX2 ones.
    let block = len.div_ceil(threads).div_ceil(16) * 16;
    par::for_each(len.div_ceil(block), |i| {
        let (lo, hi) = (i * block, ((i + 1) * block).min(len));
        if split_rows {
            one((lo, hi), (0, n))
        } else {
            one((0, m), (lo, hi))
        }
    });
}

/// Asks the CPU to bring the cache line holding `p` into L1 ahead of its
/// use. `p` may point anywhere, past a slice's end included: a prefetch is a
/// hint that reads nothing the program sees and never faults.
#[inline(always)]
pub(crate) fn prefetch(p: *const f32) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `prefetcht0` only hints the cache; it does not dereference
    // `p` in a way that can fault, and SSE is in x86_64's baseline.
    unsafe {
        core::arch::x86_64::_mm_prefetch::<{ core::arch::x86_64::_MM_HINT_T0 }>(p.cast())
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// An empty `Vec` with room for `len` values whose memory the kernel is
/// asked to back with transparent huge pages (`MADV_HUGEPAGE`, Linux), for
/// a kernel's large outputs, which are new memory on every call.
///
/// Why: glibc maps an allocation past its mmap threshold (32 MiB at most)
/// afresh each time, and the first write to each 4 KiB page faults. For the
/// attention op at 8192 tokens that was 110-140 ms a call, a fifth of a
/// sliding-window call; 2 MiB pages fault 512 times less often. Systems
/// whose THP setting is `madvise` (the common default) act on the advice,
/// `always` needs none, `never` ignores it.
pub(crate) fn huge_vec<T>(len: usize) -> Vec<T> {
    let v: Vec<T> = Vec::with_capacity(len);
    #[cfg(target_os = "linux")]
    {
        const HUGE: usize = 2 << 20;
        let start = v.as_ptr() as usize;
        let end = start + v.capacity() * std::mem::size_of::<T>();
        let (lo, hi) = (start.div_ceil(HUGE) * HUGE, end / HUGE * HUGE);
        if hi > lo {
            // SAFETY: `lo..hi` lies inside `v`'s allocation, which nothing
            // has touched or shares yet; MADV_HUGEPAGE changes how the
            // kernel backs the pages, never their contents. A failure (an
            // old kernel, THP off) leaves 4 KiB pages, as without the call.
            unsafe {
                libc::madvise(lo as *mut libc::c_void, hi - lo, libc::MADV_HUGEPAGE);
            }
        }
    }
    v
}

/// `len` zeros in a [`huge_vec`].
pub(crate) fn huge_zeroed(len: usize) -> Vec<f32> {
    let mut v = huge_vec(len);
    v.resize(len, 0.0);
    v
}

/// Rows of the bf16 microkernel's tile.
pub(crate) const BF16_MR: usize = 14;
/// Columns of the bf16 microkernel's tile (two AVX-512 vectors).
pub(crate) const BF16_NR: usize = 32;

/// Whether this CPU runs [`bf16_tile`] (AVX-512 with its BF16 extension:
/// AMD Zen 4 and later, Intel Cooper Lake and Sapphire Rapids and later).
pub(crate) fn bf16_tile_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static AVAILABLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *AVAILABLE.get_or_init(|| {
            std::arch::is_x86_feature_detected!("avx512f")
                && std::arch::is_x86_feature_detected!("avx512bf16")
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// The left operand of a [`bf16_tile`]: each `u32` holds two bf16 values
/// (consecutive `k`, the lower one first).
#[derive(Clone, Copy)]
pub(crate) enum TileA<'a> {
    /// A packed panel, `[pairs][BF16_MR]`.
    Panel(&'a [u32]),
    /// `BF16_MR` rows in place, row `r`'s pair `p` at `[r * ld + p]`: a
    /// bf16 weight `[out, in]` read as it lies, with no packing pass. Every
    /// one of the `BF16_MR` rows is read (rows past the tile's are
    /// computed and dropped), so the slice must hold them all.
    Rows(&'a [u32], usize),
}

/// One tile of a bf16 matrix product with f32 sums:
/// `c[r * ldc + j] (+)= sum_p a(p, r) . b[p][j]` for `r < rows`, `j < cols`,
/// over `pairs` steps `p`, where each `u32` holds two bf16 values
/// (consecutive `k`, the lower one first), `a` as [`TileA`] lays it out and
/// `b`'s `BF16_NR` values of pair `p` at `b[p * ldb..]` (`ldb` = `BF16_NR`
/// for a panel of its own; wider when the panels of one pair lie side by
/// side). `accumulate` adds to what `c` holds, else overwrites it.
///
/// # Panics
/// When the CPU lacks AVX-512 BF16 (see [`bf16_tile_available`]), or a
/// panel or the tile of `c` is out of its slice.
#[allow(clippy::too_many_arguments)]
pub(crate) fn bf16_tile(
    pairs: usize,
    a: TileA,
    (b, ldb): (&[u32], usize),
    c: &mut [f32],
    ldc: usize,
    (rows, cols): (usize, usize),
    accumulate: bool,
) {
    assert!(
        bf16_tile_available(),
        "bf16_tile: this CPU lacks AVX-512 BF16"
    );
    assert!(
        rows <= BF16_MR && cols <= BF16_NR && cols <= ldc,
        "bf16_tile: a {rows} x {cols} tile (at most {BF16_MR} x {BF16_NR}) with row stride {ldc}"
    );
    let a_fits = match a {
        TileA::Panel(a) => a.len() >= pairs * BF16_MR,
        TileA::Rows(a, ld) => pairs == 0 || (ld >= pairs && a.len() >= (BF16_MR - 1) * ld + pairs),
    };
    assert!(
        ldb >= BF16_NR && a_fits && (pairs == 0 || b.len() >= (pairs - 1) * ldb + BF16_NR),
        "bf16_tile: short panel"
    );
    if rows == 0 || cols == 0 {
        return;
    }
    assert!(
        (rows - 1) * ldc + cols <= c.len(),
        "bf16_tile: a {rows} x {cols} tile with row stride {ldc} overruns {}",
        c.len()
    );
    #[cfg(target_arch = "x86_64")]
    // SAFETY: the CPU has AVX-512F and AVX512-BF16 (asserted above); the
    // kernel reads `a(p, r)` for `p < pairs`, `r < BF16_MR` (at `p * BF16_MR
    // + r` of a panel, `r * ld + p` of rows: both checked), `BF16_NR` u32 of
    // `b` at `p * ldb` for `p < pairs` (checked) and touches `c[r * ldc + j]`
    // for `r < rows`, `j < cols` only (masked loads and stores; checked above).
    unsafe {
        let b = (b.as_ptr(), ldb);
        let c_tile = (c.as_mut_ptr(), ldc);
        match a {
            TileA::Panel(a) => {
                bf16_tile_avx512_panel(pairs, a.as_ptr(), b, c_tile, (rows, cols), accumulate)
            }
            TileA::Rows(a, ld) => {
                bf16_tile_avx512_rows(pairs, (a.as_ptr(), ld), b, c_tile, (rows, cols), accumulate)
            }
        }
    }
}

/// [`bf16_tile_avx512`] on a packed panel (strides known here, so the
/// addresses are immediates).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn bf16_tile_avx512_panel(
    pairs: usize,
    a: *const u32,
    b: (*const u32, usize),
    c: (*mut f32, usize),
    tile: (usize, usize),
    accumulate: bool,
) {
    bf16_tile_avx512(pairs, (a, BF16_MR, 1), b, c, tile, accumulate)
}

/// [`bf16_tile_avx512`] on rows in place.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn bf16_tile_avx512_rows(
    pairs: usize,
    (a, ld): (*const u32, usize),
    b: (*const u32, usize),
    c: (*mut f32, usize),
    tile: (usize, usize),
    accumulate: bool,
) {
    bf16_tile_avx512(pairs, (a, 1, ld), b, c, tile, accumulate)
}

/// The tile's body: `a(p, r)` at `a[p * step + r * row]`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
#[inline]
unsafe fn bf16_tile_avx512(
    pairs: usize,
    (a, step, row): (*const u32, usize, usize),
    (b, ldb): (*const u32, usize),
    (c, ldc): (*mut f32, usize),
    (rows, cols): (usize, usize),
    accumulate: bool,
) {
    use core::arch::x86_64::*;
    let lo = if cols >= 16 {
        0xffff
    } else {
        (1u32 << cols) - 1
    } as __mmask16;
    let hi = if cols >= 32 {
        0xffff
    } else if cols > 16 {
        (1u32 << (cols - 16)) - 1
    } else {
        0
    } as __mmask16;
    let mut acc = [[_mm512_setzero_ps(); 2]; BF16_MR];
    if accumulate {
        for (r, acc) in acc.iter_mut().enumerate().take(rows) {
            let row = c.add(r * ldc);
            acc[0] = _mm512_maskz_loadu_ps(lo, row);
            acc[1] = _mm512_maskz_loadu_ps(hi, row.add(16));
        }
    }
    for p in 0..pairs {
        let b0: __m512bh = core::mem::transmute(_mm512_loadu_si512(b.add(p * ldb).cast()));
        let b1: __m512bh = core::mem::transmute(_mm512_loadu_si512(b.add(p * ldb + 16).cast()));
        let ap = a.add(p * step);
        for (r, acc) in acc.iter_mut().enumerate() {
            let x: __m512bh = core::mem::transmute(_mm512_set1_epi32(*ap.add(r * row) as i32));
            acc[0] = _mm512_dpbf16_ps(acc[0], x, b0);
            acc[1] = _mm512_dpbf16_ps(acc[1], x, b1);
        }
    }
    for (r, acc) in acc.iter().enumerate().take(rows) {
        let row = c.add(r * ldc);
        _mm512_mask_storeu_ps(row, lo, acc[0]);
        _mm512_mask_storeu_ps(row.add(16), hi, acc[1]);
    }
}

/// `dst[r] = lo[r] | hi[r] << 16` for `r < lo.len()` (`hi` zero where
/// absent), zero for the rest of `dst`: two rows of a bf16 matrix as the
/// pairs [`bf16_tile`] reads, one panel row at a time (at most 16 values).
///
/// # Panics
/// When `lo` is longer than 16 or than `dst`, or `hi` is shorter than `lo`.
pub(crate) fn pair_rows(lo: &[u16], hi: Option<&[u16]>, dst: &mut [u32]) {
    let live = lo.len();
    assert!(
        live <= 16 && live <= dst.len() && hi.is_none_or(|h| h.len() >= live),
        "pair_rows: {live} values into {}",
        dst.len()
    );
    #[cfg(target_arch = "x86_64")]
    if dst.len() <= 16 && avx512_bw_vl() {
        // SAFETY: the CPU has AVX-512 F, BW and VL (checked); the masked
        // loads read `live` values of `lo` and `hi` (both at least that
        // long, asserted) and the masked store writes `dst.len()` (<= 16).
        unsafe { pair_rows_avx512(lo.as_ptr(), hi.map(<[u16]>::as_ptr), live, dst) };
        return;
    }
    for (r, d) in dst.iter_mut().enumerate() {
        *d = match (lo.get(r), hi) {
            (Some(&l), Some(h)) => u32::from(l) | (u32::from(h[r]) << 16),
            (Some(&l), None) => u32::from(l),
            (None, _) => 0,
        };
    }
}

#[cfg(target_arch = "x86_64")]
fn avx512_bw_vl() -> bool {
    static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *HAS.get_or_init(|| {
        std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bw")
            && std::arch::is_x86_feature_detected!("avx512vl")
    })
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn pair_rows_avx512(lo: *const u16, hi: Option<*const u16>, live: usize, dst: &mut [u32]) {
    use core::arch::x86_64::*;
    let mask = ((1u32 << live) - 1) as __mmask16;
    let lo = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, lo.cast()));
    let pairs = match hi {
        Some(hi) => {
            let hi = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, hi.cast()));
            _mm512_or_si512(lo, _mm512_slli_epi32::<16>(hi))
        }
        None => lo,
    };
    let all = ((1u32 << dst.len()) - 1) as __mmask16;
    _mm512_mask_storeu_epi32(dst.as_mut_ptr().cast(), all, pairs);
}

/// Below this many flops a gemm runs on the calling thread.
const PAR_MIN_FLOPS: usize = 1 << 20;

/// Data parallelism for the kernels, on candle's CPU thread pool: the
/// sections themselves are [`accel_kernels::par`]'s (one pool and one
/// nesting rule with the optimizer kernels); the parts here hand disjoint
/// chunks of a buffer to them, which takes `unsafe`.
pub(crate) mod par {
    #[cfg(test)]
    pub(crate) use accel_kernels::par::with_threads;
    pub(crate) use accel_kernels::par::{for_each, threads};

    use super::SendPtr;

    /// `f(i, chunk)` for the `i`-th `size`-element chunk of `data` (the
    /// last may be shorter), in parallel.
    pub(crate) fn chunks_mut<T: Send>(
        data: &mut [T],
        size: usize,
        f: impl Fn(usize, &mut [T]) + Sync,
    ) {
        let (len, size) = (data.len(), size.max(1));
        let ptr = SendPtr(data.as_mut_ptr());
        for_each(len.div_ceil(size), |i| {
            let lo = i * size;
            let n = size.min(len - lo);
            // SAFETY: chunk `i` is `data[lo..lo + n]`, inside `data`
            // (lo < len since i < len / size rounded up), and chunks of
            // different `i` are disjoint; `data` is borrowed mutably for
            // the whole call, which returns after every `f` has.
            let chunk = unsafe { std::slice::from_raw_parts_mut(ptr.get().add(lo), n) };
            f(i, chunk)
        });
    }

    /// Like [`chunks_mut`] over two buffers split into the same number of
    /// chunks: `f(i, a_i, b_i)`.
    pub(crate) fn chunks_mut2<T: Send, U: Send>(
        a: &mut [T],
        a_size: usize,
        b: &mut [U],
        b_size: usize,
        f: impl Fn(usize, &mut [T], &mut [U]) + Sync,
    ) {
        let (a_len, b_len) = (a.len(), b.len());
        let (a_size, b_size) = (a_size.max(1), b_size.max(1));
        let n = a_len.div_ceil(a_size).min(b_len.div_ceil(b_size));
        let (pa, pb) = (SendPtr(a.as_mut_ptr()), SendPtr(b.as_mut_ptr()));
        for_each(n, |i| {
            let (la, lb) = (i * a_size, i * b_size);
            // SAFETY: as in `chunks_mut`, for each buffer separately (i < n
            // keeps both starts inside their buffers).
            let (ca, cb) = unsafe {
                (
                    std::slice::from_raw_parts_mut(pa.get().add(la), a_size.min(a_len - la)),
                    std::slice::from_raw_parts_mut(pb.get().add(lb), b_size.min(b_len - lb)),
                )
            };
            f(i, ca, cb)
        });
    }

    /// Like [`chunks_mut2`] over three buffers.
    pub(crate) fn chunks_mut3<T: Send>(
        (a, a_size): (&mut [T], usize),
        (b, b_size): (&mut [T], usize),
        (c, c_size): (&mut [T], usize),
        f: impl Fn(usize, &mut [T], &mut [T], &mut [T]) + Sync,
    ) {
        let c_len = c.len();
        let c_size = c_size.max(1);
        let pc = SendPtr(c.as_mut_ptr());
        let n = c_len.div_ceil(c_size);
        chunks_mut2(a, a_size, b, b_size, |i, ca, cb| {
            if i < n {
                let lc = i * c_size;
                // SAFETY: as in `chunks_mut` (i < n keeps the start inside).
                let cc = unsafe {
                    std::slice::from_raw_parts_mut(pc.get().add(lc), c_size.min(c_len - lc))
                };
                f(i, ca, cb, cc)
            }
        });
    }

    /// A new buffer of `len` values built in parallel: `f(i, chunk)` fills
    /// the `i`-th `size`-element chunk, which starts zeroed (`T::default()`).
    ///
    /// Why not `vec![0.0; len]` (or a `to_vec` copy) and [`chunks_mut`]:
    /// that zero fill is one serial `memset` on the calling thread while
    /// the pool's other threads wait. Here each task zeroes its own chunk
    /// just before writing it, in cache. Serial memsets and copies were
    /// ~12% of the GPT training step's wall time (most of the rest is
    /// candle's backward zero-filling every gradient); steps alternating
    /// with the old path in one process ran 2.5-3.5% faster with this.
    pub(crate) fn new_vec<T: Copy + Default + Send>(
        len: usize,
        size: usize,
        f: impl Fn(usize, &mut [T]) + Sync,
    ) -> Vec<T> {
        let mut v: Vec<T> = Vec::with_capacity(len);
        chunks_mut(&mut v.spare_capacity_mut()[..len], size, |i, chunk| {
            chunk.fill(std::mem::MaybeUninit::new(T::default()));
            // SAFETY: every element of `chunk` was initialised just above,
            // and `MaybeUninit<T>` has the layout of `T`.
            let chunk = unsafe { &mut *(chunk as *mut [std::mem::MaybeUninit<T>] as *mut [T]) };
            f(i, chunk)
        });
        // SAFETY: the chunks cover `0..len` (capacity >= len) and each
        // element was initialised by its task; a panic in `f` propagates out
        // of `chunks_mut` before this line, dropping `v` at length 0.
        unsafe { v.set_len(len) };
        v
    }

    /// `f` of every value of `src`, in a new buffer built in parallel
    /// chunks of `size`, each output written once (no zero fill first), with
    /// the loop compiled for AVX-512 where the CPU has it. Baseline x86-64
    /// code narrows f32 to bf16 at 0.38 ns a value (SSE2, 4 lanes); the
    /// AVX-512 loop takes 0.18 (both on 512 Ki values on this machine), and
    /// these conversions around the fused kernels were ~8% of a bf16 LoRA
    /// step's CPU time.
    pub(crate) fn map_values<S: Copy + Sync, T: Copy + Send>(
        src: &[S],
        size: usize,
        f: impl Fn(S) -> T + Sync,
    ) -> Vec<T> {
        let len = src.len();
        let mut v: Vec<T> = Vec::with_capacity(len);
        let size = size.max(1);
        chunks_mut(&mut v.spare_capacity_mut()[..len], size, |i, out| {
            map_into(&src[i * size..], out, &f)
        });
        // SAFETY: the chunks cover `0..len` (capacity >= len) and
        // `map_into` wrote every element of each; a panic in `f` propagates
        // out of `chunks_mut` before this line, dropping `v` at length 0.
        unsafe { v.set_len(len) };
        v
    }

    /// `out[i] = f(src[i])` for every `i < out.len()`.
    fn map_into<S: Copy, T>(src: &[S], out: &mut [std::mem::MaybeUninit<T>], f: &impl Fn(S) -> T) {
        #[inline(always)]
        fn imp<S: Copy, T>(src: &[S], out: &mut [std::mem::MaybeUninit<T>], f: &impl Fn(S) -> T) {
            assert!(src.len() >= out.len(), "map_values: short source");
            for (o, &x) in out.iter_mut().zip(src) {
                o.write(f(x));
            }
        }
        #[cfg(target_arch = "x86_64")]
        {
            #[target_feature(enable = "avx512f,avx512bw")]
            unsafe fn avx512<S: Copy, T>(
                src: &[S],
                out: &mut [std::mem::MaybeUninit<T>],
                f: &impl Fn(S) -> T,
            ) {
                imp(src, out, f)
            }
            static AVX512: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
            let wide = *AVX512.get_or_init(|| {
                std::arch::is_x86_feature_detected!("avx512f")
                    && std::arch::is_x86_feature_detected!("avx512bw")
            });
            if wide {
                // SAFETY: the CPU supports the enabled features.
                return unsafe { avx512(src, out, f) };
            }
        }
        imp(src, out, f)
    }

    /// `f(i, band)` for the `i`-th band of `width` columns (the last may
    /// be narrower) of the row-major `[_, cols]` buffer `data`, in
    /// parallel: a band hands out its part of each row, so tasks write
    /// disjoint columns of every row (a product's output written transposed
    /// from the tasks' tiles, with no transpose pass after it).
    pub(crate) fn column_bands<T: Send>(
        data: &mut [T],
        cols: usize,
        width: usize,
        f: impl Fn(usize, &mut Columns<'_, T>) + Sync,
    ) {
        if cols == 0 || data.is_empty() {
            return;
        }
        assert!(data.len().is_multiple_of(cols), "column_bands: ragged rows");
        let (rows, width) = (data.len() / cols, width.max(1));
        let ptr = SendPtr(data.as_mut_ptr());
        for_each(cols.div_ceil(width), |i| {
            let c0 = i * width;
            let mut band = Columns {
                ptr,
                rows,
                cols,
                c0,
                width: width.min(cols - c0),
                _data: std::marker::PhantomData,
            };
            f(i, &mut band)
        });
    }

    /// One band of [`column_bands`]: columns `c0..c0 + width` of every row.
    pub(crate) struct Columns<'a, T> {
        ptr: SendPtr<T>,
        rows: usize,
        cols: usize,
        c0: usize,
        width: usize,
        _data: std::marker::PhantomData<&'a mut [T]>,
    }

    impl<T> Columns<'_, T> {
        /// Columns in the band.
        pub(crate) fn width(&self) -> usize {
            self.width
        }

        /// The band's part of row `r`.
        ///
        /// # Panics
        /// When `r` is not a row of the buffer.
        pub(crate) fn row(&mut self, r: usize) -> &mut [T] {
            assert!(r < self.rows, "column band: row {r} of {}", self.rows);
            // SAFETY: `r * cols + c0 + width <= rows * cols = data.len()`
            // (c0 + width <= cols); bands cover disjoint columns, so parts
            // of different bands never overlap, and `&mut self` keeps one
            // part of this band alive at a time; `data` is borrowed
            // mutably until `column_bands` returns, after every task.
            unsafe {
                std::slice::from_raw_parts_mut(
                    self.ptr.get().add(r * self.cols + self.c0),
                    self.width,
                )
            }
        }
    }

    /// `f(i)` for every `i < n` in parallel, collected in order.
    pub(crate) fn map<R: Send>(n: usize, f: impl Fn(usize) -> R + Sync) -> Vec<R> {
        let mut out: Vec<Option<R>> = (0..n).map(|_| None).collect();
        chunks_mut(&mut out, 1, |i, slot| slot[0] = Some(f(i)));
        out.into_iter()
            .map(|r| r.expect("every item ran"))
            .collect()
    }
}

/// A new `m x n` row-major buffer holding `a @ b`.
///
/// gemm overwrites every element when it does not read `dst`, so the
/// buffer is never zero-filled first (that memset showed up at ~3% of a
/// training step).
pub(crate) fn gemm_new(
    (m, n, k): (usize, usize, usize),
    a: MatRef<'_>,
    b: MatRef<'_>,
    parallel: bool,
) -> Vec<f32> {
    if m == 0 || n == 0 {
        return Vec::new();
    }
    a.check(m, k, "lhs");
    b.check(k, n, "rhs");
    let mut out: Vec<f32> = Vec::with_capacity(m * n);
    let (a, b) = if k == 0 {
        (MatRef { off: 0, ..a }, MatRef { off: 0, ..b })
    } else {
        (a, b)
    };
    // SAFETY: operands checked in bounds above; `out` has capacity m * n,
    // which is exactly the m x n row-major block gemm writes (dst_rs = n).
    // gemm writes every element when read_dst is false (zeros when k == 0),
    // so all m * n elements are initialised before `set_len`.
    unsafe {
        gemm_split(
            (m, n, k),
            SendPtr(out.as_mut_ptr()),
            0,
            n,
            false,
            a,
            b,
            1.0,
            parallel,
        );
        out.set_len(m * n);
    }
    out
}

/// Defines `pub(super) fn $name($args) -> $ret` that runs `$body`
/// compiled for AVX-512, AVX2 or baseline, whichever the CPU supports.
///
/// Why: the kernels' inner loops are plain Rust over slices, and only a
/// `#[target_feature]` function lets LLVM vectorise them with the wide
/// registers while the binary still runs on older CPUs. The expansion
/// carries `#[allow(unsafe_code)]`: calling a `target_feature` function is
/// unsafe, and is sound here because it happens only after the matching
/// runtime detection.
macro_rules! multiversion {
    ($(#[$doc:meta])* fn $name:ident($($arg:ident: $ty:ty),*) $(-> $ret:ty)? $body:block) => {
        $(#[$doc])*
        #[allow(unsafe_code)]
        pub(super) fn $name($($arg: $ty),*) $(-> $ret)? {
            #[inline(always)]
            fn imp($($arg: $ty),*) $(-> $ret)? $body
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f")]
                unsafe fn avx512($($arg: $ty),*) $(-> $ret)? { imp($($arg),*) }
                #[target_feature(enable = "avx2,fma")]
                unsafe fn avx2($($arg: $ty),*) $(-> $ret)? { imp($($arg),*) }
                if std::arch::is_x86_feature_detected!("avx512f") {
                    // SAFETY: the CPU supports the enabled features.
                    return unsafe { avx512($($arg),*) };
                }
                if std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
                {
                    // SAFETY: as above.
                    return unsafe { avx2($($arg),*) };
                }
            }
            imp($($arg),*)
        }
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gemm_reads_strided_operands_and_writes_a_strided_destination() {
        // a = [[1, 2], [3, 4]], b^T stored row-major as [[5, 6], [7, 8]].
        let a = [1.0, 2.0, 3.0, 4.0];
        let bt = [5.0, 6.0, 7.0, 8.0];
        let mut dst = vec![0.0; 6];
        gemm(
            (2, 2, 2),
            &mut dst,
            1,
            3,
            false,
            MatRef::rows(&a, 0, 2),
            MatRef::rows_t(&bt, 0, 2),
            1.0,
            false,
        );
        assert_eq!(dst, vec![0.0, 17.0, 23.0, 0.0, 39.0, 53.0]);
        let new = gemm_new(
            (2, 2, 2),
            MatRef::rows(&a, 0, 2),
            MatRef::rows(&bt, 0, 2),
            true,
        );
        assert_eq!(new, vec![19.0, 22.0, 43.0, 50.0]);
        assert_eq!(
            gemm_new(
                (2, 3, 0),
                MatRef::rows(&[], 0, 0),
                MatRef::rows(&[], 0, 3),
                false
            ),
            vec![0.0; 6]
        );
    }

    #[test]
    fn par_new_vec_fills_every_chunk_from_zero_and_keeps_the_order() {
        for (len, size) in [(0, 4), (1, 4), (10, 4), (12, 4), (100_003, 16 * 1024)] {
            let v = par::new_vec(len, size, |i, c| {
                assert!(
                    c.iter().all(|&x| x == 0.0),
                    "chunk {i} did not start zeroed"
                );
                for (j, x) in c.iter_mut().enumerate() {
                    *x = (i * size + j) as f32;
                }
            });
            assert_eq!(v.len(), len);
            assert!(v.iter().enumerate().all(|(k, &x)| x == k as f32));
        }
        // Nested sections run inline instead of deadlocking on candle's pool.
        let outer = par::new_vec(8, 1, |i, c| {
            c[0] = par::new_vec(64, 8, |_, c| c.fill(1.0)).iter().sum::<f32>() + i as f32;
        });
        assert_eq!(outer, (0..8).map(|i| 64.0 + i as f32).collect::<Vec<_>>());
    }

    #[test]
    #[should_panic(expected = "overruns")]
    fn gemm_refuses_an_operand_shorter_than_its_shape() {
        let a = [1.0; 3];
        let mut dst = vec![0.0; 4];
        gemm(
            (2, 2, 2),
            &mut dst,
            0,
            2,
            false,
            MatRef::rows(&a, 0, 2),
            MatRef::rows(&a, 0, 2),
            1.0,
            false,
        );
    }
}
