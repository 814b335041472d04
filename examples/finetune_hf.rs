//! Fine-tune a Hugging Face causal language model folder on a fixed batch of
//! token ids, plain, data-parallel or FSDP-sharded as the launcher says.
//!
//! ```text
//! cargo run --release --example finetune_hf -- --model tests/fixtures/hf/llama \
//!     --data-ids ids.json --steps 5 --lr 1e-3 --json
//! accel launch --num_processes 2 --cpu target/release/examples/finetune_hf --model ... --json
//! accel launch --config_file fsdp.yaml target/release/examples/finetune_hf --model ... --json
//! ```
//!
//! The first output line is the setup (`distributed`, `mixed_precision`,
//! `world_size`, `sharding`), then one `{"step": k, "loss": f}` per step:
//! the whole batch's mean next-token cross-entropy before that step's update.

use accel_examples::finetune_hf::{run, Args};
use clap::Parser;

fn main() -> anyhow::Result<()> {
    accel_core::init_logging();
    run(&Args::parse(), &mut std::io::stdout().lock())
}
