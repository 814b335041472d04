//! The shared state of a sharded model: its units, their layouts, the full
//! parameters currently alive, and the collectives between them and the
//! fp32 pieces the optimizer updates.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};

use accel_dist::fsdp::{ShardLayout, ShardingStrategy};
use accel_dist::{Communicator, ReduceOp};

use super::frozen::FrozenParts;
use super::plugin::{FullyShardedDataParallelPlugin, StateDictType};
use crate::model::PreparedModel;
use crate::{Error, Result};

/// Tensors by full name.
type NamedTensors = Vec<(String, Tensor)>;

/// One separately gathered group of parameters.
#[derive(Debug)]
pub(crate) struct Unit {
    /// Module name (`h.0`); `""` for the root unit.
    pub prefix: String,
    /// Parameter ids (indices into the prepared model), in layout order.
    pub ids: Vec<usize>,
    pub layout: ShardLayout,
}

/// Everything the prepared model, the unit op and the checkpoint code share.
pub(crate) struct Sharding {
    pub comm: Arc<dyn Communicator>,
    pub strategy: ShardingStrategy,
    /// Dtype parameters are gathered and computed in.
    pub param_dtype: DType,
    /// Dtype gradients are reduced in.
    pub reduce_dtype: DType,
    /// Where the computation runs.
    pub device: Device,
    /// Where the fp32 pieces and optimizer state live (the CPU under offload).
    pub master_device: Device,
    /// Recompute wrapped units in backward even when parameters stay full.
    pub checkpoint_units: bool,
    /// How `save_state` writes this model.
    pub state_dict_type: StateDictType,
    /// Only rank 0 reads a full checkpoint; the others receive it.
    pub rank0_loading: bool,
    pub units: Vec<Unit>,
    /// For each parameter id: its unit and slot.
    pub slot_of: Vec<(usize, usize)>,
    /// Full parameters of units that stay gathered between steps (ZeRO-1,
    /// NO_SHARD), as variables the forward reads directly.
    persistent: Mutex<Vec<Option<Vec<Var>>>>,
    /// Tracked full parameters handed to the current forward's graph; their
    /// gradients are collected after the backward.
    pub(crate) live: Mutex<BTreeMap<usize, Vec<Tensor>>>,
    /// `ShardGradOp`: parameters a unit gathered for its forward, kept for its backward.
    pub(crate) kept: Mutex<BTreeMap<usize, Vec<Tensor>>>,
    /// Each unit's quantized parts, sharded by bytes.
    frozen: Vec<FrozenParts>,
    /// Gathered quantized parts kept: every unit's when the strategy keeps
    /// full parameters, else the root's for the current forward.
    frozen_kept: Mutex<Vec<Option<NamedTensors>>>,
}

