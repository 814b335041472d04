//! What the machine and the launcher's environment say: the variables
//! `accel launch` exports and the library reads. The `default_config.yaml`
//! file itself is read only by the command line (the `accel-cli` crate).

pub mod env;

pub use env::{
    cuda_device_count, is_bf16_available, is_cuda_available, is_nccl_available, precision_from_env,
    resolve_precision, total_ram_bytes, CANDLE_VERSION, ENV_MIXED_PRECISION,
};
