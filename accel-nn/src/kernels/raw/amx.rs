//! bf16 matrix products on AMX tiles (Intel Sapphire Rapids and later), in
//! the audited `unsafe` module: the tile instructions are inline assembly,
//! and the driver writes disjoint output blocks from the pool's threads
//! through one pointer.
//!
//! Why: PyTorch's oneDNN multiplies bf16 on AMX where the CPU has it, and
//! the AVX-512 BF16 kernel (`vdpbf16ps`, [`super::bf16_tile`]) reaches a
//! third of that: on the 2-core Xeon a LoRA step on a bf16 base ran at 0.16x
//! PEFT's. One `tdpbf16ps` multiplies a 16 x 32 bf16 tile by a 32 x 16 one
//! into 16 x 16 f32 sums. Measured on one core for a `[4864, 896] x [896,
//! 128]` product: 585 GFLOP/s here, 692 for oneDNN, 228 for `vdpbf16ps`.
//!
//! The kernel keeps a 32 x 32 block of `c` in four tiles (`tmm0..3`), and
//! per step of 32 along `k` loads two tiles of `a` rows (`tmm4`, `tmm5`) and
//! two of `b` (`tmm6`, `tmm7`). `a` is read as row-major bf16 (in place when
//! it is a bf16 matrix with contiguous rows and `k` a multiple of 32, the
//! weight in `W x^T`; else packed per block of rows), `b` as panels of 32
//! columns holding pairs of consecutive `k` (the instruction's layout),
//! packed per call. Each output is summed over `k` in one fixed order
//! whatever the thread count.
//!
//! The intrinsics are unstable in Rust 1.95, hence `asm!`; LLVM's assembler
//! knows the mnemonics. Linux hands out the tile state only after
//! `arch_prctl(ARCH_REQ_XCOMP_PERM)`, asked once per process.

use half::bf16;

use super::{par, SendPtr};

/// Rows and columns of the block of `c` one kernel call computes.
pub(crate) const BLOCK: usize = 32;
/// `k` per tile step: a tile row of 64 bytes holds 32 bf16.
const KSTEP: usize = 32;
/// Bytes per row of a packed panel of `b` (32 columns of bf16 pairs).
const PANEL_ROW_BYTES: usize = 4 * BLOCK;

/// Whether this CPU and OS run the AMX kernel: AMX-TILE and AMX-BF16 in
/// CPUID, and the kernel granted the tile state to this process; unless
/// `ACCEL_AMX=0` (or `off`) turns it off, for comparisons.
pub(crate) fn available() -> bool {
    static AVAILABLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *AVAILABLE.get_or_init(|| {
        let off = std::env::var("ACCEL_AMX").is_ok_and(|v| matches!(v.as_str(), "0" | "off"));
        !off && detect()
    })
}

#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn detect() -> bool {
    use core::arch::x86_64::__cpuid_count;
    const ARCH_REQ_XCOMP_PERM: libc::c_ulong = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_ulong = 18;
    if __cpuid_count(0, 0).eax < 7 {
        return false;
    }
    let edx = __cpuid_count(7, 0).edx;
    let (amx_bf16, amx_tile) = (edx >> 22 & 1 == 1, edx >> 24 & 1 == 1);
    // The packing and transposes around the tiles use AVX-512 (every CPU
    // with AMX has it).
    let avx512 = std::arch::is_x86_feature_detected!("avx512f")
        && std::arch::is_x86_feature_detected!("avx512bw");
    if !(amx_bf16 && amx_tile && avx512) {
        return false;
    }
    // SAFETY: `arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)` takes two
    // integers and only changes which register state the kernel saves for
    // this process; an older kernel answers with an error (then no AMX).
    let granted = unsafe {
        libc::syscall(
            libc::SYS_arch_prctl,
            ARCH_REQ_XCOMP_PERM,
            XFEATURE_XTILEDATA,
        )
    };
    granted == 0
}

#[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
fn detect() -> bool {
    false
}

/// The values of a matrix operand: bf16 as they lie, or f32 rounded to
/// bf16 (to nearest even) when packed.
#[derive(Clone, Copy)]
pub(crate) enum Values<'a> {
    Bf16(&'a [bf16]),
    F32(&'a [f32]),
}

/// A read-only strided matrix operand: element (i, j) lives at
/// `off + i * rs + j * cs` of its values.
#[derive(Clone, Copy)]
pub(crate) struct HalfRef<'a> {
    vals: Values<'a>,
    off: usize,
    rs: usize,
    cs: usize,
}

