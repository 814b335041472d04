//! The [`Trainer`]: transformers' high-level training loop, run on the [`Accelerator`].
//!
//! A model implements [`TrainModel`] ("the loss of a batch"); the Trainer
//! owns everything else: the Accelerator built from [`TrainingArguments`],
//! AdamW, the schedule, the loaders, logging, evaluation and checkpoints.
//!
//! ```no_run
//! use accel_core::data::TensorDataset;
//! use accel_core::trainer::{TrainModel, Trainer, TrainingArguments};
//! use candle_core::Tensor;
//! use candle_nn::{Linear, Module};
//!
//! struct Regression(Linear);
//! // No blocks: the model trains plain and data-parallel; FSDP needs blocks.
//! impl accel_core::nn::Model for Regression {}
//! impl TrainModel for Regression {
//!     type Batch = Vec<Tensor>;
//!     fn loss(&self, b: &Vec<Tensor>) -> accel_core::Result<Tensor> {
//!         Ok(self.0.forward(&b[0])?.sub(&b[1])?.sqr()?.mean_all()?)
//!     }
//! }
//! # fn main() -> accel_core::Result<()> {
//! # let train: TensorDataset = unimplemented!();
//! let args = TrainingArguments::new("runs/regression").with_max_steps(100);
//! let mut trainer = Trainer::new(args, |vb| Ok(Regression(candle_nn::linear(3, 1, vb)?)), train, None)?;
//! let out = trainer.train()?;
//! println!("{} steps, loss {}", out.global_step, out.training_loss);
//! # Ok(()) }
//! ```

mod args;
mod batch_size;
mod deepspeed;
mod fsdp_args;
mod options;
mod state;
mod train_loop;

pub use args::{IntervalStrategy, SchedulerType, TrainingArguments};
pub use batch_size::{find_executable_batch_size, is_out_of_memory, reduce_batch_size};
pub use fsdp_args::{fsdp_plugin, FsdpConfig, FsdpConfigFields};
pub use options::{GradientAccumulationKwargs, TrainerAcceleratorConfig};
pub use state::TrainerState;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use candle_core::{DType, Tensor};
use candle_nn::VarBuilder;

use crate::data::{DataLoader, DataLoaderConfig, Dataset};
use crate::optim::PreparedOptimizer;
use crate::scheduler::{LrScheduler, PreparedScheduler};
use crate::{Accelerator, PreparedModel, Result};
use state::Counted;

/// A model the [`Trainer`] can train: it computes the loss of a batch.
///
/// Only [`TrainModel::loss`] is required; the model's parameters live in
/// [`Block`](accel_nn::Block)s ([`accel_nn::Model`]), so FSDP (`fsdp` in the
/// arguments) shards the same forward. Override
/// [`TrainModel::sample_losses`] for an exact per-sample evaluation loss, and
/// [`TrainModel::predictions`] to feed a metrics function.
pub trait TrainModel: accel_nn::Model {
    /// What one batch is (for a `TensorDataset`, `Vec<Tensor>`).
    type Batch;

    /// The scalar loss to minimise on `batch` (a mean over its samples).
    fn loss(&self, batch: &Self::Batch) -> Result<Tensor>;

    /// One loss per sample of a batch of `n` samples, shape `(n,)`, in f32.
    ///
    /// The default repeats the batch mean `n` times, so the evaluation loss is
    /// the mean over samples when `loss` is a per-sample mean.
    fn sample_losses(&self, batch: &Self::Batch, n: usize) -> Result<Tensor> {
        let loss = self.loss(batch)?.to_dtype(DType::F32)?.reshape(1)?;
        Ok(loss.broadcast_as(n)?.contiguous()?)
    }

    /// Per-sample predictions and labels (dimension 0 = samples) for
    /// [`ComputeMetrics`]; `None` (the default) skips metrics.
    fn predictions(&self, _batch: &Self::Batch) -> Result<Option<Predictions>> {
        Ok(None)
    }
}

/// Predictions and labels of one batch, one row per sample.
#[derive(Debug, Clone)]
pub struct Predictions {
    /// What the model predicted (e.g. class ids or logits).
    pub predictions: Tensor,
    /// The expected values.
    pub labels: Tensor,
}

