//! Fused kernels over host memory.
//!
//! Every multi-tensor op works the same way: the slices of all tensors of a
//! list are cut into *pieces*, the pieces are packed into *bundles* of
//! [`CHUNK`] elements regardless of tensor boundaries, and the bundles run
//! as one parallel pass on candle's CPU pool ([`crate::par`]). Big tensors are spread over all threads, and a list of
//! many small tensors still costs a handful of jobs rather than one each.

pub(crate) mod adamw;
pub(crate) mod cast;
pub(crate) mod norm;
pub(crate) mod unscale;

use crate::slices::{FloatSlice, FloatSliceMut};

/// Elements per bundle: large enough to amortise a parallel task, small enough
/// (256 KiB of f32) to balance the load and stay cache friendly.
pub(crate) const CHUNK: usize = 64 * 1024;

/// Below this many elements in total a call runs on the calling thread:
/// waking the pool costs more than the work.
pub(crate) const SEQUENTIAL_BELOW: usize = 32 * 1024;

/// Elements converted at a time through an on-stack f32 buffer when a kernel
/// computes half-precision data in f32 (4 KiB: stays in L1).
pub(crate) const BLOCK: usize = 1024;

/// How a call splits its work. Tests shrink the chunk to exercise
/// splitting on small inputs; results never depend on whether the pass runs
/// in parallel, only (for reductions) on `chunk`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Plan {
    /// Elements per bundle.
    pub chunk: usize,
    /// Minimum total elements for a parallel pass.
    pub min_parallel: usize,
}

impl Default for Plan {
    fn default() -> Self {
        Plan {
            chunk: CHUNK,
            min_parallel: SEQUENTIAL_BELOW,
        }
    }
}

/// A slice (or tuple of equally long slices) that can be cut in two.
pub(crate) trait Piece: Sized + Send {
    /// Number of elements.
    fn len(&self) -> usize;
    /// Cuts at `mid`, like `slice::split_at`.
    fn split_at(self, mid: usize) -> (Self, Self);
}

impl<T: Send> Piece for &mut [T] {
    fn len(&self) -> usize {
        <[T]>::len(self)
    }
    fn split_at(self, mid: usize) -> (Self, Self) {
        self.split_at_mut(mid)
    }
}

impl<T: Sync> Piece for &[T] {
    fn len(&self) -> usize {
        <[T]>::len(self)
    }
    fn split_at(self, mid: usize) -> (Self, Self) {
        <[T]>::split_at(self, mid)
    }
}

impl Piece for FloatSliceMut<'_> {
    fn len(&self) -> usize {
        match self {
            FloatSliceMut::F32(s) => s.len(),
            FloatSliceMut::BF16(s) => s.len(),
            FloatSliceMut::F16(s) => s.len(),
        }
    }
    fn split_at(self, mid: usize) -> (Self, Self) {
        match self {
            FloatSliceMut::F32(s) => {
                let (a, b) = s.split_at_mut(mid);
                (FloatSliceMut::F32(a), FloatSliceMut::F32(b))
            }
            FloatSliceMut::BF16(s) => {
                let (a, b) = s.split_at_mut(mid);
                (FloatSliceMut::BF16(a), FloatSliceMut::BF16(b))
            }
            FloatSliceMut::F16(s) => {
                let (a, b) = s.split_at_mut(mid);
                (FloatSliceMut::F16(a), FloatSliceMut::F16(b))
            }
        }
    }
}

impl Piece for FloatSlice<'_> {
    fn len(&self) -> usize {
        match self {
            FloatSlice::F32(s) => s.len(),
            FloatSlice::BF16(s) => s.len(),
            FloatSlice::F16(s) => s.len(),
        }
    }
    fn split_at(self, mid: usize) -> (Self, Self) {
        match self {
            FloatSlice::F32(s) => {
                let (a, b) = s.split_at(mid);
                (FloatSlice::F32(a), FloatSlice::F32(b))
            }
            FloatSlice::BF16(s) => {
                let (a, b) = s.split_at(mid);
                (FloatSlice::BF16(a), FloatSlice::BF16(b))
            }
            FloatSlice::F16(s) => {
                let (a, b) = s.split_at(mid);
                (FloatSlice::F16(a), FloatSlice::F16(b))
            }
        }
    }
}

/// An optional operand (SGD without momentum has no buffer); only ever used
/// beside a present piece that carries the length.
impl<P: Piece> Piece for Option<P> {
    fn len(&self) -> usize {
        self.as_ref().map_or(0, Piece::len)
    }
    fn split_at(self, mid: usize) -> (Self, Self) {
        match self {
            Some(p) => {
                let (a, b) = p.split_at(mid);
                (Some(a), Some(b))
            }
            None => (None, None),
        }
    }
}