impl std::fmt::Debug for Sharding {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sharding")
            .field("strategy", &self.strategy)
            .field("units", &self.units)
            .finish_non_exhaustive()
    }
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Sharding {
    /// The sharding of `units` as `plugin` describes, for `num_params` parameters.
    pub fn new(
        comm: Arc<dyn Communicator>,
        plugin: &FullyShardedDataParallelPlugin,
        (param_dtype, reduce_dtype): (DType, DType),
        (device, master_device): (Device, Device),
        (units, frozen): (Vec<Unit>, Vec<FrozenParts>),
        num_params: usize,
    ) -> Self {
        let mut slot_of = vec![(0, 0); num_params];
        for (u, unit) in units.iter().enumerate() {
            for (k, &id) in unit.ids.iter().enumerate() {
                slot_of[id] = (u, k);
            }
        }
        let n = units.len();
        Self {
            comm,
            strategy: plugin.sharding_strategy,
            param_dtype,
            reduce_dtype,
            device,
            master_device,
            checkpoint_units: plugin.activation_checkpointing,
            state_dict_type: plugin.state_dict_type,
            rank0_loading: plugin.cpu_ram_efficient_loading,
            units,
            slot_of,
            persistent: Mutex::new(vec![None; n]),
            live: Mutex::new(BTreeMap::new()),
            kept: Mutex::new(BTreeMap::new()),
            frozen,
            frozen_kept: Mutex::new(vec![None; n]),
        }
    }

    /// The quantized parts of unit `u`, whole, on the compute device: gathered
    /// now (every rank calls this at the same points of the forward and the
    /// recomputing backward), or kept from an earlier gather where the
    /// strategy keeps full parameters or the root already has them this forward.
    pub fn frozen_full(&self, u: usize) -> Result<NamedTensors> {
        let parts = &self.frozen[u];
        if parts.is_empty() {
            return Ok(vec![]);
        }
        let keep = u == 0 || self.strategy.keeps_full_parameters();
        if keep {
            if let Some(t) = &lock(&self.frozen_kept)[u] {
                return Ok(t.clone());
            }
        }
        let full = parts.gather(&*self.comm, &self.device)?;
        if keep {
            lock(&self.frozen_kept)[u] = Some(full.clone());
        }
        Ok(full)
    }

    /// Names of the quantized parts, every unit's.
    pub fn frozen_names(&self) -> Vec<String> {
        self.frozen.iter().flat_map(FrozenParts::names).collect()
    }

    /// Bytes of quantized parts this rank keeps sharded.
    pub fn frozen_bytes(&self) -> usize {
        self.frozen.iter().map(FrozenParts::local_bytes).sum()
    }

    /// Lets go of the root's gathered quantized parts once its forward's
    /// parameters are stale (the full-parameter strategies keep theirs).
    fn release_root_frozen(&self) {
        if !self.strategy.keeps_full_parameters() {
            lock(&self.frozen_kept)[0] = None;
        }
    }

    /// `(world, rank)` of the parameter split: the process group's, or
    /// `(1, 0)` under NO_SHARD, where every rank holds whole parameters.
    pub fn shard_group(&self) -> (usize, usize) {
        let layout = &self.units[0].layout;
        (layout.world(), layout.rank())
    }

    /// True when gradients differ between ranks after reduction (each rank
    /// holds other pieces), so norms and overflow checks need a collective.
    pub fn grads_are_sharded(&self) -> bool {
        self.strategy != ShardingStrategy::NoShard && self.comm.world_size() > 1
    }

    /// True when wrapped unit `u` runs through the recomputing unit op.
    pub fn uses_unit_op(&self, u: usize) -> bool {
        u != 0 && (!self.strategy.keeps_full_parameters() || self.checkpoint_units)
    }

    /// The full parameters of unit `u` gathered from `pieces` (its masters,
    /// in layout order), in the compute dtype on the compute device.
    pub fn gather(&self, u: usize, pieces: &[Tensor]) -> Result<Vec<Tensor>> {
        let unit = &self.units[u];
        Ok(unit
            .layout
            .all_gather(&*self.comm, pieces, self.param_dtype, &self.device)?)
    }

    /// This rank's pieces of the rank-averaged `full` gradients of unit `u`,
    /// in fp32 on the master device.
    pub fn reduce(&self, u: usize, full: &[Tensor]) -> Result<Vec<Tensor>> {
        let layout = &self.units[u].layout;
        let pieces = if self.strategy == ShardingStrategy::NoShard {
            // NO_SHARD layouts have one "rank": a piece is the whole parameter.
            let packed = layout.pack_full(full, self.reduce_dtype)?;
            let packed = if self.comm.world_size() > 1 && packed.elem_count() > 0 {
                self.comm.all_reduce_tensor(&packed, ReduceOp::Mean)?
            } else {
                packed
            };
            layout.unpack_local(&packed)?
        } else {
            layout.reduce_scatter_mean(&*self.comm, full, self.reduce_dtype)?
        };
        pieces
            .into_iter()
            .map(|p| Ok(p.to_dtype(DType::F32)?.to_device(&self.master_device)?))
            .collect()
    }

    /// The persistent full parameters of unit `u` (ZeRO-1 / NO_SHARD).
    pub fn persistent(&self, u: usize) -> Option<Vec<Var>> {
        lock(&self.persistent)[u].clone()
    }

    /// Bytes of the full parameters kept between steps (ZeRO-1 / NO_SHARD).
    pub fn persistent_bytes(&self) -> usize {
        lock(&self.persistent)
            .iter()
            .flatten()
            .flatten()
            .map(|v| v.elem_count() * v.dtype().size_in_bytes())
            .sum()
    }

    /// Gathers every unit that keeps full parameters from `masters` (all
    /// pieces, by id) into its persistent variables; called at preparation
    /// and after every optimizer step.
    pub fn refresh(&self, masters: &[Tensor]) -> Result<()> {
        lock(&self.kept).clear();
        // Parameters handed out before this step are stale now.
        lock(&self.live).clear();
        self.release_root_frozen();
        if !self.strategy.keeps_full_parameters() {
            return Ok(());
        }
        let mut persistent = lock(&self.persistent);
        for (u, unit) in self.units.iter().enumerate() {
            let pieces: Vec<Tensor> = unit.ids.iter().map(|&i| masters[i].clone()).collect();
            let full = self.gather(u, &pieces)?;
            match &persistent[u] {
                Some(vars) => {
                    for (v, t) in vars.iter().zip(&full) {
                        v.set(t)?;
                    }
                }
                None => {
                    persistent[u] = Some(
                        full.iter()
                            .map(Var::from_tensor)
                            .collect::<candle_core::Result<_>>()?,
                    );
                }
            }
        }
        Ok(())
    }

    /// Every full parameter in fp32 (by id) from all ranks' `masters`
    /// pieces: one all-gather per unit; every rank must call it.
    pub fn gather_all_f32(&self, masters: &[Tensor]) -> Result<Vec<Tensor>> {
        let mut full: Vec<Option<Tensor>> = vec![None; masters.len()];
        for unit in &self.units {
            let pieces: Vec<Tensor> = unit.ids.iter().map(|&i| masters[i].clone()).collect();
            let gathered =
                unit.layout
                    .all_gather(&*self.comm, &pieces, DType::F32, &self.master_device)?;
            for (&id, t) in unit.ids.iter().zip(gathered) {
                full[id] = Some(t);
            }
        }
        Ok(full
            .into_iter()
            .map(|t| t.expect("every parameter is in one unit"))
            .collect())
    }

    /// The full tensor of parameter `id` from this rank's `piece` of it (or of
    /// any per-parameter state shaped like it, such as AdamW's moments);
    /// every rank must call it for the same ids in the same order.
    pub fn gather_full(&self, id: usize, piece: &Tensor) -> Result<Tensor> {
        let (u, k) = self.slot_of[id];
        let layout = &self.units[u].layout;
        let slot = &layout.slots()[k];
        // The unit's layout restricted to this one parameter.
        let single = ShardLayout::new(
            &[(slot.name.clone(), slot.shape.clone())],
            layout.world(),
            layout.rank(),
        )?;
        let mut full = single.all_gather(
            &*self.comm,
            std::slice::from_ref(piece),
            piece.dtype(),
            &Device::Cpu,
        )?;
        Ok(full
            .pop()
            .expect("a one-parameter layout gathers one tensor"))
    }

    /// This rank's piece of the full tensor `full` of parameter `id`.
    pub fn piece_of(&self, id: usize, full: &Tensor, what: &str) -> Result<Tensor> {
        let (u, k) = self.slot_of[id];
        let layout = &self.units[u].layout;
        let slot = &layout.slots()[k];
        if full.elem_count() != slot.numel {
            return Err(Error::Config {
                key: what.to_string(),
                reason: format!(
                    "has shape {:?}, parameter {} has shape {:?}",
                    full.dims(),
                    slot.name,
                    slot.shape.dims()
                ),
            });
        }
        let r = layout.piece_range(k);
        Ok(full.flatten_all()?.narrow(0, r.start, r.len())?.copy()?)
    }

    /// Combines a per-rank partial result across ranks when gradients are
    /// sharded (`Sum` of squares, `Max` of magnitudes or overflow flags).
    pub fn combine(&self, local: f64, op: ReduceOp) -> Result<f64> {
        if !self.grads_are_sharded() {
            return Ok(local);
        }
        let mut v = [local];
        self.comm.all_reduce((&mut v[..]).into(), op)?;
        Ok(v[0])
    }
}

