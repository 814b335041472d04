//! Bandwidth-optimal ring collectives, pipelined in segments.
//!
//! The buffer is cut into `world` chunks and every chunk into segments. In
//! the ring all-reduce (reduce-scatter, then all-gather) each rank sends
//! `2 (n-1)/n` of the buffer to its successor and receives as much from its
//! predecessor: the minimum a lossless all-reduce can move.
//!
//! A writer thread per operation sends segments to the successor while the
//! calling thread receives from the predecessor and reduces, so sending,
//! receiving and reducing overlap, and a segment is forwarded as soon as it
//! is reduced (the reduce-scatter's last step feeds the all-gather's first).
//! The two threads pass ownership of segments (`&mut [T]`) to each other
//! through channels: the writer hands a segment back once sent, and the
//! reader takes it back before overwriting it. No segment is ever shared,
//! so there is no `unsafe` and no data race, and a segment cannot be
//! overwritten while it is still being sent.
//!
//! Why this cannot deadlock: a reduce-scatter step only needs data from the
//! predecessor's previous step, and the first step needs nothing; the reader
//! waits for a segment to come back from its writer only in the all-gather,
//! after it has consumed every reduce-scatter frame its predecessor sends.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
use std::sync::Mutex;
use std::time::Duration;

use super::wire::{read_exact, read_header, write_frame, Ctl, Fault, Header, Link};
use super::Mesh;
use crate::{Element, ReduceOp};

/// How often a thread waiting on a channel checks whether the other failed.
const POLL: Duration = Duration::from_millis(50);

/// A segment moving between the reader and the writer, tagged with its place.
struct Job<'s, T> {
    chunk: usize,
    seg: usize,
    data: &'s mut [T],
}

/// What the two threads of one operation share.
#[derive(Default)]
struct Shared {
    failed: AtomicBool,
    fault: Mutex<Option<Fault>>,
}

/// The reader's side of a running pipeline: the segments it holds, and the
/// channels to and from the writer.
struct Pipe<'s, 'a, T> {
    slots: Vec<Vec<Option<&'s mut [T]>>>,
    to_writer: Sender<Job<'s, T>>,
    from_writer: Receiver<Job<'s, T>>,
    shared: &'a Shared,
    timeout: Duration,
}

impl<'s, T: Element> Pipe<'s, '_, T> {
    fn segments(&self, chunk: usize) -> usize {
        self.slots[chunk].len()
    }

    fn ctl(&self) -> Ctl<'_> {
        Ctl {
            timeout: self.timeout,
            cancel: Some(&self.shared.failed),
        }
    }

    /// Takes a segment, waiting for the writer to hand it back if it is being sent.
    fn take(&mut self, chunk: usize, seg: usize) -> Result<&'s mut [T], Fault> {
        loop {
            if let Some(data) = self.slots[chunk][seg].take() {
                return Ok(data);
            }
            match self.from_writer.recv_timeout(POLL) {
                Ok(job) => self.slots[job.chunk][job.seg] = Some(job.data),
                Err(RecvTimeoutError::Timeout) if !self.shared.failed.load(Ordering::Relaxed) => {}
                Err(_) => return Err(Fault::Cancelled),
            }
        }
    }

    /// Queues a segment for the successor.
    fn send(&self, chunk: usize, seg: usize, data: &'s mut [T]) {
        // If the writer has stopped, its fault surfaces when the operation ends.
        let _ = self.to_writer.send(Job { chunk, seg, data });
    }

    fn put(&mut self, chunk: usize, seg: usize, data: &'s mut [T]) {
        self.slots[chunk][seg] = Some(data);
    }

    /// Receives the next segment from `link` into `dst`.
    fn recv(&self, link: &Link, expect: Header, dst: &mut [T]) -> Result<(), Fault> {
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(dst);
        read_header(link, expect, bytes.len(), self.ctl())?;
        read_exact(link, bytes, self.ctl())
    }
}

/// Sends queued segments in order and hands each back once it is on the wire.
fn writer<'s, T: Element>(
    link: &Link,
    header: Header,
    jobs: Receiver<Job<'s, T>>,
    back: Sender<Job<'s, T>>,
    shared: &Shared,
    timeout: Duration,
) {
    let ctl = Ctl {
        timeout,
        cancel: Some(&shared.failed),
    };
    for job in jobs {
        if shared.failed.load(Ordering::Relaxed) {
            return;
        }
        let bytes: &[u8] = bytemuck::cast_slice(job.data);
        if let Err(fault) = write_frame(link, header.with_len(bytes.len()), bytes, ctl) {
            if !matches!(fault, Fault::Cancelled) {
                *shared.fault.lock().unwrap_or_else(|p| p.into_inner()) = Some(fault);
            }
            shared.failed.store(true, Ordering::Relaxed);
            return;
        }
        let _ = back.send(job);
    }
}

