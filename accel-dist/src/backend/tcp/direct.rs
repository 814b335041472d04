//! Latency-optimal collectives for small buffers: every rank exchanges
//! with every other rank in one round.
//!
//! Each rank writes its frames to all peers, then reads one frame from each
//! peer in rank order. A ring needs `2 (n-1)` dependent steps; this needs
//! one, at the price of sending `n-1` copies, which only matters once
//! messages are large. Reductions run in rank order (`d0 op d1 op d2 …`) on
//! every rank, so floating-point results are bitwise identical everywhere.
//!
//! Frames up to 64 KiB are written before any read. That cannot deadlock:
//! no rank can be more than one call ahead of another (finishing a call
//! needs every peer's frame of it), so a rank blocked writing to a peer
//! would need that peer to be a call behind and itself blocked writing to a
//! rank a call behind it, and so on around a cycle, which the one-call
//! spread rules out; and one frame always fits in the kernel's buffers of
//! an idle connection (at least the 64 KiB initial TCP window plus the send
//! buffer; ~200 KiB for a Unix socket). Larger frames go through a scoped
//! writer thread so both directions flow at once.

use std::sync::atomic::{AtomicBool, Ordering};

use super::wire::{read_exact, read_header, write_frame, Ctl, Fault, Header};
use super::Mesh;
use crate::{Element, ReduceOp};

/// Frames up to this size are written inline before reading (see above).
const INLINE_MAX: usize = 64 * 1024;

/// Writes `sends[i].1` to rank `sends[i].0` and reads a frame from rank
/// `recvs[i].0` into `recvs[i].1`, all concurrently.
fn exchange(
    mesh: &Mesh,
    expect: Header,
    sends: &[(usize, &[u8])],
    recvs: &mut [(usize, &mut [u8])],
) -> Result<(), Fault> {
    let write_all = |ctl: Ctl<'_>| -> Result<(), Fault> {
        for &(peer, payload) in sends {
            write_frame(
                mesh.link(peer),
                expect.with_len(payload.len()),
                payload,
                ctl,
            )?;
        }
        Ok(())
    };
    let read_all = |recvs: &mut [(usize, &mut [u8])], ctl: Ctl<'_>| -> Result<(), Fault> {
        for (peer, dst) in recvs.iter_mut() {
            let link = mesh.link(*peer);
            read_header(link, expect, dst.len(), ctl)?;
            read_exact(link, dst, ctl)?;
        }
        Ok(())
    };
    let largest = sends.iter().map(|(_, p)| p.len()).max().unwrap_or(0);
    if largest <= INLINE_MAX || recvs.is_empty() {
        let ctl = Ctl {
            timeout: mesh.timeout,
            cancel: None,
        };
        write_all(ctl)?;
        return read_all(recvs, ctl);
    }
    let failed = AtomicBool::new(false);
    let ctl = Ctl {
        timeout: mesh.timeout,
        cancel: Some(&failed),
    };
    std::thread::scope(|s| {
        let writer = s.spawn(|| {
            let r = write_all(ctl);
            if r.is_err() {
                failed.store(true, Ordering::Relaxed);
            }
            r
        });
        let read = read_all(recvs, ctl);
        if read.is_err() {
            failed.store(true, Ordering::Relaxed);
        }
        let written = writer.join().expect("the direct writer does not panic");
        match (read, written) {
            (Err(Fault::Cancelled), Err(fault)) | (Ok(()), Err(fault)) => Err(fault),
            (read, _) => read,
        }
    })
}

/// Splits `buf` into `parts` consecutive slices of `len` elements.
fn split<T>(mut buf: &mut [T], parts: usize, len: usize) -> Vec<&mut [T]> {
    let mut out = Vec::with_capacity(parts);
    for _ in 0..parts {
        let (head, tail) = buf.split_at_mut(len);
        out.push(head);
        buf = tail;
    }
    out
}

fn peers(mesh: &Mesh) -> impl Iterator<Item = usize> + '_ {
    (0..mesh.world).filter(move |&p| p != mesh.rank)
}

/// `out = parts[0] op parts[1] op …` in rank order, then the mean's division.
fn reduce_in_order<T: Element>(out: &mut [T], parts: &[&[T]], op: ReduceOp, n: usize) {
    out.copy_from_slice(parts[0]);
    for part in &parts[1..] {
        T::reduce(out, part, op);
    }
    if op == ReduceOp::Mean {
        T::divide(out, n);
    }
}

