//! `prepare_fsdp_model`: building a model straight into sharded parameters.

use std::sync::{Arc, Mutex};

use candle_core::Device;
use candle_nn::VarBuilder;

use accel_dist::fsdp::ShardingStrategy;
use accel_dist::CommunicatorExt;

use super::Accelerator;
use crate::fsdp::{FsdpModel, ShardedInit};
use crate::state::DistributedType;
use crate::{Error, Result};

impl Accelerator {
    /// Refuses to train a plain model (`prepare_model`) as DDP when the run
    /// is configured for FSDP at more than one rank, which would otherwise
    /// replicate the model on every rank without a word. NO_SHARD is DDP by
    /// definition and passes.
    ///
    /// One function on purpose: once plain models can be wrapped in place,
    /// this check becomes the wrapping.
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
                     ranks; build it with Accelerator::prepare_fsdp_model instead, or launch \
                     without FSDP (distributed_type: MULTI_CPU / MULTI_GPU)",
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
    /// placeholders: its forward must read parameters through the returned
    /// [`FsdpModel`] (see [`crate::fsdp`]).
    pub fn prepare_fsdp_model<M, E: Into<Error>>(
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
        // sync_module_states: every rank draws its piece with rank 0's seed,
        // so the pieces fit together even when the ranks were seeded apart.
        let mut seed = vec![self.seed];
        if plugin.sync_module_states && self.num_processes() > 1 {
            self.comm().broadcast_object_list(&mut seed, 0)?;
        }
        let drawn = Arc::new(Mutex::new(vec![]));
        let backend = ShardedInit {
            seed: seed[0],
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
        let model = FsdpModel::new(
            pieces,
            &plugin,
            self.comm.clone(),
            self.compute_dtype(),
            self.device().clone(),
            master_device,
        )?;
        let params = model.params().clone();
        self.buckets.push(None);
        self.models.push(params);
        self.fsdp_models.push(model.clone());
        Ok((user_model, model))
    }
}
