//! accel-core: the `Accelerator` for training candle models.
//!
//! What Hugging Face Accelerate gives a PyTorch script, for candle: one
//! training loop that runs with mixed precision, gradient accumulation,
//! checkpoint/resume and trackers, on one process or many (DDP, FSDP/ZeRO),
//! with Accelerate's names so a script ports line by line.
//!
//! One crate to depend on: it re-exports the lower crates as [`kernels`], [`nn`],
//! [`dist`], [`bigmodel`] and [`models`].
//!
//! Main types:
//! - [`Accelerator`], built from an [`AcceleratorConfig`]: `prepare_model` (or
//!   `prepare` with a model builder) gives a [`PreparedModel`],
//!   `prepare_optimizer` an [`optim::PreparedOptimizer`], and `backward`,
//!   `accumulate`, `clip_grad_norm`, `save_state`/`load_state`, `gather` and
//!   `log` do what Accelerate's methods of those names do;
//! - [`data::DataLoader`] over a [`data::Dataset`], sharded per rank;
//! - [`PrecisionType`] and [`GradScaler`] (mixed precision),
//!   [`fsdp::FullyShardedDataParallelPlugin`] (sharding),
//!   [`trackers`] (JSON lines, TensorBoard);
//! - [`Trainer`] and [`TrainingArguments`]: transformers' high-level loop;
//! - [`prelude`]: the names a training loop imports.
//!
//! A linear fit, trained through the Accelerator:
//!
//! ```
//! use accel_core::nn::layers::{linear, Linear};
//! use accel_core::prelude::{
//!     Accelerator, AcceleratorConfig, AdamW, AdamWConfig, DataLoader, DataLoaderConfig,
//!     TensorDataset,
//! };
//! use candle_core::{Device, Module, Tensor};
//!
//! let config = AcceleratorConfig::default().with_seed(0).with_device(Device::Cpu);
//! let mut acc = Accelerator::new(config)?;
//! // y = 3x - 1 on 64 points of [0, 1)
//! let x = (Tensor::arange(0f32, 64., &Device::Cpu)? / 64.)?.reshape((64, 1))?;
//! let y = x.affine(3., -1.)?;
//! let data = TensorDataset::new(vec![x.clone(), y.clone()])?;
//! let data = DataLoader::new(data, DataLoaderConfig::new(16).with_shuffle(true));
//! let loader = acc.prepare_data_loader(data); // each rank reads its own shard
//!
//! let varmap = candle_nn::VarMap::new();
//! let model = linear(1, 1, acc.var_builder(&varmap))?;
//! let params = acc.prepare_model(&varmap)?;
//! let adamw = AdamW::new(AdamWConfig { lr: 0.05, weight_decay: 0.0, ..Default::default() });
//! let mut opt = acc.prepare_optimizer(&params, adamw);
//! let mse = |m: &Linear| m.forward(&x)?.sub(&y)?.sqr()?.mean_all()?.to_scalar::<f32>();
//! let before = mse(&model)?;
//! for _epoch in 0..50 {
//!     for batch in loader.iter() {
//!         let batch = batch?;
//!         acc.accumulate(|acc| {
//!             acc.backward(&model.forward(&batch[0])?.sub(&batch[1])?.sqr()?.mean_all()?)?;
//!             opt.step()?;
//!             opt.zero_grad();
//!             Ok(())
//!         })?;
//!     }
//! }
//! assert!(mse(&model)? < before / 100.0);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
#![warn(missing_docs)]
#![forbid(unsafe_code)]

mod error;
pub use error::{Error, Result};

mod accelerator;
pub mod accumulation;
pub mod checkpoint;
pub mod config;
pub mod cuda_graphs;
pub mod data;
pub mod deepspeed;
pub mod fsdp;
mod init;
mod logging;
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
pub use logging::init_logging;
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
