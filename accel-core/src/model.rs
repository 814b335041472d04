//! A prepared model: its parameters, their fp32 master copies and the
//! accumulated gradients, shared between the Accelerator and the optimizer.

use std::sync::{Arc, Mutex, MutexGuard};

use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, Var};

use crate::fsdp::sharding::Sharding;
use crate::{Error, Result};

#[derive(Debug)]
pub(crate) struct ModelInner {
    /// Parameter names in sorted order; indices below follow it.
    pub names: Vec<String>,
    /// The variables the model's forward reads, in its compute dtype.
    pub model_vars: Vec<Var>,
    /// fp32 master weights the optimizer updates; the same `Var` as
    /// `model_vars[i]` when that one is already fp32.
    pub masters: Vec<Var>,
    /// fp32 gradient accumulators, allocated on the first backward.
    pub grads: Vec<Option<Tensor>>,
    /// Which accumulators hold a gradient since the last `zero_grad`.
    pub has_grad: Vec<bool>,
    /// Set once gradients were divided by the loss scale this step, and
    /// whether that found a non-finite value.
    pub unscaled: Option<bool>,
    /// Set for an FSDP model: `masters` are then this rank's fp32 pieces
    /// (and `model_vars` the same variables).
    pub sharding: Option<Arc<Sharding>>,
}

/// The parameters of a model prepared by the Accelerator.
///
/// It is a cheap handle: clones share the same parameters and gradients. The
/// model struct itself stays the user's; it keeps reading `model_vars`, which
/// the optimizer refreshes from the master weights after each step.
#[derive(Debug, Clone)]
pub struct PreparedModel {
    inner: Arc<Mutex<ModelInner>>,
}

impl PreparedModel {
    pub(crate) fn new(names: Vec<String>, model_vars: Vec<Var>, masters: Vec<Var>) -> Self {
        let n = names.len();
        Self {
            inner: Arc::new(Mutex::new(ModelInner {
                names,
                model_vars,
                masters,
                grads: vec![None; n],
                has_grad: vec![false; n],
                unscaled: None,
                sharding: None,
            })),
        }
    }

    /// A model over this rank's pieces of sharded parameters.
    pub(crate) fn new_sharded(
        names: Vec<String>,
        pieces: Vec<Var>,
        sharding: Arc<Sharding>,
    ) -> Self {
        let model = Self::new(names, pieces.clone(), pieces);
        model.lock().sharding = Some(sharding);
        model
    }

    /// The sharding of an FSDP model.
    pub(crate) fn sharding(&self) -> Option<Arc<Sharding>> {
        self.lock().sharding.clone()
    }

    /// True for the parameters of an FSDP model (each rank holds pieces).
    pub fn is_sharded(&self) -> bool {
        self.lock().sharding.is_some()
    }

    /// The master tensors of parameters `ids`, detached: what is computed
    /// from them (gathered parameters) must not lead a backward back to the
    /// masters, whose gradients arrive reduced instead.
    pub(crate) fn pieces(&self, ids: &[usize]) -> Vec<Tensor> {
        let g = self.lock();
        ids.iter()
            .map(|&i| g.masters[i].as_tensor().detach())
            .collect()
    }

