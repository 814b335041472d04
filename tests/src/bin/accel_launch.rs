//! `accel launch` as a binary of this crate: the `accel` tool's own command
//! line and launch code (`accel_cli`), reachable from the integration
//! tests as `CARGO_BIN_EXE_accel_launch` (a binary of another package has no
//! such variable). Run as `accel_launch launch --num_processes 2 --cpu PROG`.

use accel_cli::{launch, Cli, Command};
use clap::Parser;

fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Launch(args) => Ok(launch(&args)?),
        _ => anyhow::bail!("accel_launch runs only `launch`; use the accel binary for the rest"),
    }
}
