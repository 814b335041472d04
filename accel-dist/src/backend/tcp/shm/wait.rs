//! Waiting for a peer's counter: spin, then yield, then sleep; give up on
//! the timeout, a dead peer or an abort frame.
//!
//! A counter in shared memory cannot tell a slow peer from a dead one, so
//! while it waits a rank also watches the socket mesh, which carries no
//! data during a shared-memory collective: end-of-stream there means the
//! peer process is gone (the kernel closes its sockets however it died),
//! and an abort frame means another rank saw a failure first. Checking is a
//! non-blocking `recv(MSG_PEEK)` per peer, so nothing is consumed unless it
//! is an abort. A data frame of a later call is a peer already in a later
//! socket collective, alive and waiting for us, and is left for that call;
//! one of this very call means the peer took the socket path for it (a
//! different size or dtype), which is reported as a mismatch at once
//! rather than after the timeout.
//!
//! Spinning keeps the latency of small calls in microseconds when each rank
//! has a core; yielding and then short sleeps hand the core over when ranks
//! share cores (2 ranks on 2 busy cores), where spinning would starve the
//! very peer being waited for.

use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use nix::sys::socket::{recv, MsgFlags};

use super::super::wire::{
    describe, describe_call, read_header, Ctl, Fault, Header, ABORT, DATA, HEADER_LEN,
};
use super::super::{Mesh, Op};

/// Busy checks before the first yield.
const SPINS: u32 = 256;
/// How long to yield before sleeping between checks.
const YIELD_FOR: Duration = Duration::from_micros(200);
/// The sleep between checks after that.
const NAP: Duration = Duration::from_micros(50);
/// How often the sockets are checked for a dead or aborting peer.
const LIVENESS_EVERY: Duration = Duration::from_micros(500);

/// Waits on counters of the peers of one call.
pub(crate) struct Waiter<'a> {
    mesh: &'a Mesh,
    /// The header of the running call, for reading an abort frame.
    expect: Header,
    /// This rank's buffer size in the call, for mismatch messages.
    total_bytes: usize,
    /// Peers seen sending a data frame of a later call: alive, not rechecked.
    ahead: Vec<bool>,
}

impl<'a> Waiter<'a> {
    pub fn new(mesh: &'a Mesh, expect: Header, total_bytes: usize) -> Self {
        Self {
            mesh,
            expect,
            total_bytes,
            ahead: vec![false; mesh.world],
        }
    }

    /// Returns once `counter` (owned by `peer`) is at least `target`.
    ///
    /// # Errors
    /// [`Fault::Timeout`] naming `peer` after the timeout without progress;
    /// [`Fault::Closed`]/[`Fault::Aborted`] as soon as the mesh shows a peer
    /// died or a failure was reported.
    pub fn until(&mut self, peer: usize, counter: &AtomicU64, target: u64) -> Result<(), Fault> {
        let reached = || counter.load(Ordering::Acquire) >= target;
        for _ in 0..SPINS {
            if reached() {
                return Ok(());
            }
            std::hint::spin_loop();
        }
        let start = Instant::now();
        let mut checked = start;
        self.check_peers()?;
        loop {
            if reached() {
                return Ok(());
            }
            let now = Instant::now();
            if now.duration_since(checked) >= LIVENESS_EVERY {
                self.check_peers()?;
                checked = now;
            }
            let waited = now.duration_since(start);
            if waited >= self.mesh.timeout {
                return Err(Fault::Timeout { peer });
            }
            if waited < YIELD_FOR {
                std::thread::yield_now();
            } else {
                std::thread::sleep(NAP);
            }
        }
    }

    /// Looks at every peer's socket without blocking.
    fn check_peers(&mut self) -> Result<(), Fault> {
        for link in self.mesh.links.iter().flatten() {
            if self.ahead[link.peer] {
                continue;
            }
            let mut head = [0u8; HEADER_LEN];
            let fd = link.stream.as_raw_fd();
            match recv(fd, &mut head, MsgFlags::MSG_PEEK | MsgFlags::MSG_DONTWAIT) {
                Ok(0) => {
                    return Err(Fault::Closed {
                        peer: link.peer,
                        reason: "end of stream".into(),
                    })
                }
                Ok(_) if head[0] == ABORT => {
                    let ctl = Ctl {
                        timeout: self.mesh.timeout,
                        cancel: None,
                    };
                    // An abort frame always turns into an error here.
                    read_header(link, self.expect, 0, ctl)?;
                    return Err(Fault::Closed {
                        peer: link.peer,
                        reason: "unexpected frame".into(),
                    });
                }
                Ok(HEADER_LEN) => {
                    let got = Header::decode(&head);
                    // Point-to-point frames count per pair, not per collective.
                    let same_call = got.kind == DATA
                        && got.op != Op::SendRecv as u8
                        && got.seq == self.expect.seq;
                    if same_call {
                        let detail = format!(
                            "it sent {} over a socket while this rank runs {} through shared \
                             memory; every rank must make the same calls in the same order with \
                             the same buffer sizes",
                            describe(&got),
                            describe_call(
                                self.expect.op,
                                self.expect.dtype,
                                self.expect.reduce,
                                self.total_bytes as u64,
                                self.expect.seq
                            )
                        );
                        return Err(Fault::Mismatch {
                            peer: link.peer,
                            detail,
                        });
                    }
                    self.ahead[link.peer] = true;
                }
                // Part of a header: look again at the next check.
                Ok(_) => {}
                Err(nix::errno::Errno::EAGAIN | nix::errno::Errno::EINTR) => {}
                Err(e) => {
                    return Err(Fault::Closed {
                        peer: link.peer,
                        reason: e.to_string(),
                    })
                }
            }
        }
        Ok(())
    }
}
