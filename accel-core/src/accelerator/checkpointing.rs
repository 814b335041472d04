//! `save_state` / `load_state` / `save_model`: Accelerate's checkpoint folder
//! layout, every tensor in safetensors and every other value in JSON.
//!
//! ```text
//! checkpoint/
//!   model.safetensors            fp32 master weights (model_{i}.safetensors for i > 0)
//!   optimizer.safetensors/.json  moments / hyper-parameters and step counts
//!   scheduler.json               LambdaLR state
//!   sampler.json                 data loader epoch, position and seed
//!   scaler.json                  fp16 loss scale
//!   random_states_{rank}.json    seed, generator state, accumulation step
//!   custom_checkpoint_{i}.*      objects from register_for_checkpointing
//! ```
//!
//! A checkpoint is written into a temporary sibling folder and renamed into
//! place, so a process killed mid-save never leaves a partial checkpoint.

use std::path::{Path, PathBuf};

use accel_dist::CommunicatorExt;

use super::Accelerator;
use crate::checkpoint::{self, AtomicDir, StateDict};
use crate::fsdp::state_dict as fsdp_state;
use crate::model::{PreparedModel, SavedOptimizer as Saved};
use crate::rng::SplitMix64;
use crate::{Error, Result};

fn stem(base: &str, i: usize) -> String {
    if i == 0 {
        base.to_string()
    } else {
        format!("{base}_{i}")
    }
}

impl Accelerator {
    pub(super) fn checkpoints_dir(&self) -> PathBuf {
        self.config.project.project_dir.join("checkpoints")
    }

    /// Saves everything prepared or registered into `output_dir`, or with
    /// automatic checkpoint naming into `project_dir/checkpoints/checkpoint_{n}`
    /// (deleting the oldest beyond `total_limit`). Returns the folder written.
    ///
    /// Every rank must call it. When any rank fails a step (the main process
    /// cannot create the folder, a rank cannot write its files), every rank
    /// returns an error at that step ([`Error::RankFailed`] naming the rank on
    /// the others) and the previous checkpoints stay as they were.
    pub fn save_state(&mut self, output_dir: Option<&Path>) -> Result<PathBuf> {
        let dir = self.next_checkpoint_dir(output_dir)?;
        if !self
            .grad_state
            .step()
            .is_multiple_of(self.gradient_accumulation_steps() as u64)
        {
            tracing::warn!("save_state in the middle of an accumulation cycle: accumulated gradients are not saved");
        }
        // Only the folder's owner (the main process, or each machine's first
        // with `save_on_each_node`) touches the folder tree; every rank
        // learns the outcome before the first collective below.
        let begun = if self.owns_checkpoint_folder() {
            self.begin_checkpoint(&dir).map(Some)
        } else {
            Ok(None)
        };
        let tmp = self.agree("save_state", begun)?;
        let mine = tmp
            .as_ref()
            .map(|t| t.path().display().to_string())
            .unwrap_or_default();
        let tmp_path = match self.num_processes() {
            1 => vec![mine],
            _ => {
                // Each rank writes into its owner's folder: the main
                // process's, or the first process's of its own machine (ranks
                // are numbered machine by machine, as torchrun numbers them).
                let all: Vec<String> = self.comm().gather_object(&mine)?;
                let owner = match self.config.project.save_on_each_node {
                    true => self.process_index() - self.state.local_rank,
                    false => 0,
                };
                vec![all[owner].clone()]
            }
        };
        // Sharded models gather their full state first (every rank takes
        // part). Then every rank writes its own files (RNG state, sharded
        // pieces) into the main process's temporary folder, and the main
        // process adds the shared state and publishes the folder atomically.
        let states = self.states_to_save();
        let states = self.agree("save_state", states)?;
        let written = self.write_rank_state(Path::new(&tmp_path[0]), &states);
        self.agree("save_state", written)?;
        let published = match tmp {
            Some(t) => self
                .write_state(t.path(), states)
                .and_then(|()| t.commit().map(|_| ())),
            None => Ok(()),
        };
        self.agree("save_state", published)?;
        if self.config.project.automatic_checkpoint_naming {
            self.config.project.iteration += 1;
        }
        Ok(dir)
    }

    /// Whether this process creates and publishes the checkpoint folder.
    fn owns_checkpoint_folder(&self) -> bool {
        match self.config.project.save_on_each_node {
            true => self.is_local_main_process(),
            false => self.is_main_process(),
        }
    }

