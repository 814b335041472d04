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
            if !is_cast_of(v.as_tensor(), m.as_tensor())? {
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

/// Whether `copy` (a bf16 or f16 compute copy) is exactly `master` (fp32)
/// cast down, as `refresh_model_weights` writes it. Host tensors are compared
/// in place, element by element, with no allocation (this runs before every
/// mixed-precision step); others through candle ops.
fn is_cast_of(copy: &Tensor, master: &Tensor) -> Result<bool> {
    use half::{bf16, f16};
    if copy.dims() != master.dims() {
        return Ok(false);
    }
    let host = copy.device().is_cpu() && copy.is_contiguous() && master.is_contiguous();
    if host && master.dtype() == DType::F32 {
        let same = accel_kernels::with_slice::<f32, _>(master, "is_cast_of", |m| {
            Ok(match copy.dtype() {
                DType::BF16 => accel_kernels::with_slice::<bf16, _>(copy, "is_cast_of", |c| {
                    Ok(m.iter()
                        .zip(c)
                        .all(|(a, b)| bf16::from_f32(*a).to_bits() == b.to_bits()))
                })?,
                DType::F16 => accel_kernels::with_slice::<f16, _>(copy, "is_cast_of", |c| {
                    Ok(m.iter()
                        .zip(c)
                        .all(|(a, b)| f16::from_f32(*a).to_bits() == b.to_bits()))
                })?,
                _ => false,
            })
        })?;
        if matches!(copy.dtype(), DType::BF16 | DType::F16) {
            return Ok(same);
        }
    }
    let cast = master.to_dtype(copy.dtype())?;
    // NaNs differ from themselves; a NaN master cast down is the NaN copy.
    let differ = cast
        .ne(copy)?
        .to_dtype(DType::F32)?
        .sum_all()?
        .to_scalar::<f32>()?;
    Ok(differ == 0.0)
}
