//! `FullyShardedDataParallelPlugin`: the FSDP settings, from code or from the
//! `FSDP_*` variables `accel launch` exports from `default_config.yaml`.

use candle_core::{DType, Device};

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

/// When FSDP1 gathers the next unit's parameters during backward
/// (`FSDP_BACKWARD_PREFETCH`). Stored and reported: units here gather
/// synchronously when they run, so no prefetch happens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BackwardPrefetch {
    /// `BACKWARD_PRE`: before the current unit's gradient computation.
    BackwardPre,
    /// `BACKWARD_POST`: after it.
    BackwardPost,
    /// `NO_PREFETCH` (also what an unset variable means).
    #[default]
    NoPrefetch,
}

impl std::str::FromStr for BackwardPrefetch {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_uppercase().as_str() {
            "BACKWARD_PRE" => Ok(Self::BackwardPre),
            "BACKWARD_POST" => Ok(Self::BackwardPost),
            "NO_PREFETCH" | "NONE" => Ok(Self::NoPrefetch),
            other => Err(Error::Config {
                key: "FSDP_BACKWARD_PREFETCH".into(),
                reason: format!("{other:?} (expected BACKWARD_PRE, BACKWARD_POST or NO_PREFETCH)"),
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
    /// Every rank draws its initial pieces with rank 0's seed, so the ranks
    /// start from one model even if they were seeded apart (PyTorch
    /// broadcasts rank 0's module; drawing from one seed gives the same).
    /// With `false` each rank draws from its own seed: the same thing when
    /// the seeds agree, as they do by default.
    pub sync_module_states: bool,
    /// FSDP1's backward prefetch; no effect here (said at start-up).
    pub backward_prefetch: BackwardPrefetch,
    /// FSDP1's forward prefetch; no effect here (said at start-up).
    pub forward_prefetch: bool,
    /// FSDP1's `use_orig_params`. The optimizer here always sees each
    /// original parameter (its piece, by name), which is `true`; `false`
    /// has no effect (said at start-up).
    pub use_orig_params: bool,
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
            sync_module_states: true,
            backward_prefetch: BackwardPrefetch::NoPrefetch,
            forward_prefetch: false,
            use_orig_params: true,
        }
    }

