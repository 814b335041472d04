//! Fully sharded data parallelism (FSDP, ZeRO-1/2/3) for candle models.
//!
//! Every parameter is split between the ranks (per-parameter sharding, see
//! `accel_dist::fsdp::ShardLayout`); a rank keeps only its fp32 piece of
//! each, the optimizer updates only those pieces, so its state is sharded
//! too. A model's [`Block`](accel_nn::Block)s are grouped into units by an
//! [`AutoWrapPolicy`] (a block class such as `GPT2Block`, a name pattern such
//! as `h.*`, or a size); each block gets a hook that runs it on its unit's
//! full parameters, so the model's own forward runs sharded.
//!
//! | strategy | between steps | forward | backward |
//! |---|---|---|---|
//! | `FullShard` (ZeRO-3) | pieces only | gather, run, free | gather again, recompute, reduce-scatter |
//! | `ShardGradOp` (ZeRO-2) | pieces only | gather, run, keep | reuse, recompute, free, reduce-scatter |
//! | `ShardOptimizer` (ZeRO-1) | full params | run on them | reduce-scatter after the backward |
//! | `NoShard` (DDP) | full params | run on them | all-reduce after the backward |
//!
//! The root unit (blocks no policy wrapped, such as embeddings) is gathered
//! once per forward, when its first block runs, and reduced after the
//! backward. Because candle has no backward hooks, a wrapped block enters the
//! graph as a custom op whose backward recomputes it (see `unit_op.rs`):
//! under ZeRO-2/3 activation checkpointing of wrapped units is therefore
//! always on.
//!
//! ```no_run
//! use accel_core::fsdp::{AutoWrapPolicy, FullyShardedDataParallelPlugin, ShardingStrategy};
//! use accel_core::nn::{Block, Sequential};
//! use accel_core::{Accelerator, AcceleratorConfig};
//! use candle_nn::Module;
//!
//! # fn main() -> accel_core::Result<()> {
//! type Layer = Box<dyn Module + Send + Sync>;
//! let plugin = FullyShardedDataParallelPlugin::new(ShardingStrategy::FullShard)
//!     .with_auto_wrap_policy(AutoWrapPolicy::Transformer { patterns: vec!["Linear".into()] });
//! let mut acc = Accelerator::new(AcceleratorConfig::default().with_fsdp(plugin))?;
//! // Building the model draws each parameter and keeps only this rank's piece.
//! let (model, fsdp) = acc.prepare_fsdp_model(|vb| {
//!     let blocks = (0..4)
//!         .map(|i| {
//!             Block::new(&vb, &format!("layers.{i}"), "Linear", |vb| {
//!                 Ok(Box::new(candle_nn::linear(64, 64, vb)?) as Layer)
//!             })
//!         })
//!         .collect::<accel_core::nn::Result<Vec<_>>>()?;
//!     Ok::<_, accel_core::Error>(Sequential::new(blocks))
//! })?;
//! let x = candle_core::Tensor::ones((8, 64), candle_core::DType::F32, acc.device())?;
//! let y = model.forward_hidden(&x)?; // each layer gathered, run, freed
//! acc.backward(&y.sqr()?.mean_all()?)?;
//! # let _ = fsdp;
//! # Ok(()) }
//! ```

mod blocks;
pub(crate) mod frozen;
mod model;
mod plugin;
pub(crate) mod sharding;
pub(crate) mod state_dict;
mod sync;
mod unit_op;

pub(crate) use blocks::{plan_units, shard_blocks};
pub use model::FsdpModel;
pub use plugin::{
    BackwardPrefetch, FullyShardedDataParallelPlugin, MixedPrecisionPolicy, StateDictType,
};
pub use state_dict::merge_sharded_weights;

pub use accel_dist::fsdp::{AutoWrapPolicy, ShardingStrategy};