/// Cuts `buf` into chunks of `chunk_lens` and each chunk into segments, runs
/// `body` as the reader while a writer thread feeds `next`, and returns the
/// first real fault of either thread.
fn pipeline<T: Element>(
    mesh: &Mesh,
    next: usize,
    header: Header,
    buf: &mut [T],
    chunk_lens: &[usize],
    body: impl FnOnce(&mut Pipe<'_, '_, T>) -> Result<(), Fault>,
) -> Result<(), Fault> {
    let seg = (mesh.segment_bytes / std::mem::size_of::<T>()).max(1);
    let shared = Shared::default();
    let link = mesh.link(next);
    std::thread::scope(|s| {
        let (to_writer, jobs) = channel();
        let (back, from_writer) = channel();
        let shared = &shared;
        let timeout = mesh.timeout;
        let handle = s.spawn(move || writer(link, header, jobs, back, shared, timeout));
        let mut slots = Vec::with_capacity(chunk_lens.len());
        let mut rest = buf;
        for &len in chunk_lens {
            let (chunk, tail) = rest.split_at_mut(len);
            rest = tail;
            slots.push(chunk.chunks_mut(seg).map(Some).collect());
        }
        let mut pipe = Pipe {
            slots,
            to_writer,
            from_writer,
            shared,
            timeout,
        };
        let result = body(&mut pipe);
        if result.is_err() {
            shared.failed.store(true, Ordering::Relaxed);
        }
        // Closing the job channel lets the writer drain its queue and stop.
        drop(pipe);
        handle.join().expect("the ring writer does not panic");
        let writer_fault = shared
            .fault
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        match (result, writer_fault) {
            (Err(Fault::Cancelled), Some(fault)) | (Ok(()), Some(fault)) => Err(fault),
            (result, _) => result,
        }
    })
}

/// `len` elements split into `n` chunks whose sizes differ by at most one.
fn balanced(len: usize, n: usize) -> Vec<usize> {
    let bound = |c: usize| (len as u128 * c as u128 / n as u128) as usize;
    (0..n).map(|c| bound(c + 1) - bound(c)).collect()
}

/// Reduce-scatter: afterwards chunk `rank` holds the reduction (divided by
/// `n` for `Mean`). With `forward_final` it is also queued for the
/// all-gather that follows.
fn reduce_scatter_phase<T: Element>(
    mesh: &Mesh,
    pipe: &mut Pipe<'_, '_, T>,
    expect: Header,
    op: ReduceOp,
    forward_final: bool,
) -> Result<(), Fault> {
    let (r, n) = (mesh.rank, mesh.world);
    let prev = mesh.link((r + n - 1) % n);
    let first = (r + n - 1) % n;
    for k in 0..pipe.segments(first) {
        let data = pipe.take(first, k)?;
        pipe.send(first, k, data);
    }
    let seg = (mesh.segment_bytes / std::mem::size_of::<T>()).max(1);
    let mut scratch = vec![T::zeroed(); seg];
    for step in 0..n - 1 {
        let c = (r + 2 * n - step - 2) % n;
        let last = step == n - 2;
        for k in 0..pipe.segments(c) {
            let dst = pipe.take(c, k)?;
            let tmp = &mut scratch[..dst.len()];
            pipe.recv(prev, expect, tmp)?;
            T::reduce(dst, tmp, op);
            if last && op == ReduceOp::Mean {
                T::divide(dst, n);
            }
            if !last || forward_final {
                pipe.send(c, k, dst);
            } else {
                pipe.put(c, k, dst);
            }
        }
    }
    Ok(())
}

