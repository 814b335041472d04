//! The `accel` command-line tool.

use std::process::ExitCode;

use accel_cli::{
    config_command, device_map, env_report, estimate_memory, launch, merge_lora, merge_weights,
    quantize, Cli, Command,
};
use clap::Parser;

fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::DeviceMap(args) => {
            let out = device_map(&args)?;
            println!("{}", serde_json::to_string(&out)?);
        }
        Command::Config(args) => {
            let stdin = std::io::stdin();
            let msg = config_command(&args, &mut stdin.lock(), &mut std::io::stdout())?;
            println!("{msg}");
        }
        Command::Env(args) => print!("{}", env_report(&args)?),
        Command::Launch(args) => launch(&args)?,
        Command::EstimateMemory(args) => println!("{}", estimate_memory(&args)?),
        Command::MergeWeights(args) => {
            for path in merge_weights(&args)? {
                println!("wrote {}", path.display());
            }
        }
        Command::MergeLora(args) => {
            for path in merge_lora(&args)? {
                println!("wrote {}", path.display());
            }
        }
        Command::Quantize(args) => {
            for path in quantize(&args)? {
                println!("wrote {}", path.display());
            }
        }
    }
    Ok(())
}

fn main() -> ExitCode {
    accel_core::init_logging();
    match run(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // Our errors already carry their cause in the message; print it once.
            eprintln!("accel: error: {e}");
            ExitCode::FAILURE
        }
    }
}