/// Turns the gathered predictions and labels of a whole evaluation set into
/// named metrics (transformers' `compute_metrics`); the Trainer prefixes them with `eval_`.
pub type ComputeMetrics = Box<dyn Fn(&Predictions) -> Result<BTreeMap<String, f64>>>;

/// The result of [`Trainer::train`], as transformers' `TrainOutput`.
#[derive(Debug, Clone, PartialEq)]
pub struct TrainOutput {
    /// Optimizer steps taken in total (including those before a resume).
    pub global_step: u64,
    /// Mean micro-batch loss of this run (over processes).
    pub training_loss: f64,
    /// `train_runtime` (s), `train_steps_per_second`, `train_loss`, `epoch`.
    pub metrics: BTreeMap<String, f64>,
}

/// Trains a [`TrainModel`] on the [`Accelerator`] as transformers' `Trainer`.
pub struct Trainer<M: TrainModel, D: Dataset<Batch = M::Batch>> {
    args: TrainingArguments,
    acc: Accelerator,
    model: M,
    params: PreparedModel,
    opt: PreparedOptimizer,
    sched: PreparedScheduler,
    train_loader: DataLoader<Counted<D>>,
    eval_loader: Option<DataLoader<Counted<D>>>,
    compute_metrics: Option<ComputeMetrics>,
    state: Arc<Mutex<TrainerState>>,
    total_steps: u64,
    steps_per_epoch: u64,
    trackers_started: bool,
    /// DeepSpeed's `stage3_gather_16bit_weights_on_model_save`: the dtype
    /// `save_model` writes every weight in.
    save_dtype: Option<DType>,
}

