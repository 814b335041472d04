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
}

impl Default for TcpConfig {
    fn default() -> Self {
        Self {
            timeout: DEFAULT_TIMEOUT,
            direct_max_bytes: 128 * 1024,
            segment_bytes: 256 * 1024,
            unix_sockets: true,
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
            Algorithm::Local => "local",
        }
    }
}
