//! Frames on peer connections, and reads and writes that time out or give up.
//!
//! Every message between two ranks is a frame: a 16-byte header, then
//! `len` payload bytes.
//!
//! ```text
//! kind:u8  op:u8  dtype:u8  reduce:u8  len:u32  seq:u64      (little-endian)
//! ```
//!
//! `kind` is `DATA` or `ABORT`. A data frame carries one segment of a
//! collective; `op`, `dtype`, `reduce` and `seq` (the collective's sequence
//! number, or the per-pair counter of `send`/`recv`) let the receiver check
//! that both ranks are running the same call with the same buffer. An abort
//! frame's payload is `failed_rank:u32` followed by a UTF-8 message: a rank
//! that sees a failure tells its other peers, so every survivor can name the
//! rank that died rather than the neighbour that gave up on it.
//!
//! Sockets carry short read/write timeouts (a "tick"); the loops here retry
//! on each tick until the real timeout passes without progress, and check a
//! cancel flag in between so a failure on one thread of an operation stops
//! the others promptly.

use std::io::{self, IoSlice, Read, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use super::stream::Stream;
use crate::reduce::{dtype_name, reduce_name};
use crate::Error;

/// Bytes in a frame header.
pub(crate) const HEADER_LEN: usize = 16;
/// Frame kinds.
pub(crate) const DATA: u8 = 1;
pub(crate) const ABORT: u8 = 2;
/// The largest abort message read back (a longer one is a corrupt stream).
const MAX_ABORT: usize = 64 * 1024;

/// A connection to one peer.
pub(crate) struct Link {
    /// The peer's rank.
    pub peer: usize,
    pub stream: Stream,
    /// False once a write stopped mid-frame: the stream can no longer carry an abort.
    pub tx_clean: AtomicBool,
}

/// A frame header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Header {
    pub kind: u8,
    pub op: u8,
    pub dtype: u8,
    pub reduce: u8,
    pub len: u32,
    pub seq: u64,
}

impl Header {
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0] = self.kind;
        b[1] = self.op;
        b[2] = self.dtype;
        b[3] = self.reduce;
        b[4..8].copy_from_slice(&self.len.to_le_bytes());
        b[8..16].copy_from_slice(&self.seq.to_le_bytes());
        b
    }

    pub fn decode(b: &[u8; HEADER_LEN]) -> Self {
        Self {
            kind: b[0],
            op: b[1],
            dtype: b[2],
            reduce: b[3],
            len: u32::from_le_bytes(b[4..8].try_into().expect("4 bytes")),
            seq: u64::from_le_bytes(b[8..16].try_into().expect("8 bytes")),
        }
    }

    /// The same header for a payload of `len` bytes.
    pub fn with_len(mut self, len: usize) -> Self {
        self.len = u32::try_from(len).expect("segments are far below 4 GiB");
        self
    }
}

/// What went wrong on a link, before the operation's name is attached.
#[derive(Debug)]
pub(crate) enum Fault {
    /// EOF or a reset: the peer process is gone or closed the group.
    Closed { peer: usize, reason: String },
    /// Nothing moved for the whole timeout.
    Timeout { peer: usize },
    /// A peer reported that `failed` failed.
    Aborted {
        failed: usize,
        reporter: usize,
        detail: String,
    },
    /// The peer runs a different call or buffer.
    Mismatch { peer: usize, detail: String },
    /// Another thread of this operation failed first; its fault is the real one.
    Cancelled,
}

impl Fault {
    /// The rank to blame, for abort messages to the other peers.
    pub fn culprit(&self) -> Option<usize> {
        match self {
            Fault::Closed { peer, .. } | Fault::Timeout { peer } | Fault::Mismatch { peer, .. } => {
                Some(*peer)
            }
            Fault::Aborted { failed, .. } => Some(*failed),
            Fault::Cancelled => None,
        }
    }

    /// The rank that told us, when the fault was reported rather than seen.
    pub fn reporter(&self) -> Option<usize> {
        match self {
            Fault::Aborted { reporter, .. } => Some(*reporter),
            _ => None,
        }
    }

    pub fn into_error(self, op: &'static str, world: usize, timeout: Duration) -> Error {
        match self {
            Fault::Closed { peer, reason } => Error::PeerClosed {
                op,
                rank: peer,
                world,
                reason,
            },
            Fault::Timeout { peer } => Error::PeerTimeout {
                op,
                rank: peer,
                waited: timeout,
                world,
            },
            Fault::Aborted {
                failed,
                reporter,
                detail,
            } => Error::PeerFailed {
                op,
                rank: failed,
                reporter,
                detail,
            },
            Fault::Mismatch { peer, detail } => Error::Mismatch {
                op,
                rank: peer,
                detail,
            },
            Fault::Cancelled => Error::Poisoned {
                op,
                cause: "the operation was cancelled".into(),
            },
        }
    }
}

