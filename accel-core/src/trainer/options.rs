//! transformers' `accelerator_config` training argument, turned into the
//! Accelerator's settings (`fsdp` / `fsdp_config` are in `fsdp_args.rs`).

use serde::{Deserialize, Serialize};

use crate::accelerator::AcceleratorConfig;
use crate::{Error, Result};

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
    /// synchronous, so this has no effect (said at start-up when set);
    /// `dataloader_num_workers` overlaps batch preparation with the step.
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

/// `accelerator_config` as transformers takes it: a JSON object, or the path
/// of a JSON file holding one.
pub(super) fn accelerator_config_arg<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> std::result::Result<TrainerAcceleratorConfig, D::Error> {
    use serde::de::Error as _;
    let v = serde_json::Value::deserialize(d)?;
    let v = match v {
        serde_json::Value::Null => return Ok(TrainerAcceleratorConfig::default()),
        serde_json::Value::String(path) => {
            let text = std::fs::read_to_string(&path).map_err(|e| {
                D::Error::custom(format!("accelerator_config: reading {path}: {e}"))
            })?;
            serde_json::from_str(&text)
                .map_err(|e| D::Error::custom(format!("accelerator_config: {path}: {e}")))?
        }
        other => other,
    };
    serde_json::from_value(v).map_err(|e| D::Error::custom(format!("accelerator_config: {e}")))
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
