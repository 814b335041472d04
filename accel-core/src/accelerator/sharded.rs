//! `prepare_fsdp_model`: building a model straight into sharded parameters.

use std::path::Path;
use std::sync::{Arc, Mutex};

use candle_core::Device;
use candle_nn::VarBuilder;

use accel_dist::fsdp::ShardingStrategy;
use accel_dist::CommunicatorExt;

use super::Accelerator;
use accel_nn::Model;

use crate::fsdp::{plan_units, shard_blocks, FsdpModel};
use crate::init::{FrozenFn, Keep, Pieces, Pretrained, SeededBackend};
use crate::state::DistributedType;
use crate::{Error, PreparedModel, Result};

impl Accelerator {
    /// Builds a model and prepares it for the way this run trains
    /// (Accelerate's `prepare(model)`): sharded across the ranks when the
    /// configuration (or `accel launch`'s `distributed_type: FSDP`) has an
    /// FSDP plugin, as [`Accelerator::prepare_fsdp_model`] does; else built
    /// on [`Accelerator::var_builder`] and prepared for plain or
    /// data-parallel training, as [`Accelerator::prepare_model`] does. The
    /// model's one forward serves every case.
    ///
    /// Pass the returned parameters to `prepare_optimizer`. To start from
    /// pretrained weights, [`Accelerator::prepare_pretrained`] reads them
    /// in place of the random draw.
    ///
    /// # Errors
    /// Those of `build` and of the preparation.
    pub fn prepare<M: Model, E: Into<Error>>(
        &mut self,
        build: impl FnOnce(VarBuilder<'static>) -> std::result::Result<M, E>,
    ) -> Result<(M, PreparedModel)> {
        self.prepare_from(None, None, build)
    }

    /// [`Accelerator::prepare`] with every parameter starting from the
    /// tensor of its name in `checkpoint` (a Hugging Face folder, a
    /// `.safetensors` file or an index), in every precision and sharding:
    /// what `prepare` then [`PreparedModel::load_checkpoint`] give, without
    /// first drawing random values (on one thread, about 30 s per billion
    /// parameters) only to overwrite them. Like `from_pretrained`,
    /// checkpoint tensors the model does not use are ignored with a warning.
    ///
    /// # Errors
    /// The checkpoint's (a missing or damaged file, named); a parameter the
    /// checkpoint lacks or holds in another shape (named with the file), as
    /// the error of `build`; those of the preparation.
    pub fn prepare_pretrained<M: Model, E: Into<Error>>(
        &mut self,
        checkpoint: impl AsRef<Path>,
        build: impl FnOnce(VarBuilder<'static>) -> std::result::Result<M, E>,
    ) -> Result<(M, PreparedModel)> {
        let from = Arc::new(Pretrained::open(checkpoint.as_ref())?);
        let (model, params) = self.prepare_from(Some(from.clone()), None, build)?;
        from.warn_unused();
        params.set_source(crate::model::PretrainedSource::of(&from.source));
        Ok((model, params))
    }

    /// `prepare`, starting from `from` when given, with the parameters
    /// `frozen` selects prepared frozen.
    pub(super) fn prepare_from<M: Model, E: Into<Error>>(
        &mut self,
        from: Option<Arc<Pretrained>>,
        frozen: Option<FrozenFn>,
        build: impl FnOnce(VarBuilder<'static>) -> std::result::Result<M, E>,
    ) -> Result<(M, PreparedModel)> {
        let is_frozen = |name: &str| frozen.as_ref().is_some_and(|f| f(name));
        if self.config.fsdp.is_some() {
            let (model, fsdp) = self.prepare_fsdp_model_from(from, build)?;
            fsdp.params().freeze_where(&is_frozen);
            return Ok((model, fsdp.params().clone()));
        }
        let varmap = candle_nn::VarMap::new();
        let vb = self.var_builder_from(&varmap, from, frozen.clone());
        let model = build(vb).map_err(Into::into)?;
        let params = self.prepare_model_frozen(&varmap, is_frozen)?;
        Ok((model, params))
    }

    /// Refuses to train a plain model (`prepare_model`, a `VarMap` with no
    /// blocks to shard) as DDP when the run is configured for FSDP at more
    /// than one rank, which would otherwise replicate the model on every
    /// rank without a word. NO_SHARD is DDP by definition and passes.
    pub(super) fn check_plain_model_allowed(&self) -> Result<()> {
        let sharded = self
            .config
            .fsdp
            .as_ref()
            .is_some_and(|p| p.sharding_strategy != ShardingStrategy::NoShard);
        if self.distributed_type() == DistributedType::Fsdp && sharded {
            return Err(Error::Config {
                key: "distributed_type: FSDP (ACCELERATE_USE_FSDP)".into(),
                reason: format!(
                    "prepare_model would train this model unsharded, as DDP, on each of {} \
                     ranks; build it from blocks with Accelerator::prepare (or \
                     prepare_fsdp_model) instead, or launch without FSDP (distributed_type: \
                     MULTI_CPU / MULTI_GPU)",
                    self.num_processes()
                ),
            });
        }
        Ok(())
    }

    /// Builds a model with its parameters sharded across the ranks (FSDP /
    /// ZeRO, as the `fsdp` plugin of the configuration says; FULL_SHARD
    /// with no auto-wrap when none is set).
    ///
    /// `build` creates the model from a `VarBuilder` as usual; each
    /// parameter is drawn (seeded, the same values as [`Accelerator::var_builder`]
    /// gives) and only this rank's piece is kept, so the full model never
    /// exists in one process. The model `build` returns holds zero-memory
    /// placeholders in its [`Block`](accel_nn::Block)s, each of which gets
    /// the FSDP hook: the model's own forward then runs sharded, each wrapped
    /// block on its gathered parameters (see [`crate::fsdp`]).
    ///
    /// # Errors
    /// Those of `build`; a parameter that is in no block.
    pub fn prepare_fsdp_model<M: Model, E: Into<Error>>(
        &mut self,
        build: impl FnOnce(VarBuilder<'static>) -> std::result::Result<M, E>,
    ) -> Result<(M, FsdpModel)> {
        self.prepare_fsdp_model_from(None, build)
    }

    /// [`Accelerator::prepare_fsdp_model`] with every piece cut from the
    /// tensor of its name in `checkpoint`, as
    /// [`Accelerator::prepare_pretrained`] does for any run: each rank reads
    /// the tensors whole and keeps its piece.
    ///
    /// # Errors
    /// Those of [`Accelerator::prepare_pretrained`] and of
    /// [`Accelerator::prepare_fsdp_model`].
    pub fn prepare_fsdp_pretrained<M: Model, E: Into<Error>>(
        &mut self,
        checkpoint: impl AsRef<Path>,
        build: impl FnOnce(VarBuilder<'static>) -> std::result::Result<M, E>,
    ) -> Result<(M, FsdpModel)> {
        let from = Arc::new(Pretrained::open(checkpoint.as_ref())?);
        let (model, fsdp) = self.prepare_fsdp_model_from(Some(from.clone()), build)?;
        from.warn_unused();
        Ok((model, fsdp))
    }

    /// `prepare_fsdp_model`, the pieces cut from `from`'s tensors when given.
    fn prepare_fsdp_model_from<M: Model, E: Into<Error>>(
        &mut self,
        from: Option<Arc<Pretrained>>,
        build: impl FnOnce(VarBuilder<'static>) -> std::result::Result<M, E>,
    ) -> Result<(M, FsdpModel)> {
        let plugin = self.config.fsdp.clone().unwrap_or_default();
        let (world, rank) = plugin.shard_group(self.num_processes(), self.process_index());
        let master_device = if plugin.cpu_offload {
            Device::Cpu
        } else {
            self.device().clone()
        };
        // sync_module_states: every rank draws its piece with rank 0's seed,
        // so the pieces fit together even when the ranks were seeded apart.
        let mut seed = vec![self.seed];
        if plugin.sync_module_states && self.num_processes() > 1 {
            self.comm().broadcast_object_list(&mut seed, 0)?;
        }
        let drawn = Arc::new(Mutex::new(vec![]));
        let frozen = Arc::new(Mutex::new(vec![]));
        let backend = SeededBackend {
            seed: seed[0],
            keep: Keep::Piece(Pieces {
                world,
                rank,
                master_device: master_device.clone(),
                drawn: drawn.clone(),
                frozen: frozen.clone(),
            }),
            from,
            // Pieces are fp32 masters; frozen ones are only left untrained.
            frozen: None,
        };
        let vb = VarBuilder::from_backend(
            Box::new(backend),
            self.compute_dtype(),
            self.device().clone(),
        );
        let user_model = build(vb).map_err(Into::into)?;
        let pieces = std::mem::take(&mut *drawn.lock().unwrap_or_else(|e| e.into_inner()));
        let frozen = std::mem::take(&mut *frozen.lock().unwrap_or_else(|e| e.into_inner()));
        let sizes: Vec<(String, usize)> = pieces
            .iter()
            .map(|(n, s, _)| (n.clone(), s.elem_count()))
            .chain(frozen.iter().map(|(n, s, ..)| (n.clone(), s.elem_count())))
            .collect();
        let unit_of = plan_units(&user_model, &sizes, &plugin.auto_wrap_policy)?;
        let model = FsdpModel::new(
            (pieces, frozen),
            &unit_of,
            &plugin,
            self.comm.clone(),
            self.compute_dtype(),
            self.device().clone(),
            master_device,
        )?;
        shard_blocks(&user_model, &model)?;
        let params = model.params().clone();
        self.models.push(params);
        Ok((user_model, model))
    }
}
