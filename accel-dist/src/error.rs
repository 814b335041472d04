//! The one error type of accel-dist.

use std::time::Duration;

use candle_core::DType;

use crate::ReduceOp;

/// Everything that can go wrong in a collective, the rendezvous or the launcher.
///
/// Variants carry what a user acts on: the rank that went missing, the store
/// address and key, the operation (`op`) that was running.
#[derive(thiserror::Error)]
pub enum Error {
    // === wrapped errors ===
    /// A tensor operation failed inside candle.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),

    /// An in-place tensor access failed inside accel-kernels.
    #[error(transparent)]
    Kernels(#[from] accel_kernels::Error),

    /// An operating-system call failed outside any collective.
    #[error("{context}: {source}")]
    Io {
        /// What was being done, with the address involved.
        context: String,
        /// The underlying error.
        source: std::io::Error,
    },

    // === configuration ===
    /// An environment variable holds a value that cannot be used.
    #[error("environment variable {var}={value:?}: {reason}")]
    Env {
        /// The variable name.
        var: &'static str,
        /// Its value.
        value: String,
        /// Why it is rejected.
        reason: String,
    },

    /// A required environment variable is not set.
    #[error("environment variable {var} is not set: {reason}")]
    MissingEnv {
        /// The variable name.
        var: &'static str,
        /// Why it is needed.
        reason: &'static str,
    },

    // === launcher ===
    /// A launched rank exited unsuccessfully; the launcher stopped the others.
    #[error("rank {rank} failed with {status}; stopped the other ranks (world {world})")]
    RankFailed {
        /// The first rank that failed.
        rank: usize,
        /// How it ended (exit status or signal).
        status: String,
        /// Processes launched on this machine.
        world: usize,
    },

    /// The launcher stopped its ranks because the job failed elsewhere (a
    /// rank of another machine, or a machine lost).
    #[error("stopped this machine's ranks: {reason}")]
    Stopped {
        /// What failed.
        reason: String,
    },

    /// The launcher was interrupted (Ctrl-C or SIGTERM) and stopped every rank.
    #[error("interrupted; stopped all {world} ranks")]
    Interrupted {
        /// Processes launched on this machine.
        world: usize,
    },

    // === rendezvous store ===
    /// The store could not be reached before the timeout.
    #[error("could not reach the rendezvous store at {addr} within {waited:?}: {reason}")]
    StoreUnreachable {
        /// The store address.
        addr: String,
        /// How long connecting was retried.
        waited: Duration,
        /// The last connection error.
        reason: String,
    },

    /// The store (or a peer's listener) refused the handshake, e.g. for a wrong job token.
    #[error("{addr} refused the connection: {reason}")]
    Refused {
        /// The address that refused.
        addr: String,
        /// The reason it gave.
        reason: String,
    },

    /// A key did not appear in the store before the timeout.
    #[error("store {op} at {addr}: key {key:?} did not appear within {waited:?}")]
    StoreTimeout {
        /// The store operation (`get`, `wait`).
        op: &'static str,
        /// The missing key (the first missing one for `wait`).
        key: String,
        /// The store address.
        addr: String,
        /// How long the store waited.
        waited: Duration,
    },

    /// The store connection failed or the store answered nonsense.
    #[error("store {op} at {addr} (key {key:?}): {reason}")]
    Store {
        /// The store operation.
        op: &'static str,
        /// The key involved (empty when none).
        key: String,
        /// The store address.
        addr: String,
        /// What went wrong.
        reason: String,
    },

    /// An etcd call failed: nothing answered within the timeout, or etcd refused.
    #[error("etcd {op} at {endpoint} (key {key:?}): {reason}")]
    Etcd {
        /// The endpoint's URL.
        endpoint: String,
        /// The operation (`put`, `get`, `create`, `keep_alive`, ...).
        op: &'static str,
        /// The key involved (empty when none).
        key: String,
        /// What went wrong.
        reason: String,
    },

    /// No rendezvous round took this node in time.
    #[error("rendezvous of job {job:?}: node {node:?} was in no round within {waited:?} (last seen: {state})")]
    RoundTimeout {
        /// The job's id.
        job: String,
        /// This node.
        node: String,
        /// How long it tried.
        waited: Duration,
        /// The last round state read.
        state: String,
    },

    /// A rendezvous was asked for with settings that cannot work.
    #[error("rendezvous of job {job:?}: {reason}")]
    RoundSettings {
        /// The job's id.
        job: String,
        /// What is wrong.
        reason: String,
    },

    /// Some ranks did not reach a store barrier in time.
    #[error(
        "barrier {name:?}: ranks {missing:?} did not arrive within {waited:?} (world {world})"
    )]
    BarrierTimeout {
        /// The barrier name.
        name: String,
        /// The ranks that had not arrived.
        missing: Vec<usize>,
        /// How long this rank waited.
        waited: Duration,
        /// The world size.
        world: usize,
    },

    // === collectives ===
    /// A peer sent nothing for the whole timeout.
    #[error("{op}: rank {rank} did not arrive within {waited:?} (world {world})")]
    PeerTimeout {
        /// The collective that was running.
        op: &'static str,
        /// The silent peer.
        rank: usize,
        /// The timeout.
        waited: Duration,
        /// The world size.
        world: usize,
    },

    /// The connection to a peer was closed or reset: the peer died or gave up.
    #[error("{op}: connection to rank {rank} closed (world {world}): {reason}")]
    PeerClosed {
        /// The collective that was running.
        op: &'static str,
        /// The peer whose connection closed.
        rank: usize,
        /// The world size.
        world: usize,
        /// The operating-system detail.
        reason: String,
    },

    /// Another rank saw a peer fail and told this rank.
    #[error("{op}: rank {rank} failed, reported by rank {reporter}: {detail}")]
    PeerFailed {
        /// The collective that was running here.
        op: &'static str,
        /// The rank that failed (as far as the reporter knows).
        rank: usize,
        /// The rank that reported the failure.
        reporter: usize,
        /// The reporter's own error message.
        detail: String,
    },

    /// Ranks called different collectives, or with different sizes or dtypes.
    #[error("{op}: rank {rank} is out of step: {detail}")]
    Mismatch {
        /// The collective that was running here.
        op: &'static str,
        /// The peer that sent something else.
        rank: usize,
        /// What differed.
        detail: String,
    },

    /// The communicator failed earlier and can no longer be used.
    #[error("{op}: the communicator is unusable after an earlier failure: {cause}")]
    Poisoned {
        /// The collective that was attempted.
        op: &'static str,
        /// The first failure.
        cause: String,
    },

    /// Building the connection mesh failed.
    #[error("connecting rank {rank} to rank {peer} at {addr}: {reason}")]
    Connect {
        /// This rank.
        rank: usize,
        /// The peer.
        peer: usize,
        /// The peer's address.
        addr: String,
        /// What went wrong.
        reason: String,
    },

    // === NCCL backend ===
    /// An NCCL call failed.
    #[error("{op}: NCCL {call} failed on rank {rank} (world {world}): {message}")]
    Nccl {
        /// The collective that was called.
        op: &'static str,
        /// This rank.
        rank: usize,
        /// The world size.
        world: usize,
        /// The NCCL or CUDA call that failed (`ncclAllReduce`, `ncclCommInitRank`, ...).
        call: &'static str,
        /// NCCL's error string and last-error detail.
        message: String,
    },

    /// An NCCL collective did not complete within the group's timeout; the
    /// communicator was aborted.
    #[error(
        "{op}: NCCL collective did not complete within {waited:?} on rank {rank} (world {world}); \
         a peer is missing or stuck, the communicator was aborted"
    )]
    NcclTimeout {
        /// The collective that was called.
        op: &'static str,
        /// This rank.
        rank: usize,
        /// The world size.
        world: usize,
        /// How long it waited.
        waited: std::time::Duration,
    },

    /// A code path needs a cargo feature this build was compiled without.
    #[error(
        "{feature} support was not compiled in (enable the `{feature}` feature of accel-dist)"
    )]
    NotCompiled {
        /// The cargo feature that is missing.
        feature: &'static str,
    },

    // === arguments ===
    /// A rank argument is outside the world.
    #[error("{op}: rank {rank} is out of range (world {world})")]
    InvalidRank {
        /// The operation that was called.
        op: &'static str,
        /// The rank passed.
        rank: usize,
        /// The world size.
        world: usize,
    },

    /// A buffer has the wrong number of elements.
    #[error("{op}: {what} has {got} elements, expected {expected}")]
    LengthMismatch {
        /// The operation that was called.
        op: &'static str,
        /// Which buffer.
        what: &'static str,
        /// The expected length.
        expected: usize,
        /// The length found.
        got: usize,
    },

    /// Input and output buffers have different dtypes.
    #[error("{op}: input is {input:?} but output is {output:?}")]
    DTypeMismatch {
        /// The operation that was called.
        op: &'static str,
        /// The input dtype.
        input: DType,
        /// The output dtype.
        output: DType,
    },

    /// The collective does not support this dtype.
    #[error("{op}: unsupported dtype {dtype:?}")]
    UnsupportedDType {
        /// The operation that was called.
        op: &'static str,
        /// The dtype that was rejected.
        dtype: DType,
    },

    /// The reduction is not defined for this dtype (e.g. `Mean` on integers).
    #[error("{op}: reduction {reduce:?} is not supported for {dtype:?}")]
    UnsupportedReduce {
        /// The operation that was called.
        op: &'static str,
        /// The reduction.
        reduce: ReduceOp,
        /// The dtype.
        dtype: DType,
    },

    /// A tensor collective needs a contiguous tensor.
    #[error("{op}: the tensor is not contiguous; call .contiguous() first")]
    RequiresContiguous {
        /// The operation that was called.
        op: &'static str,
    },

    /// This backend only moves host memory.
    #[error("{op}: the tensor is on {device}, this communicator needs CPU tensors")]
    RequiresCpu {
        /// The operation that was called.
        op: &'static str,
        /// Where the tensor lives.
        device: String,
    },

    /// A tensor is on another device than the communicator's.
    #[error("{op}: the tensor is on {got}, this communicator runs on {expected}")]
    DeviceMismatch {
        /// The operation that was called.
        op: &'static str,
        /// The communicator's device.
        expected: String,
        /// Where the tensor lives.
        got: String,
    },

    /// A tensor has a shape the collective cannot split or match.
    #[error("{op}: {reason}")]
    BadShape {
        /// The operation that was called.
        op: &'static str,
        /// What is wrong with the shape.
        reason: String,
    },

    /// An object could not be serialized or deserialized.
    #[error("{op}: {source}")]
    Serde {
        /// The object helper that was called.
        op: &'static str,
        /// The serde_json error.
        source: serde_json::Error,
    },
}

impl std::fmt::Debug for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(self, f)
    }
}

/// The result type of accel-dist.
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    /// Wraps an I/O error with what was being done.
    pub(crate) fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        Error::Io {
            context: context.into(),
            source,
        }
    }
}
