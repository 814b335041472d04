//! The `finetune_hf` example's program as a binary of this crate, so the
//! integration tests can launch it (`CARGO_BIN_EXE_finetune_hf_worker`)
//! without building the examples.

use accel_examples::finetune_hf::{run, Args};
use clap::Parser;

fn main() -> anyhow::Result<()> {
    run(&Args::parse(), &mut std::io::stdout().lock())
}
