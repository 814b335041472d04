//! Quantized models: the `quantization_config` of a pre-quantized folder,
//! quantization asked for on load, and which modules store their weight
//! `[in, out]` (transformers transposes those before quantizing).

use std::path::Path;
use std::sync::Arc;

use accel_bigmodel::quant::{BnbQuantizationConfig, QuantizeOnLoad};
use accel_nn::layers::QuantSpec;
use serde_json::Value;

use crate::{ModelConfig, Result};

impl ModelConfig {
    /// Builds the model's linear layers quantized as `config` says: with a
    /// source that quantizes on load (see [`ModelConfig::quantize_on_load`])
    /// or one that holds the quantized parts, they multiply through them.
    pub fn set_quantization(&mut self, config: BnbQuantizationConfig) -> QuantSpec {
        let spec = QuantSpec::new(config);
        *self.quant_slot() = Some(spec.clone());
        spec
    }

    /// The quantization the model is built with, if any.
    pub fn quantization(&self) -> Option<&QuantSpec> {
        match self {
            Self::Llama(c) => c.quant.as_ref(),
            Self::Gemma3(c) => c.quant.as_ref(),
            Self::Gpt2(c) => c.quant.as_ref(),
            Self::Bert(c) => c.quant.as_ref(),
        }
    }

    fn quant_slot(&mut self) -> &mut Option<QuantSpec> {
        match self {
            Self::Llama(c) => &mut c.quant,
            Self::Gemma3(c) => &mut c.quant,
            Self::Gpt2(c) => &mut c.quant,
            Self::Bert(c) => &mut c.quant,
        }
    }

    /// The on-load quantization of this model's checkpoint as its
    /// [`QuantSpec`] says (GPT-2's `Conv1D` weights transposed first, as
    /// transformers does), or `None` when the model is not quantized.
    ///
    /// # Errors
    /// A config that sets both or neither of 4 and 8 bits.
    pub fn quantize_on_load(&self) -> Result<Option<QuantizeOnLoad>> {
        let Some(spec) = self.quantization() else {
            return Ok(None);
        };
        let q = QuantizeOnLoad::new(spec.config().clone())?;
        Ok(Some(match self {
            Self::Gpt2(_) => q.with_transposed(Arc::new(|m: &str| {
                ["attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"]
                    .iter()
                    .any(|s| m.ends_with(s))
            })),
            _ => q,
        }))
    }

    /// Takes `quantization_config` (of the `config.json` at `path`): a folder
    /// transformers saved quantized loads as it was saved.
    pub(crate) fn read_quantization(&mut self, path: &Path, q: Option<Value>) -> Result<()> {
        if let Some(q) = q.filter(|q| !q.is_null()) {
            let config =
                BnbQuantizationConfig::from_transformers_json(&q, &path.display().to_string())?;
            self.set_quantization(config);
        }
        Ok(())
    }
}
