//! The [`Accelerator`]: the one object a training script talks to.
//!
//! It is a thin facade: precision lives in `precision/`, accumulation in
//! `accumulation.rs`, gradients and how a model is kept in step across ranks
//! in `model/`, optimizers in `optim/`, checkpoint files in `checkpoint/` and
//! their layout in `checkpointing.rs`; the training step's verbs are in `step.rs`.

mod checkpointing;
mod config;
mod graph;
mod lora;
mod ops;
mod preemption;
mod restart;
mod seeding;
mod sharded;
mod step;

pub use config::{AcceleratorConfig, ProjectConfiguration};

use std::sync::{Arc, Mutex};

use accel_dist::ddp::GradBuckets;
use accel_dist::{Communicator, ProcessGroup, ProcessGroupConfig};
use candle_core::{DType, Device, Tensor};
use candle_nn::{VarBuilder, VarMap};

use crate::accumulation::GradientState;
use crate::checkpoint::Checkpointable;
use crate::data::{DataLoader, Dataset, LoaderPosition};
use crate::fsdp::FullyShardedDataParallelPlugin;
use crate::init::{FullVars, Keep, MasterMap, SeededBackend};
use crate::model::{PreparedModel, Replicated, SingleProcess, SyncStrategy};
use crate::optim::{Optimizer, PreparedOptimizer};
use crate::precision::{GradScaler, PrecisionType};
use crate::rng::SplitMix64;
use crate::scheduler::{LrScheduler, PreparedScheduler};
use crate::state::{DistributedType, ProcessState};
use crate::trackers::{LogValue, Trackers};
use crate::{Error, Result};

type SharedCheckpointable = Arc<Mutex<dyn Checkpointable + Send>>;

/// Runs a training loop with mixed precision, gradient accumulation,
/// checkpointing and trackers, as Hugging Face Accelerate's `Accelerator`.
///
/// ```
/// use accel_core::{Accelerator, AcceleratorConfig, optim::{AdamW, AdamWConfig}};
/// use candle_nn::{Module, VarMap};
///
/// # fn main() -> accel_core::Result<()> {
/// let mut acc = Accelerator::new(AcceleratorConfig::default().with_seed(0))?;
/// let varmap = VarMap::new();
/// let layer = candle_nn::linear(4, 1, acc.var_builder(&varmap))?;
/// let model = acc.prepare_model(&varmap)?;
/// let mut opt = acc.prepare_optimizer(&model, AdamW::new(AdamWConfig::default()));
/// let x = candle_core::Tensor::ones((8, 4), acc.compute_dtype(), acc.device())?;
/// for _ in 0..3 {
///     acc.accumulate(|acc| {
///         let loss = layer.forward(&x)?.sqr()?.mean_all()?;
///         acc.backward(&loss)?;
///         opt.step()?;
///         opt.zero_grad();
///         Ok(())
///     })?;
/// }
/// # Ok(()) }
/// ```
pub struct Accelerator {
    state: ProcessState,
    /// Keeps the rendezvous store (hosted by rank 0) alive for the whole run.
    _group: ProcessGroup,
    comm: Arc<dyn Communicator>,
    config: AcceleratorConfig,
    grad_state: GradientState,
    scaler: Option<Arc<Mutex<GradScaler>>>,
    seed: u64,
    rng: SplitMix64,
    masters: MasterMap,
    models: Vec<PreparedModel>,
    optimizers: Vec<PreparedOptimizer>,
    schedulers: Vec<PreparedScheduler>,
    loaders: Vec<Arc<Mutex<LoaderPosition>>>,
    custom: Vec<SharedCheckpointable>,
    trackers: Trackers,
    /// Termination signals are observed (`should_stop` was called).
    watching_signals: bool,
    /// `backward` calls so far (the no-gradient report gives up waiting on a
    /// model no backward reaches after a few).
    backwards: u64,
}