    /// The folder the next `save_state` writes (no file-system access).
    fn next_checkpoint_dir(&self, output_dir: Option<&Path>) -> Result<PathBuf> {
        let project = &self.config.project;
        if project.automatic_checkpoint_naming {
            return Ok(self
                .checkpoints_dir()
                .join(format!("checkpoint_{}", project.iteration)));
        }
        output_dir.map(Path::to_path_buf).ok_or_else(|| {
            Error::Usage(
                "save_state needs an output folder without automatic checkpoint naming".into(),
            )
        })
    }

    /// The main process's part before any file is written: the checkpoints
    /// folder, stale temporaries, the total limit, and the temporary folder.
    fn begin_checkpoint(&self, dir: &Path) -> Result<AtomicDir> {
        let project = &self.config.project;
        if project.automatic_checkpoint_naming {
            let base = self.checkpoints_dir();
            std::fs::create_dir_all(&base).map_err(|e| Error::io("creating", &base, e))?;
            checkpoint::clean_stale_temps(&base)?;
            if let Some(limit) = project.total_limit {
                checkpoint::enforce_total_limit(&base, limit)?;
            }
            if std::fs::symlink_metadata(dir).is_ok() {
                return Err(Error::Usage(format!(
                    "checkpoint folder {} already exists; automatic naming never overwrites",
                    dir.display()
                )));
            }
        }
        AtomicDir::begin(dir)
    }

    /// Shares every rank's outcome of a step all ranks take together, so
    /// that a failure on one rank stops all of them now rather than leaving
    /// the others waiting at the next collective until its timeout. A rank
    /// that failed returns its own error; the others return
    /// [`Error::RankFailed`] naming the first rank that failed.
    pub(crate) fn agree<T>(&self, op: &'static str, outcome: Result<T>) -> Result<T> {
        if self.num_processes() == 1 {
            return outcome;
        }
        let mine: Option<String> = outcome.as_ref().err().map(ToString::to_string);
        let all: Vec<Option<String>> = self.comm().gather_object(&mine)?;
        let value = outcome?;
        match all.into_iter().enumerate().find_map(|(r, e)| Some((r, e?))) {
            Some((rank, reason)) => Err(Error::RankFailed { op, rank, reason }),
            None => Ok(value),
        }
    }

    fn write_random_state(&self, out: &Path) -> Result<()> {
        let random = serde_json::json!({
            "seed": self.seed,
            "generator": self.rng.state(),
            "step": self.grad_state.step(),
        });
        let name = format!("random_states_{}", self.process_index());
        checkpoint::save_state_dict(out, &name, &StateDict::from_meta(random))?;
        Ok(())
    }

    /// What the models and optimizers save: full states (gathered for
    /// sharded models with FULL_STATE_DICT; a collective) or, for
    /// SHARDED_STATE_DICT, this rank's own.
    fn states_to_save(&self) -> Result<SavedStates> {
        let mut models = Vec::with_capacity(self.models.len());
        for m in &self.models {
            models.push(m.strategy().model_state(m)?);
        }
        let mut optimizers = Vec::with_capacity(self.optimizers.len());
        for o in &self.optimizers {
            let state = o.state_dict()?;
            optimizers.push(o.model().strategy().optimizer_state(state)?);
        }
        Ok(SavedStates { models, optimizers })
    }

    /// Files every rank writes: its RNG state and its sharded pieces.
    fn write_rank_state(&self, out: &Path, states: &SavedStates) -> Result<()> {
        self.write_random_state(out)?;
        for (i, m) in self.models.iter().enumerate() {
            m.strategy().write_rank_files(m, out, i)?;
        }
        for (i, saved) in states.optimizers.iter().enumerate() {
            if let Saved::PerRank(state) = saved {
                let stem = fsdp_state::rank_stem(&stem("optimizer", i), self.process_index());
                checkpoint::save_state_dict(out, &stem, state)?;
            }
        }
        Ok(())
    }

    fn write_state(&self, out: &Path, states: SavedStates) -> Result<()> {
        for (i, state) in states.models.into_iter().enumerate() {
            if let Some(state) = state {
                checkpoint::save_state_dict(out, &stem("model", i), &state)?;
            }
        }
        for (i, saved) in states.optimizers.into_iter().enumerate() {
            if let Saved::Shared(state) = saved {
                checkpoint::save_state_dict(out, &stem("optimizer", i), &state)?;
            }
        }
        for (i, s) in self.schedulers.iter().enumerate() {
            checkpoint::save_state_dict(
                out,
                &stem("scheduler", i),
                &StateDict::from_meta(s.to_json()),
            )?;
        }
        for (i, l) in self.loaders.iter().enumerate() {
            let pos = *l.lock().unwrap_or_else(|e| e.into_inner());
            let meta = serde_json::to_value(pos).expect("loader position serializes");
            checkpoint::save_state_dict(out, &stem("sampler", i), &StateDict::from_meta(meta))?;
        }
        if let Some(s) = &self.scaler {
            let meta = s.lock().unwrap_or_else(|e| e.into_inner()).to_json();
            checkpoint::save_state_dict(out, "scaler", &StateDict::from_meta(meta))?;
        }
        for (i, c) in self.custom.iter().enumerate() {
            let state = c.lock().unwrap_or_else(|e| e.into_inner()).state_dict()?;
            checkpoint::save_state_dict(out, &format!("custom_checkpoint_{i}"), &state)?;
        }
        Ok(())
    }