impl Sharding {
    /// Reduces `full`, the full gradients of unit `u` in layout order, across
    /// ranks and adds this rank's pieces to `model`'s accumulators.
    pub(crate) fn deposit(&self, model: &PreparedModel, u: usize, full: Vec<Tensor>) -> Result<()> {
        let pieces = self.reduce(u, &full)?;
        drop(full);
        model.accumulate_pieces(&self.units[u].ids, &pieces)
    }

    /// Reduces the gradients the backward left on the full parameters handed
    /// out for the root (and for unrecomputed units) into `model`'s pieces.
    pub(crate) fn collect_gradients(&self, model: &PreparedModel, store: &GradStore) -> Result<()> {
        let live = std::mem::take(&mut *lock(&self.live));
        for (u, tensors) in live {
            let (grads, found) = grads_of(store, &tensors)?;
            self.mark_reached(model, u, &found);
            self.deposit(model, u, grads)?;
        }
        // Units whose backward never ran (a forward without loss) let go here.
        lock(&self.kept).clear();
        self.release_root_frozen();
        Ok(())
    }
}

impl Sharding {
    /// Records which parameters of unit `u` (in layout order) a backward reached.
    pub(crate) fn mark_reached(&self, model: &PreparedModel, u: usize, found: &[bool]) {
        let ids = &self.units[u].ids;
        model.mark_reached(ids.iter().zip(found).filter(|(_, &f)| f).map(|(&i, _)| i));
    }
}

/// The gradient `store` holds for each of `tensors`, zeros where it has none
/// (a parameter the loss did not reach still takes part in the reduction),
/// and which of them had one.
pub(crate) fn grads_of(
    store: &GradStore,
    tensors: &[Tensor],
) -> candle_core::Result<(Vec<Tensor>, Vec<bool>)> {
    let mut found = Vec::with_capacity(tensors.len());
    let grads = tensors
        .iter()
        .map(|t| match store.get(t) {
            Some(g) => {
                found.push(true);
                Ok(g.clone())
            }
            None => {
                found.push(false);
                t.zeros_like()
            }
        })
        .collect::<candle_core::Result<Vec<_>>>()?;
    Ok((grads, found))
}
