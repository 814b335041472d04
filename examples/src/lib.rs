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
//!
//! The training loop of the README, the main job `train_gpt` condensed
//! (`no_run`: it trains for an epoch and writes a checkpoint under
//! `runs/demo`):
//!
//! ```no_run
//! use accel_core::prelude::{
//!     Accelerator, AcceleratorConfig, AdamW, AdamWConfig, DataLoader, DataLoaderConfig,
//!     PrecisionType, ProjectConfiguration, TensorDataset,
//! };
//! use accel_examples::text::{windows, CharTokenizer, CORPUS};
//! use accel_examples::{Gpt, GptConfig};
//! use candle_core::Tensor;
//!
//! fn main() -> anyhow::Result<()> {
//!     let mut acc = Accelerator::new(
//!         AcceleratorConfig::default()
//!             .with_mixed_precision(PrecisionType::Bf16) // fp32 master weights, bf16 compute
//!             .with_gradient_accumulation_steps(2)
//!             .with_seed(1337)
//!             .with_project(ProjectConfiguration::automatic("runs/demo")),
//!     )?;
//!     let tok = CharTokenizer::new(CORPUS);
//!     let cfg = GptConfig::char_small(tok.vocab_size());
//!     let (x, y, n) = windows(&tok.encode(CORPUS)?, cfg.block_size, cfg.block_size / 2);
//!     let x = Tensor::from_vec(x, (n, cfg.block_size), acc.device())?;
//!     let y = Tensor::from_vec(y, (n, cfg.block_size), acc.device())?;
//!     let data = DataLoader::new(
//!         TensorDataset::new(vec![x, y])?,
//!         DataLoaderConfig::new(16).with_shuffle(true),
//!     );
//!     let loader = acc.prepare_data_loader(data); // each rank reads its own shard
//!
//!     let varmap = candle_nn::VarMap::new();
//!     let model = Gpt::new(cfg, acc.var_builder(&varmap))?; // seeded init in the compute dtype
//!     let params = acc.prepare_model(&varmap)?; // plain or DDP, as the launcher says
//!     let mut opt = acc.prepare_optimizer(&params, AdamW::new(AdamWConfig::default()));
//!     for batch in loader.iter() {
//!         let batch = batch?;
//!         acc.accumulate(|acc| {
//!             acc.backward(&model.loss(&batch[0], &batch[1])?)?;
//!             if acc.sync_gradients() {
//!                 acc.clip_grad_norm(&params, 1.0)?;
//!             }
//!             opt.step()?;
//!             opt.zero_grad();
//!             Ok(())
//!         })?;
//!     }
//!     acc.save_state(None)?; // runs/demo/checkpoints/checkpoint_0
//!     Ok(())
//! }
//! ```
#![warn(missing_docs)]

pub mod bench_gpt2;
pub mod bench_proc;
pub mod devices;
pub mod finetune_candle;
pub mod finetune_data;
pub mod finetune_hf;
pub mod generate;
pub mod gpt;
pub mod hf;
pub mod hf_logits;
pub mod minilm;
pub mod mlp;
pub mod mnist_like;
pub mod raw_loop;
pub mod stock;

pub mod text;
pub mod torch_worker;
pub mod train_gpt;

pub use accel_core::rng::SplitMix64;

/// A program's outcome as a process: a run that saved and stopped on a
/// termination signal ([`accel_core::Error::Stopped`]) exits with
/// SIGTERM's status (143) after its message, as a process the signal ended
/// would, so a scheduler sees the same; anything else is returned.
pub fn exit_if_stopped(outcome: anyhow::Result<()>) -> anyhow::Result<()> {
    match outcome {
        Err(e) if matches!(e.downcast_ref(), Some(accel_core::Error::Stopped { .. })) => {
            eprintln!("{e}");
            std::process::exit(accel_core::dist::signals::TERMINATED_STATUS)
        }
        other => other,
    }
}
pub use devices::device_named;

/// Says at start-up what `--cuda-graphs` does on `device` (today: the step
/// runs eagerly, and why; see `accel_core::cuda_graphs`).
pub fn cuda_graphs_notice(enabled: bool, device: &candle_core::Device) {
    if enabled {
        let why = accel_core::cuda_graphs::eager_reason(device);
        tracing::warn!("--cuda-graphs: {why}");
    }
}
pub use gpt::{Gpt, GptConfig};
pub use mlp::Mlp;
pub use text::CharTokenizer;