/// `x` as bf16 bits, rounded to nearest even (a NaN stays a NaN).
#[inline(always)]
pub(crate) fn bf16_bits(x: f32) -> u16 {
    // Branch-free (a select), so that packing loops vectorise.
    let b = x.to_bits();
    let rounded = (b.wrapping_add(0x7fff + ((b >> 16) & 1))) >> 16;
    let quiet_nan = (b >> 16) | 0x40;
    (if x.is_nan() { quiet_nan } else { rounded }) as u16
}

impl<'a> HalfRef<'a> {
    pub(crate) fn new(vals: Values<'a>, off: usize, (rs, cs): (usize, usize)) -> Self {
        Self { vals, off, rs, cs }
    }

    /// The transposed operand (no copy).
    pub(crate) fn t(self) -> Self {
        Self {
            rs: self.cs,
            cs: self.rs,
            ..self
        }
    }

    /// Whether [`gemm`] reads this operand in place as its `a` with `k`
    /// columns: bf16 rows, whole tile steps.
    pub(crate) fn in_place_as_lhs(&self, k: usize) -> bool {
        matches!(self.vals, Values::Bf16(_)) && self.cs == 1 && k.is_multiple_of(KSTEP)
    }

    /// The operand as an f32 matrix, when its values are f32.
    pub(crate) fn as_f32(&self) -> Option<super::MatRef<'a>> {
        match self.vals {
            Values::F32(data) => Some(super::MatRef {
                data,
                off: self.off,
                rs: self.rs,
                cs: self.cs,
            }),
            Values::Bf16(_) => None,
        }
    }

    fn len(&self) -> usize {
        match self.vals {
            Values::Bf16(v) => v.len(),
            Values::F32(v) => v.len(),
        }
    }

    /// `len` consecutive values from flat index `at`, as bf16 bits.
    #[inline(always)]
    fn run(&self, at: usize, len: usize, out: &mut [u16]) {
        match self.vals {
            Values::Bf16(v) => {
                for (o, x) in out[..len].iter_mut().zip(&v[at..at + len]) {
                    *o = x.to_bits();
                }
            }
            Values::F32(v) => {
                for (o, &x) in out[..len].iter_mut().zip(&v[at..at + len]) {
                    *o = bf16_bits(x);
                }
            }
        }
    }

    #[inline(always)]
    fn bits(&self, i: usize, j: usize) -> u16 {
        let at = self.off + i * self.rs + j * self.cs;
        match self.vals {
            Values::Bf16(v) => v[at].to_bits(),
            Values::F32(v) => bf16_bits(v[at]),
        }
    }

    fn check(&self, rows: usize, cols: usize, what: &str) {
        if rows == 0 || cols == 0 {
            return;
        }
        let last = self.off + (rows - 1) * self.rs + (cols - 1) * self.cs;
        assert!(
            last < self.len(),
            "amx gemm: {what} [{rows}, {cols}] (offset {}, strides {}, {}) overruns {}",
            self.off,
            self.rs,
            self.cs,
            self.len()
        );
    }
}

/// Where the product goes: element (i, j) of `c` at `off + i * rs + j * cs`.
#[derive(Clone, Copy)]
pub(crate) struct OutLayout {
    pub(crate) off: usize,
    pub(crate) rs: usize,
    pub(crate) cs: usize,
}

