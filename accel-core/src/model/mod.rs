//! A prepared model: its parameters, their fp32 master copies and the
//! accumulated gradients, shared between the Accelerator and the optimizer,
//! and the `SyncStrategy` that keeps them in step across ranks.
//!
//! How a model is run (one process, replicated with DDP buckets, sharded
//! with ZeRO-1/2/3) is a type held inside the model, as burn keeps its
//! training strategies apart from the loop: the Accelerator and the
//! checkpoint code call the strategy and never ask which one it is. Adding
//! a way of running is one more implementation (`single.rs`, `ddp.rs`, and
//! the sharded one beside its sharding in `fsdp/sync.rs`).

use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};

use accel_dist::ReduceOp;
use candle_core::backprop::GradStore;
use candle_core::{Tensor, Var};

use crate::checkpoint::StateDict;
use crate::Result;

mod adapter;
mod ddp;
mod grads;
mod load;
mod pretrained;
mod quantize;
mod quantize_dispatch;
mod reach;
mod single;

pub use adapter::merge_lora;
pub(crate) use ddp::Replicated;
pub(crate) use pretrained::PretrainedSource;
pub use pretrained::{CARRIED_FILES, TOKENIZER_FILES};
pub use quantize::quantize_pretrained;
pub use quantize_dispatch::load_and_quantize_model;
pub(crate) use single::SingleProcess;

#[derive(Debug)]
pub(crate) struct ModelInner {
    /// Parameter names in sorted order; indices below follow it.
    pub names: Vec<String>,
    /// The variables the model's forward reads, in its compute dtype.
    pub model_vars: Vec<Var>,
    /// fp32 master weights the optimizer updates; the same `Var` as
    /// `model_vars[i]` when that one is already fp32. For a sharded model,
    /// this rank's fp32 pieces (and `model_vars` the same variables).
    pub masters: Vec<Var>,
    /// fp32 gradient accumulators, allocated on the first backward.
    pub grads: Vec<Option<Tensor>>,
    /// Which accumulators hold a gradient since the last `zero_grad`.
    pub has_grad: Vec<bool>,
    /// Set once gradients were divided by the loss scale this step, and
    /// whether that found a non-finite value.
    pub unscaled: Option<bool>,
    /// Parameters kept as they are (PyTorch's `requires_grad=False`): their
    /// gradients are dropped, so the optimizer and DDP never touch them.
    pub frozen: Vec<bool>,
    /// Which parameters a backward has reached since preparation.
    pub reached: Vec<bool>,
    /// Set once the no-gradient report was made for this model.
    pub unused_checked: bool,
    /// The checkpoint the weights were loaded from, for `save_pretrained`.
    pub source: Option<Arc<PretrainedSource>>,
    /// A LoRA model's adapter settings: `save_pretrained` writes the adapter.
    pub adapter: Option<accel_bigmodel::lora::LoraConfig>,
}

/// What a checkpoint keeps of an optimizer's state.
pub(crate) enum SavedOptimizer {
    /// The same on every rank: the main process writes it.
    Shared(StateDict),
    /// This rank's own part of a sharded optimizer state.
    PerRank(StateDict),
}

/// How a prepared model's gradients and weights are kept in step across
/// ranks. The provided methods are what one process does alone.
///
/// Every method that talks to other ranks is called by every rank in the
/// same order (models in preparation order), so collectives line up.
pub(crate) trait SyncStrategy: Send + Sync + std::fmt::Debug {
    /// After a backward, while the graph's gradients (`store`) still live:
    /// gradients the strategy tracks outside the model's variables (a
    /// sharded model's gathered parameters) reach the buffers here.
    fn collect(&self, _model: &PreparedModel, _store: &GradStore) -> Result<()> {
        Ok(())
    }

    /// After a backward, once `store` is dropped: reduce the buffers across
    /// ranks when `reduce_now` (the end of an accumulation cycle, or every
    /// micro-batch with `sync_each_batch`).
    fn reduce(&self, _model: &PreparedModel, _reduce_now: bool) -> Result<()> {
        Ok(())
    }

    /// Combines a value computed from this rank's gradients (a found-inf
    /// flag, a norm's part) with the other ranks' when they hold other
    /// gradients, so every rank decides the same.
    fn combine(&self, local: f64, _op: ReduceOp) -> Result<f64> {
        Ok(local)
    }