/// How long I/O may wait, and the flag that cancels it.
#[derive(Clone, Copy)]
pub(crate) struct Ctl<'a> {
    pub timeout: Duration,
    pub cancel: Option<&'a AtomicBool>,
}

impl Ctl<'_> {
    /// Decides what a socket timeout tick means: keep waiting, or give up.
    fn on_tick(&self, peer: usize, last_progress: Instant) -> Result<(), Fault> {
        if self.cancel.is_some_and(|c| c.load(Ordering::Relaxed)) {
            return Err(Fault::Cancelled);
        }
        if last_progress.elapsed() >= self.timeout {
            return Err(Fault::Timeout { peer });
        }
        Ok(())
    }
}

fn closed(peer: usize, e: impl ToString) -> Fault {
    Fault::Closed {
        peer,
        reason: e.to_string(),
    }
}

fn is_tick(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
    )
}

/// Fills `buf` from the link.
pub(crate) fn read_exact(link: &Link, mut buf: &mut [u8], ctl: Ctl<'_>) -> Result<(), Fault> {
    let mut last = Instant::now();
    while !buf.is_empty() {
        match (&link.stream).read(buf) {
            Ok(0) => return Err(closed(link.peer, "end of stream")),
            Ok(n) => {
                buf = &mut buf[n..];
                last = Instant::now();
            }
            Err(e) if is_tick(&e) => ctl.on_tick(link.peer, last)?,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(closed(link.peer, e)),
        }
    }
    Ok(())
}

