//! The `accel` command line: argument structs (one per subcommand, 1:1 with
//! the flags) and the pure functions each subcommand runs.
//!
//! A crate apart from accel-core (as ripgrep keeps its binary apart from its
//! library crates), so a training program that depends on the library does
//! not compile clap, anyhow or a YAML parser.
//!
//! [`Cli`] is the whole command line and [`Command`] its subcommands, each
//! with its flags struct ([`LaunchArgs`], [`ConfigArgs`], [`EnvArgs`],
//! [`EstimateArgs`], [`DeviceMapArgs`], [`MergeWeightsArgs`], [`MergeLoraArgs`],
//! [`QuantizeArgs`]) and the
//! function the binary calls with it ([`launch`], [`config_command`],
//! [`env_report`], [`estimate_memory`], [`device_map`], [`merge_weights`],
//! [`merge_lora`], [`quantize`]);
//! [`config_file`] reads and writes Accelerate's `default_config.yaml`. Tests
//! and other programs call these functions directly:
//!
//! ```
//! use accel_cli::{Cli, Command};
//! use clap::Parser;
//!
//! let cli = Cli::try_parse_from([
//!     "accel", "launch", "--num_processes", "2", "--cpu", "train", "--steps", "10",
//! ])?;
//! let Command::Launch(args) = cli.command else { unreachable!() };
//! assert_eq!(args.num_processes, Some(2));
//! assert!(args.cpu);
//! assert_eq!(args.command, ["train", "--steps", "10"]);
//! // `accel_cli::launch(&args)` would now start the two ranks and wait for them.
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
#![warn(missing_docs)]
#![forbid(unsafe_code)]

mod config_cmd;
pub mod config_file;
mod device_map_cmd;
mod env_cmd;
mod estimate_cmd;
mod launch_cmd;
mod launch_rdzv;
mod merge_cmd;
mod quantize_cmd;

pub use config_cmd::{ask_config, config_command, ConfigArgs, ConfigCommand, ConfigDefaultArgs};
pub use device_map_cmd::{device_map, read_model_tree, DeviceMapArgs};
pub use env_cmd::{env_report, EnvArgs};
pub use estimate_cmd::{convert_bytes, estimate_memory, estimate_rows, EstimateArgs, EstimateRow};
pub use launch_cmd::{launch, LaunchArgs};
pub use merge_cmd::{merge_lora, merge_weights, MergeLoraArgs, MergeWeightsArgs};
pub use quantize_cmd::{quantize, QuantFlags, QuantizeArgs};

use clap::{Parser, Subcommand};

/// `accel`: run and plan accel-rs jobs.
#[derive(Debug, Parser)]
#[command(
    name = "accel",
    version,
    about = "Run and plan accel-rs training and inference jobs"
)]
pub struct Cli {
    /// The subcommand.
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Write `default_config.yaml` by answering questions (or `default` for a basic one).
    Config(ConfigArgs),
    /// Plan where each module of a model goes, as Accelerate's `infer_auto_device_map`.
    DeviceMap(DeviceMapArgs),
    /// Print versions, the machine and the active config, for bug reports.
    Env(EnvArgs),
    /// What a checkpoint needs to load and to train, per dtype.
    EstimateMemory(EstimateArgs),
    /// Run a program on several processes with torchrun's environment variables.
    Launch(Box<LaunchArgs>),
    /// Merge a sharded FSDP checkpoint (`SHARDED_STATE_DICT`) into `model.safetensors`.
    MergeWeights(MergeWeightsArgs),
    /// Merge a PEFT LoRA adapter into its base model's weights (PEFT's `merge_and_unload`).
    MergeLora(MergeLoraArgs),
    /// Write a model quantized in 4 or 8 bits as transformers saves one (bitsandbytes' format).
    Quantize(QuantizeArgs),
}