    /// Restores everything prepared or registered from `input_dir`, or with
    /// automatic naming from the newest `checkpoint_{n}`. Every file is read
    /// and checked before any object changes. Returns the folder read.
    ///
    /// Every rank must call it. When any rank cannot read its files, every
    /// rank returns an error before changing anything ([`Error::RankFailed`]
    /// naming the rank on the others).
    pub fn load_state(&mut self, input_dir: Option<&Path>) -> Result<PathBuf> {
        let read = self
            .checkpoint_to_load(input_dir)
            .and_then(|dir| self.read_state_files(&dir).map(|files| (dir, files)));
        let (dir, files) = self.agree("load_state", read)?;
        let applied = self.apply_state_files(&dir, files);
        self.agree("load_state", applied)?;
        Ok(dir)
    }

    /// The folder `load_state` reads (and the next automatic number).
    fn checkpoint_to_load(&mut self, input_dir: Option<&Path>) -> Result<PathBuf> {
        let dir = match input_dir {
            Some(d) => d.to_path_buf(),
            None if self.config.project.automatic_checkpoint_naming => {
                let base = self.checkpoints_dir();
                let (n, dir) = checkpoint::list_checkpoints(&base)?.pop().ok_or_else(|| {
                    Error::MissingFile {
                        path: base.join("checkpoint_*"),
                        what: "an automatic checkpoint to resume from".into(),
                    }
                })?;
                self.config.project.iteration = n + 1;
                dir
            }
            None => {
                return Err(Error::Usage(
                    "load_state needs an input folder without automatic checkpoint naming".into(),
                ))
            }
        };
        if !dir.is_dir() {
            return Err(Error::MissingFile {
                path: dir,
                what: "checkpoint folder".into(),
            });
        }
        if self.config.project.automatic_checkpoint_naming {
            // Whatever folder was loaded, the next automatic save must not
            // collide with a checkpoint already on disk.
            if let Some((n, _)) = checkpoint::list_checkpoints(self.checkpoints_dir())?.pop() {
                self.config.project.iteration = self.config.project.iteration.max(n + 1);
            }
        }
        Ok(dir)
    }

    /// Reads and checks every file of `dir` this rank restores.
    fn read_state_files(&self, dir: &Path) -> Result<StateFiles> {
        let dev = self.device().clone();
        let load = |s: &str| checkpoint::load_state_dict(dir, s, &dev);
        let rank = self.process_index();
        let optim: Vec<StateDict> = self
            .optimizers
            .iter()
            .enumerate()
            .map(|(i, o)| {
                o.model().strategy().load_optimizer_state(
                    dir,
                    i,
                    &stem("optimizer", i),
                    rank,
                    &load,
                )
            })
            .collect::<Result<_>>()?;
        let sched: Vec<StateDict> = (0..self.schedulers.len())
            .map(|i| load(&stem("scheduler", i)))
            .collect::<Result<_>>()?;
        let loaders: Vec<StateDict> = (0..self.loaders.len())
            .map(|i| load(&stem("sampler", i)))
            .collect::<Result<_>>()?;
        let scaler = self.scaler.as_ref().map(|_| load("scaler")).transpose()?;
        // A run resumed on more ranks than saved it has no RNG state of its
        // own: it starts from the main process's (Accelerate logs and goes on).
        let own_random = format!("random_states_{}", self.process_index());
        let random_stem = if rank > 0 && !dir.join(format!("{own_random}.json")).is_file() {
            tracing::warn!(
                "{} has no {own_random}.json; using random_states_0",
                dir.display()
            );
            "random_states_0".to_string()
        } else {
            own_random
        };
        let random = load(&random_stem)?;
        let custom: Vec<StateDict> = (0..self.custom.len())
            .map(|i| load(&format!("custom_checkpoint_{i}")))
            .collect::<Result<_>>()?;
        Ok(StateFiles {
            optim,
            sched,
            loaders,
            scaler,
            random_stem,
            random,
            custom,
        })
    }

