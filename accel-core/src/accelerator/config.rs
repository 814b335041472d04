//! Settings of an [`super::Accelerator`].

use std::path::PathBuf;

use candle_core::Device;

use accel_dist::ddp::DdpConfig;
use accel_dist::InitProcessGroupKwargs;

use crate::accumulation::GradientAccumulationPlugin;
use crate::fsdp::FullyShardedDataParallelPlugin;
use crate::precision::{GradScalerConfig, PrecisionType};

/// Where a run writes its checkpoints and logs (Accelerate's `ProjectConfiguration`).
#[derive(Debug, Clone, PartialEq)]
pub struct ProjectConfiguration {
    /// Root folder of the run.
    pub project_dir: PathBuf,
    /// Where trackers write; defaults to `project_dir`.
    pub logging_dir: Option<PathBuf>,
    /// Save to `project_dir/checkpoints/checkpoint_{n}` with a counter.
    pub automatic_checkpoint_naming: bool,
    /// Keep at most this many automatic checkpoints, deleting the oldest.
    pub total_limit: Option<usize>,
    /// The number the next automatic checkpoint gets.
    pub iteration: u64,
    /// Every machine keeps its own copy of each checkpoint (Accelerate's
    /// field): the first process of each machine writes the folder on its
    /// own disk and that machine's ranks write their files into it, so a job
    /// without shared storage can save and restart. Without it the main
    /// process's folder takes every rank's files, which needs a folder all
    /// machines see.
    pub save_on_each_node: bool,
}

impl Default for ProjectConfiguration {
    fn default() -> Self {
        Self {
            project_dir: PathBuf::from("."),
            logging_dir: None,
            automatic_checkpoint_naming: false,
            total_limit: None,
            iteration: 0,
            save_on_each_node: false,
        }
    }
}

impl ProjectConfiguration {
    /// A project rooted at `project_dir` with automatic checkpoint naming.
    pub fn automatic(project_dir: impl Into<PathBuf>) -> Self {
        Self {
            project_dir: project_dir.into(),
            automatic_checkpoint_naming: true,
            ..Default::default()
        }
    }

    /// Keeps at most `limit` automatic checkpoints.
    pub fn with_total_limit(mut self, limit: usize) -> Self {
        self.total_limit = Some(limit);
        self
    }

    /// Every machine keeps its own copy of each checkpoint (see
    /// [`Self::save_on_each_node`]).
    pub fn with_save_on_each_node(mut self, on: bool) -> Self {
        self.save_on_each_node = on;
        self
    }

    /// The folder trackers write into.
    pub fn logging_dir(&self) -> PathBuf {
        self.logging_dir
            .clone()
            .unwrap_or_else(|| self.project_dir.clone())
    }
}

