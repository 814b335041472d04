//! Process groups, collectives and rendezvous for accel-rs.
//!
//! - [`ProcessGroupConfig`] reads where this process sits in a job from
//!   torchrun-style environment variables.
//! - [`TcpStore`] is the rendezvous key-value store the ranks meet through.
//! - [`Communicator`] is the seam between training code and a transport:
//!   [`LocalCommunicator`] for one process, [`TcpCommunicator`] for CPU
//!   processes over TCP, [`NcclCommunicator`] for GPU processes (feature
//!   `nccl`).
//! - [`ProcessGroup`] puts the three together.
//!
//! ```no_run
//! use accel_dist::{Communicator, ProcessGroup, ProcessGroupConfig, ReduceOp};
//!
//! let group = ProcessGroup::init(ProcessGroupConfig::from_env()?)?;
//! let comm = group.communicator();
//! let mut grads = vec![1.0f32; 1024];
//! comm.all_reduce((&mut grads).into(), ReduceOp::Mean)?;
//! comm.barrier()?;
//! # Ok::<(), accel_dist::Error>(())
//! ```
#![warn(missing_docs)]
// Only a few audited files opt back in: the NCCL backend, the shared-memory
// segment and the malloc settings.
#![deny(unsafe_code)]

pub mod affinity;
pub mod backend;
mod buffer;
mod communicator;
pub mod ddp;
pub mod engine;
mod error;
pub mod fsdp;
mod group;
pub mod launch;
pub mod malloc;
pub mod process;
mod reduce;
pub mod rendezvous;
pub mod signals;
mod tensor;
mod warn_limit;

pub use backend::tcp::{Algorithm, Collective, TcpCommunicator, TcpConfig, Transport};
pub use backend::{LocalCommunicator, NcclCommunicator, NcclConfig};
pub use buffer::{Buffer, BufferMut};
pub use communicator::{Communicator, CommunicatorExt};
pub use error::{Error, Result};
pub use group::ProcessGroup;
pub use process::{Backend, InitProcessGroupKwargs, ProcessGroupConfig};
pub(crate) use reduce::Element;
pub use reduce::ReduceOp;
pub use rendezvous::{StoreLimits, StoreServer, TcpStore};
