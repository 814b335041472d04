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
        self.prepare_lora_quantized(checkpoint, lora, None, build)
    }

    /// QLoRA: [`Accelerator::prepare_lora`] on a base whose linear layers are
    /// quantized as `quantize` says while it loads, each weight read,
    /// quantized and dropped in turn (build the model from a config given
    /// the same settings, `ModelConfig::set_quantization`, whose
    /// `quantize_on_load` makes `quantize`). A checkpoint saved quantized
    /// needs no `quantize`: its parts load as they are. The quantized base is
    /// frozen like any base, in its 4 or 8 bits; the adapters train.
    ///
    /// # Errors
    /// Those of [`Accelerator::prepare_lora`]; a checkpoint already
    /// quantized.
    ///
    /// Under FSDP the packed parts are sharded by bytes beside the fp32
    /// pieces (each rank keeps `1 / world` of them) and gathered per unit as
    /// it runs; they take no part in the gradient reductions.
    pub fn prepare_lora_quantized<M: Model, E: Into<Error>>(
        &mut self,
        checkpoint: impl AsRef<Path>,
        lora: &LoraSpec,
        quantize: Option<accel_bigmodel::quant::QuantizeOnLoad>,
        build: impl FnOnce(VarBuilder<'static>) -> std::result::Result<M, E>,
    ) -> Result<(M, PreparedModel)> {
        let config = lora.config();
        config.validate().map_err(|reason| Error::Config {
            key: "lora".into(),
            reason,
        })?;
        let mut from = Pretrained::open(checkpoint.as_ref())?;
        if let Some(q) = quantize {
            from.source = from.source.with_quantization(q)?;
        }
        let from = Arc::new(from);
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
