//! [`TrainingArguments`]: the settings of a [`super::Trainer`], named and
//! defaulted as in transformers' `TrainingArguments` where they apply.

use std::path::PathBuf;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use accel_dist::ddp::{CommHook, DdpConfig};

use super::fsdp_args::FsdpConfig;
use super::options::{config_error as config, TrainerAcceleratorConfig};
use crate::accelerator::{AcceleratorConfig, ProjectConfiguration};
use crate::precision::PrecisionType;
use crate::scheduler::Schedule;
use crate::{Error, Result};

/// When an action (evaluation, saving) happens, as transformers' `IntervalStrategy`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum IntervalStrategy {
    /// Never.
    #[default]
    No,
    /// Every `*_steps` optimizer steps.
    Steps,
    /// At the end of every epoch.
    Epoch,
}

impl FromStr for IntervalStrategy {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "no" | "none" => Ok(Self::No),
            "steps" => Ok(Self::Steps),
            "epoch" => Ok(Self::Epoch),
            other => Err(Error::Config {
                key: "strategy".into(),
                reason: format!("unknown strategy `{other}`; expected no, steps or epoch"),
            }),
        }
    }
}

/// The learning-rate schedule, as transformers' `SchedulerType` (the ones
/// [`Schedule`] implements).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum SchedulerType {
    /// Warm-up, then linear decay to 0 (transformers' default).
    #[default]
    Linear,
    /// Warm-up, then half a cosine down to 0.
    Cosine,
    /// The base rate throughout (warm-up ignored, as in transformers).
    Constant,
    /// Warm-up, then the base rate.
    ConstantWithWarmup,
}

impl FromStr for SchedulerType {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "linear" => Ok(Self::Linear),
            "cosine" => Ok(Self::Cosine),
            "constant" => Ok(Self::Constant),
            "constant_with_warmup" => Ok(Self::ConstantWithWarmup),
            other => Err(Error::Config {
                key: "lr_scheduler_type".into(),
                reason: format!(
                    "unknown schedule `{other}`; expected linear, cosine, constant or constant_with_warmup"
                ),
            }),
        }
    }
}