/// `c (+)= a [m, k] @ b [k, n]` with the operands rounded to bf16 and f32
/// sums, on AMX tiles, split over the pool's threads.
///
/// `c` is row-major (`cs == 1`, `rs >= n`) or column-major (`rs == 1`,
/// `cs >= m`), so no two outputs share a slot.
///
/// # Panics
/// When [`available`] is false, an operand or the output overruns its
/// slice, or the output layout is neither of the two.
pub(crate) fn gemm(
    (m, n, k): (usize, usize, usize),
    a: HalfRef<'_>,
    b: HalfRef<'_>,
    c: &mut [f32],
    out: OutLayout,
    accumulate: bool,
) {
    a.check(m, k, "lhs");
    b.check(k, n, "rhs");
    if m == 0 || n == 0 {
        return;
    }
    assert!(
        (out.cs == 1 && out.rs >= n) || (out.rs == 1 && out.cs >= m),
        "amx gemm: output strides ({}, {}) for [{m}, {n}] are neither row- nor column-major",
        out.rs,
        out.cs
    );
    let last = out.off + (m - 1) * out.rs + (n - 1) * out.cs;
    assert!(
        last < c.len(),
        "amx gemm: output [{m}, {n}] overruns {}",
        c.len()
    );
    assert!(available(), "amx gemm: this CPU or OS has no AMX");
    let k2 = k.div_ceil(KSTEP) * KSTEP;
    let (mb, nb) = (m.div_ceil(BLOCK), n.div_ceil(BLOCK));
    let direct_a = a.in_place_as_lhs(k);
    let job = Job {
        dims: (m, n, k2),
        c: SendPtr(c.as_mut_ptr()),
        out,
        accumulate,
    };
    let whole = (k2 / KSTEP, accumulate);
    if mb < nb && b.cs == 1 && b.rs != 1 {
        return streamed_b(&job, (&a, direct_a), &b, (k, n, k2));
    }
    let bp = PackedB::new(&b, (k, n), k2);
    if mb >= nb {
        // The threads split the rows.
        par::for_each(mb, |ib| {
            let mut ap = Vec::new();
            let (a_ptr, lda) = a_rows(&a, (m, k, k2), ib, direct_a, &mut ap);
            with_tiles(|| {
                for q in 0..nb {
                    // SAFETY: `a_rows` returns 32 rows of k2 bf16 at stride
                    // `lda` in bounds; `bp.panel(q)` is a whole packed
                    // panel; the block (ib, q) is inside the checked output.
                    unsafe { job.block((ib, q), (a_ptr, lda), bp.panel(q), whole) }
                }
            })
        });
    } else {
        // The threads split the columns; `a` is packed once unless read in
        // place.
        let direct_a = direct_a && m.is_multiple_of(BLOCK);
        let ap: Vec<u16> = if direct_a {
            Vec::new()
        } else {
            let mut ap = vec![0u16; mb * BLOCK * k2];
            par::chunks_mut(&mut ap, BLOCK * k2, |ib, rows| {
                pack_a_rows(&a, (m, k, k2), ib * BLOCK, rows)
            });
            ap
        };
        par::for_each(nb, |q| {
            with_tiles(|| {
                for ib in 0..mb {
                    let (a_ptr, lda) = if direct_a {
                        a_in_place(&a, ib)
                    } else {
                        (ap[ib * BLOCK * k2..].as_ptr().cast(), 2 * k2)
                    };
                    // SAFETY: as above (a full row block either in place or
                    // in `ap`, which has mb blocks of 32 x k2).
                    unsafe { job.block((ib, q), (a_ptr, lda), bp.panel(q), whole) }
                }
            })
        });
    }
}

/// Bytes of packed `b` a task keeps per block of `k`. Long packing runs
/// measured faster than L2-sized blocks: a LoRA step's backward took
/// 0.27 s with 2-8 MB, 0.29-0.32 s with 512 KB and 0.39 s with 128 KB.
const STREAM_BYTES: usize = 8 << 20;

