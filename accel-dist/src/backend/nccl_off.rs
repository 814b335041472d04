//! Stand-in for the NCCL backend when the `nccl` feature is off: the same
//! names; connecting fails with [`Error::NotCompiled`], so no value of
//! [`NcclCommunicator`] can exist.

use std::time::Duration;

use candle_core::Device;

use crate::buffer::{Buffer, BufferMut};
use crate::process::DEFAULT_TIMEOUT;
use crate::{Communicator, Error, ReduceOp, Result, TcpStore};

/// Options of an [`NcclCommunicator`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NcclConfig {
    /// How long a call may wait for its collective (and init for the peers).
    pub timeout: Duration,
    /// Wait for every collective to finish, so that the timeout applies to
    /// tensor collectives too.
    pub blocking_wait: bool,
}

impl Default for NcclConfig {
    fn default() -> Self {
        Self {
            timeout: DEFAULT_TIMEOUT,
            blocking_wait: true,
        }
    }
}

impl NcclConfig {
    /// Sets the timeout.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Sets whether calls wait for their collective.
    pub fn with_blocking_wait(mut self, blocking_wait: bool) -> Self {
        self.blocking_wait = blocking_wait;
        self
    }
}

/// No value exists: connecting always fails in this build.
#[derive(Debug)]
enum Never {}

/// A [`Communicator`] over NCCL; this build has no `nccl` feature.
#[derive(Debug)]
pub struct NcclCommunicator(Never);

impl NcclCommunicator {
    /// Would join the NCCL communicator of `world` ranks on `device`.
    ///
    /// # Errors
    /// Always [`Error::NotCompiled`].
    pub fn connect(
        _store: Option<&TcpStore>,
        _rank: usize,
        _world: usize,
        _device: &Device,
        _config: NcclConfig,
    ) -> Result<Self> {
        Err(Error::NotCompiled { feature: "nccl" })
    }

    /// The device the communicator runs on.
    pub fn device(&self) -> Device {
        match self.0 {}
    }
}

impl Communicator for NcclCommunicator {
    fn rank(&self) -> usize {
        match self.0 {}
    }

    fn world_size(&self) -> usize {
        match self.0 {}
    }

    fn all_reduce(&self, _buf: BufferMut<'_>, _op: ReduceOp) -> Result<()> {
        match self.0 {}
    }

    fn all_gather(&self, _input: Buffer<'_>, _output: BufferMut<'_>) -> Result<()> {
        match self.0 {}
    }

    fn reduce_scatter(
        &self,
        _input: Buffer<'_>,
        _output: BufferMut<'_>,
        _op: ReduceOp,
    ) -> Result<()> {
        match self.0 {}
    }

    fn broadcast(&self, _buf: BufferMut<'_>, _root: usize) -> Result<()> {
        match self.0 {}
    }

    fn send(&self, _buf: Buffer<'_>, _dst: usize) -> Result<()> {
        match self.0 {}
    }

    fn recv(&self, _buf: BufferMut<'_>, _src: usize) -> Result<()> {
        match self.0 {}
    }
}

/// Whether this build has the NCCL backend.
pub(crate) const NCCL_COMPILED: bool = false;

/// The CUDA device NCCL would use for `local_rank`; this build has no NCCL.
pub(crate) fn nccl_device(_local_rank: usize) -> Result<Device> {
    Err(Error::NotCompiled { feature: "nccl" })
}