    /// Applies files read by [`Accelerator::read_state_files`].
    fn apply_state_files(&mut self, dir: &Path, files: StateFiles) -> Result<()> {
        let StateFiles {
            optim,
            sched,
            loaders,
            scaler,
            random_stem,
            random,
            custom,
        } = files;
        // Models are validated as a whole by restore_vars before any weight changes.
        for (i, m) in self.models.iter().enumerate() {
            let path = dir.join(format!("{}.safetensors", stem("model", i)));
            m.strategy().restore(m, dir, i, &path)?;
        }
        for (o, s) in self.optimizers.iter().zip(optim) {
            o.load_state_dict(s)
                .map_err(|e| in_file(dir, "optimizer", e))?;
        }
        for (s, st) in self.schedulers.iter().zip(sched) {
            s.load_json(&st.meta)
                .map_err(|e| in_file(dir, "scheduler", e))?;
        }
        for (l, st) in self.loaders.iter().zip(loaders) {
            let pos = serde_json::from_value(st.meta).map_err(|e| Error::Json {
                path: dir.join("sampler.json"),
                reason: e.to_string(),
            })?;
            *l.lock().unwrap_or_else(|e| e.into_inner()) = pos;
        }
        if let (Some(s), Some(st)) = (&self.scaler, scaler) {
            s.lock()
                .unwrap_or_else(|e| e.into_inner())
                .load_json(&st.meta)
                .ok_or_else(|| Error::Json {
                    path: dir.join("scaler.json"),
                    reason: "expected scale, growth_factor, backoff_factor, growth_interval, _growth_tracker".into(),
                })?;
        }
        let random_path = dir.join(format!("{random_stem}.json"));
        let field = |k: &str| {
            random
                .meta
                .get(k)
                .and_then(|v| v.as_u64())
                .ok_or_else(|| Error::Json {
                    path: random_path.clone(),
                    reason: format!("missing unsigned integer `{k}`"),
                })
        };
        self.seed = field("seed")?;
        self.rng = SplitMix64::new(field("generator")?);
        self.grad_state.set_step(field("step")?);
        for (c, st) in self.custom.iter().zip(custom) {
            c.lock()
                .unwrap_or_else(|e| e.into_inner())
                .load_state_dict(st)?;
        }
        Ok(())
    }

    /// Saves `model`'s fp32 weights for inference or sharing, as
    /// `model.safetensors`, or sharded `model-0000i-of-0000N.safetensors` plus
    /// `model.safetensors.index.json` when larger than `max_shard_size`
    /// (e.g. `"10GB"`, `"500MiB"`, as Accelerate's `save_model`); in the
    /// compute dtype under [`AcceleratorConfig::save_16bit_model`]
    /// (DeepSpeed's `stage3_gather_16bit_weights_on_model_save`). The main
    /// process writes; every process must call it (a sharded model gathers
    /// its full weights first).
    ///
    /// [`AcceleratorConfig::save_16bit_model`]: crate::AcceleratorConfig::save_16bit_model
    pub fn save_model(
        &self,
        model: &PreparedModel,
        dir: impl AsRef<Path>,
        max_shard_size: &str,
    ) -> Result<Vec<PathBuf>> {
        let limit = checkpoint::parse_size(max_shard_size)?;
        let mut tensors: std::collections::BTreeMap<String, candle_core::Tensor> =
            model.full_weights()?.into_iter().collect();
        if self.config.save_16bit_model {
            for t in tensors.values_mut() {
                *t = t.to_dtype(self.compute_dtype())?;
            }
        }
        let written = if self.is_main_process() {
            checkpoint::save_model(dir.as_ref(), &tensors, limit)
        } else {
            Ok(vec![])
        };
        // The other ranks learn of a failed write now, not at their next collective.
        self.agree("save_model", written)
    }
}

/// Every file `load_state` reads on one rank, checked, before any object changes.
struct StateFiles {
    optim: Vec<StateDict>,
    sched: Vec<StateDict>,
    loaders: Vec<StateDict>,
    scaler: Option<StateDict>,
    random_stem: String,
    random: StateDict,
    custom: Vec<StateDict>,
}

/// What `save_state` writes for the models and optimizers.
struct SavedStates {
    /// Full model states for the main process to write; `None` for a sharded
    /// model each rank writes itself.
    models: Vec<Option<StateDict>>,
    optimizers: Vec<Saved>,
}

/// Adds the checkpoint folder to an error raised while applying a state.
fn in_file(dir: &Path, what: &str, e: Error) -> Error {
    match e {
        Error::Config { reason, .. } => Error::Config {
            key: format!("{}/{what}", dir.display()),
            reason,
        },
        other => other,
    }
}
