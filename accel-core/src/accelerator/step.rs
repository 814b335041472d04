//! The training step's verbs: `accumulate`, `backward`, gradient unscaling
//! and clipping. Each model's [`SyncStrategy`](crate::model::SyncStrategy)
//! decides what crosses ranks; these only call it in a fixed order.

use candle_core::Tensor;

use super::Accelerator;
use crate::accumulation::GradientState;
use crate::model::PreparedModel;
use crate::{Error, Result};

impl Accelerator {
    /// Runs one micro-batch of gradient accumulation: decides whether this
    /// micro-batch syncs, then runs `f`. Inside, `optimizer.step()` and
    /// `zero_grad()` only act on the sync micro-batch.
    ///
    /// `f` returns accel-core's [`Result`], so a closure ending in `Ok(())`
    /// needs no type annotation; [`Accelerator::try_accumulate`] takes a
    /// closure with its own error type.
    pub fn accumulate<R>(&mut self, f: impl FnOnce(&mut Self) -> Result<R>) -> Result<R> {
        self.try_accumulate(f)
    }

    /// [`Accelerator::accumulate`] for a closure with its own error type
    /// (`anyhow::Error`, a script's enum): any `E` that accel-core's errors
    /// convert into, so `?` on the Accelerator's calls works inside and
    /// nothing is mapped by hand. Name `E` where the closure alone does not
    /// fix it, e.g. `Ok::<_, anyhow::Error>(())`.
    ///
    /// ```
    /// use accel_core::{Accelerator, AcceleratorConfig};
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let mut acc = Accelerator::new(AcceleratorConfig::default())?;
    /// let loss = |step: usize| -> Result<f32, Box<dyn std::error::Error>> {
    ///     Ok("0.5".parse::<f32>()? / (step + 1) as f32)
    /// };
    /// let l = acc.try_accumulate(|_acc| loss(0))?;
    /// assert_eq!(l, 0.5);
    /// # Ok(()) }
    /// ```
    pub fn try_accumulate<R, E: From<Error>>(
        &mut self,
        f: impl FnOnce(&mut Self) -> std::result::Result<R, E>,
    ) -> std::result::Result<R, E> {
        self.grad_state.do_sync();
        f(self)
    }

    /// True when the current micro-batch ends an accumulation cycle.
    pub fn sync_gradients(&self) -> bool {
        self.grad_state.sync_gradients()
    }

    /// Micro-batches per optimizer step.
    pub fn gradient_accumulation_steps(&self) -> usize {
        self.grad_state.num_steps()
    }

    /// The shared accumulation state.
    pub fn gradient_state(&self) -> &GradientState {
        &self.grad_state
    }

    /// Back-propagates `loss` and adds the gradients to every prepared model's
    /// buffers; the loss is divided by the accumulation steps and, for fp16,
    /// multiplied by the loss scale first.
    pub fn backward(&mut self, loss: &Tensor) -> Result<()> {
        let mut factor = 1.0 / self.gradient_accumulation_steps() as f64;
        if let Some(s) = &self.scaler {
            factor *= s.lock().unwrap_or_else(|e| e.into_inner()).scale();
        }
        let scaled = if factor == 1.0 {
            loss.clone()
        } else {
            loss.affine(factor, 0.0)?
        };
        let grads = scaled.backward()?;
        for m in &self.models {
            m.accumulate(&grads)?;
        }
        // What each way of running does with the graph's gradients (sharded
        // models reduce the parameters outside their wrapped units)...
        for m in &self.models {
            m.strategy().collect(m, &grads)?;
        }
        drop(grads);
        // ...and with the buffers, once the graph is gone (DDP averages at
        // the end of an accumulation cycle, or every micro-batch with
        // `sync_each_batch`).
        let reduce_now = self.sync_gradients() || self.grad_state.plugin().sync_each_batch;
        for m in &self.models {
            m.strategy().reduce(m, reduce_now)?;
        }
        self.report_unused_parameters()
    }

    /// The fp16 loss scale, when one is in use.
    pub fn loss_scale(&self) -> Option<f64> {
        self.scaler
            .as_ref()
            .map(|s| s.lock().unwrap_or_else(|e| e.into_inner()).scale())
    }

    /// Divides `model`'s gradients by the loss scale now (done at most once a step);
    /// returns whether any gradient is inf or NaN. Without fp16 it does nothing.
    pub fn unscale_gradients(&self, model: &PreparedModel) -> Result<bool> {
        match self.loss_scale() {
            Some(scale) => model.unscale((1.0 / scale) as f32),
            None => Ok(false),
        }
    }

    /// Clips `model`'s gradients to a global L2 norm of `max_norm`
    /// (`torch.nn.utils.clip_grad_norm_`), unscaling them first under fp16.
    /// Returns the norm before clipping.
    pub fn clip_grad_norm(&self, model: &PreparedModel, max_norm: f64) -> Result<f64> {
        self.unscale_gradients(model)?;
        model.clip_grad_norm(max_norm, 2.0)
    }

    /// Clamps `model`'s gradients into `[-clip_value, clip_value]`, unscaling first under fp16.
    pub fn clip_grad_value(&self, model: &PreparedModel, clip_value: f64) -> Result<()> {
        self.unscale_gradients(model)?;
        model.clip_grad_value(clip_value)
    }
}