impl<M: TrainModel, D: Dataset<Batch = M::Batch>> Trainer<M, D> {
    /// Builds the Accelerator from `args` ([`TrainingArguments::accelerator_config`]),
    /// the model from `build` (its parameters come from the given `VarBuilder`,
    /// seeded from `args.seed`), and prepares everything for [`Trainer::train`].
    ///
    /// # Errors
    /// Invalid arguments, a model that fails to build, or a process group that
    /// cannot form.
    pub fn new(
        args: TrainingArguments,
        build: impl FnOnce(VarBuilder<'static>) -> Result<M>,
        train_dataset: D,
        eval_dataset: Option<D>,
    ) -> Result<Self> {
        let acc = Accelerator::new(args.accelerator_config()?)?;
        Self::with_accelerator(acc, args, build, train_dataset, eval_dataset)
    }

    /// As [`Trainer::new`] on an Accelerator the caller configured (for a
    /// device or process-group setting `args` does not cover). Its precision,
    /// accumulation and project folder are the caller's, not `args`'.
    ///
    /// # Errors
    /// As [`Trainer::new`].
    pub fn with_accelerator(
        acc: Accelerator,
        args: TrainingArguments,
        build: impl FnOnce(VarBuilder<'static>) -> Result<M>,
        train_dataset: D,
        eval_dataset: Option<D>,
    ) -> Result<Self> {
        Self::build(acc, args, None, build, train_dataset, eval_dataset)
    }

    /// As [`Trainer::new`], the model's parameters starting from the
    /// tensors of `checkpoint` (a Hugging Face folder, a `.safetensors` file
    /// or an index) instead of a seeded draw: transformers' `Trainer` on a
    /// `from_pretrained` model. See [`Accelerator::prepare_pretrained`].
    ///
    /// # Errors
    /// As [`Trainer::new`]; a parameter the checkpoint lacks or holds in
    /// another shape, named with the file.
    pub fn from_pretrained(
        args: TrainingArguments,
        checkpoint: impl AsRef<Path>,
        build: impl FnOnce(VarBuilder<'static>) -> Result<M>,
        train_dataset: D,
        eval_dataset: Option<D>,
    ) -> Result<Self> {
        let acc = Accelerator::new(args.accelerator_config()?)?;
        let checkpoint = Some(checkpoint.as_ref());
        Self::build(acc, args, checkpoint, build, train_dataset, eval_dataset)
    }

    fn build(
        mut acc: Accelerator,
        args: TrainingArguments,
        checkpoint: Option<&Path>,
        build: impl FnOnce(VarBuilder<'static>) -> Result<M>,
        train_dataset: D,
        eval_dataset: Option<D>,
    ) -> Result<Self> {
        args.validate()?;
        if args.cuda_graphs {
            let why = crate::cuda_graphs::eager_reason(acc.device());
            crate::notice::warn(&format!("TrainingArguments::cuda_graphs: {why}"));
        }
        // Under FSDP the hooks on the model's blocks shard its one forward.
        let (model, params) = match checkpoint {
            Some(checkpoint) => acc.prepare_pretrained(checkpoint, build)?,
            None => acc.prepare(build)?,
        };
        let mut args = args;
        let mut ds = deepspeed::DeepSpeedRun::new(&args, acc.num_processes())?;
        let (optimizer, optimizer_lr) = match &ds {
            Some(ds) => ds.optimizer(&args),
            None => (
                Box::new(deepspeed::trainer_adamw(&args)) as Box<dyn crate::optim::Optimizer>,
                args.learning_rate,
            ),
        };
        let opt = acc.prepare_optimizer(&params, optimizer);
        let train_loader = acc.prepare_data_loader(DataLoader::new(
            Counted(train_dataset),
            DataLoaderConfig::new(args.per_device_train_batch_size)
                .with_shuffle(true)
                .with_drop_last(args.dataloader_drop_last)
                .with_workers(
                    args.dataloader_num_workers,
                    args.dataloader_prefetch_factor.unwrap_or(2),
                ),
        ));
        let eval_loader = eval_dataset.map(|d| {
            acc.prepare_data_loader(DataLoader::new(
                Counted(d),
                DataLoaderConfig::new(args.per_device_eval_batch_size).with_workers(
                    args.dataloader_num_workers,
                    args.dataloader_prefetch_factor.unwrap_or(2),
                ),
            ))
        });
        // The loader ends an accumulation cycle at its last batch, so a short
        // tail of micro-batches still makes an optimizer step: round up.
        let batches = train_loader.len() as u64;
        let steps_per_epoch = batches
            .div_ceil(acc.gradient_accumulation_steps() as u64)
            .max(1);
        let total_steps = args.num_training_steps(steps_per_epoch);
        let schedule = match &mut ds {
            Some(ds) => ds.scheduler(&args, total_steps, optimizer_lr)?,
            None => LrScheduler::new(args.schedule(total_steps), args.learning_rate),
        };
        let sched = acc.prepare_scheduler(schedule, &opt);
        let save_dtype = ds.as_ref().and_then(|ds| {
            ds.plan
                .save_16bit_model
                .then(|| acc.mixed_precision().compute_dtype())
        });
        if let Some(ds) = &ds {
            args.max_grad_norm = ds.max_grad_norm();
        }
        let state = Arc::new(Mutex::new(TrainerState::default()));
        acc.register_for_checkpointing(state.clone());
        Ok(Self {
            args,
            acc,
            model,
            params,
            opt,
            sched,
            train_loader,
            eval_loader,
            compute_metrics: None,
            state,
            total_steps,
            steps_per_epoch,
            trackers_started: false,
            save_dtype,
        })
    }

    /// Computes metrics from the gathered predictions at every evaluation.
    pub fn with_compute_metrics(
        mut self,
        f: impl Fn(&Predictions) -> Result<BTreeMap<String, f64>> + 'static,
    ) -> Self {
        self.compute_metrics = Some(Box::new(f));
        self
    }

    /// The arguments.
    pub fn args(&self) -> &TrainingArguments {
        &self.args
    }

    /// The Accelerator (rank, device, ...).
    pub fn accelerator(&self) -> &Accelerator {
        &self.acc
    }

    /// The Accelerator, to log extra values or save state by hand.
    pub fn accelerator_mut(&mut self) -> &mut Accelerator {
        &mut self.acc
    }

    /// The model.
    pub fn model(&self) -> &M {
        &self.model
    }

    /// The prepared parameters (fp32 master weights, gradients).
    pub fn parameters(&self) -> &PreparedModel {
        &self.params
    }

    /// Optimizer steps the run takes in total.
    pub fn num_training_steps(&self) -> u64 {
        self.total_steps
    }

    /// Optimizer steps in one pass over the training data (per process).
    pub fn steps_per_epoch(&self) -> u64 {
        self.steps_per_epoch
    }

    /// Optimizer steps taken so far.
    pub fn global_step(&self) -> u64 {
        self.lock_state().global_step
    }

    fn lock_state(&self) -> std::sync::MutexGuard<'_, TrainerState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Evaluates on the evaluation set and logs the result at the current
    /// step: `eval_loss` (mean over samples, over every process, without the
    /// samples padded in for even batches) plus `eval_{name}` for every
    /// metric of [`Trainer::with_compute_metrics`].
    ///
    /// # Errors
    /// [`crate::Error::Usage`] without an evaluation set; model or collective errors.
    pub fn evaluate(&mut self) -> Result<BTreeMap<String, f64>> {
        self.start_trackers()?;
        let step = self.global_step();
        let metrics = evaluate_on(
            &mut self.acc,
            &self.model,
            self.eval_loader.as_ref(),
            self.compute_metrics.as_ref(),
        )?;
        let epoch = step as f64 / self.steps_per_epoch as f64;
        let mut logged = metrics.clone();
        logged.insert("epoch".into(), epoch);
        self.acc.log(logged, Some(step))?;
        Ok(metrics)
    }

    /// Starts the trackers of `report_to` once, recording the arguments.
    fn start_trackers(&mut self) -> Result<()> {
        if !self.trackers_started {
            let init = serde_json::to_value(&self.args).expect("training arguments serialize");
            self.acc.init_trackers(&self.args.run_name, &init)?;
            self.trackers_started = true;
        }
        Ok(())
    }

    /// Saves the model as transformers' `Trainer.save_model` does, through
    /// [`PreparedModel::save_pretrained`](crate::PreparedModel::save_pretrained):
    /// `dir/model.safetensors` (sharded past 5GB) in the dtypes of the
    /// checkpoint the model started from (fp32 from scratch), with that
    /// folder's config and tokenizer files. The main process writes.
    ///
    /// # Errors
    /// When the folder cannot be written.
    pub fn save_model(&self, dir: impl AsRef<Path>) -> Result<Vec<PathBuf>> {
        self.params
            .save_pretrained_as(&self.acc, dir, "5GB", self.save_dtype)
    }
}

/// Runs the evaluation loop; a free function so the training loop can call it
/// while it holds the training loader.
fn evaluate_on<M: TrainModel, D: Dataset<Batch = M::Batch>>(
    acc: &mut Accelerator,
    model: &M,
    loader: Option<&DataLoader<Counted<D>>>,
    compute_metrics: Option<&ComputeMetrics>,
) -> Result<BTreeMap<String, f64>> {
    let Some(loader) = loader else {
        crate::bail!("evaluate needs an eval_dataset");
    };
    let (mut loss_sum, mut samples) = (0f64, 0usize);
    let (mut preds, mut labels) = (vec![], vec![]);
    for batch in loader.iter() {
        let (n, batch) = batch?;
        let losses = model.sample_losses(&batch, n)?.to_dtype(DType::F32)?;
        let losses = acc.gather_for_metrics(&losses)?;
        samples += losses.dim(0)?;
        loss_sum += losses.to_dtype(DType::F64)?.sum_all()?.to_scalar::<f64>()?;
        if compute_metrics.is_some() {
            if let Some(p) = model.predictions(&batch)? {
                preds.push(acc.gather_for_metrics(&p.predictions)?);
                labels.push(acc.gather_for_metrics(&p.labels)?);
            }
        }
    }
    let mut metrics = BTreeMap::new();
    metrics.insert("eval_loss".to_string(), loss_sum / samples.max(1) as f64);
    if let (Some(f), false) = (compute_metrics, preds.is_empty()) {
        let all = Predictions {
            predictions: Tensor::cat(&preds, 0)?,
            labels: Tensor::cat(&labels, 0)?,
        };
        for (k, v) in f(&all)? {
            metrics.insert(format!("eval_{k}"), v);
        }
    }
    Ok(metrics)
}
