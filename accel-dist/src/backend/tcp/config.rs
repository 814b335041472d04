//! Tuning of the TCP backend and the algorithm names it reports.

use std::time::Duration;

use crate::process::DEFAULT_TIMEOUT;

/// Tuning of a [`TcpCommunicator`](super::TcpCommunicator).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TcpConfig {
    /// How long any call waits for a peer that makes no progress.
    pub timeout: Duration,
    /// Buffers up to this many bytes use [`Algorithm::Direct`].
    pub direct_max_bytes: usize,
    /// Size of the pieces the ring pipelines.
    pub segment_bytes: usize,
    /// Whether peers on the same host connect over a Unix domain socket
    /// (Linux; others always use TCP).
    pub unix_sockets: bool,
    /// Whether ranks that all share one host run collectives through a
    /// shared-memory segment (Linux `/dev/shm`) instead of sockets, for
    /// buffers above [`direct_max_bytes`](Self::direct_max_bytes). On by
    /// default; the environment variable `ACCEL_DIST_SHM=0` also switches
    /// it off. Falls back to sockets when any rank cannot map the segment.
    pub shared_memory: bool,
    /// Bytes per rank and step in the shared segment (two slots per rank).
    pub shm_slot_bytes: usize,
}

impl Default for TcpConfig {
    fn default() -> Self {
        Self {
            timeout: DEFAULT_TIMEOUT,
            direct_max_bytes: 128 * 1024,
            segment_bytes: 256 * 1024,
            unix_sockets: true,
            shared_memory: true,
            shm_slot_bytes: 256 * 1024,
        }
    }
}

impl TcpConfig {
    /// Sets the timeout.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Sets the largest buffer that takes the direct path.
    pub fn with_direct_max_bytes(mut self, bytes: usize) -> Self {
        self.direct_max_bytes = bytes;
        self
    }

    /// Chooses whether same-host peers may use Unix domain sockets.
    pub fn with_unix_sockets(mut self, on: bool) -> Self {
        self.unix_sockets = on;
        self
    }

    /// Chooses whether same-host ranks may use shared memory (see [`shared_memory`](Self::shared_memory)).
    pub fn with_shared_memory(mut self, on: bool) -> Self {
        self.shared_memory = on;
        self
    }

    /// Sets the shared-memory slot size (rounded up to a multiple of 64 bytes).
    pub fn with_shm_slot_bytes(mut self, bytes: usize) -> Self {
        self.shm_slot_bytes = bytes.max(1);
        self
    }

    /// Sets the ring segment size (at least one element is always sent).
    pub fn with_segment_bytes(mut self, bytes: usize) -> Self {
        self.segment_bytes = bytes.max(1);
        self
    }
}

/// A collective, for asking which [`Algorithm`] a size takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Collective {
    /// [`Communicator::all_reduce`](crate::Communicator::all_reduce).
    AllReduce,
    /// [`Communicator::all_gather`](crate::Communicator::all_gather).
    AllGather,
    /// [`Communicator::reduce_scatter`](crate::Communicator::reduce_scatter).
    ReduceScatter,
    /// [`Communicator::broadcast`](crate::Communicator::broadcast).
    Broadcast,
}

/// How a [`TcpCommunicator`](super::TcpCommunicator) moves a buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Algorithm {
    /// One round: every rank exchanges with every other rank (small buffers).
    Direct,
    /// Pipelined ring (reduce-scatter + all-gather for all-reduce).
    Ring,
    /// Pipelined chain from the root (broadcast).
    Chain,
    /// Steps through a segment of shared memory (all ranks on one host).
    SharedMemory,
    /// A world of one: nothing moves.
    Local,
}

impl Algorithm {
    /// A short lowercase name, for logs and benchmark output.
    pub fn name(self) -> &'static str {
        match self {
            Algorithm::Direct => "direct",
            Algorithm::Ring => "ring",
            Algorithm::Chain => "chain",
            Algorithm::SharedMemory => "shm",
            Algorithm::Local => "local",
        }
    }
}
