//! transformers' `fsdp` / `fsdp_config` and `accelerator_config` training
//! arguments, turned into the Accelerator's settings.

use serde::{Deserialize, Serialize};

use crate::accelerator::AcceleratorConfig;
use crate::fsdp::{
    AutoWrapPolicy, FullyShardedDataParallelPlugin, ShardingStrategy, StateDictType,
};
use crate::{Error, Result};

/// transformers' `fsdp_config` (the keys that apply to candle models).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FsdpConfig {
    /// Size-based auto wrap: the smallest unit, in parameters (with `auto_wrap`).
    pub min_num_params: Option<usize>,
    /// Transformer-based auto wrap: module-name patterns such as `h.*` (with
    /// `auto_wrap`; takes precedence over `min_num_params`).
    pub transformer_layer_cls_to_wrap: Vec<String>,
    /// Recompute wrapped units in backward.
    pub activation_checkpointing: bool,
    /// Rank 0 alone reads a full checkpoint when resuming.
    pub cpu_ram_efficient_loading: bool,
    /// `FULL_STATE_DICT` (default) or `SHARDED_STATE_DICT`.
    pub state_dict_type: Option<String>,
}

impl Default for FsdpConfig {
    fn default() -> Self {
        Self {
            min_num_params: None,
            transformer_layer_cls_to_wrap: vec![],
            activation_checkpointing: false,
            cpu_ram_efficient_loading: true,
            state_dict_type: None,
        }
    }
}

/// The `gradient_accumulation_kwargs` of [`TrainerAcceleratorConfig`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(default, deny_unknown_fields)]
pub struct GradientAccumulationKwargs {
    /// Synchronize gradients on every micro-batch.
    pub sync_each_batch: bool,
}

/// transformers' `accelerator_config`: how the Trainer's Accelerator
/// splits and pads data between processes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TrainerAcceleratorConfig {
    /// Split each batch across processes instead of drawing one per process.
    pub split_batches: bool,
    /// Pad the last batches by wrapping around so every process gets as many.
    pub even_batches: bool,
    /// Shuffle with a sampler seeded from `seed` (the only sampler accel-rs
    /// has; `false` is refused rather than silently ignored).
    pub use_seedable_sampler: bool,
    /// Asynchronous host-to-device batch copies. candle's copies are
    /// synchronous, so this changes nothing; accepted for scripts that set it.
    pub non_blocking: bool,
    /// Rank 0 reads every batch and sends the others theirs: not supported
    /// (each rank reads its own shard of the dataset).
    pub dispatch_batches: Option<bool>,
    /// Accumulation settings.
    pub gradient_accumulation_kwargs: GradientAccumulationKwargs,
}

impl Default for TrainerAcceleratorConfig {
    fn default() -> Self {
        Self {
            split_batches: false,
            even_batches: true,
            use_seedable_sampler: true,
            non_blocking: false,
            dispatch_batches: None,
            gradient_accumulation_kwargs: GradientAccumulationKwargs::default(),
        }
    }
}

impl TrainerAcceleratorConfig {
    /// Applies these settings to `config`.
    ///
    /// # Errors
    /// [`Error::Config`] for `dispatch_batches: true` or `use_seedable_sampler: false`.
    pub fn apply(&self, mut config: AcceleratorConfig) -> Result<AcceleratorConfig> {
        if self.dispatch_batches == Some(true) {
            return Err(config_error(
                "accelerator_config.dispatch_batches",
                "is not supported: every rank reads its own shard of the dataset",
            ));
        }
        if !self.use_seedable_sampler {
            return Err(config_error(
                "accelerator_config.use_seedable_sampler",
                "false is not supported: shuffling is always seeded from `seed`",
            ));
        }
        config.split_batches = self.split_batches;
        config.even_batches = self.even_batches;
        config.gradient_accumulation.sync_each_batch =
            self.gradient_accumulation_kwargs.sync_each_batch;
        Ok(config)
    }
}

