//! What a prepared model does with its gradients: accumulate them in fp32
//! buffers, unscale, clip and clear them. Combining values across ranks is
//! left to the model's [`SyncStrategy`](super::SyncStrategy).

use accel_dist::ReduceOp;
use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor};

use super::{ModelInner, PreparedModel};
use crate::{Error, Result};

impl PreparedModel {
    /// Adds already reduced gradient pieces of parameters `ids` to the accumulators.
    pub(crate) fn accumulate_pieces(&self, ids: &[usize], pieces: &[Tensor]) -> Result<()> {
        let mut g = self.lock();
        // Frozen parameters' pieces are dropped, as `accumulate` drops theirs.
        let kept: Vec<(usize, Tensor)> = ids
            .iter()
            .copied()
            .zip(pieces.iter().cloned())
            .filter(|(i, _)| !g.frozen[*i])
            .collect();
        // Pieces may be views into one reduced buffer: copied, never adopted.
        deposit(&mut g, kept, false)
    }

    /// Adds the gradients of this model's variables found in `store` to the
    /// accumulators (the first backward after `zero_grad` copies instead).
    ///
    /// `store` must be dropped by the caller right after (the Accelerator's
    /// `backward` does): a first fp32 gradient is adopted as the accumulator
    /// itself, not copied, since every gradient `Tensor::backward` returns
    /// owns a contiguous storage that nothing else holds (the workspace's
    /// patched candle-core copies out any that would share one, see
    /// `vendor/candle-core/src/backprop.rs`).
    ///
    /// Frozen parameters' gradients are dropped here (candle computes them
    /// anyway: it has no `requires_grad`).
    pub(crate) fn accumulate(&self, store: &GradStore) -> Result<()> {
        let mut g = self.lock();
        let found: Vec<(usize, Tensor)> = (0..g.names.len())
            .filter_map(|i| Some((i, store.get(g.model_vars[i].as_tensor())?.clone())))
            .collect();
        for &(i, _) in &found {
            g.reached[i] = true;
        }
        let found: Vec<_> = found.into_iter().filter(|(i, _)| !g.frozen[*i]).collect();
        deposit(&mut g, found, true)
    }

    /// Records that a backward reached parameters `ids` (a sharded model's,
    /// whose gradients arrive through its units).
    pub(crate) fn mark_reached(&self, ids: impl IntoIterator<Item = usize>) {
        let mut g = self.lock();
        for i in ids {
            g.reached[i] = true;
        }
    }

    /// Averages the gradients over all ranks (DDP). Every parameter takes
    /// part, a missing gradient counting as zero, so all ranks issue the same
    /// collectives whatever parts of the model their batch touched.
    ///
    /// With `find_unused`, parameters no rank gave a gradient (a flag per
    /// parameter, summed over ranks first) end with none: their buffer is
    /// zero and the optimizer skips them.
    pub(crate) fn all_reduce_grads(
        &self,
        comm: &dyn accel_dist::Communicator,
        buckets: &accel_dist::ddp::GradBuckets,
        hook: accel_dist::ddp::CommHook,
        find_unused: bool,
    ) -> Result<()> {
        let mut g = self.lock();
        let mut all = Vec::with_capacity(g.names.len());
        // The buckets were laid out over the trainable parameters only.
        let trainable: Vec<usize> = (0..g.names.len()).filter(|&i| !g.frozen[i]).collect();
        let mut used: Vec<f32> = if find_unused {
            trainable
                .iter()
                .map(|&i| f32::from(u8::from(g.has_grad[i])))
                .collect()
        } else {
            vec![]
        };
        if find_unused {
            comm.all_reduce(
                accel_dist::BufferMut::F32(&mut used),
                accel_dist::ReduceOp::Sum,
            )?;
        }
        for &i in &trainable {
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
                // The buffer may hold a previous step's values (even NaN):
                // clear, don't scale. In place, on whatever device it lives.
                t.zero_set()?;
                g.has_grad[i] = true;
            }
            all.push(t);
        }
        buckets.all_reduce_mean(comm, &all, hook)?;
        for (&i, &u) in trainable.iter().zip(&used) {
            if u == 0.0 {
                // Unused at every rank: its zero buffer is not a gradient.
                g.has_grad[i] = false;
            }
        }
        Ok(())
    }

    /// Forgets the accumulated gradients (the buffers are kept for reuse).
    pub(crate) fn zero_grad(&self) {
        let mut g = self.lock();
        g.has_grad.iter_mut().for_each(|h| *h = false);
        g.unscaled = None;
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
        // Every rank holding other gradients must skip the step together,
        // whichever of them overflowed.
        found = self
            .strategy
            .combine(f64::from(u8::from(found)), ReduceOp::Max)?
            > 0.0;
        g.unscaled = Some(found);
        Ok(found)
    }

    /// Scales gradients so their global L2 norm is at most `max_norm`, as
    /// `torch.nn.utils.clip_grad_norm_` does; returns the norm before clipping.
    pub(crate) fn clip_grad_norm(&self, max_norm: f64, norm_type: f64) -> Result<f64> {
        let g = self.lock();
        let grads = present_grads(&g);
        let combine = |v: f64, op| self.strategy.combine(v, op);
        let total = if norm_type.is_infinite() {
            combine(accel_kernels::max_abs(&grads)?, ReduceOp::Max)?
        } else if norm_type == 2.0 {
            combine(accel_kernels::sum_of_squares(&grads)?, ReduceOp::Sum)?.sqrt()
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
}

/// Adds each `(id, gradient)` to the fp32 accumulator of parameter `id`
/// (copies instead for the first gradient since `zero_grad`; with `adopt`, a
/// contiguous fp32 first gradient becomes the accumulator without a copy).
fn deposit(
    g: &mut ModelInner,
    grads: impl IntoIterator<Item = (usize, Tensor)>,
    adopt: bool,
) -> Result<()> {
    let (mut copy_dst, mut copy_src, mut add_dst, mut add_src) = (vec![], vec![], vec![], vec![]);
    for (i, grad) in grads {
        // Gradients from candle may be strided views; the kernels need contiguous input.
        let grad = grad.contiguous()?;
        let master = g.masters[i].as_tensor();
        if !g.has_grad[i]
            && adopt
            && grad.dtype() == DType::F32
            && grad.shape() == master.shape()
            && grad.device().same_device(master.device())
        {
            g.grads[i] = Some(grad);
            g.has_grad[i] = true;
            continue;
        }
        let acc = match &g.grads[i] {
            Some(t) => t.clone(),
            None => {
                let t = master.zeros_like()?;
                g.grads[i] = Some(t.clone());
                t
            }
        };
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