/// Everything that shapes a [`super::Trainer`] run.
///
/// ```
/// use accel_core::trainer::{IntervalStrategy, TrainingArguments};
/// let args = TrainingArguments::new("runs/demo")
///     .with_max_steps(100)
///     .with_eval_strategy(IntervalStrategy::Steps, 20);
/// assert_eq!(args.learning_rate, 5e-5);
/// assert_eq!(args.num_training_steps(10), 100);
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainingArguments {
    /// Run folder: `checkpoints/checkpoint_{n}`, tracker logs under `{run_name}/`.
    pub output_dir: PathBuf,
    /// Tracker project name (the folder under `output_dir` the trackers write in).
    pub run_name: String,
    /// Passes over the training data when `max_steps` is not positive (may be fractional).
    pub num_train_epochs: f64,
    /// Optimizer steps to run; -1 derives them from `num_train_epochs`.
    pub max_steps: i64,
    /// Samples per micro-batch and process, for training.
    pub per_device_train_batch_size: usize,
    /// Samples per batch and process, for evaluation.
    pub per_device_eval_batch_size: usize,
    /// Micro-batches per optimizer step.
    pub gradient_accumulation_steps: usize,
    /// Peak learning rate of AdamW.
    pub learning_rate: f64,
    /// AdamW's decoupled weight decay (applied to every parameter but biases
    /// and norm-layer weights, as transformers' `get_decay_parameter_names`).
    pub weight_decay: f64,
    /// AdamW's first-moment decay.
    pub adam_beta1: f64,
    /// AdamW's second-moment decay.
    pub adam_beta2: f64,
    /// AdamW's denominator epsilon.
    pub adam_epsilon: f64,
    /// Clip gradients to this global L2 norm; 0 disables clipping.
    pub max_grad_norm: f64,
    /// The learning-rate schedule.
    pub lr_scheduler_type: SchedulerType,
    /// Warm-up optimizer steps; when 0, `warmup_ratio` of the total is used.
    pub warmup_steps: u64,
    /// Fraction of the optimizer steps spent warming up (when `warmup_steps` is 0).
    pub warmup_ratio: f64,
    /// Log the training loss every this many optimizer steps; 0 never.
    pub logging_steps: u64,
    /// When to evaluate.
    pub eval_strategy: IntervalStrategy,
    /// Evaluate every this many steps (with `Steps`); `None` uses `logging_steps`.
    pub eval_steps: Option<u64>,
    /// When to save a checkpoint.
    pub save_strategy: IntervalStrategy,
    /// Save every this many steps (with `Steps`).
    pub save_steps: u64,
    /// Keep at most this many checkpoints, deleting the oldest.
    pub save_total_limit: Option<usize>,
    /// Every machine keeps its own copy of each checkpoint, for jobs without
    /// shared storage ([`ProjectConfiguration::save_on_each_node`]).
    #[serde(default)]
    pub save_on_each_node: bool,
    /// Seed of initialisation and data order.
    pub seed: u64,
    /// Precision mode, overridden by `bf16` / `fp16`; `None` defers to the
    /// launcher (`ACCELERATE_MIXED_PRECISION`), then `no`.
    pub mixed_precision: Option<PrecisionType>,
    /// Compute in bf16 (transformers' flag).
    pub bf16: bool,
    /// Compute in fp16 with a loss scale (transformers' flag).
    pub fp16: bool,
    /// Trackers: `jsonl`, `tensorboard`, `mlflow`, `all` or `none`.
    pub report_to: Vec<String>,
    /// A checkpoint folder to resume from, or `"latest"` for the newest in `output_dir`.
    pub resume_from_checkpoint: Option<String>,
    /// Drop the short last training batch of each epoch.
    pub dataloader_drop_last: bool,
    /// Background threads preparing the next batches while a step runs
    /// (transformers' `dataloader_num_workers`; threads, not processes: a
    /// Rust dataset needs no interpreter of its own). 0: in the loop.
    #[serde(default)]
    pub dataloader_num_workers: usize,
    /// Batches each worker keeps ready (`dataloader_prefetch_factor`; 2 when
    /// unset); only with workers, as PyTorch requires.
    #[serde(default)]
    pub dataloader_prefetch_factor: Option<usize>,
    /// Page-locked staging for host-to-device copies
    /// (`dataloader_pin_memory`). A CPU run copies nothing, and CUDA runs
    /// copy from pageable memory here: said at start-up when set.
    #[serde(default)]
    pub dataloader_pin_memory: Option<bool>,
    /// Hide the progress bar.
    pub disable_tqdm: bool,
    /// Train on the CPU even when a GPU is available.
    pub use_cpu: bool,
    /// DDP bucket size in MiB; `None` keeps the default (25).
    #[serde(default)]
    pub ddp_bucket_cap_mb: Option<f64>,
    /// DDP gradient compression on the wire (`none`, `fp16`, `bf16`).
    #[serde(default)]
    pub ddp_comm_hook: CommHook,
    /// Accept parameters that receive no gradient at more than one rank
    /// (transformers' `ddp_find_unused_parameters`): a warning instead of an
    /// error at the first backward.
    #[serde(default)]
    pub ddp_find_unused_parameters: Option<bool>,
    /// The collective transport, as transformers' `ddp_backend`: `nccl`
    /// (CUDA), `gloo` (the TCP backend); `mpi`, `ccl`, `hccl`, ... are
    /// refused by name. `None`: the launcher's choice (NCCL on CUDA with the
    /// `nccl` feature, else TCP).
    #[serde(default)]
    pub ddp_backend: Option<String>,
    /// Seconds any collective or rendezvous step waits for a peer before
    /// failing with the missing rank named (transformers' `ddp_timeout`;
    /// `None`: the launcher's `--timeout`, else 1800).
    #[serde(default)]
    pub ddp_timeout: Option<f64>,
    /// DDP's buffer broadcast (transformers' `ddp_broadcast_buffers`): the
    /// models here keep no buffers outside their parameters, so it has no
    /// effect (said at start-up when set).
    #[serde(default)]
    pub ddp_broadcast_buffers: Option<bool>,
    /// Fully sharded data parallel, as transformers' `fsdp`: `"true"` (the
    /// strategy and the rest from `fsdp_config`), or the legacy words
    /// `"full_shard auto_wrap"`, `"shard_grad_op offload"`, ...; empty or
    /// `"false"`: off. From JSON also `true`/`false` or a list of words.
    #[serde(default, deserialize_with = "super::fsdp_args::fsdp_words")]
    pub fsdp: String,
    /// transformers' `fsdp_config`: `version`, `reshard_after_forward`,
    /// `auto_wrap_policy`, `transformer_layer_cls_to_wrap`,
    /// `min_num_params`, `cpu_offload`, `activation_checkpointing`,
    /// `state_dict_type`, `cpu_ram_efficient_loading`, FSDP1's prefetch and
    /// `sync_module_states`; from JSON an object (with or without the
    /// `fsdp_` prefix) or the path of a JSON file.
    #[serde(default)]
    pub fsdp_config: FsdpConfig,
    /// How the Accelerator splits data between processes (from JSON an
    /// object or the path of a JSON file, as transformers takes it).
    #[serde(default, deserialize_with = "super::options::accelerator_config_arg")]
    pub accelerator_config: TrainerAcceleratorConfig,
    /// Capture the training step as a CUDA graph and replay it (as
    /// `torch.compile(mode="reduce-overhead")`). Capture is not built yet:
    /// the Trainer says so when it starts and trains eagerly.
    #[serde(default)]
    pub cuda_graphs: bool,
    /// A DeepSpeed configuration, as transformers' `deepspeed`: a JSON
    /// string is the path of a `ds_config.json`, an object the
    /// configuration itself. Its ZeRO stage, offload, precision, batch
    /// sizes, clipping, optimizer and schedule are run as the equivalent
    /// accel-rs settings ([`crate::deepspeed`]); `"auto"` values come from
    /// these arguments; a contradicting value is an error listing every
    /// mismatch. Not with `fsdp`.
    #[serde(default)]
    pub deepspeed: Option<serde_json::Value>,
}