    /// After an optimizer step: makes the weights the forward reads equal
    /// the fp32 masters.
    fn refresh(&self, masters: &[Var], model_vars: &[Var]) -> Result<()> {
        let (mut src, mut dst) = (vec![], vec![]);
        for (m, v) in masters.iter().zip(model_vars) {
            if m.dtype() != v.dtype() {
                src.push(m.as_tensor().clone());
                dst.push(v.as_tensor().clone());
            }
        }
        accel_kernels::cast_into(&src, &dst)?;
        Ok(())
    }

    /// True when the masters are this rank's pieces of the parameters.
    fn holds_pieces(&self) -> bool {
        false
    }

    /// The names of a quantized base's packed parts kept sharded apart from
    /// the parameters (FSDP), and the bytes of them this rank holds; `None`
    /// where they are not sharded.
    fn sharded_quantized(&self) -> Option<(Vec<String>, usize)> {
        None
    }

    /// The full fp32 weights from the masters (gathered from every rank's
    /// pieces when sharded; then a collective).
    fn full_weights(&self, masters: Vec<Tensor>) -> Result<Vec<Tensor>> {
        Ok(masters)
    }

    /// [`Self::full_weights`] of the parameters `ids` only, `masters` being
    /// theirs (under FSDP, each gathered alone: an adapter's save must not
    /// gather the whole base).
    fn full_weights_of(&self, _ids: &[usize], masters: Vec<Tensor>) -> Result<Vec<Tensor>> {
        Ok(masters)
    }

    /// [`PreparedModel::load_checkpoint`].
    fn load_checkpoint(&self, model: &PreparedModel, path: &Path) -> Result<()> {
        model.load_whole_checkpoint(path)
    }

    /// The model state a checkpoint's main process writes as
    /// `model{_i}.safetensors`, or `None` when each rank writes its own
    /// (see [`SyncStrategy::write_rank_files`]).
    fn model_state(&self, model: &PreparedModel) -> Result<Option<StateDict>> {
        Ok(Some(StateDict::from_tensors(
            model.full_weights()?.into_iter().collect(),
        )))
    }

    /// What a checkpoint keeps of `state`, the state of an optimizer over this model.
    fn optimizer_state(&self, state: StateDict) -> Result<SavedOptimizer> {
        Ok(SavedOptimizer::Shared(state))
    }

    /// Files of model `i` that every rank writes into the checkpoint `dir`.
    fn write_rank_files(&self, _model: &PreparedModel, _dir: &Path, _i: usize) -> Result<()> {
        Ok(())
    }

    /// Restores model `i` from the checkpoint `dir`, whose shared model file is `full`.
    fn restore(&self, model: &PreparedModel, _dir: &Path, _i: usize, full: &Path) -> Result<()> {
        crate::checkpoint::restore_vars(full, &model.named_masters(), true)?;
        model.refresh_model_weights()
    }

    /// Reads the state of the optimizer over model `i` from the checkpoint
    /// `dir`; `stem` names its shared file, `rank` is this process's and
    /// `load` reads a file by stem.
    fn load_optimizer_state(
        &self,
        _dir: &Path,
        _i: usize,
        stem: &str,
        _rank: usize,
        load: &dyn Fn(&str) -> Result<StateDict>,
    ) -> Result<StateDict> {
        load(stem)
    }
}

/// The parameters of a model prepared by the Accelerator.
///
/// It is a cheap handle: clones share the same parameters and gradients. The
/// model struct itself stays the user's; it keeps reading `model_vars`, which
/// the optimizer refreshes from the master weights after each step.
#[derive(Debug, Clone)]
pub struct PreparedModel {
    inner: Arc<Mutex<ModelInner>>,
    /// Outside the lock: strategies may lock the model themselves.
    strategy: Arc<dyn SyncStrategy>,
}

impl PreparedModel {
    /// A model run as `strategy` says; for a sharded one `masters` (and
    /// `model_vars`) are this rank's pieces.
    pub(crate) fn new(
        names: Vec<String>,
        model_vars: Vec<Var>,
        masters: Vec<Var>,
        strategy: Arc<dyn SyncStrategy>,
    ) -> Self {
        let n = names.len();
        Self {
            inner: Arc::new(Mutex::new(ModelInner {
                names,
                model_vars,
                masters,
                grads: vec![None; n],
                has_grad: vec![false; n],
                unscaled: None,
                frozen: vec![false; n],
                reached: vec![false; n],
                unused_checked: false,
                source: None,
                adapter: None,
            })),
            strategy,
        }
    }