impl Accelerator {
    /// An Accelerator for this process, reading its rank from the launcher's
    /// environment (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`).
    pub fn new(config: AcceleratorConfig) -> Result<Self> {
        // `accel launch --mixed_precision` exports ACCELERATE_MIXED_PRECISION;
        // an explicit choice in `config` wins over it.
        let mut config = config;
        // `distributed_type: DEEPSPEED`: the ZeRO stage, accumulation,
        // clipping and precision of the launcher's DeepSpeed settings.
        if config.fsdp.is_none() {
            if let Some(ds) = crate::deepspeed::from_vars(|k| std::env::var(k).ok())? {
                crate::deepspeed::apply_to_accelerator(&ds, &mut config)?;
            }
        }
        let mut config = config.with_env_precision()?;
        if config.fsdp.is_none() {
            config.fsdp = FullyShardedDataParallelPlugin::from_env()?;
        }
        let device = match &config.device {
            Some(d) => d.clone(),
            None => default_device()?,
        };
        let mut state = ProcessState::from_env(device)?;
        if config.fsdp.is_some() && state.world_size > 1 {
            state.distributed_type = DistributedType::Fsdp;
        }
        if std::env::var(accel_dist::affinity::ENV_CPU_AFFINITY).is_ok_and(|v| v == "1") {
            let local_world = crate::state::process_var("LOCAL_WORLD_SIZE")?
                .and_then(|v| v.parse().ok())
                .unwrap_or(1);
            let cpus = accel_dist::affinity::set_numa_affinity(state.local_rank, local_world)?;
            tracing::info!(local_rank = state.local_rank, ?cpus, "pinned to CPUs");
        }
        let omp = std::env::var("OMP_NUM_THREADS").ok();
        let rayon_env = std::env::var("RAYON_NUM_THREADS").ok();
        let pool = rayon::current_num_threads();
        if let Some(msg) =
            crate::config::env::omp_threads_notice(omp.as_deref(), rayon_env.as_deref(), pool)
        {
            tracing::warn!("{msg}");
        }
        // A training step frees and reallocates the same large buffers; with
        // glibc's defaults each step faults them in again (see accel_dist::malloc).
        match accel_dist::malloc::tune_for_training() {
            accel_dist::malloc::MallocTuning::Applied => tracing::info!(
                "glibc malloc kept for reuse: M_MMAP_THRESHOLD 32 MiB, M_TRIM_THRESHOLD 1 GiB \
                 (set ACCEL_MALLOC_TUNING=0 to keep glibc's defaults)"
            ),
            accel_dist::malloc::MallocTuning::Refused(what) => {
                tracing::warn!(
                    setting = what,
                    "glibc refused a malloc setting; defaults kept"
                )
            }
            _ => {}
        }
        graph::check_candle_nn_backward();
        let mut pg_config = ProcessGroupConfig::from_env()?;
        if let Some(kwargs) = &config.init_kwargs {
            pg_config = pg_config.with_kwargs(kwargs);
        }
        // World 1 gives a local communicator; more ranks meet at MASTER_ADDR
        // (over NCCL when training on CUDA with the `nccl` feature).
        let group = ProcessGroup::init_on(pg_config, &state.device)?;
        if config.gradient_accumulation.num_steps == 0 {
            return Err(Error::Config {
                key: "gradient_accumulation_steps".into(),
                reason: "must be at least 1".into(),
            });
        }
        let scaler = (config.precision() == PrecisionType::Fp16)
            .then(|| Arc::new(Mutex::new(GradScaler::new(config.scaler))));
        let comm = group.communicator();
        // Every rank shuffles with one seed (rank 0's clock when unseeded).
        let seed = seeding::shared_seed(config.seed, &*comm)?;
        seeding::seed_device(&state.device, seed);
        if let Some(plugin) = &config.fsdp {
            if state.is_main_process() {
                for warning in plugin.inert_settings(&state.device) {
                    tracing::warn!("{warning}");
                }
            }
        }
        Ok(Self {
            grad_state: GradientState::new(config.gradient_accumulation),
            state,
            comm,
            _group: group,
            scaler,
            seed,
            rng: SplitMix64::new(seed),
            masters: Default::default(),
            models: vec![],
            optimizers: vec![],
            schedulers: vec![],
            loaders: vec![],
            custom: vec![],
            trackers: Trackers::default(),
            watching_signals: false,
            backwards: 0,
            config,
        })
    }

    // === identity ===

    /// The device this process computes on.
    pub fn device(&self) -> &Device {
        &self.state.device
    }

    /// Rank, world size and device of this process.
    pub fn state(&self) -> &ProcessState {
        &self.state
    }

    /// Global rank of this process.
    pub fn process_index(&self) -> usize {
        self.state.rank
    }

    /// Number of processes in the job.
    pub fn num_processes(&self) -> usize {
        self.state.world_size
    }

    /// True on global rank 0.
    pub fn is_main_process(&self) -> bool {
        self.state.is_main_process()
    }

    /// True on local rank 0.
    pub fn is_local_main_process(&self) -> bool {
        self.state.is_local_main_process()
    }

    /// The kind of run.
    pub fn distributed_type(&self) -> DistributedType {
        self.state.distributed_type
    }

    /// The configuration this Accelerator runs with (after the launcher's
    /// environment was applied).
    pub fn config(&self) -> &AcceleratorConfig {
        &self.config
    }

    /// The precision mode.
    pub fn mixed_precision(&self) -> PrecisionType {
        self.config.precision()
    }

    /// The dtype models compute in (bf16/f16 under mixed precision, else f32).
    pub fn compute_dtype(&self) -> DType {
        self.config.precision().compute_dtype()
    }

