//! The block protocol: one unit type that every model-level feature acts on.
//!
//! A model keeps one struct and one forward. Its parameters live in
//! [`Block`]s (an embedding, each transformer layer, a head), and its forward
//! passes [`Activations`] (hidden states plus masks, rotary tables, positions,
//! a KV cache slot, labels) from block to block. What the model is *run as*
//! is done to its blocks, never written into its forward, as PyTorch's
//! `fully_shard(module)` and Accelerate's hooks act on an unchanged model:
//!
//! | feature | what it does to a block |
//! |---|---|
//! | DDP | nothing: the block's weights are the prepared `Var`s |
//! | FSDP / ZeRO | a hook gathers the weights before the forward, frees them after, regathers and recomputes in backward |
//! | activation checkpointing | a hook runs the forward without keeping activations and recomputes it in backward |
//! | dispatch, CPU/disk offload | [`crate::hooks::AlignDevicesHook`] moves weights and activations per forward |
//! | layerwise casting | [`crate::hooks::LayerwiseCastingHook`] stores in one dtype, computes in another |
//!
//! All of them go through one mechanism: a [`crate::hooks::ModelHook`] on the
//! block, which may replace the block's weights in its
//! [`accel_bigmodel::ModuleWeights`] handle and may wrap its computation.

mod activations;
mod checkpoint;
mod model;
mod module;
mod record;

pub use crate::layers::KvCache;
pub use activations::{Activations, KvCacheSlot};
pub use checkpoint::{apply_activation_checkpointing, CheckpointHook};
pub use model::{Model, Sequential};
pub use module::{AnyBlock, Block, BlockForward, BuildFn, ForwardFn};

#[cfg(test)]
mod tests;
