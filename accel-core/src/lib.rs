//! accel-core: the `Accelerator` for training candle models.
//!
//! One crate to depend on: it re-exports the lower crates as [`kernels`], [`nn`],
//! [`dist`] and [`bigmodel`].
#![warn(missing_docs)]
#![forbid(unsafe_code)]

mod error;
pub use error::{Error, Result};

mod accelerator;
pub mod accumulation;
pub mod checkpoint;
pub mod config;
pub mod data;
pub mod fsdp;
mod init;
pub mod model;
mod notice;
pub mod optim;
pub mod precision;
pub mod prelude;
pub mod rng;
pub mod scheduler;
pub mod state;
pub mod trackers;
pub mod trainer;

pub use accelerator::{Accelerator, AcceleratorConfig, ProjectConfiguration};
pub use accumulation::{GradientAccumulationPlugin, GradientState};
pub use config::{is_bf16_available, is_cuda_available, is_nccl_available};
pub use init::init_values;
pub use model::PreparedModel;
pub use precision::{GradScaler, GradScalerConfig, PrecisionType};
pub use state::{DistributedType, ProcessState};
pub use trainer::{
    find_executable_batch_size, TrainModel, TrainOutput, Trainer, TrainingArguments,
};

pub use accel_bigmodel as bigmodel;
pub use accel_dist as dist;
pub use accel_kernels as kernels;
/// Hugging Face architectures on the block protocol (accel-models).
pub use accel_models as models;
pub use accel_nn as nn;