impl Default for TrainingArguments {
    fn default() -> Self {
        Self {
            output_dir: PathBuf::from("trainer_output"),
            run_name: "trainer".into(),
            num_train_epochs: 3.0,
            max_steps: -1,
            per_device_train_batch_size: 8,
            per_device_eval_batch_size: 8,
            gradient_accumulation_steps: 1,
            learning_rate: 5e-5,
            weight_decay: 0.0,
            adam_beta1: 0.9,
            adam_beta2: 0.999,
            adam_epsilon: 1e-8,
            max_grad_norm: 1.0,
            lr_scheduler_type: SchedulerType::Linear,
            warmup_steps: 0,
            warmup_ratio: 0.0,
            logging_steps: 500,
            eval_strategy: IntervalStrategy::No,
            eval_steps: None,
            save_strategy: IntervalStrategy::Steps,
            save_steps: 500,
            save_total_limit: None,
            save_on_each_node: false,
            seed: 42,
            mixed_precision: None,
            bf16: false,
            fp16: false,
            report_to: vec!["jsonl".into()],
            resume_from_checkpoint: None,
            dataloader_drop_last: false,
            dataloader_num_workers: 0,
            dataloader_prefetch_factor: None,
            dataloader_pin_memory: None,
            disable_tqdm: false,
            use_cpu: false,
            ddp_bucket_cap_mb: None,
            ddp_comm_hook: CommHook::None,
            ddp_find_unused_parameters: None,
            ddp_backend: None,
            ddp_timeout: None,
            ddp_broadcast_buffers: None,
            fsdp: String::new(),
            fsdp_config: FsdpConfig::default(),
            accelerator_config: TrainerAcceleratorConfig::default(),
            cuda_graphs: false,
            deepspeed: None,
        }
    }
}

impl TrainingArguments {
    /// The defaults, writing into `output_dir`.
    pub fn new(output_dir: impl Into<PathBuf>) -> Self {
        Self {
            output_dir: output_dir.into(),
            ..Default::default()
        }
    }

    /// Runs exactly `steps` optimizer steps.
    pub fn with_max_steps(mut self, steps: i64) -> Self {
        self.max_steps = steps;
        self
    }

