//! [`Trainer::train`]: the loop of transformers' `_inner_training_loop`,
//! expressed in Accelerator verbs.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Instant;

use candle_core::DType;
use indicatif::{ProgressBar, ProgressStyle};

use super::{evaluate_on, IntervalStrategy, TrainModel, TrainOutput, Trainer};
use crate::data::Dataset;
use crate::trackers::LogValue;
use crate::{Error, Result};

impl<M: TrainModel, D: Dataset<Batch = M::Batch>> Trainer<M, D> {
    /// Trains until [`Trainer::num_training_steps`] optimizer steps, first
    /// resuming from `args.resume_from_checkpoint` when set.
    ///
    /// Every `logging_steps` it logs `loss` (the mean micro-batch loss since
    /// the last log, over processes), `learning_rate` and `epoch`; it
    /// evaluates and saves as `eval_strategy` / `save_strategy` say. Steps in
    /// logs and checkpoints count optimizer steps, from 1. At the end it logs
    /// the run's metrics and ends the trackers (`end_training`).
    ///
    /// On SIGTERM, SIGINT or SIGHUP (`accel launch` passes its own on) it
    /// saves a checkpoint after the step it is at, on every rank, and
    /// returns [`Error::Stopped`].
    ///
    /// # Errors
    /// Model, data, collective and checkpoint errors; a missing checkpoint to
    /// resume from; [`Error::Stopped`] after a termination signal.
    pub fn train(&mut self) -> Result<TrainOutput> {
        self.resume()?;
        self.start_trackers()?;
        let started = Instant::now();
        let first_step = self.global_step();
        let bar = self.progress_bar(first_step);
        let (mut run_loss, mut run_batches) = (0f64, 0u64);
        let (total_steps, steps_per_epoch) = (self.total_steps, self.steps_per_epoch);
        let mut done = first_step >= total_steps;
        while !done {
            let steps_before = self.global_step();
            // Borrow the fields apart: the loader is iterated while the
            // Accelerator, model and optimizer are used and the eval loader read.
            let Self {
                acc,
                model,
                params,
                opt,
                sched,
                train_loader,
                eval_loader,
                compute_metrics,
                state,
                args,
                ..
            } = self;
            for batch in train_loader.iter() {
                let (_, batch) = batch?;
                let max_norm = args.max_grad_norm;
                let loss = acc.accumulate(|acc| {
                    let loss = model.loss(&batch)?;
                    acc.backward(&loss)?;
                    if acc.sync_gradients() && max_norm > 0.0 {
                        acc.clip_grad_norm(params, max_norm)?;
                    }
                    opt.step()?;
                    sched.step();
                    opt.zero_grad();
                    Ok(loss.to_dtype(DType::F64)?.to_scalar::<f64>()?)
                })?;
                run_loss += loss;
                run_batches += 1;
                let step = {
                    let mut s = state.lock().unwrap_or_else(|e| e.into_inner());
                    s.window_loss += loss;
                    s.window_batches += 1;
                    if acc.sync_gradients() {
                        s.global_step += 1;
                    }
                    s.global_step
                };
                if !acc.sync_gradients() {
                    continue;
                }
                bar.set_position(step);
                let epoch = step as f64 / steps_per_epoch as f64;
                if args.logging_steps > 0 && step.is_multiple_of(args.logging_steps) {
                    let mean = {
                        let mut s = state.lock().unwrap_or_else(|e| e.into_inner());
                        let mean = s.window_loss / s.window_batches.max(1) as f64;
                        (s.window_loss, s.window_batches) = (0.0, 0);
                        mean
                    };
                    let mean = acc.mean_scalar(mean)?;
                    bar.set_message(format!("loss {mean:.4}"));
                    let values = [
                        ("loss", LogValue::from(mean)),
                        ("learning_rate", LogValue::from(sched.lr())),
                        ("epoch", LogValue::from(epoch)),
                    ];
                    acc.log(values, Some(step))?;
                }
                if args.eval_strategy == IntervalStrategy::Steps
                    && step.is_multiple_of(args.eval_interval())
                {
                    let metrics =
                        evaluate_on(acc, &*model, eval_loader.as_ref(), compute_metrics.as_ref())?;
                    log_eval(acc, metrics, epoch, step)?;
                }
                if args.save_strategy == IntervalStrategy::Steps
                    && step.is_multiple_of(args.save_steps)
                {
                    acc.save_state(None)?;
                }
                if acc.should_stop()? {
                    // Preempted: this step's state, then out (`resume` picks
                    // it up, bitwise).
                    let checkpoint = acc.save_state(None)?;
                    bar.abandon();
                    return Err(Error::Stopped { step, checkpoint });
                }
                if step >= total_steps {
                    done = true;
                    break;
                }
            }
            let step = self.global_step();
            if step == steps_before && !done {
                // A pass without a single optimizer step would loop forever.
                crate::bail!("the training set yields no batch (batch size larger than the dataset with drop_last?)");
            }
            self.end_of_epoch(step)?;
            done |= step >= self.total_steps;
        }
        bar.finish_and_clear();
        self.finish(started, first_step, run_loss, run_batches)
    }

