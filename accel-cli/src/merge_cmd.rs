//! `accel merge-weights`: a sharded FSDP checkpoint into `model.safetensors`.

use std::path::{Path, PathBuf};

use clap::Args;

use accel_core::checkpoint;
use accel_core::fsdp::merge_sharded_weights;
use accel_core::Result;

/// Arguments of `accel merge-weights` (Accelerate's names).
#[derive(Debug, Clone, Args)]
pub struct MergeWeightsArgs {
    /// A `model_fsdp_{i}` folder, or a checkpoint folder holding `model_fsdp_0`.
    pub checkpoint_directory: PathBuf,
    /// Folder to write `model.safetensors` (or its shards and index) into.
    pub output_path: PathBuf,
    /// Largest file before the weights are split into shards with an index.
    #[arg(long, default_value = "10GB")]
    pub max_shard_size: String,
    /// Delete the sharded folder after a successful merge.
    #[arg(long)]
    pub remove_checkpoint_dir: bool,
}

/// Merges the sharded weights and returns the files written.
pub fn merge_weights(args: &MergeWeightsArgs) -> Result<Vec<PathBuf>> {
    let limit = checkpoint::parse_size(&args.max_shard_size)?;
    let tensors = merge_sharded_weights(&args.checkpoint_directory)?;
    std::fs::create_dir_all(&args.output_path)
        .map_err(|e| accel_core::Error::io("creating", &args.output_path, e))?;
    let written = checkpoint::save_model(&args.output_path, &tensors, limit)?;
    if args.remove_checkpoint_dir {
        remove_sharded(&args.checkpoint_directory)?;
    }
    Ok(written)
}

fn remove_sharded(dir: &Path) -> Result<()> {
    let folder = if dir.join("index.json").is_file() {
        dir.to_path_buf()
    } else {
        dir.join("model_fsdp_0")
    };
    std::fs::remove_dir_all(&folder).map_err(|e| accel_core::Error::io("removing", &folder, e))
}

/// Arguments of `accel merge-lora`.
#[derive(Debug, Clone, Args)]
pub struct MergeLoraArgs {
    /// The base model's Hugging Face folder (config.json and safetensors).
    #[arg(long)]
    pub model: PathBuf,
    /// The PEFT LoRA adapter folder (adapter_config.json, adapter_model.safetensors).
    #[arg(long)]
    pub adapter: PathBuf,
    /// Folder to write the merged model into (transformers' from_pretrained loads it).
    #[arg(long)]
    pub out: PathBuf,
    /// Largest file before the weights are split into shards with an index.
    #[arg(long, default_value = "5GB")]
    pub max_shard_size: String,
}

/// Writes the base model with the adapter merged (PEFT's `merge_and_unload`
/// then `save_pretrained`) and returns the files written.
pub fn merge_lora(args: &MergeLoraArgs) -> Result<Vec<PathBuf>> {
    accel_core::model::merge_lora(&args.model, &args.adapter, &args.out, &args.max_shard_size)
}