    /// Sets both per-device batch sizes.
    pub fn with_batch_size(mut self, batch_size: usize) -> Self {
        self.per_device_train_batch_size = batch_size;
        self.per_device_eval_batch_size = batch_size;
        self
    }

    /// Sets the peak learning rate.
    pub fn with_learning_rate(mut self, lr: f64) -> Self {
        self.learning_rate = lr;
        self
    }

    /// Logs every `steps` optimizer steps.
    pub fn with_logging_steps(mut self, steps: u64) -> Self {
        self.logging_steps = steps;
        self
    }

    /// Evaluates with `strategy`, every `steps` steps for `Steps`.
    pub fn with_eval_strategy(mut self, strategy: IntervalStrategy, steps: u64) -> Self {
        self.eval_strategy = strategy;
        self.eval_steps = Some(steps);
        self
    }

    /// Saves with `strategy`, every `steps` steps for `Steps`.
    pub fn with_save_strategy(mut self, strategy: IntervalStrategy, steps: u64) -> Self {
        self.save_strategy = strategy;
        self.save_steps = steps;
        self
    }

    /// Resumes from a checkpoint folder or `"latest"`.
    pub fn with_resume_from_checkpoint(mut self, checkpoint: impl Into<String>) -> Self {
        self.resume_from_checkpoint = Some(checkpoint.into());
        self
    }

    /// The precision mode after the `bf16` / `fp16` flags; `None` when
    /// nothing was chosen, so the Accelerator takes the launcher's.
    ///
    /// # Errors
    /// [`Error::Config`] when both flags are set.
    pub fn precision(&self) -> Result<Option<PrecisionType>> {
        match (self.bf16, self.fp16) {
            (true, true) => Err(config("bf16/fp16", "set at most one of bf16 and fp16")),
            (true, false) => Ok(Some(PrecisionType::Bf16)),
            (false, true) => Ok(Some(PrecisionType::Fp16)),
            (false, false) => Ok(self.mixed_precision),
        }
    }

    /// The evaluation interval in steps (`eval_steps`, else `logging_steps`).
    pub fn eval_interval(&self) -> u64 {
        self.eval_steps.unwrap_or(self.logging_steps)
    }

    /// Optimizer steps of the run, given the optimizer steps in one epoch.
    pub fn num_training_steps(&self, steps_per_epoch: u64) -> u64 {
        if self.max_steps > 0 {
            self.max_steps as u64
        } else {
            (self.num_train_epochs * steps_per_epoch as f64).ceil() as u64
        }
    }

    /// Warm-up steps: `warmup_steps` when set, else `ceil(warmup_ratio * total)`
    /// (transformers' `get_warmup_steps`).
    pub fn num_warmup_steps(&self, total: u64) -> u64 {
        if self.warmup_steps > 0 {
            self.warmup_steps
        } else {
            (self.warmup_ratio * total as f64).ceil() as u64
        }
    }

    /// The schedule over `total` optimizer steps.
    pub fn schedule(&self, total: u64) -> Schedule {
        let warmup = self.num_warmup_steps(total);
        match self.lr_scheduler_type {
            SchedulerType::Linear => Schedule::Linear { warmup, total },
            SchedulerType::Cosine => Schedule::Cosine { warmup, total },
            SchedulerType::Constant => Schedule::Constant,
            SchedulerType::ConstantWithWarmup => Schedule::ConstantWithWarmup { warmup },
        }
    }