    /// The settings this plugin holds that do nothing here, one sentence
    /// each naming its key; the Accelerator logs them once at start-up.
    pub fn inert_settings(&self, device: &Device) -> Vec<String> {
        let mut out = vec![];
        let mut say = |key: &str, why: &str| {
            out.push(format!(
                "FSDP setting `{key}` has no effect in accel-rs: {why}"
            ))
        };
        if self.backward_prefetch != BackwardPrefetch::NoPrefetch {
            say(
                "fsdp_backward_prefetch (FSDP_BACKWARD_PREFETCH)",
                "units gather their parameters when they run; there is no prefetch",
            );
        }
        if self.forward_prefetch {
            say(
                "fsdp_forward_prefetch (FSDP_FORWARD_PREFETCH)",
                "units gather their parameters when they run; there is no prefetch",
            );
        }
        if !self.use_orig_params {
            say(
                "fsdp_use_orig_params (FSDP_USE_ORIG_PARAMS) = false",
                "the optimizer always steps each original parameter's piece (as `true`)",
            );
        }
        if self.cpu_offload && device.is_cpu() {
            say(
                "fsdp_offload_params (FSDP_OFFLOAD_PARAMS)",
                "this run is on the CPU, where the shards already are",
            );
        }
        out
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

    /// Sets whether every rank starts from rank 0's initial pieces.
    pub fn with_sync_module_states(mut self, on: bool) -> Self {
        self.sync_module_states = on;
        self
    }

    /// FSDP2's name for the difference between `FullShard` and `ShardGradOp`.
    pub fn reshard_after_forward(&self) -> bool {
        self.sharding_strategy == ShardingStrategy::FullShard
    }

    /// The plugin `accel launch` describes through `ACCELERATE_USE_FSDP` and
    /// the `FSDP_*` variables (written from `fsdp_config`), or `None` when
    /// FSDP is not on. `FSDP_TRANSFORMER_CLS_TO_WRAP` holds comma-separated
    /// block class names (`LlamaDecoderLayer`, as Python configs write them)
    /// or module-name patterns (`h.*`).
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
        let mut p = Self::new(strategy_from_vars(&var, &truthy)?);
        p.auto_wrap_policy = match var("FSDP_AUTO_WRAP_POLICY").as_deref() {
            None | Some("NO_WRAP") => AutoWrapPolicy::NoWrap,
            Some("TRANSFORMER_BASED_WRAP") => {
                let patterns: Vec<String> = var("FSDP_TRANSFORMER_CLS_TO_WRAP")
                    .unwrap_or_default()
                    .split(',')
                    .map(|s| s.trim().to_string())
                    .filter(|s| !s.is_empty())
                    .collect();
                // None named: the model's repeated block class, as
                // Accelerate falls back to `_no_split_modules`.
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
        p.sync_module_states = truthy("FSDP_SYNC_MODULE_STATES", true)?;
        p.forward_prefetch = truthy("FSDP_FORWARD_PREFETCH", false)?;
        p.use_orig_params = truthy("FSDP_USE_ORIG_PARAMS", true)?;
        if let Some(b) = var("FSDP_BACKWARD_PREFETCH") {
            p.backward_prefetch = b.parse()?;
        }
        Ok(Some(p))
    }
}

/// The sharding strategy from `FSDP_SHARDING_STRATEGY` and
/// `FSDP_RESHARD_AFTER_FORWARD`, as Accelerate 1.x reads them: FSDP2 spells
/// the strategy as a boolean (`false` is SHARD_GRAD_OP); FSDP1 takes a
/// strategy name from either variable (newer files write it under
/// `fsdp_reshard_after_forward`) and `false` turns FULL_SHARD into
/// SHARD_GRAD_OP (gathered parameters kept from forward to backward).
fn strategy_from_vars(
    var: &dyn Fn(&str) -> Option<String>,
    truthy: &dyn Fn(&str, bool) -> Result<bool>,
) -> Result<ShardingStrategy> {
    const RESHARD: &str = "FSDP_RESHARD_AFTER_FORWARD";
    let parse = |key: &str, v: &str| -> Result<ShardingStrategy> {
        v.parse().map_err(|e: accel_dist::Error| Error::Config {
            key: key.into(),
            reason: e.to_string(),
        })
    };
    if var("FSDP_VERSION").as_deref() == Some("2") {
        return Ok(if truthy(RESHARD, true)? {
            ShardingStrategy::FullShard
        } else {
            ShardingStrategy::ShardGradOp
        });
    }
    let reshard = var(RESHARD);
    let reshard_bool = match reshard.as_deref().map(str::to_ascii_lowercase).as_deref() {
        Some("true" | "1" | "yes") => Some(true),
        Some("false" | "0" | "no") => Some(false),
        _ => None,
    };
    let mut strategy = match (var("FSDP_SHARDING_STRATEGY"), &reshard, reshard_bool) {
        (Some(s), _, _) => parse("FSDP_SHARDING_STRATEGY", &s)?,
        (None, Some(r), None) => parse(RESHARD, r)?,
        _ => ShardingStrategy::FullShard,
    };
    if strategy == ShardingStrategy::FullShard && reshard_bool == Some(false) {
        strategy = ShardingStrategy::ShardGradOp;
    }
    Ok(strategy)
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
        // No class named: the model's repeated block class, as Accelerate
        // falls back to `_no_split_modules` (resolved when the model is prepared).
        let p = from(&[
            ("ACCELERATE_USE_FSDP", "true"),
            ("FSDP_AUTO_WRAP_POLICY", "TRANSFORMER_BASED_WRAP"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(
            p.auto_wrap_policy,
            AutoWrapPolicy::Transformer { patterns: vec![] }
        );
        let err = from(&[("ACCELERATE_USE_FSDP", "maybe")])
            .unwrap_err()
            .to_string();
        assert!(err.contains("ACCELERATE_USE_FSDP"), "{err}");
    }

    #[test]
    fn python_class_names_to_wrap_load_as_the_policy_and_are_not_reported() {
        let p = from(&[
            ("ACCELERATE_USE_FSDP", "true"),
            ("FSDP_AUTO_WRAP_POLICY", "TRANSFORMER_BASED_WRAP"),
            (
                "FSDP_TRANSFORMER_CLS_TO_WRAP",
                "LlamaDecoderLayer,BertLayer",
            ),
        ])
        .unwrap()
        .unwrap();
        // Blocks declare their class, so the names act (see fsdp/blocks.rs).
        assert_eq!(
            p.auto_wrap_policy,
            AutoWrapPolicy::Transformer {
                patterns: vec!["LlamaDecoderLayer".into(), "BertLayer".into()]
            }
        );
        assert!(p.inert_settings(&Device::Cpu).is_empty());
    }

    #[test]
    fn settings_without_effect_are_named_at_start_up() {
        let p = from(&[
            ("ACCELERATE_USE_FSDP", "true"),
            ("FSDP_BACKWARD_PREFETCH", "BACKWARD_POST"),
            ("FSDP_FORWARD_PREFETCH", "true"),
            ("FSDP_USE_ORIG_PARAMS", "false"),
            ("FSDP_OFFLOAD_PARAMS", "true"),
        ])
        .unwrap()
        .unwrap();
        let w = p.inert_settings(&Device::Cpu).join("\n");
        for key in [
            "FSDP_BACKWARD_PREFETCH",
            "FSDP_FORWARD_PREFETCH",
            "FSDP_USE_ORIG_PARAMS",
            "FSDP_OFFLOAD_PARAMS",
        ] {
            assert!(w.contains(key), "{key} missing in {w}");
        }
        // The defaults act (or are what happens anyway): nothing to say.
        let d = from(&[("ACCELERATE_USE_FSDP", "true")]).unwrap().unwrap();
        assert!(d.inert_settings(&Device::Cpu).is_empty());
        let e = from(&[
            ("ACCELERATE_USE_FSDP", "true"),
            ("FSDP_BACKWARD_PREFETCH", "SOMETIMES"),
        ])
        .unwrap_err()
        .to_string();
        assert!(e.contains("FSDP_BACKWARD_PREFETCH"), "{e}");
        let e = from(&[
            ("ACCELERATE_USE_FSDP", "true"),
            ("FSDP_RESHARD_AFTER_FORWARD", "HALF"),
        ])
        .unwrap_err()
        .to_string();
        assert!(e.contains("FSDP_RESHARD_AFTER_FORWARD"), "{e}");
    }
}