/// Pairs cut in lockstep (the caller guarantees equal lengths).
impl<A: Piece, B: Piece> Piece for (A, B) {
    fn len(&self) -> usize {
        self.0.len()
    }
    fn split_at(self, mid: usize) -> (Self, Self) {
        let (a0, a1) = self.0.split_at(mid);
        let (b0, b1) = self.1.split_at(mid);
        ((a0, b0), (a1, b1))
    }
}

/// Quadruples cut in lockstep (the caller guarantees equal lengths).
impl<A: Piece, B: Piece, C: Piece, D: Piece> Piece for (A, B, C, D) {
    fn len(&self) -> usize {
        self.0.len()
    }
    fn split_at(self, mid: usize) -> (Self, Self) {
        let (a0, a1) = self.0.split_at(mid);
        let (b0, b1) = self.1.split_at(mid);
        let (c0, c1) = self.2.split_at(mid);
        let (d0, d1) = self.3.split_at(mid);
        ((a0, b0, c0, d0), (a1, b1, c1, d1))
    }
}

/// Packs pieces, in order, into bundles of exactly `chunk` elements (the
/// last may be shorter), cutting pieces at bundle boundaries. Empty pieces
/// are dropped: they have no work.
pub(crate) fn bundle<P: Piece>(pieces: impl IntoIterator<Item = P>, chunk: usize) -> Vec<Vec<P>> {
    let chunk = chunk.max(1);
    let mut out = Vec::new();
    let mut cur = Vec::new();
    let mut room = chunk;
    for mut p in pieces {
        loop {
            let n = p.len();
            if n == 0 {
                break;
            }
            if n <= room {
                room -= n;
                cur.push(p);
                if room == 0 {
                    out.push(std::mem::take(&mut cur));
                    room = chunk;
                }
                break;
            }
            let (head, tail) = p.split_at(room);
            cur.push(head);
            out.push(std::mem::take(&mut cur));
            room = chunk;
            p = tail;
        }
    }
    if !cur.is_empty() {
        out.push(cur);
    }
    out
}

/// Runs `f` on every bundle of `pieces` and returns the results in bundle
/// order, so reductions combine partial results in a fixed order and are
/// bitwise reproducible whether or not the pass ran in parallel.
pub(crate) fn map_bundles<P, R, F>(pieces: Vec<P>, plan: Plan, f: F) -> Vec<R>
where
    P: Piece,
    R: Send,
    F: Fn(Vec<P>) -> R + Sync + Send,
{
    let total: usize = pieces.iter().map(Piece::len).sum();
    let bundles = bundle(pieces, plan.chunk);
    if total >= plan.min_parallel && bundles.len() > 1 && crate::par::threads() > 1 {
        crate::par::map(bundles, f)
    } else {
        bundles.into_iter().map(f).collect()
    }
}

/// Updates half-precision data in place through f32: each block is widened,
/// handed to `f`, and rounded back once.
pub(crate) fn update_as_f32<H: cast::Half>(data: &mut [H], mut f: impl FnMut(&mut [f32])) {
    let mut buf = [0f32; BLOCK];
    for block in data.chunks_mut(BLOCK) {
        let wide = &mut buf[..block.len()];
        H::widen(block, wide);
        f(wide);
        H::narrow(wide, block);
    }
}

/// Reads half-precision data through f32, block by block.
pub(crate) fn read_as_f32<H: cast::Half>(data: &[H], mut f: impl FnMut(&[f32])) {
    let mut buf = [0f32; BLOCK];
    for block in data.chunks(BLOCK) {
        let wide = &mut buf[..block.len()];
        H::widen(block, wide);
        f(wide);
    }
}

/// Widens any float slice to f32 block by block and calls `f(offset, block)`
/// — the form kernels use when one operand (a gradient) may be half while
/// the others are f32.
pub(crate) fn read_float_as_f32(src: FloatSlice<'_>, mut f: impl FnMut(usize, &[f32])) {
    match src {
        FloatSlice::F32(s) => {
            // Already f32: hand it over in the same block pattern.
            for (k, block) in s.chunks(BLOCK).enumerate() {
                f(k * BLOCK, block);
            }
        }
        FloatSlice::BF16(s) => {
            let mut off = 0;
            read_as_f32(s, |b| {
                f(off, b);
                off += b.len();
            });
        }
        FloatSlice::F16(s) => {
            let mut off = 0;
            read_as_f32(s, |b| {
                f(off, b);
                off += b.len();
            });
        }
    }
}