    /// Checks settings that would otherwise fail deep inside a run.
    ///
    /// # Errors
    /// [`Error::Config`] naming the setting at fault.
    pub fn validate(&self) -> Result<()> {
        self.precision()?;
        if self.per_device_train_batch_size == 0 || self.per_device_eval_batch_size == 0 {
            return Err(config("per_device_*_batch_size", "must be at least 1"));
        }
        if self.gradient_accumulation_steps == 0 {
            return Err(config("gradient_accumulation_steps", "must be at least 1"));
        }
        if self.max_steps <= 0 && self.num_train_epochs <= 0.0 {
            return Err(config(
                "num_train_epochs",
                "must be positive when max_steps is -1",
            ));
        }
        if !(0.0..=1.0).contains(&self.warmup_ratio) {
            return Err(config("warmup_ratio", "must lie in [0, 1]"));
        }
        if self.eval_strategy == IntervalStrategy::Steps && self.eval_interval() == 0 {
            return Err(config(
                "eval_steps",
                "must be positive with eval_strategy steps",
            ));
        }
        if self.dataloader_prefetch_factor.is_some() && self.dataloader_num_workers == 0 {
            return Err(config(
                "dataloader_prefetch_factor",
                "can only be set with dataloader_num_workers > 0 (as PyTorch's DataLoader)",
            ));
        }
        if self.dataloader_prefetch_factor == Some(0) {
            return Err(config("dataloader_prefetch_factor", "must be at least 1"));
        }
        if self
            .ddp_bucket_cap_mb
            .is_some_and(|mb| !(mb.is_finite() && mb > 0.0))
        {
            return Err(config("ddp_bucket_cap_mb", "must be a positive number"));
        }
        if self.save_strategy == IntervalStrategy::Steps && self.save_steps == 0 {
            return Err(config(
                "save_steps",
                "must be positive with save_strategy steps",
            ));
        }
        Ok(())
    }

    /// `deepspeed` read and filled from these arguments for `world`
    /// processes (transformers' `trainer_config_process`), its mismatches
    /// so far an error; `None` without one.
    ///
    /// # Errors
    /// An unreadable file, `fsdp` set too, or values that contradict these
    /// arguments (every one listed, as transformers does).
    pub fn deepspeed_config(
        &self,
        world: usize,
    ) -> Result<Option<crate::deepspeed::DeepSpeedConfig>> {
        let Some(v) = &self.deepspeed else {
            return Ok(None);
        };
        if !self.fsdp.trim().is_empty() {
            return Err(config(
                "deepspeed",
                "cannot be combined with fsdp; choose one",
            ));
        }
        let mut ds = crate::deepspeed::DeepSpeedConfig::from_argument(v)?;
        ds.fill_from_args(self, world);
        ds.check_mismatches()?;
        Ok(Some(ds))
    }

    /// The settings given that have no effect here, one sentence each.
    pub fn inert_settings(&self) -> Vec<String> {
        let mut out = vec![];
        if self.ddp_broadcast_buffers.is_some() {
            out.push("TrainingArguments::ddp_broadcast_buffers has no effect in accel-rs: models keep no buffers outside their parameters, which DDP already keeps equal".into());
        }
        if self.dataloader_pin_memory == Some(true) {
            out.push("TrainingArguments::dataloader_pin_memory has no effect in accel-rs: batches are made on the training device's host side and copied from pageable memory (a CPU run copies nothing)".into());
        }
        if self.accelerator_config.non_blocking {
            out.push("accelerator_config.non_blocking has no effect in accel-rs: host-to-device batch copies are synchronous (dataloader_num_workers overlaps batch preparation with the step instead)".into());
        }
        out
    }

    /// The process-group settings of `ddp_backend` and `ddp_timeout`, if any.
    ///
    /// # Errors
    /// A backend accel-rs does not have (named), NCCL on a CPU run, a
    /// timeout that is not a positive number of seconds.
    pub fn init_kwargs(&self) -> Result<Option<accel_dist::InitProcessGroupKwargs>> {
        if self.ddp_backend.is_none() && self.ddp_timeout.is_none() {
            return Ok(None);
        }
        let mut k = accel_dist::InitProcessGroupKwargs::default();
        if let Some(secs) = self.ddp_timeout {
            if !(secs.is_finite() && secs > 0.0) {
                return Err(config(
                    "ddp_timeout",
                    "must be a positive number of seconds",
                ));
            }
            k = k.with_timeout(std::time::Duration::from_secs_f64(secs));
        } else if let Some(secs) = crate::state::env_f64(accel_dist::process::ENV_TIMEOUT)? {
            // The launcher's --timeout stays in force when only the backend is set.
            k = k.with_timeout(std::time::Duration::from_secs_f64(secs));
        }
        if let Some(b) = &self.ddp_backend {
            let backend =
                match b.to_ascii_lowercase().as_str() {
                    "nccl" if self.use_cpu => return Err(config(
                        "ddp_backend",
                        "nccl needs CUDA devices and this run is on the CPU (use_cpu); use gloo",
                    )),
                    "nccl" => accel_dist::Backend::Nccl,
                    "gloo" | "tcp" => accel_dist::Backend::Tcp,
                    other @ ("mpi" | "ccl" | "hccl" | "cncl" | "mccl" | "xla" | "smddp") => {
                        return Err(config(
                            "ddp_backend",
                            &format!(
                                "{other:?} is not built in accel-rs (nccl on CUDA, gloo over TCP)"
                            ),
                        ))
                    }
                    other => {
                        return Err(config(
                            "ddp_backend",
                            &format!("unknown backend {other:?} (expected nccl or gloo)"),
                        ))
                    }
                };
            k = k.with_backend(backend);
        }
        Ok(Some(k))
    }

