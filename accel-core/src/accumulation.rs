//! Gradient accumulation: when gradients are synchronized and the optimizer steps.
//!
//! Semantics follow Accelerate's `GradientAccumulationPlugin` and `GradientState`:
//! inside [`crate::Accelerator::accumulate`] the step counter advances, and
//! gradients sync every `num_steps` micro-batches, or at the last batch of a
//! prepared data loader when `sync_with_dataloader` is set.

use std::sync::{Arc, Mutex, MutexGuard};

use serde::{Deserialize, Serialize};

/// How gradients are accumulated (Accelerate's `GradientAccumulationPlugin`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct GradientAccumulationPlugin {
    /// Micro-batches per optimizer step.
    pub num_steps: usize,
    /// Step the LR scheduler's step count on non-sync micro-batches too, so a
    /// schedule written in micro-batches keeps its length.
    pub adjust_scheduler: bool,
    /// Force a sync at the end of each pass over a prepared data loader.
    pub sync_with_dataloader: bool,
    /// Synchronize on every micro-batch (matters for DDP only).
    pub sync_each_batch: bool,
}

impl Default for GradientAccumulationPlugin {
    fn default() -> Self {
        Self {
            num_steps: 1,
            adjust_scheduler: true,
            sync_with_dataloader: true,
            sync_each_batch: false,
        }
    }
}

impl GradientAccumulationPlugin {
    /// Accumulation over `num_steps` micro-batches with the other settings at their defaults.
    pub fn with_steps(num_steps: usize) -> Self {
        Self {
            num_steps,
            ..Default::default()
        }
    }
}

#[derive(Debug, Default)]
struct Inner {
    plugin: GradientAccumulationPlugin,
    step: u64,
    sync_gradients: bool,
    end_of_dataloader: bool,
    in_dataloader: usize,
    remainder: usize,
}

/// Shared view of the accumulation state: the Accelerator advances it, prepared
/// data loaders mark their last batch, prepared optimizers and schedulers read it.
#[derive(Debug, Clone)]
pub struct GradientState {
    inner: Arc<Mutex<Inner>>,
}

impl GradientState {
    /// A state that syncs on the first step.
    pub fn new(plugin: GradientAccumulationPlugin) -> Self {
        Self {
            inner: Arc::new(Mutex::new(Inner {
                plugin,
                sync_gradients: true,
                ..Default::default()
            })),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A poisoned lock only means another thread panicked while holding plain
        // counters; the values are still meaningful.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The accumulation settings.
    pub fn plugin(&self) -> GradientAccumulationPlugin {
        self.lock().plugin
    }

    /// Micro-batches per optimizer step.
    pub fn num_steps(&self) -> usize {
        self.lock().plugin.num_steps
    }

    /// True when this micro-batch ends an accumulation cycle: the optimizer steps.
    pub fn sync_gradients(&self) -> bool {
        self.lock().sync_gradients
    }

    /// True while a prepared data loader is yielding its last batch.
    pub fn end_of_dataloader(&self) -> bool {
        let g = self.lock();
        g.in_dataloader > 0 && g.end_of_dataloader
    }

    /// Micro-batches counted by `accumulate` since the last forced sync.
    pub fn step(&self) -> u64 {
        self.lock().step
    }

    /// Advances the counter for one micro-batch and decides whether it syncs
    /// (Accelerate's `Accelerator._do_sync`).
    pub fn do_sync(&self) {
        let mut g = self.lock();
        if g.plugin.sync_with_dataloader && g.in_dataloader > 0 && g.end_of_dataloader {
            g.step = 0;
            g.sync_gradients = true;
        } else {
            g.step += 1;
            g.sync_gradients = g.step.is_multiple_of(g.plugin.num_steps.max(1) as u64);
        }
    }

    /// Sets the sync flag directly (outside `accumulate`, every step syncs).
    pub fn set_sync_gradients(&self, sync: bool) {
        self.lock().sync_gradients = sync;
    }

    /// Real (not duplicated) samples in the last global batch of the current
    /// loader, 0 when the last batch is full (Accelerate's `remainder`).
    pub fn remainder(&self) -> usize {
        self.lock().remainder
    }

    pub(crate) fn set_remainder(&self, remainder: usize) {
        self.lock().remainder = remainder;
    }

    pub(crate) fn set_step(&self, step: u64) {
        self.lock().step = step;
    }

    pub(crate) fn enter_dataloader(&self) {
        let mut g = self.lock();
        g.in_dataloader += 1;
        g.end_of_dataloader = false;
    }

    pub(crate) fn mark_end_of_dataloader(&self, end: bool) {
        self.lock().end_of_dataloader = end;
    }

    pub(crate) fn leave_dataloader(&self) {
        let mut g = self.lock();
        g.in_dataloader = g.in_dataloader.saturating_sub(1);
        g.end_of_dataloader = false;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn syncs_every_num_steps_micro_batches() {
        let s = GradientState::new(GradientAccumulationPlugin::with_steps(3));
        let syncs: Vec<bool> = (0..7)
            .map(|_| {
                s.do_sync();
                s.sync_gradients()
            })
            .collect();
        assert_eq!(syncs, [false, false, true, false, false, true, false]);
    }

    #[test]
    fn last_batch_of_a_loader_forces_a_sync_and_resets_the_counter() {
        let s = GradientState::new(GradientAccumulationPlugin::with_steps(4));
        s.enter_dataloader();
        s.do_sync();
        assert!(!s.sync_gradients());
        s.mark_end_of_dataloader(true);
        s.do_sync();
        assert!(s.sync_gradients());
        assert_eq!(s.step(), 0);
        s.leave_dataloader();
        assert!(!s.end_of_dataloader());
    }

    #[test]
    fn end_of_dataloader_is_ignored_when_sync_with_dataloader_is_off() {
        let s = GradientState::new(GradientAccumulationPlugin {
            num_steps: 4,
            sync_with_dataloader: false,
            ..Default::default()
        });
        s.enter_dataloader();
        s.mark_end_of_dataloader(true);
        s.do_sync();
        assert!(!s.sync_gradients());
    }
}