/// Everything that shapes an [`super::Accelerator`]; `Default` is a plain fp32
/// run on the CPU with no accumulation.
///
/// ```
/// use accel_core::{AcceleratorConfig, PrecisionType};
/// let config = AcceleratorConfig::default()
///     .with_mixed_precision(PrecisionType::Bf16)
///     .with_gradient_accumulation_steps(4)
///     .with_seed(42);
/// assert_eq!(config.gradient_accumulation.num_steps, 4);
/// ```
#[derive(Debug, Clone)]
pub struct AcceleratorConfig {
    /// The precision mode; `None` defers to the launcher
    /// (`ACCELERATE_MIXED_PRECISION`), then `no`, as Accelerate's
    /// `Accelerator(mixed_precision=None)`. [`super::Accelerator::new`] stores
    /// the resolved mode here.
    pub mixed_precision: Option<PrecisionType>,
    /// Gradient accumulation.
    pub gradient_accumulation: GradientAccumulationPlugin,
    /// The loss scale for fp16.
    pub scaler: GradScalerConfig,
    /// Seed for initialisation and data order; `None` draws one from the clock.
    pub seed: Option<u64>,
    /// Checkpoint and log folders.
    pub project: ProjectConfiguration,
    /// The device; `None` picks the CPU (or CUDA device `LOCAL_RANK` when built with `cuda`).
    pub device: Option<Device>,
    /// Trackers by name (`"jsonl"`, `"tensorboard"`, `"mlflow"`, `"all"`).
    pub log_with: Vec<String>,
    /// Batches are split across processes rather than drawn per process.
    pub split_batches: bool,
    /// Pad the last batches by wrapping around so every process gets the
    /// same number of batches (Accelerate's default).
    pub even_batches: bool,
    /// Step schedulers once per process per optimizer step (Accelerate's default).
    pub step_scheduler_with_optimizer: bool,
    /// Data-parallel settings (bucket size, gradient compression).
    pub ddp: DdpConfig,
    /// Process-group settings (the collective timeout); `None` keeps what the
    /// launcher set (`ACCEL_DIST_TIMEOUT`, else 30 minutes).
    pub init_kwargs: Option<InitProcessGroupKwargs>,
    /// Fully sharded data parallelism for models prepared with
    /// `prepare_fsdp_model`; `None` reads `accel launch`'s `FSDP_*`
    /// variables (set when `distributed_type: FSDP`), else FULL_SHARD defaults.
    pub fsdp: Option<FullyShardedDataParallelPlugin>,
    /// Clip the gradients' global L2 norm to this at every optimizer step,
    /// before it (DeepSpeed's `gradient_clipping`, which its engine applies
    /// without a call; set by `distributed_type: DEEPSPEED`). `None`: only
    /// where the loop calls `clip_grad_norm`.
    pub gradient_clipping: Option<f64>,
    /// `save_model` writes the weights in the compute dtype, not fp32
    /// (DeepSpeed's `stage3_gather_16bit_weights_on_model_save`, set by
    /// `distributed_type: DEEPSPEED`'s `zero3_save_16bit_model`).
    pub save_16bit_model: bool,
}

impl Default for AcceleratorConfig {
    fn default() -> Self {
        Self {
            mixed_precision: None,
            gradient_accumulation: GradientAccumulationPlugin::default(),
            scaler: GradScalerConfig::default(),
            seed: None,
            project: ProjectConfiguration::default(),
            device: None,
            log_with: vec![],
            split_batches: false,
            even_batches: true,
            step_scheduler_with_optimizer: true,
            ddp: DdpConfig::default(),
            init_kwargs: None,
            fsdp: None,
            gradient_clipping: None,
            save_16bit_model: false,
        }
    }
}

impl AcceleratorConfig {
    /// Sets the precision mode explicitly (it then wins over the launcher's).
    pub fn with_mixed_precision(mut self, p: PrecisionType) -> Self {
        self.mixed_precision = Some(p);
        self
    }

    /// Accumulates gradients over `n` micro-batches.
    pub fn with_gradient_accumulation_steps(mut self, n: usize) -> Self {
        self.gradient_accumulation.num_steps = n;
        self
    }

    /// Sets the whole accumulation plugin.
    pub fn with_gradient_accumulation(mut self, plugin: GradientAccumulationPlugin) -> Self {
        self.gradient_accumulation = plugin;
        self
    }

    /// Fixes the seed.
    pub fn with_seed(mut self, seed: u64) -> Self {
        self.seed = Some(seed);
        self
    }

    /// Sets the project folders.
    pub fn with_project(mut self, project: ProjectConfiguration) -> Self {
        self.project = project;
        self
    }

    /// Sets the device.
    pub fn with_device(mut self, device: Device) -> Self {
        self.device = Some(device);
        self
    }

    /// Sets the trackers.
    pub fn with_log_with<S: Into<String>>(mut self, names: impl IntoIterator<Item = S>) -> Self {
        self.log_with = names.into_iter().map(Into::into).collect();
        self
    }

    /// Sets the data-parallel settings.
    pub fn with_ddp(mut self, ddp: DdpConfig) -> Self {
        self.ddp = ddp;
        self
    }

    /// Sets the process-group settings (collective timeout).
    pub fn with_init_kwargs(mut self, kwargs: InitProcessGroupKwargs) -> Self {
        self.init_kwargs = Some(kwargs);
        self
    }

    /// Shards models prepared with `prepare_fsdp_model` as `plugin` says.
    pub fn with_fsdp(mut self, plugin: FullyShardedDataParallelPlugin) -> Self {
        self.fsdp = Some(plugin);
        self
    }

    /// Sets the fp16 loss-scale settings.
    pub fn with_scaler(mut self, scaler: GradScalerConfig) -> Self {
        self.scaler = scaler;
        self
    }
}