    /// The trackers to start: `report_to` without `none`.
    pub fn trackers(&self) -> Vec<String> {
        self.report_to
            .iter()
            .filter(|n| !n.eq_ignore_ascii_case("none"))
            .cloned()
            .collect()
    }

    /// The data-parallel settings: `ddp_bucket_cap_mb` (default 25), `ddp_comm_hook`
    /// and `ddp_find_unused_parameters` (default false).
    pub fn ddp_config(&self) -> DdpConfig {
        let default = DdpConfig::default();
        DdpConfig {
            bucket_cap_mb: self.ddp_bucket_cap_mb.unwrap_or(default.bucket_cap_mb),
            comm_hook: self.ddp_comm_hook,
            find_unused_parameters: self.ddp_find_unused_parameters.unwrap_or(false),
        }
    }

    /// The Accelerator settings of this run: precision, accumulation, seed,
    /// `output_dir` with automatic checkpoint naming and `save_total_limit`,
    /// the trackers, and the DDP bucket size and compression hook.
    ///
    /// The scheduler steps once per optimizer step whatever the world size
    /// (as transformers, which does not hand its scheduler to Accelerate), so
    /// a schedule's length is the number of optimizer steps every process takes.
    ///
    /// # Errors
    /// As [`TrainingArguments::validate`], or when `output_dir` cannot be listed.
    pub fn accelerator_config(&self) -> Result<AcceleratorConfig> {
        self.validate()?;
        let mut project = ProjectConfiguration::automatic(&self.output_dir);
        project.total_limit = self.save_total_limit;
        project.save_on_each_node = self.save_on_each_node;
        // Number new checkpoints after any already there, so a second run (or a
        // resume from an explicit folder) never collides with an existing one.
        let existing = crate::checkpoint::list_checkpoints(self.output_dir.join("checkpoints"))?;
        project.iteration = existing.last().map_or(0, |(n, _)| n + 1);
        let mut config = AcceleratorConfig::default()
            .with_gradient_accumulation_steps(self.gradient_accumulation_steps)
            .with_seed(self.seed)
            .with_project(project)
            .with_log_with(self.trackers())
            .with_ddp(self.ddp_config());
        config.mixed_precision = self.precision()?;
        config.step_scheduler_with_optimizer = false;
        if let Some(kwargs) = self.init_kwargs()? {
            config = config.with_init_kwargs(kwargs);
        }
        if self.ddp_broadcast_buffers.is_some()
            && crate::state::env_usize("RANK")?.unwrap_or(0) == 0
        {
            crate::notice::warn("TrainingArguments::ddp_broadcast_buffers has no effect in accel-rs: models keep no buffers outside their parameters, which DDP already keeps equal");
        }
        config = self.accelerator_config.apply(config)?;
        config.fsdp = super::fsdp_args::fsdp_plugin(&self.fsdp, &self.fsdp_config)?;
        if let Some(ds) =
            self.deepspeed_config(crate::state::env_usize("WORLD_SIZE")?.unwrap_or(1))?
        {
            config = super::deepspeed::apply(&ds.plan()?, config)?;
        }
        if self.use_cpu {
            config = config.with_device(candle_core::Device::Cpu);
        }
        Ok(config)
    }
}

#[cfg(test)]
mod tests;
