//! `prepare_lora`: a pretrained model with LoRA adapters, its base frozen.

use std::path::Path;
use std::sync::Arc;

use accel_bigmodel::lora::{is_adapter_weight, LoraTargets};
use accel_nn::layers::LoraSpec;
use accel_nn::Model;
use candle_nn::VarBuilder;

use super::Accelerator;
use crate::init::{FrozenFn, Pretrained};
use crate::{Error, PreparedModel, Result};

impl Accelerator {
    /// PEFT's `get_peft_model` on a pretrained checkpoint: `build` makes
    /// the model from a config carrying `lora` (`ModelConfig::set_lora`),
    /// every parameter but the adapters starts from `checkpoint` and is
    /// frozen, and the adapters are drawn as PEFT draws them (`A`
    /// Kaiming-uniform, `B` zero) unless the checkpoint holds them.
    ///
    /// The frozen base gets no gradient, no optimizer state and, in a
    /// plain or data-parallel run, no fp32 master: under bf16 mixed
    /// precision it is held in bf16 alone while the adapters train with
    /// fp32 masters. Under FSDP the base is sharded as fp32 pieces and left
    /// untrained. [`PreparedModel::save_pretrained`] then writes the adapter
    /// as a PEFT folder.
    ///
    /// # Errors
    /// A bad LoRA setting; targets that match no linear layer of the model
    /// (PEFT raises the same); those of [`Accelerator::prepare_pretrained`].
    pub fn prepare_lora<M: Model, E: Into<Error>>(
        &mut self,
        checkpoint: impl AsRef<Path>,
        lora: &LoraSpec,
        build: impl FnOnce(VarBuilder<'static>) -> std::result::Result<M, E>,
    ) -> Result<(M, PreparedModel)> {
        let config = lora.config();
        config.validate().map_err(|reason| Error::Config {
            key: "lora".into(),
            reason,
        })?;
        let from = Arc::new(Pretrained::open(checkpoint.as_ref())?);
        let frozen: FrozenFn = Arc::new(|name: &str| !is_adapter_weight(name));
        let (model, params) = self.prepare_from(Some(from.clone()), Some(frozen), build)?;
        if !params.names().iter().any(|n| is_adapter_weight(n)) {
            let targets = match &config.targets {
                LoraTargets::AllLinear => "all-linear".to_string(),
                LoraTargets::Modules(m) => m.join(","),
            };
            return Err(Error::Config {
                key: "lora target_modules".into(),
                reason: format!(
                    "Target modules {targets} not found in the base model {}: no linear layer \
                     is named so (was the model built from the config given `set_lora`?)",
                    checkpoint.as_ref().display()
                ),
            });
        }
        from.warn_unused();
        params.set_source(crate::model::PretrainedSource::of(&from.source));
        params.set_adapter(config.clone());
        Ok((model, params))
    }
}
