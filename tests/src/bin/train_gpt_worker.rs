//! The `train_gpt` example's program (the main job) as a binary of this
//! crate, so the integration tests can run it (`CARGO_BIN_EXE_train_gpt_worker`)
//! without building the examples; same command line and output.

use accel_examples::train_gpt::{main_with, Args};
use clap::Parser;

fn main() -> anyhow::Result<()> {
    main_with(&Args::parse())
}