/// The column-split product when `b` is large and row-major (the weight
/// in `dx = dh w`): each task takes a range of panels (one per thread) and
/// walks `k` in blocks, packing its part of the block's rows (contiguous
/// runs of each row) into its own buffer, then multiplying it, adding
/// into `c` after the first block. Each thread packs only what it then
/// multiplies, and a weight of any size takes a bounded buffer.
fn streamed_b(
    job: &Job,
    (a, direct_a): (&HalfRef<'_>, bool),
    b: &HalfRef<'_>,
    (k, n, k2): (usize, usize, usize),
) {
    let (m, _, _) = job.dims;
    let (mb, nb, steps) = (m.div_ceil(BLOCK), n.div_ceil(BLOCK), k2 / KSTEP);
    let direct_a = direct_a && m.is_multiple_of(BLOCK);
    let ap: Vec<u16> = if direct_a {
        Vec::new()
    } else {
        let mut ap = vec![0u16; mb * BLOCK * k2];
        par::chunks_mut(&mut ap, BLOCK * k2, |ib, rows| {
            pack_a_rows(a, (m, k, k2), ib * BLOCK, rows)
        });
        ap
    };
    let per = nb.div_ceil(par::threads().max(1));
    par::for_each(nb.div_ceil(per), |g| {
        let qs = g * per..nb.min((g + 1) * per);
        let width = qs.len() * STEP_U32;
        let kc = (STREAM_BYTES / (4 * width)).clamp(1, steps);
        let mut buf = PACK_BUFFER.with(|b| b.take());
        if buf.len() < kc * width {
            buf.resize(kc * width, 0);
        }
        for s0 in (0..steps).step_by(kc) {
            let sc = kc.min(steps - s0);
            for (i, step) in buf.chunks_mut(width).take(sc).enumerate() {
                pack_b_step(b, (k, n), ((s0 + i) * KSTEP, qs.start), step);
            }
            let acc = job.accumulate || s0 > 0;
            with_tiles(|| {
                for (ql, q) in qs.clone().enumerate() {
                    let panel = (buf[ql * STEP_U32..].as_ptr().cast(), 4 * width);
                    for ib in 0..mb {
                        let (a_ptr, lda) = if direct_a {
                            a_in_place(a, ib)
                        } else {
                            (ap[ib * BLOCK * k2..].as_ptr().cast::<u8>(), 2 * k2)
                        };
                        // SAFETY: 32 rows of `a` from column `32 * s0` on,
                        // `sc` steps of the panel packed just above; the
                        // block is inside the checked output and only this
                        // task writes panel `q`'s blocks.
                        unsafe {
                            let a_ptr = a_ptr.add(2 * KSTEP * s0);
                            job.block((ib, q), (a_ptr, lda), panel, (sc, acc))
                        }
                    }
                }
            });
        }
        PACK_BUFFER.with(|b| b.set(buf));
    });
}

/// `b` packed for the kernel: per panel of 32 columns and step of 32 along
/// `k`, 16 rows of 32 pairs of consecutive `k` (the lower one in the low
/// half; zeros past `k` and `n`).
///
/// Two orders, so that packing reads `b` along its contiguous direction:
/// panel-major when columns are contiguous (a transposed weight: each
/// panel reads 32 columns front to back), step-major when rows are (each
/// step reads 32 whole rows). Reading a row-major weight panel by panel
/// touched a new page per 64 bytes and made packing cost more than the
/// products.
struct PackedB {
    /// The packed panels, then stale values past them (a reused buffer).
    data: Vec<u32>,
    /// u32 between the starts of consecutive panels.
    panel_stride: usize,
    /// Bytes between consecutive steps of one panel.
    step_bytes: usize,
}

/// u32 in one step of one panel: 16 rows of 32 pairs.
const STEP_U32: usize = KSTEP / 2 * BLOCK;

thread_local! {
    /// The calling thread's last packing buffer, reused: a fresh one per
    /// call faulted in (and zeroed) up to the weight's size every time.
    static PACK_BUFFER: std::cell::Cell<Vec<u32>> = const { std::cell::Cell::new(Vec::new()) };
}

impl PackedB {
    fn new(b: &HalfRef<'_>, (k, n): (usize, usize), k2: usize) -> Self {
        let (nb, steps) = (n.div_ceil(BLOCK), k2 / KSTEP);
        let len = nb * steps * STEP_U32;
        // Reused contents are stale: the packers write every slot. The
        // buffer keeps its longest length, so that no call zero-fills more
        // than it grows.
        let mut buf = PACK_BUFFER.with(|b| b.take());
        if buf.len() < len {
            buf.resize(len, 0);
        }
        let data = &mut buf[..len];
        if b.cs == 1 && b.rs != 1 {
            par::chunks_mut(data, nb * STEP_U32, |i, step| {
                pack_b_step(b, (k, n), (i * KSTEP, 0), step)
            });
            Self {
                data: buf,
                panel_stride: STEP_U32,
                step_bytes: 4 * nb * STEP_U32,
            }
        } else {
            par::chunks_mut(data, steps * STEP_U32, |q, panel| {
                pack_b_panel(b, (k, n), q * BLOCK, panel)
            });
            Self {
                data: buf,
                panel_stride: steps * STEP_U32,
                step_bytes: 4 * STEP_U32,
            }
        }
    }

    /// Panel `q` as the kernel reads it: its first step, and the bytes to
    /// the next.
    fn panel(&self, q: usize) -> (*const u8, usize) {
        (
            self.data[q * self.panel_stride..].as_ptr().cast(),
            self.step_bytes,
        )
    }
}

impl Drop for PackedB {
    fn drop(&mut self) {
        let data = std::mem::take(&mut self.data);
        PACK_BUFFER.with(|b| b.set(data));
    }
}

/// Rows `k0..k0 + 32` of a `b` with contiguous rows, in panels from `q0`
/// on: `out` is `[panel][16][32]` pairs.
///
/// Pairs of rows are read front to back (two streams the hardware
/// prefetcher follows), and bf16 rows are interleaved with AVX-512 where
/// the CPU has it (every CPU with AMX does): packing the weight is what
/// the backward's product waits on.
fn pack_b_step(b: &HalfRef<'_>, (k, n): (usize, usize), (k0, q0): (usize, usize), out: &mut [u32]) {
    let panels = out.len() / STEP_U32;
    let j0 = q0 * BLOCK;
    let cols = n.min(j0 + panels * BLOCK) - j0;
    let mut rows = [vec![0u16; cols], vec![0u16; cols]];
    for p in 0..KSTEP / 2 {
        let kk = k0 + 2 * p;
        let row_at = |h: usize| b.off + (kk + h) * b.rs + j0;
        if let (Values::Bf16(v), true) = (b.vals, kk + 1 < k) {
            let (r0, r1) = (&v[row_at(0)..][..cols], &v[row_at(1)..][..cols]);
            interleave(r0, r1, p, out);
            continue;
        }
        for (h, row) in rows.iter_mut().enumerate() {
            if kk + h < k {
                b.run(row_at(h), cols, row);
            } else {
                row.fill(0);
            }
        }
        for (q, panel) in out.chunks_mut(STEP_U32).enumerate() {
            let dst = &mut panel[p * BLOCK..][..BLOCK];
            let (lo, hi) = (q * BLOCK, cols.min((q + 1) * BLOCK));
            for ((d, &x), &y) in dst.iter_mut().zip(&rows[0][lo..hi]).zip(&rows[1][lo..hi]) {
                *d = u32::from(x) | u32::from(y) << 16;
            }
            dst[hi - lo..].fill(0);
        }
    }
}

/// Row `p` of every panel in `out` (`[panel][16][32]`) from two bf16 rows
/// covering the panels' columns (zeros past their end).
fn interleave(r0: &[bf16], r1: &[bf16], p: usize, out: &mut [u32]) {
    assert!(r0.len() == r1.len() && r0.len() <= out.len() / STEP_U32 * BLOCK);
    #[cfg(target_arch = "x86_64")]
    // SAFETY: only the AMX gemm packs, and `available()` checked AVX-512F
    // and BW; the function is safe code compiled for them.
    unsafe {
        interleave_avx512(r0, r1, p, out)
    }
    #[cfg(not(target_arch = "x86_64"))]
    interleave_any(r0, r1, p, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
fn interleave_avx512(r0: &[bf16], r1: &[bf16], p: usize, out: &mut [u32]) {
    interleave_any(r0, r1, p, out)
}

#[inline(always)]
fn interleave_any(r0: &[bf16], r1: &[bf16], p: usize, out: &mut [u32]) {
    let whole = r0.len() / BLOCK;
    for (q, panel) in out.chunks_exact_mut(STEP_U32).enumerate() {
        let dst: &mut [u32; BLOCK] = (&mut panel[p * BLOCK..][..BLOCK]).try_into().unwrap();
        if q < whole {
            let x: &[bf16; BLOCK] = r0[q * BLOCK..][..BLOCK].try_into().unwrap();
            let y: &[bf16; BLOCK] = r1[q * BLOCK..][..BLOCK].try_into().unwrap();
            for j in 0..BLOCK {
                dst[j] = u32::from(x[j].to_bits()) | u32::from(y[j].to_bits()) << 16;
            }
        } else {
            let (x, y) = (
                &r0[(q * BLOCK).min(r0.len())..],
                &r1[(q * BLOCK).min(r1.len())..],
            );
            for (j, d) in dst.iter_mut().enumerate() {
                *d = match (x.get(j), y.get(j)) {
                    (Some(a), Some(b)) => u32::from(a.to_bits()) | u32::from(b.to_bits()) << 16,
                    _ => 0,
                };
            }
        }
    }
}

/// The rows of `a` in row block `ib` as the kernel reads them: in place,
/// or packed into `buf` (when not `direct`, or for a short last block).
fn a_rows(
    a: &HalfRef<'_>,
    (m, k, k2): (usize, usize, usize),
    ib: usize,
    direct: bool,
    buf: &mut Vec<u16>,
) -> (*const u8, usize) {
    if direct && (ib + 1) * BLOCK <= m {
        return a_in_place(a, ib);
    }
    buf.resize(BLOCK * k2, 0);
    pack_a_rows(a, (m, k, k2), ib * BLOCK, buf);
    (buf.as_ptr().cast(), 2 * k2)
}

/// Row block `ib` of a bf16 `a` with contiguous rows, in place (the caller
/// checked that a whole block of rows exists, or packs the last one).
fn a_in_place(a: &HalfRef<'_>, ib: usize) -> (*const u8, usize) {
    let Values::Bf16(v) = a.vals else {
        unreachable!("only bf16 operands are read in place")
    };
    (v[a.off + ib * BLOCK * a.rs..].as_ptr().cast(), 2 * a.rs)
}

/// Rows `i0..i0 + 32` of `a` (zeros past `m`) as `[32][k2]` bf16 bits
/// (zeros past `k`).
fn pack_a_rows(a: &HalfRef<'_>, (m, k, k2): (usize, usize, usize), i0: usize, out: &mut [u16]) {
    out.fill(0);
    let rows = BLOCK.min(m - i0);
    if a.cs == 1 {
        for (r, dst) in out.chunks_mut(k2).take(rows).enumerate() {
            a.run(a.off + (i0 + r) * a.rs, k, dst);
        }
    } else if a.rs == 1 {
        // Columns contiguous along the rows (a transposed operand).
        let mut col = [0u16; BLOCK];
        for kk in 0..k {
            a.run(a.off + i0 + kk * a.cs, rows, &mut col);
            for (r, &v) in col[..rows].iter().enumerate() {
                out[r * k2 + kk] = v;
            }
        }
    } else {
        for (r, dst) in out.chunks_mut(k2).take(rows).enumerate() {
            for (kk, d) in dst[..k].iter_mut().enumerate() {
                *d = a.bits(i0 + r, kk);
            }
        }
    }
}

/// Columns `j0..j0 + 32` of `b` as `[k2 / 2][32]` pairs (zeros past `n`
/// and `k`).
fn pack_b_panel(b: &HalfRef<'_>, (k, n): (usize, usize), j0: usize, out: &mut [u32]) {
    let cols = BLOCK.min(n - j0);
    if cols < BLOCK || !k.is_multiple_of(KSTEP) || b.rs != 1 {
        // Slots the loops below leave alone.
        out.fill(0);
    }
    if b.rs == 1 {
        // Each column contiguous along `k` (a weight `[out, in]` read as
        // its transpose): pairs of one column lie side by side.
        let mut col = vec![0u16; k + 1];
        for j in 0..cols {
            b.run(b.off + (j0 + j) * b.cs, k, &mut col);
            col[k] = 0;
            for (p, dst) in out
                .iter_mut()
                .skip(j)
                .step_by(BLOCK)
                .take(k.div_ceil(2))
                .enumerate()
            {
                *dst = u32::from(col[2 * p]) | u32::from(col[2 * p + 1]) << 16;
            }
        }
    } else {
        for (p, dst) in out.chunks_mut(BLOCK).take(k.div_ceil(2)).enumerate() {
            for (j, d) in dst[..cols].iter_mut().enumerate() {
                let y = if 2 * p + 1 < k {
                    b.bits(2 * p + 1, j0 + j)
                } else {
                    0
                };
                *d = u32::from(b.bits(2 * p, j0 + j)) | u32::from(y) << 16;
            }
        }
    }
}

/// One call's output and shape, shared by its tasks.
struct Job {
    /// (m, n, k rounded up to a tile step)
    dims: (usize, usize, usize),
    c: SendPtr<f32>,
    out: OutLayout,
    accumulate: bool,
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
    unsafe fn block(
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
fn with_tiles<R>(f: impl FnOnce() -> R) -> R {
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
unsafe fn tile_block(
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

#[cfg(test)]
mod tests {
    use super::*;

    fn values(len: usize, seed: u32) -> Vec<f32> {
        (0..len)
            .map(|i| {
                let v = ((i as u32).wrapping_mul(2654435761).wrapping_add(seed) % 2000) as f32;
                bf16::from_f32(v / 1000.0 - 1.0).to_f32()
            })
            .collect()
    }

    /// The f64 product of the operands as bf16 values.
    fn reference(m: usize, n: usize, k: usize, a: &HalfRef, b: &HalfRef) -> Vec<f64> {
        let f = |bits: u16| f64::from(bf16::from_bits(bits).to_f32());
        let mut c = vec![0f64; m * n];
        for i in 0..m {
            for j in 0..n {
                c[i * n + j] = (0..k).map(|kk| f(a.bits(i, kk)) * f(b.bits(kk, j))).sum();
            }
        }
        c
    }

    #[test]
    fn products_match_a_reference_in_every_layout_and_shape() {
        if !available() {
            eprintln!("skipped: no AMX on this CPU or OS");
            return;
        }
        // Ragged rows, columns and k; row- and column-split (m < n) calls;
        // in-place bf16 rows and packed f32 or transposed operands.
        for (m, n, k) in [
            (1, 1, 1),
            (32, 32, 32),
            (70, 33, 96),
            (33, 100, 50),
            (64, 40, 33),
        ] {
            let (x, y) = (values(m * k, 1), values(k * n, 2));
            let (xb, yb): (Vec<bf16>, Vec<bf16>) = (
                x.iter().map(|&v| bf16::from_f32(v)).collect(),
                y.iter().map(|&v| bf16::from_f32(v)).collect(),
            );
            let xt: Vec<f32> = (0..k * m).map(|t| x[(t % m) * k + t / m]).collect();
            let yt: Vec<f32> = (0..n * k).map(|t| y[(t % k) * n + t / k]).collect();
            let lhs = [
                HalfRef::new(Values::Bf16(&xb), 0, (k, 1)),
                HalfRef::new(Values::F32(&x), 0, (k, 1)),
                HalfRef::new(Values::F32(&xt), 0, (1, m)),
            ];
            let rhs = [
                HalfRef::new(Values::Bf16(&yb), 0, (n, 1)),
                HalfRef::new(Values::F32(&yt), 0, (1, k)),
            ];
            let want = reference(m, n, k, &lhs[0], &rhs[0]);
            for a in &lhs {
                for b in &rhs {
                    // Row-major with a padded row, and column-major.
                    for (out, len) in [
                        (
                            OutLayout {
                                off: 1,
                                rs: n + 2,
                                cs: 1,
                            },
                            1 + m * (n + 2),
                        ),
                        (
                            OutLayout {
                                off: 0,
                                rs: 1,
                                cs: m,
                            },
                            m * n,
                        ),
                    ] {
                        let mut c = vec![1f32; len];
                        gemm((m, n, k), *a, *b, &mut c, out, true);
                        for i in 0..m {
                            for j in 0..n {
                                let got = f64::from(c[out.off + i * out.rs + j * out.cs]);
                                let w = want[i * n + j] + 1.0;
                                assert!(
                                    (got - w).abs() <= 1e-5 * w.abs().max(1.0),
                                    "{m} {n} {k} ({i}, {j}): {got} vs {w}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn a_thread_count_does_not_change_a_single_bit() {
        if !available() {
            eprintln!("skipped: no AMX on this CPU or OS");
            return;
        }
        // Row-split, and column-split with `b` streamed (blocks of `k` that
        // differ with the thread count), adding to ragged output blocks.
        for (m, n, k) in [(96, 200, 320), (40, 2050, 600)] {
            let (x, y) = (values(m * k, 3), values(k * n, 4));
            let run = |threads| {
                par::with_threads(threads, || {
                    let mut c = values(m * n, 5);
                    let out = OutLayout {
                        off: 0,
                        rs: n,
                        cs: 1,
                    };
                    let (a, b) = (
                        HalfRef::new(Values::F32(&x), 0, (k, 1)),
                        HalfRef::new(Values::F32(&y), 0, (n, 1)),
                    );
                    gemm((m, n, k), a, b, &mut c, out, true);
                    c
                })
            };
            assert!(run(1) == run(2), "{m} {n} {k}");
        }
    }

    #[test]
    #[should_panic(expected = "neither row- nor column-major")]
    fn an_output_whose_slots_could_overlap_is_refused() {
        // The layout is checked before the CPU, so this runs anywhere.
        let x = [0f32; 4];
        let mut c = [0f32; 4];
        let a = HalfRef::new(Values::F32(&x), 0, (2, 1));
        gemm(
            (2, 2, 2),
            a,
            a,
            &mut c,
            OutLayout {
                off: 0,
                rs: 1,
                cs: 1,
            },
            false,
        );
    }
}
