//! The collectives over a shared segment, in steps of one slot.
//!
//! Every call is cut into steps; step `s` (numbered across calls, the same
//! on every rank) uses slot `b = s % NBUF` of each rank and runs:
//!
//! 1. wait until every peer is `Done` with step `s - NBUF`, the last one
//!    that read slot `b`;
//! 2. copy what peers need into the own slot, store the call descriptor
//!    with it, then `Written = s + 1` (release);
//! 3. wait for every peer's `Written >= s + 1` (acquire) and check its
//!    descriptor is the same call (op, dtype, reduce/root, total bytes,
//!    sequence number): ranks out of step fail instead of mixing data;
//! 4. the collective's own work, reading peers' slots;
//! 5. `Done = s + 1`.
//!
//! All-reduce splits each step's piece into `world` sub-pieces: rank `r`
//! reduces sub-piece `r` from every rank's slot into its own buffer, copies
//! the result back into its slot (`Reduced`), and copies the other reduced
//! sub-pieces from their owners. Each byte crosses shared memory once in
//! and once out per rank, with no kernel copies and no system calls while
//! peers keep pace. Each element is reduced once, by one rank, in rank
//! order (`d0 op d1 op …`, as in the direct path), so every rank ends up
//! with bitwise the same result.
//!
//! No step waits on a later step of anyone, and a slot is rewritten only
//! after every reader of its previous contents said `Done`, so the scheme
//! cannot deadlock or overwrite unread data.

use std::sync::atomic::Ordering;

use super::super::wire::{describe_call, Fault, Header};
use super::super::Mesh;
use super::segment::{Counter, Segment, DESC_WORDS, NBUF};
use super::wait::Waiter;
use crate::{Element, ReduceOp};

/// Elements reduced per inner block: small enough to stay in L1 with its scratch copy.
const BLOCK_BYTES: usize = 16 * 1024;

/// One call's view of the segment.
pub(crate) struct Call<'a> {
    mesh: &'a Mesh,
    seg: &'a Segment,
    waiter: Waiter<'a>,
    desc: [u64; DESC_WORDS],
    /// The step the next `begin` starts.
    step: &'a mut u64,
}

impl<'a> Call<'a> {
    /// Prepares a call; `total_bytes` is this rank's buffer size (the larger side).
    pub fn new(
        mesh: &'a Mesh,
        seg: &'a Segment,
        step: &'a mut u64,
        expect: Header,
        total_bytes: usize,
    ) -> Self {
        let word = expect.op as u64 | (expect.dtype as u64) << 8 | (expect.reduce as u64) << 16;
        Self {
            mesh,
            seg,
            waiter: Waiter::new(mesh, expect, total_bytes),
            desc: [word, total_bytes as u64, expect.seq],
            step,
        }
    }

    fn peers(&self) -> impl Iterator<Item = usize> {
        let (r, n) = (self.mesh.rank, self.mesh.world);
        (0..n).filter(move |&q| q != r)
    }

    /// Phase 1: waits until slot `s % NBUF` may be rewritten; returns `(s, b)`.
    fn begin(&mut self) -> Result<(u64, usize), Fault> {
        let s = *self.step;
        *self.step += 1;
        if s >= NBUF as u64 {
            for q in self.peers() {
                let done = self.seg.counter(q, Counter::Done);
                self.waiter.until(q, done, s + 1 - NBUF as u64)?;
            }
        }
        Ok((s, (s % NBUF as u64) as usize))
    }

    /// Phase 2 and 3: publishes this rank's slot and waits for the peers'.
    fn written(&mut self, s: u64, b: usize) -> Result<(), Fault> {
        let me = self.mesh.rank;
        for (i, w) in self.desc.iter().enumerate() {
            self.seg.desc(me, b, i).store(*w, Ordering::Relaxed);
        }
        self.publish(s, Counter::Written);
        for q in self.peers() {
            self.waiter
                .until(q, self.seg.counter(q, Counter::Written), s + 1)?;
            let theirs: Vec<u64> = (0..DESC_WORDS)
                .map(|i| self.seg.desc(q, b, i).load(Ordering::Relaxed))
                .collect();
            if theirs != self.desc {
                return Err(Fault::Mismatch {
                    peer: q,
                    detail: format!(
                        "it runs {} while this rank runs {}; every rank must make the same calls \
                         in the same order with the same buffer sizes",
                        describe(&theirs),
                        describe(&self.desc)
                    ),
                });
            }
        }
        Ok(())
    }

