//! accel-core: the `Accelerator` for training candle models.
#![warn(missing_docs)]
#![forbid(unsafe_code)]

mod error;
pub use error::{Error, Result};

pub mod checkpoint;
pub mod trackers;

pub use accel_bigmodel as bigmodel;
pub use accel_dist as dist;
pub use accel_kernels as kernels;
