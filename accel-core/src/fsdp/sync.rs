//! The sharded way of running (ZeRO-1/2/3, FSDP): each rank holds fp32
//! pieces of the parameters, gradients are reduce-scattered into those
//! pieces, and checkpoints gather them or save each rank's own.

use std::path::Path;
use std::sync::Arc;

use accel_dist::ReduceOp;
use candle_core::backprop::GradStore;
use candle_core::{Tensor, Var};

use super::plugin::StateDictType;
use super::sharding::Sharding;
use super::state_dict as fsdp_state;
use crate::checkpoint::StateDict;
use crate::model::{PreparedModel, SavedOptimizer, SyncStrategy};
use crate::Result;

/// The way of running of a sharded model; `sharding` is shared with its
/// [`FsdpModel`](super::FsdpModel).
#[derive(Debug)]
pub(crate) struct Sharded {
    pub sharding: Arc<Sharding>,
}

impl Sharded {
    fn sharded_state_dict(&self) -> bool {
        self.sharding.state_dict_type == StateDictType::ShardedStateDict
    }
}

impl SyncStrategy for Sharded {
    /// Sharded models reduce every micro-batch: their wrapped units already
    /// did during the backward, the rest of their parameters do here.
    fn collect(&self, model: &PreparedModel, store: &GradStore) -> Result<()> {
        self.sharding.collect_gradients(model, store)
    }

    fn combine(&self, local: f64, op: ReduceOp) -> Result<f64> {
        self.sharding.combine(local, op)
    }

    fn refresh(&self, masters: &[Var], _model_vars: &[Var]) -> Result<()> {
        let masters: Vec<Tensor> = masters.iter().map(|v| v.as_tensor().detach()).collect();
        self.sharding.refresh(&masters)
    }

    fn sharded_quantized(&self) -> Option<(Vec<String>, usize)> {
        Some((self.sharding.frozen_names(), self.sharding.frozen_bytes()))
    }

    fn holds_pieces(&self) -> bool {
        true
    }

    fn full_weights(&self, masters: Vec<Tensor>) -> Result<Vec<Tensor>> {
        self.sharding.gather_all_f32(&masters)
    }

    fn full_weights_of(&self, ids: &[usize], masters: Vec<Tensor>) -> Result<Vec<Tensor>> {
        ids.iter()
            .zip(masters)
            .map(|(&id, piece)| self.sharding.gather_full(id, &piece))
            .collect()
    }

    fn load_checkpoint(&self, model: &PreparedModel, path: &Path) -> Result<()> {
        fsdp_state::load_full_into_pieces(model, &self.sharding, path)
    }

    fn model_state(&self, model: &PreparedModel) -> Result<Option<StateDict>> {
        if self.sharded_state_dict() {
            return Ok(None);
        }
        Ok(Some(StateDict::from_tensors(
            model.full_weights()?.into_iter().collect(),
        )))
    }

    fn optimizer_state(&self, state: StateDict) -> Result<SavedOptimizer> {
        Ok(if self.sharded_state_dict() {
            SavedOptimizer::PerRank(state)
        } else {
            SavedOptimizer::Shared(fsdp_state::full_optimizer_state(&self.sharding, state)?)
        })
    }

    fn write_rank_files(&self, model: &PreparedModel, dir: &Path, i: usize) -> Result<()> {
        if self.sharded_state_dict() {
            fsdp_state::write_sharded_model(model, &self.sharding, dir, i)?;
        }
        Ok(())
    }

    fn restore(&self, model: &PreparedModel, dir: &Path, i: usize, full: &Path) -> Result<()> {
        fsdp_state::restore_sharded(model, &self.sharding, dir, i, full)
    }

    fn load_optimizer_state(
        &self,
        dir: &Path,
        i: usize,
        stem: &str,
        rank: usize,
        load: &dyn Fn(&str) -> Result<StateDict>,
    ) -> Result<StateDict> {
        if fsdp_state::check_sharded_world(&self.sharding, dir, i)? {
            load(&fsdp_state::rank_stem(stem, rank))
        } else {
            fsdp_state::optimizer_pieces(&self.sharding, load(stem)?)
        }
    }
}