    fn publish(&self, s: u64, which: Counter) {
        self.seg
            .counter(self.mesh.rank, which)
            .store(s + 1, Ordering::Release);
    }

    /// Steps needed for `len` elements in pieces of `per_step`; at least one,
    /// so even an empty call checks that every rank makes it.
    fn steps(len: usize, per_step: usize) -> usize {
        len.div_ceil(per_step).max(1)
    }

    fn slot_elems<T>(&self) -> usize {
        (self.seg.slot_bytes() / std::mem::size_of::<T>()).max(1)
    }

    /// `dst = d0 op d1 op …` over ranks, where `own` is this rank's
    /// contribution (`None`: already in `dst`) and the others' sit in
    /// their slot `b` at byte `offset`.
    ///
    /// Ranks 0 and 1 fold into `dst` in place: every operator here is
    /// commutative (`d1 op d0 == d0 op d1`), so only ranks from 2 on must
    /// set their own values aside to keep the rank order.
    fn reduce_into<T: Element>(
        &self,
        dst: &mut [T],
        own: Option<&[T]>,
        b: usize,
        offset: usize,
        op: ReduceOp,
        scratch: &mut Scratch<T>,
    ) {
        let (r, n) = (self.mesh.rank, self.mesh.world);
        let size = std::mem::size_of::<T>();
        let block = (BLOCK_BYTES / size).max(1);
        for (k, d) in dst.chunks_mut(block).enumerate() {
            let at = offset + k * block * size;
            let own = own.map(|o| &o[k * block..k * block + d.len()]);
            scratch.peer.resize(d.len(), T::zeroed());
            let peer = &mut scratch.peer[..];
            if r <= 1 {
                if let Some(o) = own {
                    d.copy_from_slice(o);
                }
                for q in (0..n).filter(|&q| q != r) {
                    self.seg.read(q, b, at, peer);
                    T::reduce(d, peer, op);
                }
            } else {
                let o = match own {
                    Some(o) => o,
                    None => {
                        scratch.own.clear();
                        scratch.own.extend_from_slice(d);
                        &scratch.own[..]
                    }
                };
                self.seg.read(0, b, at, d);
                for q in 1..n {
                    if q == r {
                        T::reduce(d, o, op);
                    } else {
                        self.seg.read(q, b, at, peer);
                        T::reduce(d, peer, op);
                    }
                }
            }
            if op == ReduceOp::Mean {
                T::divide(d, n);
            }
        }
    }
}

/// Per-call buffers of one reduction block.
struct Scratch<T> {
    /// A peer's block, copied out of its slot.
    peer: Vec<T>,
    /// This rank's own block, set aside (ranks from 2 on).
    own: Vec<T>,
}

impl<T> Default for Scratch<T> {
    fn default() -> Self {
        Self {
            peer: Vec::new(),
            own: Vec::new(),
        }
    }
}

/// The element range of sub-piece `c` when `len` elements are split into
/// `n` parts whose sizes differ by at most one.
fn part(len: usize, n: usize, c: usize) -> std::ops::Range<usize> {
    let bound = |c: usize| (len as u128 * c as u128 / n as u128) as usize;
    bound(c)..bound(c + 1)
}

/// A descriptor in words, for mismatch messages.
fn describe(d: &[u64]) -> String {
    let byte = |shift: u32| (d[0] >> shift) as u8;
    describe_call(byte(0), byte(8), byte(16), d[1], d[2])
}

