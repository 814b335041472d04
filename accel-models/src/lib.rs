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
#![warn(missing_docs)]
#![forbid(unsafe_code)]

mod auto;
mod bert;
pub mod config;
mod decode;
mod error;
mod gpt2;
mod llama;
mod parts;
mod tokenizer;
mod tree;

pub use auto::AutoModel;
pub use bert::{mean_pooling, Bert};
pub use config::{BertConfig, Gpt2Config, LlamaConfig, LlamaFamily, ModelConfig};
pub use error::{Error, Result};
pub use gpt2::Gpt2;
pub use llama::Llama;
pub use tokenizer::Tokenizer;

// The unit tests run with weights mapped from checkpoint files, as programs
// that install the allocator do.
#[cfg(test)]
#[global_allocator]
static ALLOC: accel_bigmodel::MappedAlloc = accel_bigmodel::MappedAlloc::system();
