//! The names a training loop imports, in one line:
//! `use accel_core::prelude::*;` (candle and burn keep a prelude for the same
//! reason). Everything here is also reachable at its own path; the prelude
//! only saves a script from learning which module each name lives in.
//!
//! It holds [`Result`] and [`Error`], so a glob import shadows the standard
//! `Result`; import by name where a function returns another error type.

pub use crate::data::{DataLoader, DataLoaderConfig, TensorDataset};
pub use crate::nn::{Activations, AnyBlock, Block, BlockForward, Model};
pub use crate::optim::{AdamW, AdamWConfig, PreparedOptimizer, Sgd, SgdConfig};
pub use crate::scheduler::{LrScheduler, Schedule};
pub use crate::{
    Accelerator, AcceleratorConfig, Error, PrecisionType, PreparedModel, ProjectConfiguration,
    Result,
};