/// All-reduce of `buf` in place.
pub(crate) fn all_reduce<T: Element>(
    call: &mut Call<'_>,
    buf: &mut [T],
    op: ReduceOp,
) -> Result<(), Fault> {
    let (r, n) = (call.mesh.rank, call.mesh.world);
    let size = std::mem::size_of::<T>();
    let per_step = call.slot_elems::<T>();
    let mut scratch = Scratch::default();
    let total = buf.len();
    for k in 0..Call::steps(total, per_step) {
        let start = (k * per_step).min(total);
        let piece = &mut buf[start..(start + per_step).min(total)];
        let len = piece.len();
        let (s, b) = call.begin()?;
        for q in call.peers() {
            let sub = part(len, n, q);
            call.seg.write(r, b, sub.start * size, &piece[sub]);
        }
        call.written(s, b)?;
        let mine = part(len, n, r);
        let at = mine.start * size;
        call.reduce_into(&mut piece[mine.clone()], None, b, at, op, &mut scratch);
        call.seg.write(r, b, mine.start * size, &piece[mine]);
        call.publish(s, Counter::Reduced);
        for q in call.peers() {
            call.waiter
                .until(q, call.seg.counter(q, Counter::Reduced), s + 1)?;
            let sub = part(len, n, q);
            call.seg.read(q, b, sub.start * size, &mut piece[sub]);
        }
        call.publish(s, Counter::Done);
    }
    Ok(())
}

/// All-gather: `out` is `world` blocks of `input.len()`.
pub(crate) fn all_gather<T: Element>(
    call: &mut Call<'_>,
    input: &[T],
    out: &mut [T],
) -> Result<(), Fault> {
    let (r, len) = (call.mesh.rank, input.len());
    let per_step = call.slot_elems::<T>();
    for k in 0..Call::steps(len, per_step) {
        let range = (k * per_step).min(len)..((k + 1) * per_step).min(len);
        let (s, b) = call.begin()?;
        call.seg.write(r, b, 0, &input[range.clone()]);
        // The piece is in cache now: its copy into the own block costs no
        // second read from memory.
        out[r * len + range.start..r * len + range.end].copy_from_slice(&input[range.clone()]);
        call.written(s, b)?;
        for q in call.peers() {
            let dst = &mut out[q * len + range.start..q * len + range.end];
            call.seg.read(q, b, 0, dst);
        }
        call.publish(s, Counter::Done);
    }
    Ok(())
}

/// Reduce-scatter: rank `r` gets block `r` of the reduced `input`.
pub(crate) fn reduce_scatter<T: Element>(
    call: &mut Call<'_>,
    input: &[T],
    out: &mut [T],
    op: ReduceOp,
) -> Result<(), Fault> {
    let (r, n, len) = (call.mesh.rank, call.mesh.world, out.len());
    let size = std::mem::size_of::<T>();
    // Each step carries one piece for every destination rank.
    let per_step = (call.slot_elems::<T>() / n).max(1);
    let mut scratch = Scratch::default();
    for k in 0..Call::steps(len, per_step) {
        let range = (k * per_step).min(len)..((k + 1) * per_step).min(len);
        let block = |q: usize| &input[q * len + range.start..q * len + range.end];
        let (s, b) = call.begin()?;
        for q in call.peers() {
            call.seg.write(r, b, q * per_step * size, block(q));
        }
        call.written(s, b)?;
        call.reduce_into(
            &mut out[range.clone()],
            Some(block(r)),
            b,
            r * per_step * size,
            op,
            &mut scratch,
        );
        call.publish(s, Counter::Done);
    }
    Ok(())
}

/// Broadcast from `root`: the root fills its slot, every other rank copies it out.
pub(crate) fn broadcast<T: Element>(
    call: &mut Call<'_>,
    buf: &mut [T],
    root: usize,
) -> Result<(), Fault> {
    let (r, len) = (call.mesh.rank, buf.len());
    let per_step = call.slot_elems::<T>();
    for k in 0..Call::steps(len, per_step) {
        let range = (k * per_step).min(len)..((k + 1) * per_step).min(len);
        let (s, b) = call.begin()?;
        if r == root {
            call.seg.write(r, b, 0, &buf[range.clone()]);
        }
        call.written(s, b)?;
        if r != root {
            call.seg.read(root, b, 0, &mut buf[range]);
        }
        call.publish(s, Counter::Done);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_cover_the_piece_in_order() {
        assert_eq!(part(10, 3, 0), 0..3);
        assert_eq!(part(10, 3, 1), 3..6);
        assert_eq!(part(10, 3, 2), 6..10);
        assert_eq!(part(1, 2, 0), 0..0);
        assert_eq!(Call::steps(0, 4), 1);
        assert_eq!(Call::steps(9, 4), 3);
    }
}