/// Writes a header and its payload (one `writev` in the common case).
pub(crate) fn write_frame(
    link: &Link,
    header: Header,
    payload: &[u8],
    ctl: Ctl<'_>,
) -> Result<(), Fault> {
    let head = header.encode();
    let mut parts = [IoSlice::new(&head), IoSlice::new(payload)];
    let mut parts = &mut parts[..];
    IoSlice::advance_slices(&mut parts, 0);
    let mut last = Instant::now();
    let started = parts.len();
    while !parts.is_empty() {
        match (&link.stream).write_vectored(parts) {
            Ok(0) => return Err(closed(link.peer, "the connection accepts no more data")),
            Ok(n) => {
                IoSlice::advance_slices(&mut parts, n);
                last = Instant::now();
            }
            Err(e) if is_tick(&e) => {
                if let Err(fault) = ctl.on_tick(link.peer, last) {
                    if parts.len() != started || parts.first().map(|p| p.len()) != Some(HEADER_LEN)
                    {
                        link.tx_clean.store(false, Ordering::Relaxed);
                    }
                    return Err(fault);
                }
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => {
                link.tx_clean.store(false, Ordering::Relaxed);
                return Err(closed(link.peer, e));
            }
        }
    }
    Ok(())
}

/// Reads a frame header, turning an abort frame into [`Fault::Aborted`] and
/// a frame of another call or size into [`Fault::Mismatch`].
pub(crate) fn read_header(
    link: &Link,
    // The header the frame must carry, up to its length.
    expect: Header,
    len: usize,
    ctl: Ctl<'_>,
) -> Result<(), Fault> {
    let mut raw = [0u8; HEADER_LEN];
    read_exact(link, &mut raw, ctl)?;
    let got = Header::decode(&raw);
    if got.kind == ABORT {
        return Err(read_abort(link, got, ctl));
    }
    let want = expect.with_len(len);
    if got != want {
        let detail = format!(
            "it sent {} while this rank runs {}; every rank must make the same calls in the same \
             order with the same buffer sizes",
            describe(&got),
            describe(&want)
        );
        return Err(Fault::Mismatch {
            peer: link.peer,
            detail,
        });
    }
    Ok(())
}

fn read_abort(link: &Link, header: Header, ctl: Ctl<'_>) -> Fault {
    let len = header.len as usize;
    if !(4..=MAX_ABORT).contains(&len) {
        return closed(link.peer, "corrupt abort frame");
    }
    let mut payload = vec![0u8; len];
    if let Err(fault) = read_exact(link, &mut payload, ctl) {
        return fault;
    }
    let failed = u32::from_le_bytes(payload[..4].try_into().expect("4 bytes")) as usize;
    Fault::Aborted {
        failed,
        reporter: link.peer,
        detail: String::from_utf8_lossy(&payload[4..]).into_owned(),
    }
}

/// Tells a peer that `failed` failed; best effort, bounded by `ctl`.
pub(crate) fn send_abort(link: &Link, failed: usize, detail: &str, ctl: Ctl<'_>) {
    if !link.tx_clean.load(Ordering::Relaxed) {
        return;
    }
    let mut payload = (failed as u32).to_le_bytes().to_vec();
    let detail = &detail.as_bytes()[..detail.len().min(MAX_ABORT - 4)];
    payload.extend_from_slice(detail);
    let header = Header {
        kind: ABORT,
        op: 0,
        dtype: 0,
        reduce: 0,
        len: payload.len() as u32,
        seq: 0,
    };
    let _ = write_frame(link, header, &payload, ctl);
    // Nothing may follow an abort on this stream.
    link.tx_clean.store(false, Ordering::Relaxed);
}

/// A data frame header in words, e.g. `all_reduce #3 (16 bytes of f32, Sum)`.
pub(crate) fn describe(h: &Header) -> String {
    if h.kind != DATA {
        return format!("an unknown frame (kind {}, op {})", h.kind, h.op);
    }
    describe_call(h.op, h.dtype, h.reduce, h.len.into(), h.seq)
}

/// A call in words from its parts (shared with the shared-memory path).
pub(crate) fn describe_call(op: u8, dtype: u8, reduce: u8, len: u64, seq: u64) -> String {
    use super::Op;
    let Some(op_) = Op::from_code(op) else {
        return format!("an unknown call (op {op})");
    };
    let extra = match op_ {
        Op::AllReduce | Op::ReduceScatter => format!(", {}", reduce_name(reduce)),
        Op::Broadcast => format!(", root {reduce}"),
        Op::AllGather | Op::SendRecv => String::new(),
    };
    format!(
        "{} #{seq} ({len} bytes of {}{extra})",
        op_.name(),
        dtype_name(dtype)
    )
}

#[cfg(test)]
mod tests {
    use std::net::{TcpListener, TcpStream};

    use super::*;

    /// Rank 0's link to rank 1, and rank 1's link to rank 0.
    fn pair() -> (Link, Link) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (b, _) = l.accept().unwrap();
        for s in [&a, &b] {
            s.set_read_timeout(Some(Duration::from_millis(20))).unwrap();
            s.set_write_timeout(Some(Duration::from_millis(20)))
                .unwrap();
        }
        let link = |peer, stream| Link {
            peer,
            stream: Stream::Tcp(stream),
            tx_clean: AtomicBool::new(true),
        };
        (link(1, a), link(0, b))
    }

    fn ctl(ms: u64) -> Ctl<'static> {
        Ctl {
            timeout: Duration::from_millis(ms),
            cancel: None,
        }
    }

    const BASE: Header = Header {
        kind: DATA,
        op: 1,
        dtype: 6,
        reduce: 0,
        len: 0,
        seq: 7,
    };

    #[test]
    fn a_frame_round_trips_and_is_checked() {
        let (a, b) = pair();
        write_frame(&a, BASE.with_len(3), &[1, 2, 3], ctl(1000)).unwrap();
        let expect = BASE;
        read_header(&b, expect, 3, ctl(1000)).unwrap();
        let mut payload = [0u8; 3];
        read_exact(&b, &mut payload, ctl(1000)).unwrap();
        assert_eq!(payload, [1, 2, 3]);

        write_frame(&a, BASE.with_len(4), &[0; 4], ctl(1000)).unwrap();
        match read_header(&b, expect, 3, ctl(1000)) {
            Err(Fault::Mismatch { peer: 0, detail }) => {
                assert!(
                    detail.contains("it sent all_reduce #7 (4 bytes of f32, Sum)"),
                    "{detail}"
                )
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn an_abort_frame_names_the_failed_rank() {
        let (a, b) = pair();
        send_abort(&a, 2, "rank 2 vanished", ctl(1000));
        let expect = BASE;
        match read_header(&b, expect, 8, ctl(1000)) {
            Err(Fault::Aborted {
                failed: 2,
                reporter: 0,
                detail,
            }) => assert_eq!(detail, "rank 2 vanished"),
            other => panic!("{other:?}"),
        }
        assert!(!a.tx_clean.load(Ordering::Relaxed));
    }

    #[test]
    fn silence_times_out_and_a_close_is_seen() {
        let (a, b) = pair();
        let start = Instant::now();
        match read_exact(&b, &mut [0u8; 1], ctl(100)) {
            Err(Fault::Timeout { peer: 0 }) => {}
            other => panic!("{other:?}"),
        }
        assert!(start.elapsed() >= Duration::from_millis(100));
        drop(a);
        assert!(matches!(
            read_exact(&b, &mut [0u8; 1], ctl(1000)),
            Err(Fault::Closed { peer: 0, .. })
        ));
    }

    #[test]
    fn the_cancel_flag_interrupts_a_wait() {
        let (_a, b) = pair();
        let cancel = AtomicBool::new(true);
        let ctl = Ctl {
            timeout: Duration::from_secs(60),
            cancel: Some(&cancel),
        };
        assert!(matches!(
            read_exact(&b, &mut [0u8; 1], ctl),
            Err(Fault::Cancelled)
        ));
    }
}
