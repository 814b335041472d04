//! Weights that arrive from outside a training step: a pretrained
//! checkpoint, or values written into the compute copies directly.

use candle_core::{DType, Tensor};

use super::PreparedModel;
use crate::{Error, Result};

impl PreparedModel {
    /// Loads pretrained weights: `checkpoint` is a `.safetensors` file, or a
    /// folder with `model.safetensors` or a sharded
    /// `model.safetensors.index.json` (transformers' `save_pretrained`
    /// layout). The fp32 masters take the values (converted from the file's
    /// dtype) and the compute copies the model reads are cast from them, so
    /// a bf16 or fp16 run starts from the same weights as an fp32 one. For a
    /// sharded (FSDP) model every rank must call it; tensors stream into the
    /// pieces. Tensors the model does not have are ignored (as transformers
    /// does with a warning).
    ///
    /// # Errors
    /// A parameter the checkpoint lacks ([`Error::KeyMismatch`]) or holds in
    /// another shape ([`Error::ShapeMismatch`]), named with the file, before
    /// any weight changes.
    pub fn load_checkpoint(&self, checkpoint: impl AsRef<std::path::Path>) -> Result<()> {
        self.strategy
            .clone()
            .load_checkpoint(self, checkpoint.as_ref())
    }

    /// [`PreparedModel::load_checkpoint`] for a model whose masters are
    /// whole: every tensor checked, then set, then cast to the compute copies.
    pub(crate) fn load_whole_checkpoint(&self, path: &std::path::Path) -> Result<()> {
        let source = accel_bigmodel::CheckpointSource::open(path)?;
        let masters = self.named_masters();
        for (name, var) in &masters {
            match source.locate(name) {
                None => {
                    return Err(Error::KeyMismatch {
                        path: path.to_path_buf(),
                        missing: vec![name.clone()],
                        unexpected: vec![],
                    })
                }
                Some(at) if at.shape() != var.dims() => {
                    return Err(Error::ShapeMismatch {
                        path: at.file.to_path_buf(),
                        tensor: name.clone(),
                        expected: var.dims().to_vec(),
                        got: at.shape().to_vec(),
                    })
                }
                Some(_) => {}
            }
        }
        let extra = source
            .names()
            .filter(|n| !masters.iter().any(|(m, _)| m == n))
            .count();
        if extra > 0 {
            tracing::warn!(checkpoint = %path.display(), extra, "checkpoint tensors the model does not use were ignored");
        }
        for (name, var) in &masters {
            var.set(&source.tensor(name, var.device(), Some(DType::F32))?)?;
        }
        drop(source);
        self.refresh_model_weights()
    }

    /// Takes up values written into the compute copies behind the
    /// Accelerator's back (`VarMap::load` in the model's dtype, `Var::set`):
    /// a compute copy that no longer equals its fp32 master cast down
    /// becomes the master's value, so the next optimizer step continues
    /// from it instead of silently overwriting it. Returns the names taken up.
    /// Only mixed precision has separate copies; in fp32 the model reads the
    /// masters themselves.
    pub(crate) fn adopt_outside_writes(&self) -> Result<Vec<String>> {
        if self.strategy.holds_pieces() {
            return Ok(vec![]);
        }
        let g = self.lock();
        let mut adopted = vec![];
        for ((name, m), v) in g.names.iter().zip(&g.masters).zip(&g.model_vars) {
            if m.dtype() == v.dtype() {
                continue;
            }
            if !same_bits(&m.as_tensor().to_dtype(v.dtype())?, v.as_tensor())? {
                m.set(&v.as_tensor().to_dtype(DType::F32)?)?;
                adopted.push(name.clone());
            }
        }
        if !adopted.is_empty() {
            tracing::warn!(
                parameters = ?adopted,
                "weights changed outside the Accelerator were taken up as the new fp32 masters; \
                 load pretrained weights with PreparedModel::load_checkpoint to keep full precision"
            );
        }
        Ok(adopted)
    }
}

/// Whether two tensors of one dtype hold the same bits (NaNs included).
fn same_bits(a: &Tensor, b: &Tensor) -> Result<bool> {
    if a.dims() != b.dims() || a.dtype() != b.dtype() {
        return Ok(false);
    }
    let bits = |t: &Tensor| -> Result<Vec<u16>> {
        Ok(match t.dtype() {
            DType::BF16 => t
                .flatten_all()?
                .to_vec1::<half::bf16>()?
                .iter()
                .map(|x| x.to_bits())
                .collect(),
            DType::F16 => t
                .flatten_all()?
                .to_vec1::<half::f16>()?
                .iter()
                .map(|x| x.to_bits())
                .collect(),
            other => {
                let f = t.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
                let _ = other;
                f.iter()
                    .flat_map(|x| {
                        let b = x.to_bits();
                        [b as u16, (b >> 16) as u16]
                    })
                    .collect()
            }
        })
    };
    Ok(bits(a)? == bits(b)?)
}
