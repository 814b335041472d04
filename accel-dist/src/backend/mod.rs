//! Communicator implementations, one per transport.
//!
//! [`LocalCommunicator`] serves single-process runs and [`tcp`] connects CPU
//! processes. A GPU backend joins as `nccl.rs` behind the `nccl` feature,
//! with a feature-off twin of the same names that returns an error, so the
//! rest of the crate never checks which backends are compiled in.

mod local;
pub mod tcp;

pub use local::LocalCommunicator;
