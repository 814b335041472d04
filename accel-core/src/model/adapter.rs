//! A LoRA model's adapter written as PEFT writes it: `adapter_config.json`
//! and `adapter_model.safetensors` (fp32, names prefixed `base_model.model.`),
//! which `PeftModel.from_pretrained(base, dir)` loads.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use accel_bigmodel::lora::{
    adapter_module, is_adapter_weight, LoraConfig, ADAPTER_CONFIG_NAME, PEFT_PREFIX,
};
use candle_core::{DType, Tensor};

use super::PreparedModel;
use crate::{Accelerator, Error, Result};

/// The tokenizer files an adapter folder carries over from the base model,
/// as a Trainer saves its tokenizer beside the adapter.
const TOKENIZER_FILES: [&str; 9] = [
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.txt",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
];

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
        for (name, t) in self.full_weights()? {
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
    let Some(base) = base else {
        return Ok(written);
    };
    for name in TOKENIZER_FILES {
        let from = base.join(name);
        if from.is_file() {
            let to = dir.join(name);
            let bytes = std::fs::read(&from).map_err(|e| Error::io("reading", &from, e))?;
            crate::checkpoint::write_bytes_atomic(&to, &bytes)?;
            written.push(to);
        }
    }
    Ok(written)
}

/// Whether any of `names` is a LoRA adapter weight.
pub(crate) fn has_adapters<'a>(mut names: impl Iterator<Item = &'a String>) -> bool {
    names.any(|n| is_adapter_weight(n))
}
