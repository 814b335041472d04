//! bf16 matrix products on AMX tiles (Intel Sapphire Rapids and later), in
//! the audited `unsafe` module: the tile instructions are inline assembly,
//! and the driver writes disjoint output blocks from the pool's threads
//! through one pointer.
//!
//! Why: PyTorch's oneDNN multiplies bf16 on AMX where the CPU has it, and
//! the AVX-512 BF16 kernel (`vdpbf16ps`, [`super::bf16_tile`]) reaches a
//! third of that: on the 2-core Xeon a LoRA step on a bf16 base ran at 0.16x
//! PEFT's (0.90-0.98x with this module). One `tdpbf16ps` multiplies a
//! 16 x 32 bf16 tile by a 32 x 16 one into 16 x 16 f32 sums. The first
//! prototype, on one core for a `[4864, 896] x [896, 128]` product: 585
//! GFLOP/s, against 692 for oneDNN and 228 for `vdpbf16ps`; the kernel now
//! also prefetches its operands into L1 (`tile.rs`).
//!
//! The kernel keeps a 32 x 32 block of `c` in four tiles (`tmm0..3`), and
//! per step of 32 along `k` loads two tiles of `a` rows (`tmm4`, `tmm5`) and
//! two of `b` (`tmm6`, `tmm7`). `a` is read as row-major bf16 (in place when
//! it is a bf16 matrix with contiguous rows and `k` a multiple of 32, the
//! weight in `W x^T`; else packed per block of rows), `b` as panels of 32
//! columns holding pairs of consecutive `k` (the instruction's layout),
//! packed per call (`pack.rs`). Each output is summed over `k` in one fixed
//! order whatever the thread count.
//!
//! The intrinsics are unstable in Rust 1.95, hence `asm!`; LLVM's assembler
//! knows the mnemonics. Linux hands out the tile state only after
//! `arch_prctl(ARCH_REQ_XCOMP_PERM)`, asked once per process.

use half::bf16;

use super::{par, SendPtr};

mod pack;
#[cfg(test)]
mod tests;
mod tile;

use pack::{a_in_place, a_rows, pack_a_rows, pack_b_step, PackedB, STEP_U32};
pub(crate) use pack::{keep_pack_buffer, take_pack_buffer};
use tile::{with_tiles, Job};

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
        let rows = RowsOfA::new(&a, (m, k, k2), direct_a);
        par::for_each(nb, |q| {
            with_tiles(|| {
                for ib in 0..mb {
                    let (a_ptr, lda) = rows.block(ib);
                    // SAFETY: as above (a full row block either in place or
                    // packed, see `RowsOfA`).
                    unsafe { job.block((ib, q), (a_ptr, lda), bp.panel(q), whole) }
                }
            })
        });
    }
}

/// The row blocks of `a` for a column-split product, where every task
/// reads all of them: in place when `a` can be (bf16 rows, whole tile steps
/// and whole blocks), else packed once for all tasks.
struct RowsOfA<'a> {
    a: &'a HalfRef<'a>,
    /// `[m / 32][32][k2]` bf16 bits, empty when read in place.
    packed: Vec<u16>,
    k2: usize,
}

impl<'a> RowsOfA<'a> {
    fn new(a: &'a HalfRef<'a>, (m, k, k2): (usize, usize, usize), in_place: bool) -> Self {
        let mut packed = Vec::new();
        if !(in_place && m.is_multiple_of(BLOCK)) {
            packed = vec![0u16; m.div_ceil(BLOCK) * BLOCK * k2];
            par::chunks_mut(&mut packed, BLOCK * k2, |ib, rows| {
                pack_a_rows(a, (m, k, k2), ib * BLOCK, rows)
            });
        }
        Self { a, packed, k2 }
    }

    /// Row block `ib`: its first row and the bytes between rows.
    fn block(&self, ib: usize) -> (*const u8, usize) {
        if self.packed.is_empty() {
            a_in_place(self.a, ib)
        } else {
            (
                self.packed[ib * BLOCK * self.k2..].as_ptr().cast(),
                2 * self.k2,
            )
        }
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
    let rows = RowsOfA::new(a, (m, k, k2), direct_a);
    let per = nb.div_ceil(par::threads().max(1));
    par::for_each(nb.div_ceil(per), |g| {
        let qs = g * per..nb.min((g + 1) * per);
        let width = qs.len() * STEP_U32;
        let kc = (STREAM_BYTES / (4 * width)).clamp(1, steps);
        let mut buf = take_pack_buffer(kc * width);
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
                        let (a_ptr, lda) = rows.block(ib);
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
        keep_pack_buffer(buf);
    });
}
