//! Operands into the layouts the tile loads read: rows of `a` as row-major
//! bf16, panels of `b` as pairs of consecutive `k`.

use half::bf16;

use super::{par, HalfRef, Values, BLOCK, KSTEP};

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
pub(super) struct PackedB {
    /// The packed panels, then stale values past them (a reused buffer).
    data: Vec<u32>,
    /// u32 between the starts of consecutive panels.
    panel_stride: usize,
    /// Bytes between consecutive steps of one panel.
    step_bytes: usize,
}

/// u32 in one step of one panel: 16 rows of 32 pairs.
pub(super) const STEP_U32: usize = KSTEP / 2 * BLOCK;

thread_local! {
    /// The thread's packing buffers, reused: a fresh one per call faulted
    /// in (and zeroed) up to the weight's size every time. Several, because
    /// a product may hold a packed block of each operand, or every block of
    /// its activations at once.
    static PACK_BUFFERS: std::cell::RefCell<Vec<Vec<u32>>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// The largest packing buffer a thread keeps between calls: a layer's
/// weights of a 0.5-7 B model; a larger one (an LM head packed whole) is
/// freed after its call rather than held for the life of the thread.
const KEPT_BUFFER_BYTES: usize = 16 << 20;

/// The most bytes of packing buffers a thread keeps in all.
const KEPT_BYTES: usize = 2 * KEPT_BUFFER_BYTES;

/// A packing buffer of this thread, at least `len` long: the first kept
/// one long enough, else the last kept one grown. Its contents are stale:
/// the packers write every slot they hand to the kernel. A buffer keeps its
/// longest length, so that no call zero-fills more than it grows.
pub(crate) fn take_pack_buffer(len: usize) -> Vec<u32> {
    let mut buf = PACK_BUFFERS.with(|b| {
        let mut kept = b.borrow_mut();
        match kept.iter().position(|v| v.len() >= len) {
            Some(i) => kept.swap_remove(i),
            None => kept.pop().unwrap_or_default(),
        }
    });
    if buf.len() < len {
        buf.resize(len, 0);
    }
    buf
}

/// Gives a buffer from [`take_pack_buffer`] back to this thread, unless it
/// is past [`KEPT_BUFFER_BYTES`] or the thread keeps [`KEPT_BYTES`] already.
pub(crate) fn keep_pack_buffer(buf: Vec<u32>) {
    let bytes = 4 * buf.capacity();
    if bytes > KEPT_BUFFER_BYTES {
        return;
    }
    PACK_BUFFERS.with(|b| {
        let mut kept = b.borrow_mut();
        let held: usize = kept.iter().map(|v| 4 * v.capacity()).sum();
        if held + bytes <= KEPT_BYTES {
            kept.push(buf);
        }
    });
}

impl PackedB {
    pub(super) fn new(b: &HalfRef<'_>, (k, n): (usize, usize), k2: usize) -> Self {
        let (nb, steps) = (n.div_ceil(BLOCK), k2 / KSTEP);
        let len = nb * steps * STEP_U32;
        let mut buf = take_pack_buffer(len);
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
    pub(super) fn panel(&self, q: usize) -> (*const u8, usize) {
        (
            self.data[q * self.panel_stride..].as_ptr().cast(),
            self.step_bytes,
        )
    }
}

impl Drop for PackedB {
    fn drop(&mut self) {
        keep_pack_buffer(std::mem::take(&mut self.data));
    }
}

/// Rows `k0..k0 + 32` of a `b` with contiguous rows, in panels from `q0`
/// on: `out` is `[panel][16][32]` pairs.
///
/// Pairs of rows are read front to back (two streams the hardware
/// prefetcher follows), and bf16 rows are interleaved with AVX-512 where
/// the CPU has it (every CPU with AMX does): packing the weight is what
/// the backward's product waits on.
pub(super) fn pack_b_step(
    b: &HalfRef<'_>,
    (k, n): (usize, usize),
    (k0, q0): (usize, usize),
    out: &mut [u32],
) {
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
pub(super) fn a_rows(
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
pub(super) fn a_in_place(a: &HalfRef<'_>, ib: usize) -> (*const u8, usize) {
    let Values::Bf16(v) = a.vals else {
        unreachable!("only bf16 operands are read in place")
    };
    (v[a.off + ib * BLOCK * a.rs..].as_ptr().cast(), 2 * a.rs)
}

/// Rows `i0..i0 + 32` of `a` (zeros past `m`) as `[32][k2]` bf16 bits
/// (zeros past `k`).
pub(super) fn pack_a_rows(
    a: &HalfRef<'_>,
    (m, k, k2): (usize, usize, usize),
    i0: usize,
    out: &mut [u16],
) {
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
pub(super) fn pack_b_panel(b: &HalfRef<'_>, (k, n): (usize, usize), j0: usize, out: &mut [u32]) {
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
