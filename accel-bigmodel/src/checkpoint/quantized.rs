//! A [`CheckpointSource`] that quantizes its linear weights as they are read
//! ([`QuantizeOnLoad`]), and the int8 tensors of pre-quantized checkpoints.

use std::sync::Arc;

use candle_core::{DType, Device, Tensor};

use super::source::CheckpointSource;
use crate::error::{Error, Result};
use crate::quant::QuantizeOnLoad;

impl CheckpointSource {
    /// The same checkpoint with its linear weights quantized on the way out:
    /// a model built on it finds the parts of a pre-quantized checkpoint
    /// (see [`QuantizeOnLoad`]). Each weight is read, quantized and dropped
    /// when its layer asks for it, so the full-precision model is never
    /// held whole.
    ///
    /// # Errors
    /// A checkpoint that is already quantized (its `quantization_config`
    /// says how it loads), or an adapter merged into weights that would be
    /// quantized after the merge (PEFT keeps a 4-bit base unmerged).
    pub fn with_quantization(mut self, quantize: QuantizeOnLoad) -> Result<Self> {
        if let Some(name) = self.names().find(|n| crate::quant::is_quant_part(n)) {
            return Err(Error::BadQuantConfig {
                key: "load_in_4bit / load_in_8bit".into(),
                reason: format!(
                    "{} is already quantized (it holds `{name}`); load it without \
                     quantization flags, as its config.json says",
                    self.checkpoint().display()
                ),
            });
        }
        if self.adapter().is_some() && !self.adapter_is_unmerged() {
            return Err(Error::BadQuantConfig {
                key: "load_in_4bit / load_in_8bit".into(),
                reason: "a LoRA adapter merged into the weights cannot be quantized after the \
                         merge; load the adapter unmerged on the quantized base"
                    .into(),
            });
        }
        self.quant = Some(Arc::new(quantize));
        Ok(self)
    }

    /// The quantization applied on load, if any.
    pub fn quantization(&self) -> Option<&QuantizeOnLoad> {
        self.quant.as_deref()
    }

    /// The checkpoint's dims and candle dtype of `name`, from the headers.
    fn stored(&self, name: &str) -> Option<(Vec<usize>, DType)> {
        let at = self.locate(name)?;
        Some((at.shape().to_vec(), at.dtype()?))
    }

    /// Whether `name` asked for in `dtype` is a quantized part served from a
    /// full-precision weight.
    pub(super) fn serves_quantized(&self, name: &str, dtype: Option<DType>) -> bool {
        self.quant
            .as_ref()
            .is_some_and(|q| q.serves(name, dtype, |w| self.stored(w)).unwrap_or(false))
    }

    /// The quantized part `name` on `device`, when this source serves it.
    ///
    /// # Errors
    /// A bad skip pattern; those of reading the full-precision weight.
    pub(super) fn quantized_part(
        &self,
        name: &str,
        dtype: Option<DType>,
        device: &Device,
    ) -> Result<Option<Tensor>> {
        let Some(q) = &self.quant else {
            return Ok(None);
        };
        if !q.serves(name, dtype, |w| self.stored(w))? {
            return Ok(None);
        }
        q.tensor(name, dtype, device, |weight| {
            let t = self.tensor_unquantized(weight, &Device::Cpu, Some(DType::F32))?;
            let (shape, stored) = self.stored(weight).ok_or_else(|| Error::MissingTensor {
                name: weight.to_string(),
                checkpoint: self.checkpoint().to_path_buf(),
            })?;
            let values = accel_kernels::with_slice::<f32, _>(&t, "quantize", |v| Ok(v.to_vec()))?;
            Ok((values, shape, stored))
        })
    }

    /// The dims `name` has when asked for in `dtype`: a quantized part's, or
    /// the checkpoint's. `None` when the source holds no such tensor.
    pub fn shape_of(&self, name: &str, dtype: Option<DType>) -> Option<Vec<usize>> {
        if let Some(shape) = self.adapter_matrix_shape(name) {
            return Some(shape);
        }
        if self.serves_quantized(name, dtype) {
            let t = self.quantized_part(name, dtype, &Device::Cpu).ok()??;
            return Some(t.dims().to_vec());
        }
        Some(self.locate(name)?.shape().to_vec())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::test_files::write;
    use crate::quant::{BnbQuantizationConfig, Packed4bit, QuantType};

    /// A float checkpoint seen through 4-bit quantization: the packed
    /// weight for a u8 request, the float weight otherwise, the other
    /// tensors untouched, shapes known before reading.
    #[test]
    fn a_float_checkpoint_serves_the_parts_of_its_quantized_linears() {
        let dir = tempfile::tempdir().unwrap();
        let vals: Vec<f32> = (0..128 * 64)
            .map(|i| ((i * 13 % 97) as f32 - 48.0) / 31.0)
            .collect();
        let w = Tensor::from_vec(vals.clone(), (128, 64), &Device::Cpu).unwrap();
        let emb = Tensor::ones((10, 64), DType::F32, &Device::Cpu).unwrap();
        let path = write(
            &dir.path().join("model.safetensors"),
            &[("q.weight", w), ("emb.weight", emb)],
        );
        let mut c = BnbQuantizationConfig::four_bit(QuantType::Nf4);
        c.bnb_4bit_use_double_quant = true;
        let source = CheckpointSource::open(&path)
            .unwrap()
            .with_quantization(QuantizeOnLoad::new(c).unwrap())
            .unwrap();
        let want = Packed4bit::quantize(&vals, &[128, 64], DType::F32, QuantType::Nf4, true);
        assert!(source.contains("q.weight.quant_state.bitsandbytes__nf4"));
        assert!(source.contains("q.weight.nested_absmax"));
        assert!(!source.contains("q.weight.quant_state.bitsandbytes__fp4"));
        assert_eq!(
            source.shape_of("q.weight", Some(DType::U8)),
            Some(vec![4096, 1])
        );
        assert_eq!(
            source.shape_of("q.weight", Some(DType::F32)),
            Some(vec![128, 64])
        );
        assert_eq!(source.shape_of("q.weight.absmax", None), Some(vec![128]));
        let cpu = Device::Cpu;
        let packed = source.tensor("q.weight", &cpu, Some(DType::U8)).unwrap();
        assert_eq!(
            packed.flatten_all().unwrap().to_vec1::<u8>().unwrap(),
            want.packed
        );
        let full = source.tensor("q.weight", &cpu, Some(DType::F32)).unwrap();
        assert_eq!(full.dims(), [128, 64]);
        let state = source
            .tensor(
                "q.weight.quant_state.bitsandbytes__nf4",
                &cpu,
                Some(DType::U8),
            )
            .unwrap();
        assert_eq!(
            state.to_vec1::<u8>().unwrap(),
            want.state.to_json().into_bytes()
        );
        // The source cannot tell an embedding from a linear layer (only
        // linear layers ask for parts), but the float tensor is unchanged.
        assert!(source.contains("emb.weight.absmax"));
        assert_eq!(
            source.tensor("emb.weight", &cpu, None).unwrap().dims(),
            [10, 64]
        );
        // A quantized folder cannot be quantized again.
        let q = dir.path().join("q.safetensors");
        let state = Tensor::new(b"{}".as_slice(), &cpu).unwrap();
        write(&q, &[("l.weight.quant_state.bitsandbytes__nf4", state)]);
        let e = CheckpointSource::open(&q)
            .unwrap()
            .with_quantization(QuantizeOnLoad::new(BnbQuantizationConfig::eight_bit()).unwrap())
            .unwrap_err();
        assert!(e.to_string().contains("already quantized"), "{e}");
    }
}
