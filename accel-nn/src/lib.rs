//! accel-nn: candle-nn-compatible layers whose every op has a backward, and
//! the one block protocol that FSDP, activation checkpointing, dispatch with
//! CPU/disk offload and layerwise casting act on.
//!
//! * [`ops`]: differentiable ops (norms, softmax, activations, attention,
//!   rotary embeddings, fused linear + cross-entropy). On CPU the hot ones run
//!   as fused kernels with hand-written backward passes; on other devices
//!   they are composed from candle ops, which have a backward everywhere.
//! * [`layers`]: `Linear`, `Embedding`, `LayerNorm`, `RmsNorm`, ... with
//!   candle-nn's constructor signatures and VarBuilder names, so a candle-nn
//!   model moves over by changing its imports.
//! * [`block`]: [`block::Block`], the unit a model is made of and that every
//!   model-level feature acts on, and [`block::Activations`], what flows
//!   between blocks.
//!
//! candle 0.11's own `layer_norm`, `rms_norm` and `softmax_last_dim` are
//! custom ops registered without a backward: a model built on them trains
//! none of the parameters before them, silently. Nothing here has that gap.
#![warn(missing_docs)]
// `unsafe` lives in one audited file, `kernels/raw.rs`, which opts back in.
#![deny(unsafe_code)]

mod error;
pub use error::{Error, Result};

pub mod block;
mod dispatch;
pub mod hooks;
mod kernels;
pub mod layers;
pub mod ops;

pub use block::{Activations, AnyBlock, Block, BlockForward, Model, Sequential};
pub use dispatch::{
    dispatch_model, load_checkpoint_and_dispatch, DeviceMapChoice, DispatchOptions, DispatchReport,
    LoadDispatchOptions,
};

// The unit tests run with weights mapped from checkpoint files, as programs
// that install the allocator do.
#[cfg(test)]
#[global_allocator]
static ALLOC: accel_bigmodel::MappedAlloc = accel_bigmodel::MappedAlloc::system();
