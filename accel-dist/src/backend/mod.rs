//! Communicator implementations, one per transport.
//!
//! [`LocalCommunicator`] serves single-process runs, [`tcp`] connects CPU
//! processes and [`NcclCommunicator`] GPU processes. NCCL lives behind the
//! `nccl` feature; without it a twin of the same names (`nccl_off.rs`)
//! fails with `Error::NotCompiled`, so the rest of the crate never checks
//! which backends are compiled in.

mod local;
#[cfg(feature = "nccl")]
mod nccl;
#[cfg(not(feature = "nccl"))]
#[path = "nccl_off.rs"]
mod nccl;
pub mod tcp;

pub use local::LocalCommunicator;
pub(crate) use nccl::{nccl_device, NCCL_COMPILED};
pub use nccl::{NcclCommunicator, NcclConfig};
