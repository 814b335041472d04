//! accel-models: Hugging Face architectures written on accel-nn's block
//! protocol, loaded from checkpoint folders (`config.json`, safetensors in
//! one file or shards with an index, `tokenizer.json`).
//!
//! Each model is one struct of [`accel_nn::Block`]s with transformers'
//! module names and block classes (`LlamaDecoderLayer`, `GPT2Block`,
//! `BertLayer`), so what Python configs name (`no_split_module_classes`,
//! `fsdp_transformer_layer_cls_to_wrap`) finds the same units here, and
//! every model-level feature (FSDP, activation checkpointing, dispatch with
//! CPU/disk offload, layerwise casting) applies unchanged. Their ops come
//! from accel-nn, so they train too.
//!
//! | `model_type` | type | blocks |
//! |---|---|---|
//! | `llama`, `mistral`, `qwen2` | [`Llama`] | `model.embed_tokens`, `model.layers.{i}`, `model.norm`, `lm_head` |
//! | `gpt2` | [`Gpt2`] | `transformer.wte`, `transformer.wpe`, `transformer.h.{i}`, `transformer.ln_f`, `lm_head` |
//! | `bert` | [`Bert`] | `embeddings`, `encoder.layer.{i}`, `pooler` |
//!
//! [`AutoModel`] picks the architecture from `config.json`: [`AutoModel::load`]
//! loads a folder onto a device, [`AutoModel::load_dispatched`] loads it
//! dispatched over GPU, CPU and disk as Accelerate's
//! `load_checkpoint_and_dispatch` does, and [`Tokenizer`] reads the folder's
//! `tokenizer.json`. Errors are [`Error`], naming the file and the tensor.
//!
//! A tiny Llama from this repository's test fixtures, loaded whole, then
//! planned under a CPU budget of 96 KB (Accelerate's "auto" device map), the
//! layers beyond it read from the checkpoint on disk at each forward:
//!
//! ```
//! use accel_bigmodel::{Placement, PlanOptions};
//! use accel_models::AutoModel;
//! use accel_nn::{DeviceMapChoice, LoadDispatchOptions};
//! use candle_core::{DType, Device, Tensor};
//!
//! let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/hf/llama");
//! let model = AutoModel::load(&dir, DType::F32, &Device::Cpu)?;
//! let ids = Tensor::new(&[[1u32, 17, 42]], &Device::Cpu)?;
//! let logits = model.forward(&ids)?;
//! assert_eq!(logits.dims(), [1, 3, model.vocab_size()]);
//!
//! let budget = vec![(Placement::Cpu, "96KB".into()), (Placement::Disk, "1GB".into())];
//! let plan = PlanOptions::new(budget).with_no_split_module_classes([model.layer_class()]);
//! let opts = LoadDispatchOptions::new(DeviceMapChoice::Auto(plan));
//! let (offloaded, _report) = AutoModel::load_dispatched(&dir, &opts)?;
//! let diff = (offloaded.forward(&ids)? - &logits)?.abs()?.max_all()?;
//! assert!(diff.to_scalar::<f32>()? < 1e-5);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
#![warn(missing_docs)]
#![forbid(unsafe_code)]

mod auto;
mod bert;
pub mod config;
mod decode;
mod decoder;
mod error;
mod gemma;
mod gemma_config;
mod gpt2;
pub mod hub;
mod llama;
mod llama_config;
mod parts;
mod pickled;
mod quantized;
mod rope;
mod sampling;
mod tokenizer;
mod tree;

pub use auto::AutoModel;
pub use bert::{mean_pooling, Bert};
pub use config::{BertConfig, Gpt2Config, LlamaConfig, LlamaFamily, ModelConfig, MoeConfig};
pub use error::{Error, Result};
pub use gemma::{Gemma3, Gemma3Config};
pub use gpt2::Gpt2;
pub use llama::Llama;
pub use rope::{RopeScaling, RopeSpec};
pub use sampling::Sampling;
pub use tokenizer::Tokenizer;

// The unit tests run with weights mapped from checkpoint files, as programs
// that install the allocator do.
#[cfg(test)]
#[global_allocator]
static ALLOC: accel_bigmodel::MappedAlloc = accel_bigmodel::MappedAlloc::system();