    /// Prints on the main process only.
    pub fn print(&self, msg: impl std::fmt::Display) {
        if self.is_main_process() {
            println!("{msg}");
        }
    }

    /// Waits for every process to reach this point (a no-op in a single process).
    pub fn wait_for_everyone(&self) -> Result<()> {
        Ok(self.comm().barrier()?)
    }

    /// The communicator of the process group (a local one in a single process).
    pub fn communicator(&self) -> Arc<dyn Communicator> {
        self.comm.clone()
    }

    fn comm(&self) -> &dyn Communicator {
        &*self.comm
    }

    // === preparing ===

    /// A `VarBuilder` that creates parameters into `varmap` in the compute
    /// dtype, initialised from the seed and each parameter's name.
    pub fn var_builder(&self, varmap: &VarMap) -> VarBuilder<'static> {
        self.var_builder_from(varmap, None, None)
    }

    /// [`Accelerator::var_builder`], with the starting values read from
    /// `from` when given.
    pub(crate) fn var_builder_from(
        &self,
        varmap: &VarMap,
        from: Option<Arc<crate::init::Pretrained>>,
        frozen: Option<crate::init::FrozenFn>,
    ) -> VarBuilder<'static> {
        let backend = SeededBackend {
            seed: self.seed,
            keep: Keep::Full(FullVars {
                varmap: varmap.clone(),
                masters: self.masters.clone(),
            }),
            from,
            frozen,
        };
        VarBuilder::from_backend(
            Box::new(backend),
            self.compute_dtype(),
            self.device().clone(),
        )
    }

    /// Prepares the parameters in `varmap` for training: fp32 master copies
    /// for parameters held in a lower precision, and gradient buffers.
    ///
    /// # Errors
    /// [`Error::Config`] under an FSDP plugin at more than one rank (see
    /// [`Accelerator::prepare_fsdp_model`]); candle or collective errors.
    pub fn prepare_model(&mut self, varmap: &VarMap) -> Result<PreparedModel> {
        self.prepare_model_frozen(varmap, |_| false)
    }

    /// [`Accelerator::prepare_model`], with the parameters whose names
    /// `frozen` selects kept as they are (PyTorch's `requires_grad=False`,
    /// e.g. `|name| name.starts_with("embeddings.")`): their gradients are
    /// dropped, the optimizer and DDP leave them alone, the no-gradient
    /// report does not name them, and checkpoints still save them. candle
    /// has no `requires_grad`, so `backward` still computes their gradients.
    ///
    /// # Errors
    /// As [`Accelerator::prepare_model`].
    pub fn prepare_model_frozen(
        &mut self,
        varmap: &VarMap,
        frozen: impl Fn(&str) -> bool,
    ) -> Result<PreparedModel> {
        self.check_plain_model_allowed()?;
        let data = varmap.data().lock().unwrap_or_else(|e| e.into_inner());
        let mut named: Vec<_> = data.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
        drop(data);
        if named.is_empty() {
            // A model built after this call (lazily, on its first forward)
            // would create variables nothing ever trains, without a word.
            return Err(Error::Config {
                key: "prepare_model".into(),
                reason: "the VarMap holds no parameters: build the model on \
                         acc.var_builder(&varmap) before preparing it, or its weights would \
                         never be trained"
                    .into(),
            });
        }
        named.sort_by(|a, b| a.0.cmp(&b.0));
        if let Some((name, var)) = named
            .iter()
            .find(|(n, v)| !frozen(n) && !v.dtype().is_float())
        {
            return Err(Error::Config {
                key: "trainable parameters".into(),
                reason: format!(
                    "`{name}` is a quantized weight ({:?}), which cannot be trained: train LoRA \
                     adapters on the frozen quantized base instead (prepare_lora; finetune_hf \
                     --lora-r), as transformers refuses to fine-tune a purely quantized model",
                    var.dtype()
                ),
            });
        }
        let mut masters_drawn = self.masters.lock().unwrap_or_else(|e| e.into_inner());
        let (mut names, mut vars, mut masters) = (vec![], vec![], vec![]);
        for (name, var) in named {
            // A frozen parameter never steps: it is its own master, in its dtype.
            let master = match (var.dtype(), masters_drawn.remove(&name)) {
                (DType::F32, _) => var.clone(),
                (_, Some(m)) if !frozen(&name) => m,
                _ if frozen(&name) => var.clone(),
                _ => candle_core::Var::from_tensor(&var.to_dtype(DType::F32)?)?,
            };
            names.push(name);
            vars.push(var);
            masters.push(master);
        }
        drop(masters_drawn);
        // How the model is kept in step: DDP buckets at more than one rank.
        let strategy: Arc<dyn SyncStrategy> = if self.num_processes() > 1 {
            let numels: Vec<usize> = (names.iter().zip(&masters))
                .filter(|(name, _)| !frozen(name))
                .map(|(_, v)| v.elem_count())
                .collect();
            let cap = (self.config.ddp.bucket_cap_mb * 1024.0 * 1024.0) as usize;
            Arc::new(Replicated {
                comm: self.comm.clone(),
                buckets: GradBuckets::new(&numels, cap),
                hook: self.config.ddp.comm_hook,
                find_unused: self.config.ddp.find_unused_parameters,
            })
        } else {
            Arc::new(SingleProcess)
        };
        let model = PreparedModel::new(names, vars, masters, strategy);
        model.freeze_where(&frozen);
        // Weights loaded into the VarMap after `var_builder` drew them win
        // over the drawn fp32 masters.
        model.adopt_outside_writes()?;
        if self.num_processes() > 1 {
            // DDP: every replica starts from rank 0's weights.
            let masters: Vec<Tensor> = model.master_weights().into_iter().map(|(_, t)| t).collect();
            accel_dist::ddp::broadcast_parameters(self.comm(), &masters, 0)?;
            model.refresh_model_weights()?;
        }
        self.models.push(model.clone());
        Ok(model)
    }

    /// Wraps `optimizer` over `model`'s master weights.
    pub fn prepare_optimizer(
        &mut self,
        model: &PreparedModel,
        optimizer: impl Optimizer + 'static,
    ) -> PreparedOptimizer {
        let opt = PreparedOptimizer::new(
            Box::new(optimizer),
            model.clone(),
            self.grad_state.clone(),
            self.scaler.clone(),
        )
        .with_gradient_clipping(self.config.gradient_clipping);
        self.optimizers.push(opt.clone());
        opt
    }

    /// Wraps a learning-rate schedule that drives `optimizer`.
    pub fn prepare_scheduler(
        &mut self,
        scheduler: LrScheduler,
        optimizer: &PreparedOptimizer,
    ) -> PreparedScheduler {
        let procs = if self.config.step_scheduler_with_optimizer {
            self.num_processes()
        } else {
            1
        };
        let s = PreparedScheduler::new(
            scheduler,
            optimizer.clone(),
            self.grad_state.clone(),
            procs,
            self.config.split_batches,
        );
        self.schedulers.push(s.clone());
        s
    }

    /// Prepares a data loader: its last batch ends an accumulation cycle, its
    /// shuffle is seeded, and its position is saved with the state.
    pub fn prepare_data_loader<D: Dataset>(&mut self, mut loader: DataLoader<D>) -> DataLoader<D> {
        let shard = crate::data::ShardConfig {
            num_processes: self.num_processes(),
            process_index: self.process_index(),
            split_batches: self.config.split_batches,
            even_batches: self.config.even_batches,
        };
        let pos = loader.attach(self.grad_state.clone(), self.seed, shard);
        self.loaders.push(pos);
        loader
    }

    /// Saves and restores `object` with the state (`custom_checkpoint_{i}`).
    pub fn register_for_checkpointing<T: Checkpointable + Send + 'static>(
        &mut self,
        object: Arc<Mutex<T>>,
    ) {
        self.custom.push(object);
    }

    // === trackers ===

    /// Starts the trackers named in the configuration and records `config`.
    pub fn init_trackers(&mut self, project_name: &str, config: &serde_json::Value) -> Result<()> {
        if !self.is_main_process() || self.config.log_with.is_empty() {
            return Ok(());
        }
        let names: Vec<&str> = self.config.log_with.iter().map(String::as_str).collect();
        self.trackers =
            Trackers::from_names(&names, project_name, self.config.project.logging_dir())?;
        self.trackers.store_init_configuration(config)
    }

    /// Logs `values` at `step` to every tracker (main process only).
    ///
    /// `values` is any list of `(name, value)` pairs, e.g. `[("loss", 0.5)]`.
    pub fn log<K: Into<String>, V: Into<LogValue>>(
        &mut self,
        values: impl IntoIterator<Item = (K, V)>,
        step: Option<u64>,
    ) -> Result<()> {
        if !self.is_main_process() || self.trackers.is_empty() {
            return Ok(());
        }
        self.trackers.log(values, step)
    }

    /// Flushes and closes the trackers.
    pub fn end_training(&mut self) -> Result<()> {
        self.trackers.finish()
    }
}

fn default_device() -> Result<Device> {
    #[cfg(feature = "cuda")]
    {
        // `accel launch --cpu` sets this, as Accelerate's launcher does.
        let force_cpu = std::env::var("ACCELERATE_USE_CPU").is_ok_and(|v| v == "true" || v == "1");
        if !force_cpu && candle_core::utils::cuda_is_available() {
            let local_rank = crate::state::env_usize("LOCAL_RANK")?.unwrap_or(0);
            return Ok(accel_kernels::cuda_device(local_rank)?);
        }
    }
    Ok(Device::Cpu)
}
