//! Fine-tune candle-transformers' BERT (sequence classification on the
//! MiniLM checkpoint) or Llama (a Hugging Face folder) through the
//! Accelerator; see `accel_examples::finetune_candle`.
//!
//! ```text
//! scripts/fetch_minilm.sh
//! cargo run --release --example finetune_candle -- --model bert --steps 20
//! cargo run --release --example finetune_candle -- --model llama --mixed-precision bf16
//! ```

use accel_examples::finetune_candle::{run, Args};
use clap::Parser;

fn main() -> anyhow::Result<()> {
    accel_core::init_logging();
    run(&Args::parse(), &mut std::io::stdout().lock())?;
    Ok(())
}
