//! `prepare_fsdp_model`: building a model straight into sharded parameters.

use std::sync::{Arc, Mutex};

use candle_core::Device;
use candle_nn::VarBuilder;

use super::Accelerator;
use accel_nn::Model;

use crate::fsdp::{plan_units, shard_blocks, FsdpModel, ShardedInit};
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
    /// Pass the returned parameters to `prepare_optimizer`, and load
    /// pretrained weights with [`PreparedModel::load_checkpoint`].
    ///
    /// # Errors
    /// Those of `build` and of the preparation.
    pub fn prepare<M: Model, E: Into<Error>>(
        &mut self,
        build: impl FnOnce(VarBuilder<'static>) -> std::result::Result<M, E>,
    ) -> Result<(M, PreparedModel)> {
        if self.config.fsdp.is_some() {
            let (model, fsdp) = self.prepare_fsdp_model(build)?;
            return Ok((model, fsdp.params().clone()));
        }
        let varmap = candle_nn::VarMap::new();
        let model = build(self.var_builder(&varmap)).map_err(Into::into)?;
        let params = self.prepare_model(&varmap)?;
        Ok((model, params))
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
        let plugin = self.config.fsdp.clone().unwrap_or_default();
        let (world, rank) = plugin.shard_group(self.num_processes(), self.process_index());
        let master_device = if plugin.cpu_offload {
            Device::Cpu
        } else {
            self.device().clone()
        };
        let drawn = Arc::new(Mutex::new(vec![]));
        let backend = ShardedInit {
            seed: self.seed,
            world,
            rank,
            master_device: master_device.clone(),
            drawn: drawn.clone(),
        };
        let vb = VarBuilder::from_backend(
            Box::new(backend),
            self.compute_dtype(),
            self.device().clone(),
        );
        let user_model = build(vb).map_err(Into::into)?;
        let pieces = std::mem::take(&mut *drawn.lock().unwrap_or_else(|e| e.into_inner()));
        let sizes: Vec<(String, usize)> = pieces
            .iter()
            .map(|(n, s, _)| (n.clone(), s.elem_count()))
            .collect();
        let unit_of = plan_units(&user_model, &sizes, &plugin.auto_wrap_policy)?;
        let model = FsdpModel::new(
            pieces,
            &unit_of,
            &plugin,
            self.comm.clone(),
            self.compute_dtype(),
            self.device().clone(),
            master_device,
        )?;
        shard_blocks(&user_model, &model)?;
        let params = model.params().clone();
        self.buckets.push(None);
        self.models.push(params);
        self.fsdp_models.push(model.clone());
        Ok((user_model, model))
    }
}
