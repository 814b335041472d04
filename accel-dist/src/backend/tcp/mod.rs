//! Collectives between CPU processes over TCP (the role of PyTorch's gloo backend).
//!
//! [`TcpCommunicator::connect`] builds a full mesh of TCP connections
//! through the rendezvous store (see `mesh.rs`). Small buffers take the
//! one-round [`Algorithm::Direct`] path; large ones the pipelined
//! [`Algorithm::Ring`] (or [`Algorithm::Chain`] for broadcast). Framing and
//! timeouts live in `wire.rs`, the algorithms in `direct.rs` and `ring.rs`.
//!
//! When every rank is on this host, large collectives instead go through a
//! shared-memory segment ([`Algorithm::SharedMemory`], `shm/`): the kernel
//! copies of the socket path were half of all cycles of a 64 MiB
//! all-reduce at 2 ranks, and through shared memory each byte is copied
//! once into the segment and once out, reductions reading peers' data in
//! place. The mesh stays for small calls (one blocking round trip has the
//! better median latency on busy cores), point-to-point messages, and
//! failure reports. [`TcpConfig::shared_memory`] or `ACCEL_DIST_SHM=0`
//! switch it off; any rank that cannot map the segment keeps all ranks on
//! sockets.
//!
//! Failures never hang a rank: every read and write gives up after the
//! timeout without progress, a closed connection is reported at once, and a
//! rank that sees a peer fail sends an abort frame to its other peers, so
//! every survivor's error names the rank that failed. A shared-memory wait
//! has the same timeout and watches the mesh for a closed connection or an
//! abort frame, so it fails the same way. After a failure the
//! communicator refuses further calls ([`Error::Poisoned`]).
//!
//! Peers on the same host talk over Unix domain sockets unless
//! [`TcpConfig::unix_sockets`] is off (see `stream.rs`): same protocol, less
//! CPU per byte than loopback TCP.
//!
//! Socket buffers are left to the kernel: Linux grows TCP buffers on demand
//! up to `tcp_rmem`/`tcp_wmem` (megabytes), while an explicit `SO_SNDBUF`
//! would switch that autotuning off and be capped at the usually smaller
//! `wmem_max`.

mod config;
mod direct;
mod handshake;
mod mesh;
mod ring;
mod shm;
mod stream;
mod wire;

pub use config::{Algorithm, Collective, TcpConfig};
pub use shm::ENV_SHM;
pub use stream::Transport;

use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use wire::{send_abort, Ctl, Fault, Header, Link, DATA};

use crate::buffer::{with_buffer, with_buffer_pair, Buffer, BufferMut};
use crate::communicator::{check_pair, check_rank, check_reduce_buffer, copy_into, Longer};
use crate::reduce::dtype_code;
use crate::{Communicator, Error, ReduceOp, Result, TcpStore};

/// Operation codes on the wire.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Op {
    AllReduce = 1,
    AllGather = 2,
    ReduceScatter = 3,
    Broadcast = 4,
    SendRecv = 5,
}

impl Op {
    fn from_code(code: u8) -> Option<Self> {
        [
            Op::AllReduce,
            Op::AllGather,
            Op::ReduceScatter,
            Op::Broadcast,
            Op::SendRecv,
        ]
        .into_iter()
        .find(|op| *op as u8 == code)
    }

    fn name(self) -> &'static str {
        match self {
            Op::AllReduce => "all_reduce",
            Op::AllGather => "all_gather",
            Op::ReduceScatter => "reduce_scatter",
            Op::Broadcast => "broadcast",
            Op::SendRecv => "send/recv",
        }
    }
}

/// The connections and settings the algorithms run on.
struct Mesh {
    rank: usize,
    world: usize,
    links: Vec<Option<Link>>,
    timeout: Duration,
    segment_bytes: usize,
    /// The shared segment, when every rank is on this host and it is enabled.
    shm: Option<shm::SharedMemory>,
}

impl Mesh {
    fn link(&self, peer: usize) -> &Link {
        self.links[peer]
            .as_ref()
            .expect("a rank has a link to every other rank")
    }
}

/// Per-call bookkeeping, behind the lock that serializes calls.
struct State {
    /// Sequence number of the next collective (the same on every rank).
    seq: u64,
    /// Per-peer counters of point-to-point messages.
    sent: Vec<u64>,
    received: Vec<u64>,
    /// The first failure; set once, then every call fails.
    poisoned: Option<String>,
}

