//! Accelerate's configuration: the `default_config.yaml` file written by
//! `accel config` (and by Python's `accelerate config`), and what the machine
//! and the launcher's environment say.

pub mod env;
mod file;
mod fsdp;

pub use env::{
    cuda_device_count, is_bf16_available, is_cuda_available, is_nccl_available, precision_from_env,
    resolve_precision, total_ram_bytes, CANDLE_VERSION, ENV_MIXED_PRECISION,
};
pub use file::{default_config_path, write_basic_config, ClusterConfig, KNOWN_KEYS};
pub use fsdp::FsdpFileConfig;
