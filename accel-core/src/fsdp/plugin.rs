//! `FullyShardedDataParallelPlugin`: the FSDP settings, from code or from the
//! `FSDP_*` variables `accel launch` exports from `default_config.yaml`.

use candle_core::DType;

use accel_dist::fsdp::{AutoWrapPolicy, ShardingStrategy};

use crate::{Error, Result};

/// How `save_state` writes a sharded model (Accelerate's `state_dict_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum StateDictType {
    /// Gathered to rank 0 and written as `model.safetensors` (and a full
    /// optimizer state): the same files a DDP run writes, loadable at any
    /// world size.
    #[default]
    FullStateDict,
    /// Every rank writes its own pieces (`model_rank{r}.safetensors`,
    /// `optimizer_rank{r}.safetensors`); no gather, resume needs the same
    /// world size; `accel merge-weights` turns it into `model.safetensors`.
    ShardedStateDict,
}

impl std::str::FromStr for StateDictType {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_uppercase().as_str() {
            "FULL_STATE_DICT" => Ok(Self::FullStateDict),
            "SHARDED_STATE_DICT" => Ok(Self::ShardedStateDict),
            other => Err(Error::Config {
                key: "fsdp_state_dict_type".into(),
                reason: format!("{other:?} (expected FULL_STATE_DICT or SHARDED_STATE_DICT)"),
            }),
        }
    }
}

/// Dtypes of FSDP's mixed precision (PyTorch's `MixedPrecision`): the
/// parameters are gathered and computed in `param_dtype`, gradients are
/// reduced in `reduce_dtype`; the sharded master weights stay fp32.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MixedPrecisionPolicy {
    /// Dtype of gathered parameters and of the computation.
    pub param_dtype: DType,
    /// Dtype gradients are reduced in.
    pub reduce_dtype: DType,
}

/// Fully sharded data parallel settings, as Accelerate's
/// `FullyShardedDataParallelPlugin` (the options that apply to candle).
///
/// ```
/// use accel_core::fsdp::{AutoWrapPolicy, FullyShardedDataParallelPlugin, ShardingStrategy};
/// let plugin = FullyShardedDataParallelPlugin::new(ShardingStrategy::FullShard)
///     .with_auto_wrap_policy(AutoWrapPolicy::Transformer { patterns: vec!["h.*".into()] });
/// assert!(plugin.reshard_after_forward());
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct FullyShardedDataParallelPlugin {
    /// What is sharded (ZeRO-3, ZeRO-2, ZeRO-1 or nothing).
    pub sharding_strategy: ShardingStrategy,
    /// How parameters group into separately gathered units.
    pub auto_wrap_policy: AutoWrapPolicy,
    /// Keep the fp32 shards and optimizer state in host memory (on a CPU
    /// run they are there anyway).
    pub cpu_offload: bool,
    /// Gather/compute and reduce dtypes; `None` uses the Accelerator's
    /// compute dtype and fp32 reductions.
    pub mixed_precision_policy: Option<MixedPrecisionPolicy>,
    /// Recompute each unit's activations in backward instead of keeping
    /// them. Always the case for wrapped units under `FullShard` and
    /// `ShardGradOp` (the backward regathers and recomputes the unit).
    pub activation_checkpointing: bool,
    /// How checkpoints are written.
    pub state_dict_type: StateDictType,
    /// When loading a full checkpoint, only rank 0 reads it; the others
    /// receive the tensors from rank 0.
    pub cpu_ram_efficient_loading: bool,
}

impl Default for FullyShardedDataParallelPlugin {
    fn default() -> Self {
        Self::new(ShardingStrategy::FullShard)
    }
}

impl FullyShardedDataParallelPlugin {
    /// A plugin with `strategy` and Accelerate's other defaults (no
    /// auto-wrap, full state dict, rank-0 loading).
    pub fn new(strategy: ShardingStrategy) -> Self {
        Self {
            sharding_strategy: strategy,
            auto_wrap_policy: AutoWrapPolicy::NoWrap,
            cpu_offload: false,
            mixed_precision_policy: None,
            activation_checkpointing: false,
            state_dict_type: StateDictType::FullStateDict,
            cpu_ram_efficient_loading: true,
        }
    }

    /// Sets the auto-wrap policy.
    pub fn with_auto_wrap_policy(mut self, policy: AutoWrapPolicy) -> Self {
        self.auto_wrap_policy = policy;
        self
    }

