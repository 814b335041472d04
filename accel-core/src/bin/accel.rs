//! The `accel` command-line tool.

use std::process::ExitCode;

use accel_core::cli::{device_map, estimate_memory, launch, Cli, Command};
use clap::Parser;

fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::DeviceMap(args) => {
            let out = device_map(&args)?;
            println!("{}", serde_json::to_string(&out)?);
        }
        Command::Launch(args) => launch(&args)?,
        Command::EstimateMemory(args) => println!("{}", estimate_memory(&args)?),
    }
    Ok(())
}

fn main() -> ExitCode {
    match run(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // Our errors already carry their cause in the message; print it once.
            eprintln!("accel: error: {e}");
            ExitCode::FAILURE
        }
    }
}
