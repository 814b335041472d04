//! The main job: train a small character-level GPT on the text embedded in
//! this repository, with a progress bar, a falling loss, trackers and a
//! checkpoint at the end.
//!
//! ```text
//! cargo run --release --example train_gpt
//! cargo run --release --example train_gpt -- --steps 100 --mixed-precision bf16 --out runs/gpt
//! ```

use accel_examples::train_gpt::{main_with, Args};
use clap::Parser;

fn main() -> anyhow::Result<()> {
    accel_core::init_logging();
    main_with(&Args::parse())
}
