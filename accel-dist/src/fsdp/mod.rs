//! The collective side of fully sharded data parallelism (FSDP / ZeRO): how
//! parameters are split into units and between ranks, and how a unit's
//! parameters are gathered and its gradients reduce-scattered.
//!
//! The training side (the autograd op that gathers a unit for its forward
//! and recomputes it in backward, the sharded optimizer, state dicts) lives
//! in `accel_core::fsdp`, which builds on these pieces.

mod layout;
mod wrap;

pub use layout::{piece_range, ShardLayout, ShardSlot};
pub use wrap::{group_units, matches_pattern, AutoWrapPolicy};

use serde::{Deserialize, Serialize};

/// What is sharded, named as PyTorch FSDP's `ShardingStrategy` plus
/// DeepSpeed's ZeRO stage 1.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum ShardingStrategy {
    /// ZeRO-3: parameters, gradients and optimizer state are sharded; a
    /// unit's parameters are gathered for its forward, freed after it, and
    /// gathered again for its backward (`reshard_after_forward = true`).
    #[default]
    FullShard,
    /// ZeRO-2: gradients and optimizer state are sharded; a unit's gathered
    /// parameters stay from its forward until its backward is done
    /// (`reshard_after_forward = false`).
    ShardGradOp,
    /// ZeRO-1: only the optimizer state (and the fp32 master weights) is
    /// sharded; every rank keeps the full parameters, which are gathered
    /// again after each optimizer step.
    ShardOptimizer,
    /// DDP: nothing is sharded; gradients are all-reduced.
    NoShard,
}

impl ShardingStrategy {
    /// True when a rank keeps a full copy of every parameter between steps.
    pub fn keeps_full_parameters(self) -> bool {
        matches!(self, Self::ShardOptimizer | Self::NoShard)
    }

    /// Accelerate's name (`FULL_SHARD`, `SHARD_GRAD_OP`, `NO_SHARD`; ZeRO-1 is `SHARD_OPTIMIZER`).
    pub fn name(self) -> &'static str {
        match self {
            Self::FullShard => "FULL_SHARD",
            Self::ShardGradOp => "SHARD_GRAD_OP",
            Self::ShardOptimizer => "SHARD_OPTIMIZER",
            Self::NoShard => "NO_SHARD",
        }
    }
}

impl std::str::FromStr for ShardingStrategy {
    type Err = crate::Error;

    /// Accepts Accelerate's names, their numbers (`1` = FULL_SHARD, `2` =
    /// SHARD_GRAD_OP, `3` = NO_SHARD, as old config files store them) and
    /// `ZERO1`/`ZERO2`/`ZERO3`.
    fn from_str(s: &str) -> crate::Result<Self> {
        match s.trim().to_ascii_uppercase().as_str() {
            "FULL_SHARD" | "1" | "ZERO3" | "ZERO-3" => Ok(Self::FullShard),
            "SHARD_GRAD_OP" | "2" | "ZERO2" | "ZERO-2" => Ok(Self::ShardGradOp),
            "SHARD_OPTIMIZER" | "ZERO1" | "ZERO-1" => Ok(Self::ShardOptimizer),
            "NO_SHARD" | "3" | "DDP" => Ok(Self::NoShard),
            other => Err(crate::Error::Env {
                var: "FSDP_SHARDING_STRATEGY",
                value: other.into(),
                reason: "expected FULL_SHARD, SHARD_GRAD_OP, SHARD_OPTIMIZER or NO_SHARD".into(),
            }),
        }
    }
}
