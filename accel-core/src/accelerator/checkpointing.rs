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

use super::Accelerator;
use crate::checkpoint::{self, AtomicDir, StateDict};
use crate::model::PreparedModel;
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
    fn checkpoints_dir(&self) -> PathBuf {
        self.config.project.project_dir.join("checkpoints")
    }

    /// Saves everything prepared or registered into `output_dir`, or with
    /// automatic checkpoint naming into `project_dir/checkpoints/checkpoint_{n}`
    /// (deleting the oldest beyond `total_limit`). Returns the folder written.
    pub fn save_state(&mut self, output_dir: Option<&Path>) -> Result<PathBuf> {
        let project = &self.config.project;
        let dir = if project.automatic_checkpoint_naming {
            let base = self.checkpoints_dir();
            let dir = base.join(format!("checkpoint_{}", project.iteration));
            // Only the main process touches the folder tree; the others learn
            // the outcome at the barrier below.
            if self.is_main_process() {
                std::fs::create_dir_all(&base).map_err(|e| Error::io("creating", &base, e))?;
                checkpoint::clean_stale_temps(&base)?;
                if let Some(limit) = project.total_limit {
                    checkpoint::enforce_total_limit(&base, limit)?;
                }
                if dir.exists() {
                    return Err(Error::Usage(format!(
                        "checkpoint folder {} already exists; automatic naming never overwrites",
                        dir.display()
                    )));
                }
            }
            dir
        } else {
            output_dir
                .ok_or_else(|| {
                    Error::Usage(
                        "save_state needs an output folder without automatic checkpoint naming"
                            .into(),
                    )
                })?
                .to_path_buf()
        };
        if !self
            .grad_state
            .step()
            .is_multiple_of(self.gradient_accumulation_steps() as u64)
        {
            tracing::warn!("save_state in the middle of an accumulation cycle: accumulated gradients are not saved");
        }
        // Model, optimizer and loader states are identical on every rank: the
        // main process writes them (with its own RNG state) and publishes the
        // folder atomically; then every other rank adds its RNG state file.
        if self.is_main_process() {
            let tmp = AtomicDir::begin(&dir)?;
            self.write_state(tmp.path())?;
            tmp.commit()?;
        }
        self.wait_for_everyone()?;
        if !self.is_main_process() {
            self.write_random_state(&dir)?;
        }
        self.wait_for_everyone()?;
        if self.config.project.automatic_checkpoint_naming {
            self.config.project.iteration += 1;
        }
        Ok(dir)
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

    fn write_state(&self, out: &Path) -> Result<()> {
        for (i, m) in self.models.iter().enumerate() {
            let tensors = m.master_weights().into_iter().collect();
            checkpoint::save_state_dict(out, &stem("model", i), &StateDict::from_tensors(tensors))?;
        }
        for (i, o) in self.optimizers.iter().enumerate() {
            checkpoint::save_state_dict(out, &stem("optimizer", i), &o.state_dict()?)?;
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
        self.write_random_state(out)?;
        for (i, c) in self.custom.iter().enumerate() {
            let state = c.lock().unwrap_or_else(|e| e.into_inner()).state_dict()?;
            checkpoint::save_state_dict(out, &format!("custom_checkpoint_{i}"), &state)?;
        }
        Ok(())
    }

    /// Restores everything prepared or registered from `input_dir`, or with
    /// automatic naming from the newest `checkpoint_{n}`. Every file is read
    /// and checked before any object changes. Returns the folder read.
    pub fn load_state(&mut self, input_dir: Option<&Path>) -> Result<PathBuf> {
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
        let dev = self.device().clone();
        let load = |s: &str| checkpoint::load_state_dict(&dir, s, &dev);
        let optim: Vec<StateDict> = (0..self.optimizers.len())
            .map(|i| load(&stem("optimizer", i)))
            .collect::<Result<_>>()?;
        let sched: Vec<StateDict> = (0..self.schedulers.len())
            .map(|i| load(&stem("scheduler", i)))
            .collect::<Result<_>>()?;
        let loaders: Vec<StateDict> = (0..self.loaders.len())
            .map(|i| load(&stem("sampler", i)))
            .collect::<Result<_>>()?;
        let scaler = self.scaler.as_ref().map(|_| load("scaler")).transpose()?;
        let random = load(&format!("random_states_{}", self.process_index()))?;
        let custom: Vec<StateDict> = (0..self.custom.len())
            .map(|i| load(&format!("custom_checkpoint_{i}")))
            .collect::<Result<_>>()?;

        // Models are validated as a whole by restore_vars before any weight changes.
        for (i, m) in self.models.iter().enumerate() {
            let path = dir.join(format!("{}.safetensors", stem("model", i)));
            restore_model(m, &path)?;
        }
        for (o, s) in self.optimizers.iter().zip(optim) {
            o.load_state_dict(s)
                .map_err(|e| in_file(&dir, "optimizer", e))?;
        }
        for (s, st) in self.schedulers.iter().zip(sched) {
            s.load_json(&st.meta)
                .map_err(|e| in_file(&dir, "scheduler", e))?;
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
        let random_path = dir.join(format!("random_states_{}.json", self.process_index()));
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
        Ok(dir)
    }

    /// Saves `model`'s fp32 weights for inference or sharing, as
    /// `model.safetensors`, or sharded `model-0000i-of-0000N.safetensors` plus
    /// `model.safetensors.index.json` when larger than `max_shard_size`
    /// (e.g. `"10GB"`, `"500MiB"`, as Accelerate's `save_model`).
    pub fn save_model(
        &self,
        model: &PreparedModel,
        dir: impl AsRef<Path>,
        max_shard_size: &str,
    ) -> Result<Vec<PathBuf>> {
        let limit = checkpoint::parse_size(max_shard_size)?;
        let tensors = model.master_weights().into_iter().collect();
        if !self.is_main_process() {
            return Ok(vec![]);
        }
        checkpoint::save_model(dir.as_ref(), &tensors, limit)
    }
}

fn restore_model(model: &PreparedModel, path: &Path) -> Result<()> {
    checkpoint::restore_vars(path, &model.named_masters(), true)?;
    model.refresh_model_weights()
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
