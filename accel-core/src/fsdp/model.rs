//! [`FsdpModel`]: the handle a model's forward uses to reach its sharded
//! parameters, one unit at a time.

use std::collections::HashMap;
use std::sync::Arc;

use accel_nn::block::{Activations, ForwardFn};
use accel_nn::hooks::ModuleWeights;
use candle_core::{DType, Device, Shape, Tensor, Var};

use accel_dist::fsdp::{ShardLayout, ShardingStrategy};
use accel_dist::Communicator;

use super::frozen::{FrozenParts, FrozenPiece};
use super::plugin::FullyShardedDataParallelPlugin;
use super::sharding::{lock, Sharding, Unit};
use super::sync::Sharded;
use crate::model::PreparedModel;
use crate::{Error, Result};

/// A model whose parameters are sharded across ranks (FSDP / ZeRO), made by
/// [`crate::Accelerator::prepare_fsdp_model`].
///
/// The model's forward reaches its parameters through this handle: the
/// parameters outside every wrapped unit once per forward, and each wrapped
/// unit's when the unit runs, gathered for the unit's computation and freed
/// after (or kept, depending on the strategy). Pass
/// [`FsdpModel::params`] to `prepare_optimizer`: the optimizer then updates
/// this rank's fp32 pieces only, so its state is sharded too.
///
/// Cheap to clone: clones share the parameters.
#[derive(Clone)]
pub struct FsdpModel {
    params: PreparedModel,
    sharding: Arc<Sharding>,
    unit_index: Arc<HashMap<String, usize>>,
}

impl std::fmt::Debug for FsdpModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FsdpModel")
            .field("sharding", &self.sharding)
            .finish_non_exhaustive()
    }
}

