//! A LoRA model's adapter written as PEFT writes it: `adapter_config.json`
//! and `adapter_model.safetensors` (fp32, names prefixed `base_model.model.`),
//! which `PeftModel.from_pretrained(base, dir)` loads.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use accel_bigmodel::lora::{adapter_module, LoraConfig, ADAPTER_CONFIG_NAME, PEFT_PREFIX};
use candle_core::{DType, Tensor};

use super::PreparedModel;
use crate::{Accelerator, Error, Result};

impl PreparedModel {
    /// Marks the model as a LoRA model with `config`: saving it writes the adapter.
    pub(crate) fn set_adapter(&self, config: LoraConfig) {
        self.lock().adapter = Some(config);
    }

    /// The LoRA adapters' settings of a model prepared with
    /// [`Accelerator::prepare_lora`].
    pub fn adapter_config(&self) -> Option<LoraConfig> {
        self.lock().adapter.clone()
    }

    /// Writes the adapter as a PEFT folder in `dir` (see the module doc),
    /// with the base folder's tokenizer files. Every process must call it.
    pub(crate) fn save_adapter(
        &self,
        acc: &Accelerator,
        dir: &Path,
        config: &LoraConfig,
    ) -> Result<Vec<PathBuf>> {
        let base = self.pretrained_dir();
        let mut tensors = BTreeMap::new();
        let mut adapted = vec![];
        // Only the adapters are gathered: under FSDP the base stays sharded.
        for (name, t) in self.full_weights_where(|n| adapter_module(n).is_some())? {
            if let Some(module) = adapter_module(&name) {
                let last = module.rsplit('.').next().unwrap_or(module);
                adapted.push(last.to_string());
                tensors.insert(format!("{PEFT_PREFIX}{name}"), t.to_dtype(DType::F32)?);
            }
        }
        let written = if acc.is_main_process() {
            write_adapter(dir, &tensors, config, &adapted, base.as_deref())
        } else {
            Ok(vec![])
        };
        acc.agree("save_pretrained (adapter)", written)
    }
}

fn write_adapter(
    dir: &Path,
    tensors: &BTreeMap<String, Tensor>,
    config: &LoraConfig,
    adapted: &[String],
    base: Option<&Path>,
) -> Result<Vec<PathBuf>> {
    std::fs::create_dir_all(dir).map_err(|e| Error::io("creating", dir, e))?;
    let mut written = crate::checkpoint::save_sharded(dir, "adapter_model", tensors, u64::MAX)?;
    let base_name = base.map_or(String::new(), |b| b.display().to_string());
    let json = config.to_peft_json(&base_name, "CAUSAL_LM", adapted);
    let config_path = dir.join(ADAPTER_CONFIG_NAME);
    crate::checkpoint::write_json(&config_path, &json)?;
    written.push(config_path);
    if let Some(base) = base {
        written.extend(super::pretrained::copy_files(
            base,
            dir,
            &super::pretrained::TOKENIZER_FILES,
        )?);
    }
    Ok(written)
}

/// Writes the base model `model_dir` with the PEFT LoRA adapter `adapter_dir`
/// merged into its weights to `out` as a Hugging Face folder: PEFT's
/// `merge_and_unload()` then `save_pretrained`. Each weight keeps the base
/// file's dtype (the update is summed in f32 and rounded once); shards past
/// `max_shard_size`; the base's config, generation config and tokenizer
/// files are copied. Unadapted weights are served from the base files'
/// pages, so memory holds little beyond the adapted weights.
///
/// # Errors
/// A bad base checkpoint or adapter folder (named), an adapter for modules
/// the base lacks, a bad size, a failed write.
pub fn merge_lora(
    model_dir: &Path,
    adapter_dir: &Path,
    out: &Path,
    max_shard_size: &str,
) -> Result<Vec<PathBuf>> {
    let limit = crate::checkpoint::parse_size(max_shard_size)?;
    let adapter = std::sync::Arc::new(accel_bigmodel::lora::LoraAdapter::open(adapter_dir)?);
    let cfg = crate::checkpoint::read_json(model_dir.join("config.json"))?;
    if let Some(q) = cfg.get("quantization_config").filter(|q| !q.is_null()) {
        let q = accel_bigmodel::quant::BnbQuantizationConfig::from_transformers_json(
            q,
            &model_dir.join("config.json").display().to_string(),
        )?;
        return super::quantize::merge_into_quantized(model_dir, &adapter, &q, cfg, out, limit);
    }
    let source = accel_bigmodel::CheckpointSource::open(model_dir)?.with_adapter(adapter)?;
    let cpu = candle_core::Device::Cpu;
    let tensors = source
        .names()
        .map(|n| Ok((n.to_string(), source.tensor(n, &cpu, None)?)))
        .collect::<Result<BTreeMap<_, _>>>()?;
    std::fs::create_dir_all(out).map_err(|e| Error::io("creating", out, e))?;
    let mut written = crate::checkpoint::save_model(out, &tensors, limit)?;
    written.extend(super::pretrained::copy_files(
        model_dir,
        out,
        &super::CARRIED_FILES,
    )?);
    Ok(written)
}