/// A [`Communicator`] over a full mesh of TCP connections between CPU processes.
///
/// Calls from several threads are serialized. Buffers are sent in native
/// byte order, so all ranks must share one endianness.
pub struct TcpCommunicator {
    mesh: Mesh,
    config: TcpConfig,
    state: Mutex<State>,
}

impl TcpCommunicator {
    /// Connects `world_size` ranks through `store` with default tuning.
    ///
    /// Every rank calls this with the same world size; the n-th communicator
    /// created on a store meets the n-th on every other rank.
    ///
    /// # Errors
    /// [`Error::PeerTimeout`] naming a rank that did not show up within
    /// `timeout`; [`Error::Connect`]/[`Error::Refused`] when a peer cannot be reached.
    pub fn connect(
        store: &TcpStore,
        rank: usize,
        world_size: usize,
        timeout: Duration,
    ) -> Result<Self> {
        Self::connect_with(
            store,
            rank,
            world_size,
            TcpConfig::default().with_timeout(timeout),
        )
    }

    /// As [`connect`](Self::connect), with explicit tuning.
    pub fn connect_with(
        store: &TcpStore,
        rank: usize,
        world_size: usize,
        config: TcpConfig,
    ) -> Result<Self> {
        if world_size == 0 {
            return Err(Error::InvalidRank {
                op: "connect",
                rank,
                world: world_size,
            });
        }
        check_rank("connect", rank, world_size)?;
        let links = mesh::connect(store, rank, world_size, config.timeout, config.unix_sockets)?;
        let wanted = config.shared_memory && shm::env_allows();
        let shm = if world_size > 1 {
            shm::negotiate(store, rank, world_size, wanted, config.shm_slot_bytes)?
        } else {
            None
        };
        tracing::debug!(
            rank,
            world_size,
            shared_memory = shm.is_some(),
            "tcp communicator connected"
        );
        Ok(Self {
            mesh: Mesh {
                rank,
                world: world_size,
                links,
                timeout: config.timeout,
                segment_bytes: config.segment_bytes.max(1),
                shm,
            },
            state: Mutex::new(State {
                seq: 0,
                sent: vec![0; world_size],
                received: vec![0; world_size],
                poisoned: None,
            }),
            config,
        })
    }

    /// The tuning in use.
    pub fn config(&self) -> &TcpConfig {
        &self.config
    }

    /// How the connection to `peer` is carried (`None` for this rank itself or out of range).
    pub fn transport(&self, peer: usize) -> Option<Transport> {
        self.mesh
            .links
            .get(peer)?
            .as_ref()
            .map(|l| l.stream.transport())
    }

    /// Whether collectives above the direct size go through shared memory
    /// (every rank is on this host and none switched it off).
    pub fn shared_memory(&self) -> bool {
        self.mesh.shm.is_some()
    }

    /// How the data of a collective over `bytes` bytes travels:
    /// [`Transport::SharedMemory`] or the socket to the next rank.
    pub fn transport_for(&self, collective: Collective, bytes: usize) -> Option<Transport> {
        match self.algorithm(collective, bytes) {
            Algorithm::Local => None,
            Algorithm::SharedMemory => Some(Transport::SharedMemory),
            _ => self.transport((self.mesh.rank + 1) % self.mesh.world),
        }
    }

