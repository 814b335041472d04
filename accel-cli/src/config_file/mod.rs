//! Accelerate's `default_config.yaml`, which only the command line reads:
//! `accel config` writes it, `accel launch` turns it into flags and `FSDP_*`
//! variables, `accel env` prints it. The library sees the result through the
//! environment (`accel_core::config::env`), so YAML stays out of accel-core.

mod deepspeed;
mod file;
mod fsdp;

pub use deepspeed::launch_env as deepspeed_launch_env;
pub use file::{default_config_path, write_basic_config, ClusterConfig, KNOWN_KEYS};
pub use fsdp::FsdpFileConfig;