impl FsdpModel {
    /// Shards the drawn `pieces` (name, full shape, this rank's fp32 piece)
    /// into units as `plugin` says.
    /// The parts of quantized weights in `frozen` are sharded by bytes
    /// beside them, into the same units (see `frozen.rs`).
    pub(crate) fn new(
        (mut pieces, mut frozen): (Vec<(String, Shape, Tensor)>, Vec<FrozenPiece>),
        unit_of: &HashMap<String, String>,
        plugin: &FullyShardedDataParallelPlugin,
        comm: Arc<dyn Communicator>,
        compute_dtype: DType,
        device: Device,
        master_device: Device,
    ) -> Result<Self> {
        pieces.sort_by(|a, b| a.0.cmp(&b.0));
        let names: Vec<String> = pieces.iter().map(|p| p.0.clone()).collect();
        let (world, rank) = plugin.shard_group(comm.world_size(), comm.rank());
        frozen.sort_by(|a, b| a.0.cmp(&b.0));
        let frozen_names: Vec<String> = frozen.iter().map(|p| p.0.clone()).collect();
        let mut grouped = group_by_unit(&names, unit_of);
        for (prefix, _) in group_by_unit(&frozen_names, unit_of) {
            if !grouped.iter().any(|(p, _)| *p == prefix) {
                grouped.push((prefix, vec![]));
            }
        }
        // The root unit ("") first, as everywhere.
        grouped.sort_by(|a, b| a.0.cmp(&b.0));
        let mut frozen_units = Vec::with_capacity(grouped.len());
        for (prefix, _) in &grouped {
            let (mine, rest) = std::mem::take(&mut frozen)
                .into_iter()
                .partition(|p| unit_of.get(&p.0).map_or("", String::as_str) == prefix);
            frozen = rest;
            frozen_units.push(FrozenParts::new(mine, world, rank)?);
        }
        let units = grouped
            .into_iter()
            .map(|(prefix, ids)| {
                let params: Vec<(String, Shape)> = ids
                    .iter()
                    .map(|&i| (names[i].clone(), pieces[i].1.clone()))
                    .collect();
                let layout = ShardLayout::new(&params, world, rank)?;
                Ok(Unit {
                    prefix,
                    ids,
                    layout,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let unit_index = units
            .iter()
            .enumerate()
            .map(|(u, unit)| (unit.prefix.clone(), u))
            .collect();
        let (param_dtype, reduce_dtype) = match plugin.mixed_precision_policy {
            Some(p) => (p.param_dtype, p.reduce_dtype),
            None => (compute_dtype, DType::F32),
        };
        let sharding = Arc::new(Sharding::new(
            comm,
            plugin,
            (param_dtype, reduce_dtype),
            (device, master_device),
            (units, frozen_units),
            names.len(),
        ));
        let vars = pieces
            .iter()
            .map(|(_, _, t)| Var::from_tensor(t))
            .collect::<candle_core::Result<Vec<_>>>()?;
        drop(pieces);
        let strategy = Arc::new(Sharded {
            sharding: sharding.clone(),
        });
        let params = PreparedModel::new(names, vars.clone(), vars, strategy);
        params.refresh_model_weights()?;
        Ok(Self {
            params,
            sharding,
            unit_index: Arc::new(unit_index),
        })
    }

    /// The parameters as the optimizer sees them: this rank's fp32 pieces.
    pub fn params(&self) -> &PreparedModel {
        &self.params
    }

    /// The sharding strategy.
    pub fn strategy(&self) -> ShardingStrategy {
        self.sharding.strategy
    }

    /// Bytes of full parameters this rank keeps between steps: the whole
    /// model under `ShardOptimizer`/`NoShard`, nothing under ZeRO-2/3.
    pub fn resident_full_parameter_bytes(&self) -> usize {
        self.sharding.persistent_bytes()
    }

    /// Bytes of the quantized base's packed parts (codes, block maxima) this
    /// rank keeps: its `1 / world` share, gathered per unit as it runs.
    pub fn frozen_quantized_bytes(&self) -> usize {
        self.sharding.frozen_bytes()
    }

    /// Loads pretrained full weights into the shards: `checkpoint` is a
    /// `.safetensors` file, a folder with `model.safetensors` or a sharded
    /// `model.safetensors.index.json`. Tensors stream one at a time; with
    /// `cpu_ram_efficient_loading` (the default) only rank 0 reads the files
    /// and the others receive each tensor from it. Every rank must call it.
    ///
    /// # Errors
    /// A missing tensor or a shape mismatch (named, with the file) on any
    /// reading rank fails every rank, before any weight changes.
    pub fn load_checkpoint(&self, checkpoint: impl AsRef<std::path::Path>) -> Result<()> {
        super::state_dict::load_full_into_pieces(&self.params, &self.sharding, checkpoint.as_ref())
    }

    /// Names of the wrapped units, as the auto-wrap policy formed them
    /// (the root unit, `""`, is not listed).
    pub fn unit_names(&self) -> Vec<String> {
        self.sharding.units[1..]
            .iter()
            .map(|u| u.prefix.clone())
            .collect()
    }

    /// Names of the parameters in unit `prefix` (`""` for the root unit).
    pub fn unit_parameter_names(&self, prefix: &str) -> Result<Vec<String>> {
        let u = *self.unit_index.get(prefix).ok_or_else(|| Error::Config {
            key: format!("fsdp unit `{prefix}`"),
            reason: format!(
                "no such unit; the auto-wrap policy formed {:?}",
                self.unit_names()
            ),
        })?;
        Ok(self.sharding.units[u]
            .layout
            .slots()
            .iter()
            .map(|s| s.name.clone())
            .collect())
    }

    pub(crate) fn sharding(&self) -> &Arc<Sharding> {
        &self.sharding
    }

    /// Runs a block of the root unit (parameters no policy wrapped) on the
    /// root's full parameters for this forward, gathered once per forward;
    /// gradients reach them as usual and are reduced by `Accelerator::backward`.
    pub(crate) fn forward_root(
        &self,
        args: &Activations,
        forward: &Arc<ForwardFn>,
    ) -> accel_nn::Result<Tensor> {
        let tensors = self.tracked_params(0).map_err(wrap)?;
        forward(&self.unit_weights(0, &tensors)?, args)
    }

    /// The unit's index for a wrapped block, `None` for a block of the root unit.
    pub(crate) fn unit_of_block(&self, block: &str) -> Option<usize> {
        self.unit_index.get(block).copied().filter(|&u| u != 0)
    }

    /// The full parameters of unit `u`, untracked: gathered from the pieces,
    /// or the persistent copy when the strategy keeps one.
    pub(crate) fn unit_params(&self, u: usize) -> Result<Vec<Tensor>> {
        if let Some(vars) = self.sharding.persistent(u) {
            return Ok(vars.iter().map(|v| v.as_tensor().detach()).collect());
        }
        let pieces = self.params.pieces(&self.sharding.units[u].ids);
        self.sharding.gather(u, &pieces)
    }

    /// Full parameters of unit `u` as variables of the current graph; their
    /// gradients are collected after the backward
    /// (`Sharding::collect_gradients`).
    pub(super) fn tracked_params(&self, u: usize) -> Result<Vec<Tensor>> {
        // Once per forward: blocks sharing a unit (the root) or a block run
        // twice see the same tensors, so their gradients add up.
        if let Some(live) = lock(&self.sharding.live).get(&u) {
            return Ok(live.clone());
        }
        let tensors: Vec<Tensor> = match self.sharding.persistent(u) {
            Some(vars) => vars.iter().map(|v| v.as_tensor().clone()).collect(),
            None => self
                .unit_params(u)?
                .iter()
                .map(|t| Ok(Var::from_tensor(t)?.as_tensor().clone()))
                .collect::<Result<_>>()?,
        };
        lock(&self.sharding.live).insert(u, tensors.clone());
        Ok(tensors)
    }

    /// A weights handle over `tensors`, the full parameters of unit `u` in
    /// layout order, under their full names.
    pub(crate) fn unit_weights(
        &self,
        u: usize,
        tensors: &[Tensor],
    ) -> accel_nn::Result<ModuleWeights> {
        let unit = &self.sharding.units[u];
        let mut named: Vec<(String, Tensor)> = unit
            .layout
            .slots()
            .iter()
            .zip(tensors)
            .map(|(s, t)| (s.name.clone(), t.clone()))
            .collect();
        named.extend(self.sharding.frozen_full(u).map_err(wrap)?);
        Ok(ModuleWeights::new(unit.prefix.clone(), named)?)
    }

    /// Reduces `full`, the full gradients of unit `u` in layout order, across
    /// ranks and adds this rank's pieces to the accumulators.
    pub(crate) fn deposit_unit_grads(&self, u: usize, full: Vec<Tensor>) -> Result<()> {
        self.sharding.deposit(&self.params, u, full)
    }

    /// Records which parameters of unit `u` (in layout order) a backward reached.
    pub(crate) fn mark_unit_reached(&self, u: usize, found: &[bool]) {
        self.sharding.mark_reached(&self.params, u, found)
    }
}

/// Carries an accel-core error through candle ops (a unit's backward), typed.
pub(super) fn wrap(e: Error) -> candle_core::Error {
    candle_core::Error::wrap(e)
}

/// Groups parameter indices by their unit (`unit_of`: parameter name to unit
/// prefix; absent = root): the root unit `""` first, then units by name.
fn group_by_unit(names: &[String], unit_of: &HashMap<String, String>) -> Vec<(String, Vec<usize>)> {
    let mut units: std::collections::BTreeMap<String, Vec<usize>> = Default::default();
    let mut root = vec![];
    for (i, n) in names.iter().enumerate() {
        match unit_of.get(n) {
            Some(prefix) => units.entry(prefix.clone()).or_default().push(i),
            None => root.push(i),
        }
    }
    std::iter::once((String::new(), root))
        .chain(units)
        .collect()
}