/// The FSDP plugin of transformers' `fsdp` words (`"full_shard auto_wrap"`,
/// `"shard_grad_op"`, `"no_shard"`, `"offload"`; ZeRO-1 as
/// `"shard_optimizer"`) and `fsdp_config`; `None` for an empty `fsdp`.
///
/// # Errors
/// [`Error::Config`] naming an unknown word, or two strategies.
pub fn fsdp_plugin(
    words: &str,
    config: &FsdpConfig,
) -> Result<Option<FullyShardedDataParallelPlugin>> {
    let mut strategy = None;
    let (mut offload, mut auto_wrap) = (false, false);
    for word in words.split_whitespace() {
        let s = match word.to_ascii_lowercase().as_str() {
            "full_shard" => Some(ShardingStrategy::FullShard),
            "shard_grad_op" => Some(ShardingStrategy::ShardGradOp),
            "shard_optimizer" => Some(ShardingStrategy::ShardOptimizer),
            "no_shard" => Some(ShardingStrategy::NoShard),
            "offload" => {
                offload = true;
                None
            }
            "auto_wrap" => {
                auto_wrap = true;
                None
            }
            other => {
                return Err(config_error(
                    "fsdp",
                    &format!("unknown option {other:?} (expected full_shard, shard_grad_op, shard_optimizer, no_shard, offload, auto_wrap)"),
                ))
            }
        };
        if let Some(s) = s {
            if strategy.replace(s).is_some() {
                return Err(config_error(
                    "fsdp",
                    "names more than one sharding strategy",
                ));
            }
        }
    }
    if words.trim().is_empty() {
        return Ok(None);
    }
    let mut plugin = FullyShardedDataParallelPlugin::new(strategy.unwrap_or_default())
        .with_cpu_offload(offload)
        .with_activation_checkpointing(config.activation_checkpointing);
    plugin.cpu_ram_efficient_loading = config.cpu_ram_efficient_loading;
    if let Some(t) = &config.state_dict_type {
        plugin.state_dict_type = t.parse::<StateDictType>()?;
    }
    if auto_wrap {
        plugin.auto_wrap_policy = if !config.transformer_layer_cls_to_wrap.is_empty() {
            AutoWrapPolicy::Transformer {
                patterns: config.transformer_layer_cls_to_wrap.clone(),
            }
        } else if let Some(min) = config.min_num_params {
            AutoWrapPolicy::Size {
                min_num_params: min,
            }
        } else {
            return Err(config_error(
                "fsdp_config",
                "auto_wrap needs transformer_layer_cls_to_wrap (module-name patterns) or min_num_params",
            ));
        };
    }
    Ok(Some(plugin))
}

/// An [`Error::Config`] for `key`. Here rather than in args.rs, which
/// imports this file, so the two files do not import each other.
pub(super) fn config_error(key: &str, reason: &str) -> Error {
    Error::Config {
        key: key.into(),
        reason: reason.into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fsdp_words_and_config_become_a_plugin() {
        assert_eq!(fsdp_plugin("", &FsdpConfig::default()).unwrap(), None);
        let config = FsdpConfig {
            transformer_layer_cls_to_wrap: vec!["h.*".into()],
            ..Default::default()
        };
        let p = fsdp_plugin("shard_grad_op auto_wrap offload", &config)
            .unwrap()
            .unwrap();
        assert_eq!(p.sharding_strategy, ShardingStrategy::ShardGradOp);
        assert!(p.cpu_offload);
        assert_eq!(
            p.auto_wrap_policy,
            AutoWrapPolicy::Transformer {
                patterns: vec!["h.*".into()]
            }
        );
        let p = fsdp_plugin(
            "auto_wrap",
            &FsdpConfig {
                min_num_params: Some(10),
                ..Default::default()
            },
        )
        .unwrap()
        .unwrap();
        assert_eq!(p.sharding_strategy, ShardingStrategy::FullShard);
        assert_eq!(
            p.auto_wrap_policy,
            AutoWrapPolicy::Size { min_num_params: 10 }
        );
    }

    #[test]
    fn bad_fsdp_options_name_the_key() {
        let err = fsdp_plugin("full_shard hybrid", &FsdpConfig::default())
            .unwrap_err()
            .to_string();
        assert!(err.contains("fsdp") && err.contains("hybrid"), "{err}");
        let err = fsdp_plugin("full_shard no_shard", &FsdpConfig::default())
            .unwrap_err()
            .to_string();
        assert!(err.contains("more than one"), "{err}");
        let err = fsdp_plugin("full_shard auto_wrap", &FsdpConfig::default())
            .unwrap_err()
            .to_string();
        assert!(err.contains("fsdp_config"), "{err}");
        let bad: std::result::Result<FsdpConfig, _> =
            serde_json::from_str(r#"{"min_num_param": 3}"#);
        assert!(bad.unwrap_err().to_string().contains("min_num_param"));
    }

    #[test]
    fn accelerator_config_sets_data_splitting_and_refuses_what_it_cannot_do() {
        let c = TrainerAcceleratorConfig {
            split_batches: true,
            even_batches: false,
            gradient_accumulation_kwargs: GradientAccumulationKwargs {
                sync_each_batch: true,
            },
            ..Default::default()
        };
        let out = c.apply(AcceleratorConfig::default()).unwrap();
        assert!(
            out.split_batches && !out.even_batches && out.gradient_accumulation.sync_each_batch
        );
        let c = TrainerAcceleratorConfig {
            dispatch_batches: Some(true),
            ..Default::default()
        };
        let err = c
            .apply(AcceleratorConfig::default())
            .unwrap_err()
            .to_string();
        assert!(err.contains("dispatch_batches"), "{err}");
    }
}