    /// Adds already reduced gradient pieces of parameters `ids` to the accumulators.
    pub(crate) fn accumulate_pieces(&self, ids: &[usize], pieces: &[Tensor]) -> Result<()> {
        let mut g = self.lock();
        deposit(&mut g, ids.iter().copied().zip(pieces.iter().cloned()))
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, ModelInner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Parameter names, sorted.
    pub fn names(&self) -> Vec<String> {
        self.lock().names.clone()
    }

    /// Number of parameter tensors.
    pub fn len(&self) -> usize {
        self.lock().names.len()
    }

    /// True when the model has no parameters.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Total number of scalar parameters.
    pub fn num_parameters(&self) -> usize {
        self.lock().masters.iter().map(|v| v.elem_count()).sum()
    }

    /// The fp32 master weights, by name.
    pub fn master_weights(&self) -> Vec<(String, Tensor)> {
        let g = self.lock();
        g.names
            .iter()
            .cloned()
            .zip(g.masters.iter().map(|v| v.as_tensor().clone()))
            .collect()
    }

    /// The full fp32 weights, by name: the master weights, or for a sharded
    /// model the pieces of every rank gathered (every rank must call it then).
    pub fn full_weights(&self) -> Result<Vec<(String, Tensor)>> {
        let (names, masters, sharding) = {
            let g = self.lock();
            let masters: Vec<Tensor> = g.masters.iter().map(|v| v.as_tensor().detach()).collect();
            (g.names.clone(), masters, g.sharding.clone())
        };
        let full = match sharding {
            Some(s) => s.gather_all_f32(&masters)?,
            None => masters,
        };
        Ok(names.into_iter().zip(full).collect())
    }

    /// The accumulated fp32 gradient of each parameter that has one.
    pub fn gradients(&self) -> Vec<(String, Tensor)> {
        let g = self.lock();
        (0..g.names.len())
            .filter(|&i| g.has_grad[i])
            .filter_map(|i| Some((g.names[i].clone(), g.grads[i].clone()?)))
            .collect()
    }

    /// Adds the gradients of this model's variables found in `store` to the
    /// accumulators (the first backward after `zero_grad` copies instead).
    pub(crate) fn accumulate(&self, store: &GradStore) -> Result<()> {
        let mut g = self.lock();
        let found: Vec<(usize, Tensor)> = (0..g.names.len())
            .filter_map(|i| Some((i, store.get(g.model_vars[i].as_tensor())?.clone())))
            .collect();
        deposit(&mut g, found)
    }

    /// Averages the gradients over all ranks (DDP). Every parameter takes
    /// part, a missing gradient counting as zero, so all ranks issue the same
    /// collectives whatever parts of the model their batch touched.
    pub(crate) fn all_reduce_grads(
        &self,
        comm: &dyn accel_dist::Communicator,
        buckets: &accel_dist::ddp::GradBuckets,
        hook: accel_dist::ddp::CommHook,
    ) -> Result<()> {
        let mut g = self.lock();
        let mut all = Vec::with_capacity(g.names.len());
        for i in 0..g.names.len() {
            let t = match g.grads[i].clone() {
                Some(t) => t,
                None => {
                    let m = g.masters[i].as_tensor();
                    let t = Tensor::zeros(m.shape(), DType::F32, m.device())?;
                    g.grads[i] = Some(t.clone());
                    t
                }
            };
            if !g.has_grad[i] {
                // The buffer may hold a previous step's values (even NaN): clear, don't scale.
                accel_kernels::with_slice_mut::<f32, _>(&t, "zero_grad", |s| {
                    s.fill(0.0);
                    Ok(())
                })?;
                g.has_grad[i] = true;
            }
            all.push(t);
        }
        buckets.all_reduce_mean(comm, &all, hook)?;
        Ok(())
    }

    /// Numbers of elements of each parameter, for bucketing.
    pub(crate) fn numels(&self) -> Vec<usize> {
        self.lock().masters.iter().map(|v| v.elem_count()).collect()
    }

    /// Forgets the accumulated gradients (the buffers are kept for reuse).
    pub(crate) fn zero_grad(&self) {
        let mut g = self.lock();
        g.has_grad.iter_mut().for_each(|h| *h = false);
        g.unscaled = None;
    }

    /// Copies the master weights into the compute-dtype variables the model reads.
    pub(crate) fn refresh_model_weights(&self) -> Result<()> {
        let g = self.lock();
        if let Some(sharding) = &g.sharding {
            let masters: Vec<Tensor> = g.masters.iter().map(|v| v.as_tensor().detach()).collect();
            return sharding.refresh(&masters);
        }
        let (mut src, mut dst) = (vec![], vec![]);
        for (m, v) in g.masters.iter().zip(&g.model_vars) {
            if m.dtype() != v.dtype() {
                src.push(m.as_tensor().clone());
                dst.push(v.as_tensor().clone());
            }
        }
        accel_kernels::cast_into(&src, &dst)?;
        Ok(())
    }

    /// Divides the gradients by the loss scale once per step; returns whether
    /// any of them is inf or NaN.
    pub(crate) fn unscale(&self, inv_scale: f32) -> Result<bool> {
        let mut g = self.lock();
        if let Some(found) = g.unscaled {
            return Ok(found);
        }
        let grads = present_grads(&g);
        let mut found = accel_kernels::unscale_and_check(&grads, inv_scale)?;
        if let Some(sharding) = &g.sharding {
            // Every rank must skip the step together, whichever pieces overflowed.
            found = sharding.combine(f64::from(u8::from(found)), accel_dist::ReduceOp::Max)? > 0.0;
        }
        g.unscaled = Some(found);
        Ok(found)
    }

    /// Scales gradients so their global L2 norm is at most `max_norm`, as
    /// `torch.nn.utils.clip_grad_norm_` does; returns the norm before clipping.
    pub(crate) fn clip_grad_norm(&self, max_norm: f64, norm_type: f64) -> Result<f64> {
        let g = self.lock();
        let grads = present_grads(&g);
        let combine = |v: f64, op| match &g.sharding {
            Some(s) => s.combine(v, op),
            None => Ok(v),
        };
        let total = if norm_type.is_infinite() {
            combine(accel_kernels::max_abs(&grads)?, accel_dist::ReduceOp::Max)?
        } else if norm_type == 2.0 {
            combine(
                accel_kernels::sum_of_squares(&grads)?,
                accel_dist::ReduceOp::Sum,
            )?
            .sqrt()
        } else {
            return Err(Error::Config {
                key: "norm_type".into(),
                reason: format!("{norm_type} is not supported (use 2.0 or f64::INFINITY)"),
            });
        };
        // PyTorch computes the coefficient in f32 and clamps it at 1.
        let coef = (max_norm as f32 / (total as f32 + 1e-6)).min(1.0);
        if coef < 1.0 {
            accel_kernels::scale_in_place(&grads, coef)?;
        }
        Ok(total)
    }

    /// Clamps every gradient element into `[-clip, clip]`.
    pub(crate) fn clip_grad_value(&self, clip: f64) -> Result<()> {
        let g = self.lock();
        let grads = present_grads(&g);
        accel_kernels::clamp_in_place(&grads, -clip as f32, clip as f32)?;
        Ok(())
    }

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
        let path = checkpoint.as_ref();
        if let Some(s) = self.sharding() {
            return crate::fsdp::state_dict::load_full_into_pieces(self, &s, path);
        }
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
        let g = self.lock();
        if g.sharding.is_some() {
            return Ok(vec![]);
        }
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

    /// The master variables with their names, for loading.
    pub(crate) fn named_masters(&self) -> Vec<(String, Var)> {
        let g = self.lock();
        g.names
            .iter()
            .cloned()
            .zip(g.masters.iter().cloned())
            .collect()
    }
}

/// Adds each `(id, gradient)` to the fp32 accumulator of parameter `id`
/// (copies instead for the first gradient since `zero_grad`).
fn deposit(g: &mut ModelInner, grads: impl IntoIterator<Item = (usize, Tensor)>) -> Result<()> {
    let (mut copy_dst, mut copy_src, mut add_dst, mut add_src) = (vec![], vec![], vec![], vec![]);
    for (i, grad) in grads {
        let acc = match &g.grads[i] {
            Some(t) => t.clone(),
            None => {
                let t = g.masters[i].as_tensor().zeros_like()?;
                g.grads[i] = Some(t.clone());
                t
            }
        };
        // Gradients from candle may be strided views; the kernels need contiguous input.
        let grad = grad.contiguous()?;
        if g.has_grad[i] {
            add_dst.push(acc);
            add_src.push(grad);
        } else {
            copy_dst.push(acc);
            copy_src.push(grad);
            g.has_grad[i] = true;
        }
    }
    accel_kernels::cast_into(&copy_src, &copy_dst)?;
    accel_kernels::add_in_place(&add_dst, &add_src)?;
    Ok(())
}

fn present_grads(g: &ModelInner) -> Vec<Tensor> {
    (0..g.names.len())
        .filter(|&i| g.has_grad[i])
        .filter_map(|i| g.grads[i].clone())
        .collect()
}

/// Whether `copy` (a bf16 or f16 compute copy) is exactly `master` (fp32)
/// cast down, as `refresh_model_weights` writes it. Host tensors are compared
/// in place, element by element, with no allocation (this runs before every
/// mixed-precision step); others through candle ops.
pub(crate) fn is_cast_of(copy: &Tensor, master: &Tensor) -> Result<bool> {
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
