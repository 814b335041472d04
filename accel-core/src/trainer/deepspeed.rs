//! The Trainer's side of `TrainingArguments::deepspeed`: the Accelerator
//! settings of a [`DeepSpeedPlan`], and the optimizer, schedule, clipping
//! and final save the run takes from it (see [`crate::deepspeed`]).

use crate::accelerator::AcceleratorConfig;
use crate::deepspeed::{DeepSpeedConfig, DeepSpeedOptimizer, DeepSpeedPlan};
use crate::optim::{transformers_no_decay, AdamW, AdamWConfig, Optimizer, Sgd};
use crate::scheduler::LrScheduler;
use crate::Result;

use super::TrainingArguments;

/// The Accelerator settings of `plan`: [`crate::deepspeed::apply_zero`]'s
/// (notices, the ZeRO stage as FSDP, the loss scale), then the precision and
/// accumulation, which the arguments already agree with (a mismatch was an
/// error when the file was filled).
pub(super) fn apply(
    plan: &DeepSpeedPlan,
    mut config: AcceleratorConfig,
) -> Result<AcceleratorConfig> {
    crate::deepspeed::apply_zero(plan, &[], &mut config)?;
    if let Some(p) = plan.precision {
        config.mixed_precision = Some(p);
    }
    if let Some(gas) = plan.gradient_accumulation_steps {
        config = config.with_gradient_accumulation_steps(gas);
    }
    Ok(config)
}

/// What the Trainer builds from a resolved configuration.
pub(super) struct DeepSpeedRun {
    pub(super) config: DeepSpeedConfig,
    pub(super) plan: DeepSpeedPlan,
}

impl DeepSpeedRun {
    /// `args.deepspeed` for `world` processes, or `None`.
    pub(super) fn new(args: &TrainingArguments, world: usize) -> Result<Option<Self>> {
        let Some(config) = args.deepspeed_config(world)? else {
            return Ok(None);
        };
        let plan = config.plan()?;
        Ok(Some(Self { config, plan }))
    }

    /// The `optimizer` section's optimizer over every trainable parameter
    /// alike (as DeepSpeed builds it), or the Trainer's AdamW without one;
    /// and its learning rate.
    pub(super) fn optimizer(&self, args: &TrainingArguments) -> (Box<dyn Optimizer>, f64) {
        match self.plan.optimizer {
            Some(DeepSpeedOptimizer::AdamW(c)) => (Box::new(AdamW::new(c)), c.lr),
            Some(DeepSpeedOptimizer::Sgd(c)) => (Box::new(Sgd::new(c)), c.lr),
            None => (Box::new(trainer_adamw(args)), args.learning_rate),
        }
    }

    /// The `scheduler` section's schedule over `total` optimizer steps, or
    /// the arguments' schedule without one; the last mismatches (the run's
    /// length, the warm-up) are an error here.
    pub(super) fn scheduler(
        &mut self,
        args: &TrainingArguments,
        total: u64,
        optimizer_lr: f64,
    ) -> Result<LrScheduler> {
        self.config.finalize(args, None, total)?;
        Ok(match self.config.scheduler(optimizer_lr)? {
            Some(s) => LrScheduler::new(s.schedule, s.base_lr.unwrap_or(optimizer_lr)),
            None => LrScheduler::new(args.schedule(total), optimizer_lr),
        })
    }

    /// DeepSpeed clips only where `gradient_clipping` says (its default is
    /// 0, no clipping, whatever `max_grad_norm` is).
    pub(super) fn max_grad_norm(&self) -> f64 {
        self.plan.gradient_clipping.unwrap_or(0.0)
    }
}

/// transformers' Trainer AdamW: no decay on biases and norm weights.
pub(super) fn trainer_adamw(args: &TrainingArguments) -> AdamW {
    AdamW::new(AdamWConfig {
        lr: args.learning_rate,
        beta1: args.adam_beta1,
        beta2: args.adam_beta2,
        eps: args.adam_epsilon,
        weight_decay: args.weight_decay,
    })
    .with_no_decay(transformers_no_decay)
}
