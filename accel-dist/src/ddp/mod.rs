//! Data-parallel gradient synchronisation (PyTorch DDP's reducer, for candle).
//!
//! candle computes all gradients in one `backward()` call, so there is no
//! backward-overlap to exploit; buckets still bound the staging memory and
//! turn hundreds of small parameters into a few large, bandwidth-bound
//! collectives.

mod bucket;

pub use bucket::{broadcast_parameters, GradBuckets};

use serde::{Deserialize, Serialize};

/// A gradient compression hook (PyTorch's `fp16_compress_hook` / `bf16_compress_hook`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CommHook {
    /// All-reduce fp32 gradients.
    #[default]
    None,
    /// Divide by the world size, all-reduce in f16, widen back.
    Fp16,
    /// Divide by the world size, all-reduce in bf16, widen back.
    Bf16,
}

/// Settings of data-parallel training (Accelerate's `DistributedDataParallelKwargs`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct DdpConfig {
    /// Largest bucket in MiB (PyTorch's default 25).
    pub bucket_cap_mb: f64,
    /// Compression of gradients on the wire.
    pub comm_hook: CommHook,
    /// Accept trainable parameters that receive no gradient (PyTorch DDP's
    /// `find_unused_parameters`). Without it, such a parameter at any rank
    /// is an error at the first backward that reaches the model, naming it;
    /// with it, a warning. Either way its gradient counts as zero in the
    /// average, so the ranks stay in step.
    #[serde(default)]
    pub find_unused_parameters: bool,
}

impl Default for DdpConfig {
    fn default() -> Self {
        Self {
            bucket_cap_mb: 25.0,
            comm_hook: CommHook::None,
            find_unused_parameters: false,
        }
    }
}