    /// The algorithm a collective over a buffer of `bytes` bytes uses
    /// (`bytes` is the larger side: the output of an all-gather, the input of a reduce-scatter).
    pub fn algorithm(&self, collective: Collective, bytes: usize) -> Algorithm {
        if self.mesh.world == 1 {
            Algorithm::Local
        } else if bytes <= self.config.direct_max_bytes {
            Algorithm::Direct
        } else if self.mesh.shm.is_some() {
            Algorithm::SharedMemory
        } else if collective == Collective::Broadcast {
            Algorithm::Chain
        } else {
            Algorithm::Ring
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // The state is plain counters; a panic mid-call cannot leave it torn.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Runs one collective: checks for an earlier failure, numbers the call,
    /// and turns a fault into an error (telling the other peers).
    fn collective(
        &self,
        op: Op,
        dtype: candle_core::DType,
        reduce: u8,
        body: impl FnOnce(&Mesh, Header) -> std::result::Result<(), Fault>,
    ) -> Result<()> {
        let mut state = self.lock();
        let seq = state.seq;
        state.seq += 1;
        self.run(&mut state, op, seq, dtype, reduce, body)
    }

    fn run(
        &self,
        state: &mut State,
        op: Op,
        seq: u64,
        dtype: candle_core::DType,
        reduce: u8,
        body: impl FnOnce(&Mesh, Header) -> std::result::Result<(), Fault>,
    ) -> Result<()> {
        if let Some(cause) = &state.poisoned {
            return Err(Error::Poisoned {
                op: op.name(),
                cause: cause.clone(),
            });
        }
        let base = Header {
            kind: DATA,
            op: op as u8,
            dtype: dtype_code(dtype),
            reduce,
            len: 0,
            seq,
        };
        body(&self.mesh, base).map_err(|fault| self.fail(state, op.name(), fault))
    }

    /// Poisons the communicator and tells every peer that can still hear it.
    fn fail(&self, state: &mut State, op: &'static str, fault: Fault) -> Error {
        let (culprit, reporter) = (fault.culprit(), fault.reporter());
        let err = fault.into_error(op, self.mesh.world, self.mesh.timeout);
        let message = err.to_string();
        tracing::warn!(rank = self.mesh.rank, error = %message, "collective failed");
        if let Some(culprit) = culprit {
            let ctl = Ctl {
                timeout: self.mesh.timeout.min(Duration::from_secs(1)),
                cancel: None,
            };
            for link in self.mesh.links.iter().flatten() {
                if link.peer != culprit && Some(link.peer) != reporter {
                    send_abort(link, culprit, &message, ctl);
                }
            }
        }
        state.poisoned = Some(message);
        err
    }

    fn segment_elems(&self, elem_bytes: usize) -> usize {
        (self.mesh.segment_bytes / elem_bytes).max(1)
    }
}

impl Communicator for TcpCommunicator {
    fn rank(&self) -> usize {
        self.mesh.rank
    }

    fn world_size(&self) -> usize {
        self.mesh.world
    }

    fn all_reduce(&self, buf: BufferMut<'_>, op: ReduceOp) -> Result<()> {
        check_reduce_buffer("all_reduce", &buf.as_buffer(), op)?;
        let algo = self.algorithm(Collective::AllReduce, buf.as_buffer().as_bytes().len());
        if algo == Algorithm::Local {
            return Ok(());
        }
        let dtype = buf.dtype();
        self.collective(Op::AllReduce, dtype, op.code(), |mesh, expect| {
            with_buffer!(BufferMut, buf, b => match (algo, &mesh.shm) {
                (Algorithm::Direct, _) => direct::all_reduce(mesh, b, op, expect),
                (Algorithm::SharedMemory, Some(shm)) => {
                    let bytes = std::mem::size_of_val(b);
                    shm.run(mesh, expect, bytes, |call| shm::all_reduce(call, b, op))
                }
                _ => ring::all_reduce(mesh, b, op, expect),
            })
        })
    }

    fn all_gather(&self, input: Buffer<'_>, output: BufferMut<'_>) -> Result<()> {
        const OP: &str = "all_gather";
        check_pair(OP, &input, &output, self.mesh.world, Longer::Output)?;
        let algo = self.algorithm(Collective::AllGather, output.as_buffer().as_bytes().len());
        if algo == Algorithm::Local {
            return copy_into(OP, input, output);
        }
        let (dtype, r) = (input.dtype(), self.mesh.rank);
        self.collective(Op::AllGather, dtype, 0, |mesh, expect| {
            with_buffer_pair!(input, output, (i, o) => match (algo, &mesh.shm) {
                (Algorithm::Direct, _) => direct::all_gather(mesh, i, o, expect),
                (Algorithm::SharedMemory, Some(shm)) => {
                    let bytes = std::mem::size_of_val(o);
                    shm.run(mesh, expect, bytes, |call| shm::all_gather(call, i, o))
                }
                _ => {
                    o[r * i.len()..(r + 1) * i.len()].copy_from_slice(i);
                    ring::all_gather(mesh, o, expect)
                }
            }, unreachable!("check_pair compared the dtypes"))
        })
    }

    fn reduce_scatter(&self, input: Buffer<'_>, output: BufferMut<'_>, op: ReduceOp) -> Result<()> {
        const OP: &str = "reduce_scatter";
        check_pair(OP, &input, &output, self.mesh.world, Longer::Input)?;
        check_reduce_buffer(OP, &input, op)?;
        let algo = self.algorithm(Collective::ReduceScatter, input.as_bytes().len());
        if algo == Algorithm::Local {
            return copy_into(OP, input, output);
        }
        self.collective(
            Op::ReduceScatter,
            input.dtype(),
            op.code(),
            |mesh, expect| {
                with_buffer_pair!(input, output, (i, o) => match (algo, &mesh.shm) {
                (Algorithm::Direct, _) => direct::reduce_scatter(mesh, i, o, op, expect),
                (Algorithm::SharedMemory, Some(shm)) => {
                    let bytes = std::mem::size_of_val(i);
                    shm.run(mesh, expect, bytes, |call| shm::reduce_scatter(call, i, o, op))
                }
                _ => ring::reduce_scatter(mesh, &mut i.to_vec(), o, op, expect),
            }, unreachable!("check_pair compared the dtypes"))
            },
        )
    }

    fn broadcast(&self, buf: BufferMut<'_>, root: usize) -> Result<()> {
        check_rank("broadcast", root, self.mesh.world)?;
        let algo = self.algorithm(Collective::Broadcast, buf.as_buffer().as_bytes().len());
        if algo == Algorithm::Local {
            return Ok(());
        }
        // The root travels as the `reduce` byte so peers check they agree on it.
        self.collective(Op::Broadcast, buf.dtype(), root as u8, |mesh, expect| {
            with_buffer!(BufferMut, buf, b => match (algo, &mesh.shm) {
                (Algorithm::Direct, _) => direct::broadcast(mesh, b, root, expect),
                (Algorithm::SharedMemory, Some(shm)) => {
                    let bytes = std::mem::size_of_val(b);
                    shm.run(mesh, expect, bytes, |call| shm::broadcast(call, b, root))
                }
                _ => ring::broadcast(mesh, b, root, expect),
            })
        })
    }

    fn send(&self, buf: Buffer<'_>, dst: usize) -> Result<()> {
        check_rank("send", dst, self.mesh.world)?;
        if dst == self.mesh.rank {
            return Err(Error::InvalidRank {
                op: "send",
                rank: dst,
                world: self.mesh.world,
            });
        }
        let seg = self.segment_elems(buf.dtype().size_in_bytes());
        let mut state = self.lock();
        let seq = state.sent[dst];
        state.sent[dst] += 1;
        self.run(
            &mut state,
            Op::SendRecv,
            seq,
            buf.dtype(),
            0,
            |mesh, expect| {
                let ctl = Ctl {
                    timeout: mesh.timeout,
                    cancel: None,
                };
                with_buffer!(Buffer, buf, b => {
                    // An empty message still sends one frame, so the receiver can check it.
                    let mut parts: Vec<&[u8]> = b.chunks(seg).map(bytemuck::cast_slice).collect();
                    if parts.is_empty() {
                        parts.push(&[]);
                    }
                    for part in parts {
                        wire::write_frame(mesh.link(dst), expect.with_len(part.len()), part, ctl)?;
                    }
                    Ok(())
                })
            },
        )
    }

    fn recv(&self, buf: BufferMut<'_>, src: usize) -> Result<()> {
        check_rank("recv", src, self.mesh.world)?;
        if src == self.mesh.rank {
            return Err(Error::InvalidRank {
                op: "recv",
                rank: src,
                world: self.mesh.world,
            });
        }
        let seg = self.segment_elems(buf.dtype().size_in_bytes());
        let mut state = self.lock();
        let seq = state.received[src];
        state.received[src] += 1;
        self.run(&mut state, Op::SendRecv, seq, buf.dtype(), 0, |mesh, expect| {
            let ctl = Ctl { timeout: mesh.timeout, cancel: None };
            let link = mesh.link(src);
            with_buffer!(BufferMut, buf, b => {
                let mut parts: Vec<&mut [u8]> = b.chunks_mut(seg).map(bytemuck::cast_slice_mut).collect();
                if parts.is_empty() {
                    parts.push(&mut []);
                }
                for part in parts {
                    wire::read_header(link, expect, part.len(), ctl)?;
                    wire::read_exact(link, part, ctl)?;
                }
                Ok(())
            })
        })
    }
}
