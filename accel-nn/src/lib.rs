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
//!
//! * [`hooks`] and [`dispatch_model`] / [`load_checkpoint_and_dispatch`]:
//!   Accelerate's hooks (`AlignDevicesHook`, CPU and disk offload, layerwise
//!   casting) and big-model dispatch, acting on blocks.
//!
//! A model of two residual layers, built as blocks and trained through:
//!
//! ```
//! use accel_nn::layers::{layer_norm, linear, LayerNorm, Linear};
//! use accel_nn::{Activations, Block, BlockForward, Model, Sequential};
//! use candle_core::{DType, Device, Module, Tensor};
//! use candle_nn::{VarBuilder, VarMap};
//!
//! /// A transformer layer in small: pre-norm, a linear map, a residual.
//! struct Layer {
//!     norm: LayerNorm,
//!     fc: Linear,
//! }
//! impl BlockForward for Layer {
//!     fn forward(&self, x: &Activations) -> candle_core::Result<Tensor> {
//!         let h = self.fc.forward(&self.norm.forward(&x.hidden)?)?.gelu()?;
//!         x.hidden.clone() + h
//!     }
//! }
//!
//! let varmap = VarMap::new();
//! let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
//! let blocks = (0..2)
//!     .map(|i| {
//!         Block::new(&vb, &format!("layers.{i}"), "Layer", |vb| {
//!             let norm = layer_norm(16, 1e-5, vb.pp("norm"))?;
//!             Ok(Layer { norm, fc: linear(16, 16, vb.pp("fc"))? })
//!         })
//!     })
//!     .collect::<accel_nn::Result<Vec<_>>>()?;
//! let model = Sequential::new(blocks);
//! assert_eq!(model.blocks().len(), 2); // what FSDP, offload and casting act on
//!
//! let x = Tensor::randn(0f32, 1., (4, 16), &Device::Cpu)?;
//! let loss = model.forward_hidden(&x)?.sqr()?.mean_all()?;
//! let grads = loss.backward()?;
//! // every parameter, the norms' included, has a gradient
//! assert_eq!(varmap.all_vars().len(), 8);
//! assert!(varmap.all_vars().iter().all(|v| grads.get(v).is_some()));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
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