    /// Sets how checkpoints are written.
    pub fn with_state_dict_type(mut self, t: StateDictType) -> Self {
        self.state_dict_type = t;
        self
    }

    /// Keeps shards and optimizer state in host memory.
    pub fn with_cpu_offload(mut self, on: bool) -> Self {
        self.cpu_offload = on;
        self
    }

    /// Sets the FSDP mixed-precision dtypes.
    pub fn with_mixed_precision_policy(mut self, p: MixedPrecisionPolicy) -> Self {
        self.mixed_precision_policy = Some(p);
        self
    }

    /// Recomputes unit activations in backward.
    pub fn with_activation_checkpointing(mut self, on: bool) -> Self {
        self.activation_checkpointing = on;
        self
    }

    /// The `(world, rank)` parameters are split between for rank `rank` of
    /// `world`: NO_SHARD keeps whole parameters, as a world of one.
    pub fn shard_group(&self, world: usize, rank: usize) -> (usize, usize) {
        match self.sharding_strategy {
            ShardingStrategy::NoShard => (1, 0),
            _ => (world, rank),
        }
    }

    /// FSDP2's name for the difference between `FullShard` and `ShardGradOp`.
    pub fn reshard_after_forward(&self) -> bool {
        self.sharding_strategy == ShardingStrategy::FullShard
    }

    /// The plugin `accel launch` describes through `ACCELERATE_USE_FSDP` and
    /// the `FSDP_*` variables (written from `fsdp_config`), or `None` when
    /// FSDP is not on. `FSDP_TRANSFORMER_CLS_TO_WRAP` holds comma-separated
    /// module-name patterns (`h.*`), since Rust modules have no class names.
    pub fn from_env() -> Result<Option<Self>> {
        Self::from_vars(&|k| std::env::var(k).ok())
    }

    /// [`FullyShardedDataParallelPlugin::from_env`] over any variable lookup.
    pub fn from_vars(lookup: &dyn Fn(&str) -> Option<String>) -> Result<Option<Self>> {
        let var = |k: &str| lookup(k).filter(|v| !v.is_empty());
        let truthy = |k: &str, default: bool| -> Result<bool> {
            match var(k) {
                None => Ok(default),
                Some(v) => match v.to_ascii_lowercase().as_str() {
                    "1" | "true" | "yes" => Ok(true),
                    "0" | "false" | "no" => Ok(false),
                    _ => Err(Error::Config {
                        key: k.into(),
                        reason: format!("{v:?} is not a boolean"),
                    }),
                },
            }
        };
        if !truthy("ACCELERATE_USE_FSDP", false)? {
            return Ok(None);
        }
        let mut p = Self::default();
        let version2 = var("FSDP_VERSION").as_deref() == Some("2");
        if let Some(s) = var("FSDP_SHARDING_STRATEGY").filter(|_| !version2) {
            p.sharding_strategy = s.parse().map_err(|e: accel_dist::Error| Error::Config {
                key: "FSDP_SHARDING_STRATEGY".into(),
                reason: e.to_string(),
            })?;
        }
        if version2 {
            // FSDP2 spells the strategy as reshard_after_forward.
            p.sharding_strategy = if truthy("FSDP_RESHARD_AFTER_FORWARD", true)? {
                ShardingStrategy::FullShard
            } else {
                ShardingStrategy::ShardGradOp
            };
        }
        p.auto_wrap_policy = match var("FSDP_AUTO_WRAP_POLICY").as_deref() {
            None | Some("NO_WRAP") => AutoWrapPolicy::NoWrap,
            Some("TRANSFORMER_BASED_WRAP") => {
                let patterns: Vec<String> = var("FSDP_TRANSFORMER_CLS_TO_WRAP")
                    .unwrap_or_default()
                    .split(',')
                    .map(|s| s.trim().to_string())
                    .filter(|s| !s.is_empty())
                    .collect();
                if patterns.is_empty() {
                    return Err(Error::Config {
                        key: "FSDP_TRANSFORMER_CLS_TO_WRAP".into(),
                        reason: "TRANSFORMER_BASED_WRAP needs module-name patterns such as `h.*`"
                            .into(),
                    });
                }
                AutoWrapPolicy::Transformer { patterns }
            }
            Some("SIZE_BASED_WRAP") => {
                let min = var("FSDP_MIN_NUM_PARAMS").unwrap_or_else(|| "100000000".into());
                AutoWrapPolicy::Size {
                    min_num_params: min.parse().map_err(|_| Error::Config {
                        key: "FSDP_MIN_NUM_PARAMS".into(),
                        reason: format!("{min:?} is not a number"),
                    })?,
                }
            }
            Some(other) => {
                return Err(Error::Config {
                    key: "FSDP_AUTO_WRAP_POLICY".into(),
                    reason: format!(
                        "{other:?} (expected TRANSFORMER_BASED_WRAP, SIZE_BASED_WRAP or NO_WRAP)"
                    ),
                })
            }
        };
        p.cpu_offload = truthy("FSDP_OFFLOAD_PARAMS", false)?;
        p.activation_checkpointing = truthy("FSDP_ACTIVATION_CHECKPOINTING", false)?;
        p.cpu_ram_efficient_loading = truthy("FSDP_CPU_RAM_EFFICIENT_LOADING", true)?;
        if let Some(t) = var("FSDP_STATE_DICT_TYPE") {
            p.state_dict_type = t.parse()?;
        }
        Ok(Some(p))
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    fn from(pairs: &[(&str, &str)]) -> Result<Option<FullyShardedDataParallelPlugin>> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        FullyShardedDataParallelPlugin::from_vars(&|k| map.get(k).cloned())
    }