    /// Restores the checkpoint named by `resume_from_checkpoint`, if any;
    /// without one, on a restart of the job (`accel launch --max_restarts`),
    /// the newest checkpoint that loads
    /// ([`Accelerator::load_state_on_restart`](crate::Accelerator::load_state_on_restart)).
    fn resume(&mut self) -> Result<()> {
        let Some(which) = self.args.resume_from_checkpoint.clone() else {
            self.acc.load_state_on_restart()?;
            return Ok(());
        };
        let dir = if which == "latest" {
            self.acc.load_state(None)?
        } else {
            self.acc.load_state(Some(Path::new(&which)))?
        };
        let step = self.global_step();
        self.acc.print(format!(
            "resumed from {} at step {step} of {}",
            dir.display(),
            self.total_steps
        ));
        Ok(())
    }

    fn progress_bar(&self, position: u64) -> ProgressBar {
        if !self.acc.is_main_process() || self.args.disable_tqdm {
            return ProgressBar::hidden();
        }
        let bar = ProgressBar::new(self.total_steps).with_position(position);
        if let Ok(style) = ProgressStyle::with_template(
            "{bar:40} {pos}/{len} [{elapsed_precise}<{eta_precise}] {msg}",
        ) {
            bar.set_style(style);
        }
        bar
    }

    /// Epoch-strategy evaluation and saving, after each pass over the data.
    fn end_of_epoch(&mut self, step: u64) -> Result<()> {
        let epoch = step as f64 / self.steps_per_epoch as f64;
        if self.args.eval_strategy == IntervalStrategy::Epoch {
            let metrics = evaluate_on(
                &mut self.acc,
                &self.model,
                self.eval_loader.as_ref(),
                self.compute_metrics.as_ref(),
            )?;
            log_eval(&mut self.acc, metrics, epoch, step)?;
        }
        if self.args.save_strategy == IntervalStrategy::Epoch {
            self.acc.save_state(None)?;
        }
        Ok(())
    }

    fn finish(
        &mut self,
        started: Instant,
        first_step: u64,
        run_loss: f64,
        run_batches: u64,
    ) -> Result<TrainOutput> {
        let global_step = self.global_step();
        let runtime = started.elapsed().as_secs_f64();
        let training_loss = self.acc.mean_scalar(run_loss / run_batches.max(1) as f64)?;
        let metrics = BTreeMap::from([
            ("train_runtime".to_string(), runtime),
            (
                "train_steps_per_second".to_string(),
                (global_step - first_step) as f64 / runtime.max(1e-9),
            ),
            ("train_loss".to_string(), training_loss),
            (
                "epoch".to_string(),
                global_step as f64 / self.steps_per_epoch as f64,
            ),
        ]);
        self.acc.log(metrics.clone(), Some(global_step))?;
        // transformers' `on_train_end`: the trackers end with the training
        // (MLflow's run FINISHED, TensorBoard's file closed). An `evaluate`
        // afterwards starts them again, as transformers' callbacks do: a new
        // MLflow run, a new TensorBoard file, more lines of the same JSONL.
        self.acc.end_training()?;
        self.trackers_started = false;
        Ok(TrainOutput {
            global_step,
            training_loss,
            metrics,
        })
    }
}

fn log_eval(
    acc: &mut crate::Accelerator,
    mut metrics: BTreeMap<String, f64>,
    epoch: f64,
    step: u64,
) -> Result<()> {
    metrics.insert("epoch".into(), epoch);
    acc.log(metrics, Some(step))
}
