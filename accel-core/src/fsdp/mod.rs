//! Fully sharded data parallelism (FSDP, ZeRO-1/2/3) for candle models.
//!
//! Every parameter is split between the ranks (per-parameter sharding, see
//! `accel_dist::fsdp::ShardLayout`); a rank keeps only its fp32 piece of
//! each, the optimizer updates only those pieces, so its state is sharded
//! too. Parameters are grouped into units by an [`AutoWrapPolicy`]; a
//! model's forward asks [`FsdpModel`] for a unit's full parameters right
//! when the unit runs.
//!
//! | strategy | between steps | forward | backward |
//! |---|---|---|---|
//! | `FullShard` (ZeRO-3) | pieces only | gather, run, free | gather again, recompute, reduce-scatter |
//! | `ShardGradOp` (ZeRO-2) | pieces only | gather, run, keep | reuse, recompute, free, reduce-scatter |
//! | `ShardOptimizer` (ZeRO-1) | full params | run on them | reduce-scatter after the backward |
//! | `NoShard` (DDP) | full params | run on them | all-reduce after the backward |
//!
//! The root unit (parameters no policy wrapped, such as embeddings) is
//! gathered once per forward by [`FsdpModel::root`] and reduced after the
//! backward. Because candle has no backward hooks, a wrapped unit enters
//! the graph as a custom op whose backward recomputes the unit (see
//! `unit_op.rs`): under ZeRO-2/3 activation checkpointing of wrapped units
//! is therefore always on.
//!
//! ```no_run
//! use accel_core::fsdp::{AutoWrapPolicy, FullyShardedDataParallelPlugin, ShardingStrategy};
//! use accel_core::{Accelerator, AcceleratorConfig};
//! use candle_nn::{Linear, Module};
//!
//! # fn main() -> accel_core::Result<()> {
//! let plugin = FullyShardedDataParallelPlugin::new(ShardingStrategy::FullShard)
//!     .with_auto_wrap_policy(AutoWrapPolicy::Transformer { patterns: vec!["layers.*".into()] });
//! let mut acc = Accelerator::new(AcceleratorConfig::default().with_fsdp(plugin))?;
//! // Building the model draws each parameter and keeps only this rank's piece.
//! let ((), model) = acc.prepare_fsdp_model(|vb| {
//!     for i in 0..4 {
//!         candle_nn::linear(64, 64, vb.pp(format!("layers.{i}")))?;
//!     }
//!     Ok::<(), candle_core::Error>(())
//! })?;
//! let x = candle_core::Tensor::ones((8, 64), candle_core::DType::F32, acc.device())?;
//! let mut h = x;
//! for i in 0..4 {
//!     h = model.forward_unit(&format!("layers.{i}"), &h, |vb, x| {
//!         candle_nn::linear(64, 64, vb)?.forward(x)?.relu()
//!     })?;
//! }
//! acc.backward(&h.sqr()?.mean_all()?)?;
//! # Ok(()) }
//! ```

mod init;
mod model;
mod plugin;
pub(crate) mod sharding;
pub(crate) mod state_dict;
mod unit_op;

pub(crate) use init::ShardedInit;
pub use model::FsdpModel;
pub use plugin::{
    BackwardPrefetch, FullyShardedDataParallelPlugin, MixedPrecisionPolicy, StateDictType,
};
pub use state_dict::merge_sharded_weights;
pub use unit_op::UnitFn;

pub use accel_dist::fsdp::{AutoWrapPolicy, ShardingStrategy};