    #[test]
    fn the_launchers_fsdp_variables_become_a_plugin() {
        assert_eq!(from(&[]).unwrap(), None);
        let p = from(&[
            ("ACCELERATE_USE_FSDP", "true"),
            ("FSDP_SHARDING_STRATEGY", "SHARD_GRAD_OP"),
            ("FSDP_AUTO_WRAP_POLICY", "TRANSFORMER_BASED_WRAP"),
            ("FSDP_TRANSFORMER_CLS_TO_WRAP", "h.*, blocks.*"),
            ("FSDP_STATE_DICT_TYPE", "SHARDED_STATE_DICT"),
            ("FSDP_OFFLOAD_PARAMS", "false"),
            ("FSDP_CPU_RAM_EFFICIENT_LOADING", "false"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(p.sharding_strategy, ShardingStrategy::ShardGradOp);
        assert_eq!(
            p.auto_wrap_policy,
            AutoWrapPolicy::Transformer {
                patterns: vec!["h.*".into(), "blocks.*".into()]
            }
        );
        assert_eq!(p.state_dict_type, StateDictType::ShardedStateDict);
        assert!(!p.cpu_ram_efficient_loading);
        // Old config files store the strategy as a number; FSDP2 as reshard_after_forward.
        let p = from(&[
            ("ACCELERATE_USE_FSDP", "true"),
            ("FSDP_SHARDING_STRATEGY", "3"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(p.sharding_strategy, ShardingStrategy::NoShard);
        let p = from(&[
            ("ACCELERATE_USE_FSDP", "true"),
            ("FSDP_VERSION", "2"),
            ("FSDP_RESHARD_AFTER_FORWARD", "false"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(p.sharding_strategy, ShardingStrategy::ShardGradOp);
        let p = from(&[
            ("ACCELERATE_USE_FSDP", "true"),
            ("FSDP_AUTO_WRAP_POLICY", "SIZE_BASED_WRAP"),
            ("FSDP_MIN_NUM_PARAMS", "2000"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(
            p.auto_wrap_policy,
            AutoWrapPolicy::Size {
                min_num_params: 2000
            }
        );
    }

    #[test]
    fn bad_fsdp_variables_name_the_variable() {
        let err = from(&[
            ("ACCELERATE_USE_FSDP", "true"),
            ("FSDP_SHARDING_STRATEGY", "HALF"),
        ])
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("FSDP_SHARDING_STRATEGY") && err.contains("HALF"),
            "{err}"
        );
        let err = from(&[
            ("ACCELERATE_USE_FSDP", "true"),
            ("FSDP_AUTO_WRAP_POLICY", "TRANSFORMER_BASED_WRAP"),
        ])
        .unwrap_err()
        .to_string();
        assert!(err.contains("FSDP_TRANSFORMER_CLS_TO_WRAP"), "{err}");
        let err = from(&[("ACCELERATE_USE_FSDP", "maybe")])
            .unwrap_err()
            .to_string();
        assert!(err.contains("ACCELERATE_USE_FSDP"), "{err}");
    }
}