/// All-gather: starts with chunk `rank` complete (and already queued), ends
/// with every chunk complete.
fn all_gather_phase<T: Element>(
    mesh: &Mesh,
    pipe: &mut Pipe<'_, '_, T>,
    expect: Header,
) -> Result<(), Fault> {
    let (r, n) = (mesh.rank, mesh.world);
    let prev = mesh.link((r + n - 1) % n);
    for step in 0..n - 1 {
        let c = (r + 2 * n - step - 1) % n;
        for k in 0..pipe.segments(c) {
            let dst = pipe.take(c, k)?;
            pipe.recv(prev, expect, dst)?;
            if step < n - 2 {
                pipe.send(c, k, dst);
            } else {
                pipe.put(c, k, dst);
            }
        }
    }
    Ok(())
}

/// Ring all-reduce of `buf` in place.
pub(crate) fn all_reduce<T: Element>(
    mesh: &Mesh,
    buf: &mut [T],
    op: ReduceOp,
    expect: Header,
) -> Result<(), Fault> {
    let n = mesh.world;
    let lens = balanced(buf.len(), n);
    pipeline(mesh, (mesh.rank + 1) % n, expect, buf, &lens, |pipe| {
        reduce_scatter_phase(mesh, pipe, expect, op, true)?;
        all_gather_phase(mesh, pipe, expect)
    })
}

/// Ring all-gather: `out` holds this rank's block at chunk `rank` on entry.
pub(crate) fn all_gather<T: Element>(
    mesh: &Mesh,
    out: &mut [T],
    expect: Header,
) -> Result<(), Fault> {
    let (r, n) = (mesh.rank, mesh.world);
    let lens = vec![out.len() / n; n];
    pipeline(mesh, (r + 1) % n, expect, out, &lens, |pipe| {
        for k in 0..pipe.segments(r) {
            let data = pipe.take(r, k)?;
            pipe.send(r, k, data);
        }
        all_gather_phase(mesh, pipe, expect)
    })
}

/// Ring reduce-scatter: reduces `work` (a copy of the input, clobbered) and
/// copies block `rank` into `out`.
pub(crate) fn reduce_scatter<T: Element>(
    mesh: &Mesh,
    work: &mut [T],
    out: &mut [T],
    op: ReduceOp,
    expect: Header,
) -> Result<(), Fault> {
    let (r, n) = (mesh.rank, mesh.world);
    let lens = vec![out.len(); n];
    pipeline(mesh, (r + 1) % n, expect, work, &lens, |pipe| {
        reduce_scatter_phase(mesh, pipe, expect, op, false)?;
        let mut done = 0;
        for k in 0..pipe.segments(r) {
            let data = pipe.take(r, k)?;
            out[done..done + data.len()].copy_from_slice(data);
            done += data.len();
        }
        Ok(())
    })
}

/// Pipelined chain broadcast: `root` → `root+1` → … → `root-1`, each rank
/// forwarding a segment as soon as it has it.
pub(crate) fn broadcast<T: Element>(
    mesh: &Mesh,
    buf: &mut [T],
    root: usize,
    expect: Header,
) -> Result<(), Fault> {
    let (r, n) = (mesh.rank, mesh.world);
    let seg = (mesh.segment_bytes / std::mem::size_of::<T>()).max(1);
    let pos = (r + n - root) % n;
    let (prev, next) = ((r + n - 1) % n, (r + 1) % n);
    let ctl = Ctl {
        timeout: mesh.timeout,
        cancel: None,
    };
    if pos == 0 {
        for part in buf.chunks(seg) {
            let bytes: &[u8] = bytemuck::cast_slice(part);
            write_frame(mesh.link(next), expect.with_len(bytes.len()), bytes, ctl)?;
        }
        return Ok(());
    }
    if pos == n - 1 {
        for part in buf.chunks_mut(seg) {
            let bytes: &mut [u8] = bytemuck::cast_slice_mut(part);
            read_header(mesh.link(prev), expect, bytes.len(), ctl)?;
            read_exact(mesh.link(prev), bytes, ctl)?;
        }
        return Ok(());
    }
    let len = buf.len();
    pipeline(mesh, next, expect, buf, &[len], |pipe| {
        for k in 0..pipe.segments(0) {
            let dst = pipe.take(0, k)?;
            pipe.recv(mesh.link(prev), expect, dst)?;
            pipe.send(0, k, dst);
        }
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn balanced_chunks_cover_the_buffer() {
        assert_eq!(balanced(10, 3), [3, 3, 4]);
        assert_eq!(balanced(1, 3), [0, 0, 1]);
        assert_eq!(balanced(0, 2), [0, 0]);
        assert_eq!(balanced(7, 7).iter().sum::<usize>(), 7);
    }
}
