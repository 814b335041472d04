//! Models and data shared by the accel-rs examples, integration tests and
//! benchmarks.
//!
//! * [`mlp::Mlp`] and [`mnist_like::synthetic_classification`]: the MLP
//!   classifier workload.
//! * [`gpt::Gpt`] with [`text::CORPUS`], [`text::CharTokenizer`] and
//!   [`text::synthetic_tokens`]: the GPT language-model workload.
//! * [`finetune_hf`], [`hf_logits`], [`generate`], [`minilm`]: the programs
//!   of the examples of those names (`minilm_dispatch` for [`minilm`]), here
//!   so the integration tests can run them as binaries of their own crate.
//!
//! Everything is deterministic given a seed and needs no download (but for
//! [`minilm`], which runs the checkpoint `scripts/fetch_minilm.sh` fetches),
//! so that the same batches can be replayed against the PyTorch reference.
#![warn(missing_docs)]

pub mod devices;
pub mod finetune_candle;
pub mod finetune_hf;
pub mod generate;
pub mod gpt;
pub mod hf;
pub mod hf_logits;
pub mod minilm;
pub mod mlp;
pub mod mnist_like;
pub mod stock;

pub mod text;

pub use accel_core::rng::SplitMix64;
pub use devices::device_named;
pub use gpt::{Gpt, GptConfig};
pub use mlp::Mlp;
pub use text::CharTokenizer;
