//! The `minilm_dispatch` example's program as a binary of this crate, so the
//! integration tests can run it (`CARGO_BIN_EXE_minilm_worker`) without
//! building the examples; same command line and output.

use accel_examples::minilm::{run, Args};
use clap::Parser;

fn main() -> anyhow::Result<()> {
    run(&Args::parse(), &mut std::io::stdout().lock())
}