/// All-reduce by full exchange.
pub(crate) fn all_reduce<T: Element>(
    mesh: &Mesh,
    buf: &mut [T],
    op: ReduceOp,
    expect: Header,
) -> Result<(), Fault> {
    let (r, n, len) = (mesh.rank, mesh.world, buf.len());
    let mut scratch = vec![T::zeroed(); len * (n - 1)];
    {
        let own: &[u8] = bytemuck::cast_slice(buf);
        let sends: Vec<(usize, &[u8])> = peers(mesh).map(|p| (p, own)).collect();
        let mut recvs: Vec<(usize, &mut [u8])> = peers(mesh)
            .zip(split(&mut scratch, n - 1, len))
            .map(|(p, s)| (p, bytemuck::cast_slice_mut(s)))
            .collect();
        exchange(mesh, expect, &sends, &mut recvs)?;
    }
    let own = buf.to_vec();
    let parts: Vec<&[T]> = (0..n)
        .map(|p| match p.cmp(&r) {
            std::cmp::Ordering::Less => &scratch[p * len..(p + 1) * len],
            std::cmp::Ordering::Equal => &own[..],
            std::cmp::Ordering::Greater => &scratch[(p - 1) * len..p * len],
        })
        .collect();
    reduce_in_order(buf, &parts, op, n);
    Ok(())
}

/// All-gather by full exchange: peers' blocks land directly in `out`.
pub(crate) fn all_gather<T: Element>(
    mesh: &Mesh,
    input: &[T],
    out: &mut [T],
    expect: Header,
) -> Result<(), Fault> {
    let (r, n) = (mesh.rank, mesh.world);
    let own: &[u8] = bytemuck::cast_slice(input);
    let sends: Vec<(usize, &[u8])> = peers(mesh).map(|p| (p, own)).collect();
    let mut blocks = split(out, n, input.len());
    blocks[r].copy_from_slice(input);
    let mut recvs: Vec<(usize, &mut [u8])> = blocks
        .into_iter()
        .enumerate()
        .filter(|(p, _)| *p != r)
        .map(|(p, b)| (p, bytemuck::cast_slice_mut(b)))
        .collect();
    exchange(mesh, expect, &sends, &mut recvs)
}

/// Reduce-scatter by full exchange: rank `p` gets block `p` of every input.
pub(crate) fn reduce_scatter<T: Element>(
    mesh: &Mesh,
    input: &[T],
    out: &mut [T],
    op: ReduceOp,
    expect: Header,
) -> Result<(), Fault> {
    let (r, n, len) = (mesh.rank, mesh.world, out.len());
    let block = |p: usize| &input[p * len..(p + 1) * len];
    let sends: Vec<(usize, &[u8])> = peers(mesh)
        .map(|p| (p, bytemuck::cast_slice(block(p))))
        .collect();
    let mut scratch = vec![T::zeroed(); len * (n - 1)];
    {
        let mut recvs: Vec<(usize, &mut [u8])> = peers(mesh)
            .zip(split(&mut scratch, n - 1, len))
            .map(|(p, s)| (p, bytemuck::cast_slice_mut(s)))
            .collect();
        exchange(mesh, expect, &sends, &mut recvs)?;
    }
    let parts: Vec<&[T]> = (0..n)
        .map(|p| match p.cmp(&r) {
            std::cmp::Ordering::Less => &scratch[p * len..(p + 1) * len],
            std::cmp::Ordering::Equal => block(r),
            std::cmp::Ordering::Greater => &scratch[(p - 1) * len..p * len],
        })
        .collect();
    reduce_in_order(out, &parts, op, n);
    Ok(())
}

/// Broadcast as a star: the root writes to every peer.
pub(crate) fn broadcast<T: Element>(
    mesh: &Mesh,
    buf: &mut [T],
    root: usize,
    expect: Header,
) -> Result<(), Fault> {
    if mesh.rank == root {
        let own: &[u8] = bytemuck::cast_slice(buf);
        let sends: Vec<(usize, &[u8])> = peers(mesh).map(|p| (p, own)).collect();
        exchange(mesh, expect, &sends, &mut [])
    } else {
        exchange(
            mesh,
            expect,
            &[],
            &mut [(root, bytemuck::cast_slice_mut(buf))],
        )
    }
}
