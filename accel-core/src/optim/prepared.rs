//! The optimizer handle returned by `Accelerator::prepare_optimizer`.

use std::sync::{Arc, Mutex, MutexGuard};

use super::Optimizer;
use crate::accumulation::GradientState;
use crate::checkpoint::StateDict;
use crate::model::PreparedModel;
use crate::precision::GradScaler;
use crate::Result;

struct Inner {
    opt: Box<dyn Optimizer>,
    model: PreparedModel,
    grad_state: GradientState,
    scaler: Option<Arc<Mutex<GradScaler>>>,
    step_was_skipped: bool,
    /// Clip the global L2 norm to this before each step (DeepSpeed's
    /// `gradient_clipping`).
    clip: Option<f64>,
}

/// An optimizer wrapped by the Accelerator, as Accelerate's `AcceleratedOptimizer`:
/// `step` and `zero_grad` do nothing until the accumulation cycle syncs; with
/// fp16 the gradients are unscaled first and a step with inf/NaN gradients is
/// skipped (weights untouched, scale backed off); after a step the model's
/// low-precision weights are refreshed from the fp32 masters.
///
/// Cheap to clone: clones share the optimizer.
#[derive(Clone)]
pub struct PreparedOptimizer {
    inner: Arc<Mutex<Inner>>,
}

impl PreparedOptimizer {
    pub(crate) fn new(
        mut opt: Box<dyn Optimizer>,
        model: PreparedModel,
        grad_state: GradientState,
        scaler: Option<Arc<Mutex<GradScaler>>>,
    ) -> Self {
        opt.set_param_names(&model.names());
        Self {
            inner: Arc::new(Mutex::new(Inner {
                opt,
                model,
                grad_state,
                scaler,
                step_was_skipped: false,
                clip: None,
            })),
        }
    }

    /// Clips the gradients' global L2 norm to `max_norm` before every step.
    pub(crate) fn with_gradient_clipping(self, max_norm: Option<f64>) -> Self {
        self.lock().clip = max_norm;
        self
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Updates the parameters from the accumulated gradients, when gradients sync.
    pub fn step(&mut self) -> Result<()> {
        let mut g = self.lock();
        if !g.grad_state.sync_gradients() {
            return Ok(());
        }
        let found_inf = match &g.scaler {
            Some(scaler) => {
                let scale = scaler.lock().unwrap_or_else(|e| e.into_inner()).scale();
                g.model.unscale((1.0 / scale) as f32)?
            }
            None => false,
        };
        if found_inf {
            tracing::debug!("optimizer step skipped: non-finite gradients");
        } else {
            if let Some(max_norm) = g.clip {
                g.model.clip_grad_norm(max_norm, 2.0)?;
            }
            // A compute copy written since the last step is taken up, not overwritten.
            g.model.adopt_outside_writes()?;
            let (params, grads, ids) = {
                let m = g.model.lock();
                let ids: Vec<usize> = (0..m.names.len()).filter(|&i| m.has_grad[i]).collect();
                let params = ids
                    .iter()
                    .map(|&i| m.masters[i].as_tensor().clone())
                    .collect::<Vec<_>>();
                let grads = ids
                    .iter()
                    .filter_map(|&i| m.grads[i].clone())
                    .collect::<Vec<_>>();
                (params, grads, ids)
            };
            g.opt.step(&params, &grads, &ids)?;
            g.model.refresh_model_weights()?;
        }
        if let Some(scaler) = &g.scaler {
            scaler
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .update(found_inf);
        }
        // A later clip or step in the same cycle must unscale again.
        g.model.lock().unscaled = None;
        g.step_was_skipped = found_inf;
        Ok(())
    }

    /// Clears the accumulated gradients, when gradients sync.
    pub fn zero_grad(&mut self) {
        let g = self.lock();
        if g.grad_state.sync_gradients() {
            g.model.zero_grad();
        }
    }

    /// True when the last `step` was skipped because of inf/NaN gradients.
    pub fn step_was_skipped(&self) -> bool {
        self.lock().step_was_skipped
    }

    /// The current learning rate.
    pub fn learning_rate(&self) -> f64 {
        self.lock().opt.learning_rate()
    }

    /// Sets the learning rate.
    pub fn set_learning_rate(&mut self, lr: f64) {
        self.lock().opt.set_learning_rate(lr)
    }

    /// The model this optimizer updates.
    pub fn model(&self) -> PreparedModel {
        self.lock().model.clone()
    }

    pub(crate) fn state_dict(&self) -> Result<StateDict> {
        self.lock().opt.state_dict()
    }

    pub(crate) fn load_state_dict(&self, state: StateDict) -> Result<()> {
        let mut g = self.lock();
        let params: Vec<_> = g
            .model
            .master_weights()
            .into_iter()
            .map(|(_, t)| t)
            .collect();
        g.opt.load_state_dict(state, &params)
    }
}
