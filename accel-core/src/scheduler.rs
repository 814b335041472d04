//! Learning-rate schedules (as `transformers.get_*_schedule_with_warmup`) and
//! the prepared scheduler that steps them in step with the optimizer.

use std::sync::{Arc, Mutex, MutexGuard};

use serde::{Deserialize, Serialize};

use crate::accumulation::GradientState;
use crate::optim::PreparedOptimizer;
use crate::{Error, Result};

/// The shape of a schedule: a multiplier of the base learning rate per step.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(tag = "name", rename_all = "snake_case")]
pub enum Schedule {
    /// The base rate throughout.
    Constant,
    /// Linear ramp from 0 over `warmup` steps, then constant.
    ConstantWithWarmup {
        /// Warm-up steps.
        warmup: u64,
    },
    /// Linear ramp up over `warmup` steps, then linear decay to 0 at `total`.
    Linear {
        /// Warm-up steps.
        warmup: u64,
        /// Total training steps.
        total: u64,
    },
    /// Linear ramp up, then half a cosine from 1 to 0 at `total`.
    Cosine {
        /// Warm-up steps.
        warmup: u64,
        /// Total training steps.
        total: u64,
    },
    /// DeepSpeed's `WarmupLR` (no `total`) and `WarmupDecayLR`: from
    /// `min_ratio` (`warmup_min_lr / warmup_max_lr`, the base rate being
    /// `warmup_max_lr`) up to 1 over `warmup` steps (at least 2), along a
    /// logarithm or a line, then 1, or a linear decay to 0 at `total`.
    /// DeepSpeed steps its schedule after each optimizer step, so step `s`
    /// takes the rate of iteration `s - 1` (the first two the minimum).
    DeepSpeedWarmup {
        /// `warmup_min_lr / warmup_max_lr`.
        min_ratio: f64,
        /// `warmup_num_steps`.
        warmup: u64,
        /// `warmup_type: log` (DeepSpeed's default) rather than `linear`.
        log: bool,
        /// `total_num_steps` of `WarmupDecayLR`.
        total: Option<u64>,
    },
    /// DeepSpeed's `WarmupCosineLR`: from `warmup_min_ratio` up to 1 over
    /// `warmup` steps (log or linear), then a cosine down to `cos_min_ratio`
    /// at `total`; stepped as [`Schedule::DeepSpeedWarmup`] (the first step
    /// at rate 0).
    DeepSpeedWarmupCosine {
        /// `warmup_min_ratio`.
        warmup_min_ratio: f64,
        /// `warmup_num_steps`.
        warmup: u64,
        /// `warmup_type: log` rather than `linear`.
        log: bool,
        /// `total_num_steps`.
        total: u64,
        /// `cos_min_ratio`.
        cos_min_ratio: f64,
    },
}

/// DeepSpeed's warm-up fraction at `iteration` of `warmup` (already at
/// least 2) steps.
fn deepspeed_gamma(iteration: u64, warmup: u64, log: bool) -> f64 {
    if log {
        ((iteration + 1) as f64).ln() / (warmup as f64).ln()
    } else {
        iteration as f64 / warmup as f64
    }
}

impl Schedule {
    /// The multiplier at `step` (transformers' lambdas, computed in f64).
    pub fn factor(&self, step: u64) -> f64 {
        let ramp = |w: u64| step as f64 / w.max(1) as f64;
        match *self {
            Schedule::Constant => 1.0,
            Schedule::ConstantWithWarmup { warmup } => {
                if step < warmup {
                    ramp(warmup)
                } else {
                    1.0
                }
            }
            Schedule::Linear { warmup, total } => {
                if step < warmup {
                    ramp(warmup)
                } else {
                    (total.saturating_sub(step) as f64 / total.saturating_sub(warmup).max(1) as f64)
                        .max(0.0)
                }
            }
            Schedule::Cosine { warmup, total } => {
                if step < warmup {
                    ramp(warmup)
                } else {
                    let progress =
                        (step - warmup) as f64 / total.saturating_sub(warmup).max(1) as f64;
                    (0.5 * (1.0 + (std::f64::consts::PI * progress).cos())).max(0.0)
                }
            }
            Schedule::DeepSpeedWarmup {
                min_ratio,
                warmup,
                log,
                total,
            } => {
                let Some(it) = step.checked_sub(1) else {
                    return min_ratio;
                };
                let warmup = warmup.max(2);
                let gamma = if it < warmup {
                    deepspeed_gamma(it, warmup, log)
                } else if let Some(total) = total {
                    ((total as f64 - it as f64) / (total as f64 - warmup as f64).max(1.0)).max(0.0)
                } else {
                    1.0
                };
                min_ratio + (1.0 - min_ratio) * gamma
            }
            Schedule::DeepSpeedWarmupCosine {
                warmup_min_ratio,
                warmup,
                log,
                total,
                cos_min_ratio,
            } => {
                let Some(it) = step.checked_sub(1) else {
                    return 0.0;
                };
                let warmup = warmup.max(2);
                if it < warmup {
                    let r = deepspeed_gamma(it, warmup, log);
                    return warmup_min_ratio + r * (1.0 - warmup_min_ratio);
                }
                let real_last = (it - warmup + 1) as f64;
                let real_total = (total as f64 - warmup as f64).max(1.0);
                let r = (1.0 + (std::f64::consts::PI * real_last / real_total).cos()) / 2.0;
                (cos_min_ratio + (1.0 - cos_min_ratio) * r).max(0.0)
            }
        }
    }
}

