//! Weights that arrive from outside a training step: a pretrained
//! checkpoint, or values written into the compute copies directly.

use candle_core::{DType, Tensor, Var};

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
            // fp32 masters, or a frozen parameter in its own dtype.
            var.set(&source.tensor(name, var.device(), Some(var.dtype()))?)?;
        }
        self.set_source(super::PretrainedSource::of(&source));
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
        let pairs: Vec<(&String, &Var, &Var)> = g
            .names
            .iter()
            .zip(&g.masters)
            .zip(&g.model_vars)
            .filter(|((_, m), v)| m.dtype() != v.dtype())
            .map(|((n, m), v)| (n, m, v))
            .collect();
        let same = are_casts_of(
            &pairs
                .iter()
                .map(|(_, m, v)| (v.as_tensor(), m.as_tensor()))
                .collect::<Vec<_>>(),
        )?;
        let mut adopted = vec![];
        for ((name, m, v), same) in pairs.into_iter().zip(same) {
            if !same {
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

/// For each `(copy, master)` pair, whether `copy` (a bf16 or f16 compute
/// copy) is exactly `master` (fp32) cast down, as `refresh_model_weights`
/// writes it. This runs before every mixed-precision step: host tensors are
/// compared in place, element by element, with no allocation; the others
/// (GPU tensors) through candle ops, with one read back for all of them, so
/// a step costs one device synchronisation here, not one per parameter.
fn are_casts_of(pairs: &[(&Tensor, &Tensor)]) -> Result<Vec<bool>> {
    let mut out: Vec<Option<bool>> = pairs
        .iter()
        .map(|(copy, master)| host_is_cast_of(copy, master))
        .collect::<Result<_>>()?;
    let mut counts = vec![];
    let mut slots = vec![];
    for (k, (copy, master)) in pairs.iter().enumerate() {
        if out[k].is_some() {
            continue;
        }
        if copy.dims() != master.dims() {
            out[k] = Some(false);
            continue;
        }
        // Elements that differ, not counting NaN against NaN (a NaN master
        // cast down is the NaN copy, as the host path compares bits).
        let cast = master.to_dtype(copy.dtype())?;
        let nan = |t: &Tensor| -> candle_core::Result<Tensor> { t.ne(t)?.to_dtype(DType::F32) };
        let differ = (cast.ne(*copy)?.to_dtype(DType::F32)? - (nan(&cast)? * nan(copy)?)?)?;
        counts.push(differ.sum_all()?.to_device(&candle_core::Device::Cpu)?);
        slots.push(k);
    }
    if !counts.is_empty() {
        let differ = Tensor::stack(&counts, 0)?.to_vec1::<f32>()?;
        for (k, d) in slots.into_iter().zip(differ) {
            out[k] = Some(d == 0.0);
        }
    }
    Ok(out.into_iter().map(|o| o.unwrap_or(false)).collect())
}

/// [`are_casts_of`] for one pair of contiguous host tensors (fp32 master,
/// bf16/f16 copy), in place; `None` for any other pair.
fn host_is_cast_of(copy: &Tensor, master: &Tensor) -> Result<Option<bool>> {
    use half::{bf16, f16};
    let host = copy.device().is_cpu() && copy.is_contiguous() && master.is_contiguous();
    if !host || master.dtype() != DType::F32 || !matches!(copy.dtype(), DType::BF16 | DType::F16) {
        return Ok(None);
    }
    if copy.dims() != master.dims() {
        return Ok(Some(false));
    }
    let same = accel_kernels::with_slice::<f32, _>(master, "is_cast_of", |m| {
        Ok(match copy.dtype() {
            DType::BF16 => accel_kernels::with_slice::<bf16, _>(copy, "is_cast_of", |c| {
                Ok(m.iter()
                    .zip(c)
                    .all(|(a, b)| bf16::from_f32(*a).to_bits() == b.to_bits()))
            })?,
            _ => accel_kernels::with_slice::<f16, _>(copy, "is_cast_of", |c| {
                Ok(m.iter()
                    .zip(c)
                    .all(|(a, b)| f16::from_f32(*a).to_bits() == b.to_bits()))
            })?,
        })
    })?;
    Ok(Some(same))
}

#[cfg(test)]
mod tests {
    use candle_core::Device;

    use super::*;

    /// Both paths: contiguous host pairs in place, the others (here
    /// transposed views, as a GPU tensor would go) through one batched
    /// read back; equal casts, a changed element and a NaN master.
    #[test]
    fn casts_are_recognised_on_both_paths() -> Result<()> {
        let dev = Device::Cpu;
        let master = Tensor::new(&[[1.0f32, 2.5, -3.0], [0.1, f32::NAN, 7.0]], &dev)?;
        let copy = master.to_dtype(DType::BF16)?;
        let changed = copy.affine(1.0, 0.5)?;
        let (mt, ct, cht) = (master.t()?, copy.t()?, changed.t()?);
        let half = master.to_dtype(DType::F16)?;
        let got = are_casts_of(&[
            (&copy, &master),
            (&changed, &master),
            (&ct, &mt),
            (&cht, &mt),
            (&half, &master),
            (&copy, &mt),
        ])?;
        assert_eq!(got, [true, false, true, false, true, false]);
        Ok(())
    }
}