    /// How this model is kept in step across ranks.
    pub(crate) fn strategy(&self) -> &Arc<dyn SyncStrategy> {
        &self.strategy
    }

    /// True for the parameters of an FSDP model (each rank holds pieces).
    pub fn is_sharded(&self) -> bool {
        self.strategy.holds_pieces()
    }

    /// Under FSDP, the bytes of the quantized base's packed parts (codes,
    /// block maxima, states) this rank keeps: its share, `1 / world` of
    /// them. `None` where the model is not sharded.
    pub fn sharded_quantized_bytes(&self) -> Option<usize> {
        self.strategy.sharded_quantized().map(|(_, b)| b)
    }

    /// Under FSDP, the names of the quantized base's packed parts, which are
    /// no parameters (they never train) and so are not in [`Self::names`].
    pub fn sharded_quantized_names(&self) -> Vec<String> {
        self.strategy
            .sharded_quantized()
            .map_or_else(Vec::new, |(n, _)| n)
    }

    /// The master tensors of parameters `ids`, detached: what is computed
    /// from them (gathered parameters) must not lead a backward back to the
    /// masters, whose gradients arrive reduced instead.
    pub(crate) fn pieces(&self, ids: &[usize]) -> Vec<Tensor> {
        let g = self.lock();
        ids.iter()
            .map(|&i| g.masters[i].as_tensor().detach())
            .collect()
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, ModelInner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Parameter names, sorted.
    pub fn names(&self) -> Vec<String> {
        self.lock().names.clone()
    }

    /// Number of parameter tensors.
    pub fn len(&self) -> usize {
        self.lock().names.len()
    }

    /// True when the model has no parameters.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Total number of scalar parameters.
    pub fn num_parameters(&self) -> usize {
        self.lock().masters.iter().map(|v| v.elem_count()).sum()
    }

    /// The fp32 master weights, by name.
    pub fn master_weights(&self) -> Vec<(String, Tensor)> {
        let g = self.lock();
        g.names
            .iter()
            .cloned()
            .zip(g.masters.iter().map(|v| v.as_tensor().clone()))
            .collect()
    }

    /// The full fp32 weights, by name: the master weights, or for a sharded
    /// model the pieces of every rank gathered (every rank must call it then).
    pub fn full_weights(&self) -> Result<Vec<(String, Tensor)>> {
        let (names, masters) = {
            let g = self.lock();
            let masters: Vec<Tensor> = g.masters.iter().map(|v| v.as_tensor().detach()).collect();
            (g.names.clone(), masters)
        };
        let full = self.strategy.full_weights(masters)?;
        Ok(names.into_iter().zip(full).collect())
    }

    /// [`Self::full_weights`] of the parameters whose names `keep` accepts,
    /// gathering only those. Every process must call it with the same `keep`.
    pub(crate) fn full_weights_where(
        &self,
        keep: impl Fn(&str) -> bool,
    ) -> Result<Vec<(String, Tensor)>> {
        let (ids, names, masters) = {
            let g = self.lock();
            let ids: Vec<usize> = (0..g.names.len()).filter(|&i| keep(&g.names[i])).collect();
            let names: Vec<String> = ids.iter().map(|&i| g.names[i].clone()).collect();
            let masters = ids
                .iter()
                .map(|&i| g.masters[i].as_tensor().detach())
                .collect();
            (ids, names, masters)
        };
        let full = self.strategy.full_weights_of(&ids, masters)?;
        Ok(names.into_iter().zip(full).collect())
    }

    /// The accumulated fp32 gradient of each parameter that has one.
    pub fn gradients(&self) -> Vec<(String, Tensor)> {
        let g = self.lock();
        (0..g.names.len())
            .filter(|&i| g.has_grad[i])
            .filter_map(|i| Some((g.names[i].clone(), g.grads[i].clone()?)))
            .collect()
    }

    /// Copies the master weights into the compute-dtype variables the model reads.
    pub(crate) fn refresh_model_weights(&self) -> Result<()> {
        let g = self.lock();
        self.strategy.refresh(&g.masters, &g.model_vars)
    }

    /// The master variables with their names, for loading.
    pub(crate) fn named_masters(&self) -> Vec<(String, Var)> {
        let g = self.lock();
        g.names
            .iter()
            .cloned()
            .zip(g.masters.iter().cloned())
            .collect()
    }
}