/// A `LambdaLR` over a [`Schedule`]: `lr = base_lr * factor(last_epoch)`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LrScheduler {
    /// The schedule.
    pub schedule: Schedule,
    /// The learning rate at factor 1.
    pub base_lr: f64,
    /// Steps taken (PyTorch's `last_epoch`).
    pub last_epoch: u64,
    /// Calls to `step`, including the ones `adjust_scheduler` counts without
    /// moving the rate (PyTorch's `_step_count`).
    pub step_count: u64,
}

impl LrScheduler {
    /// A schedule starting at step 0 from `base_lr`.
    pub fn new(schedule: Schedule, base_lr: f64) -> Self {
        Self {
            schedule,
            base_lr,
            last_epoch: 0,
            step_count: 1,
        }
    }

    /// The current learning rate.
    pub fn lr(&self) -> f64 {
        self.base_lr * self.schedule.factor(self.last_epoch)
    }
}

struct Inner {
    sched: LrScheduler,
    optimizer: PreparedOptimizer,
    grad_state: GradientState,
    num_processes: usize,
    split_batches: bool,
}

/// A scheduler wrapped by the Accelerator, as Accelerate's `AcceleratedScheduler`:
/// it steps only when the optimizer really stepped, and once per process when
/// batches are not split, so a schedule written for one process keeps its length.
#[derive(Clone)]
pub struct PreparedScheduler {
    inner: Arc<Mutex<Inner>>,
}

impl PreparedScheduler {
    pub(crate) fn new(
        sched: LrScheduler,
        mut optimizer: PreparedOptimizer,
        grad_state: GradientState,
        num_processes: usize,
        split_batches: bool,
    ) -> Self {
        optimizer.set_learning_rate(sched.lr());
        Self {
            inner: Arc::new(Mutex::new(Inner {
                sched,
                optimizer,
                grad_state,
                num_processes,
                split_batches,
            })),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Advances the schedule after an optimizer step.
    pub fn step(&mut self) {
        let mut g = self.lock();
        if !g.grad_state.sync_gradients() {
            if g.grad_state.plugin().adjust_scheduler {
                g.sched.step_count += 1;
            }
            return;
        }
        if g.optimizer.step_was_skipped() {
            return;
        }
        let n = if g.split_batches {
            1
        } else {
            g.num_processes.max(1)
        };
        for _ in 0..n {
            g.sched.last_epoch += 1;
            g.sched.step_count += 1;
        }
        let lr = g.sched.lr();
        g.optimizer.set_learning_rate(lr);
    }

    /// The learning rate the optimizer uses now.
    pub fn lr(&self) -> f64 {
        self.lock().sched.lr()
    }

    /// A copy of the schedule's state.
    pub fn scheduler(&self) -> LrScheduler {
        self.lock().sched.clone()
    }

    pub(crate) fn to_json(&self) -> serde_json::Value {
        serde_json::to_value(&self.lock().sched).expect("scheduler state serializes")
    }

    pub(crate) fn load_json(&self, v: &serde_json::Value) -> Result<()> {
        let sched: LrScheduler = serde_json::from_value(v.clone()).map_err(|e| Error::Config {
            key: "scheduler".into(),
            reason: e.to_string(),
        })?;
        let mut g = self.lock();
        let lr = sched.lr();
        g.sched = sched;
        g.optimizer.set_learning_rate(lr);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn linear_warmup_then_decay_matches_transformers() {
        let s = Schedule::Linear {
            warmup: 2,
            total: 10,
        };
        let f: Vec<f64> = (0..11).map(|t| s.factor(t)).collect();
        assert_eq!(f[0], 0.0);
        assert_eq!(f[1], 0.5);
        assert_eq!(f[2], 1.0);
        assert_eq!(f[6], 0.5);
        assert_eq!(f[10], 0.0);
    }

    #[test]
    fn cosine_reaches_half_at_mid_decay_and_zero_at_end() {
        let s = Schedule::Cosine {
            warmup: 0,
            total: 100,
        };
        assert_eq!(s.factor(0), 1.0);
        assert!((s.factor(50) - 0.5).abs() < 1e-12);
        assert!(s.factor(100).abs() < 1e-12);
    }

    #[test]
    fn constant_with_warmup_ramps_then_holds() {
        let s = Schedule::ConstantWithWarmup { warmup: 4 };
        assert_eq!(s.factor(1), 0.25);
        assert_eq!(s.factor(4), 1.0);
        assert_eq!(s.factor(1000), 1.0);
    }
}
