//! Logits of a Hugging Face checkpoint for one sequence, plain or dispatched
//! with CPU/disk offload, as one JSON object:
//! `{"logits": [[...vocab floats...] per position], "device_map": {...}}`.
//!
//! ```text
//! cargo run --release --example hf_logits -- --model DIR --input-ids 1,17,42 \
//!     [--max-memory cpu=300KB,disk=1GB] [--offload-folder DIR] [--device-map FILE]
//! ```
//!
//! With `--max-memory` the model is planned by `infer_auto_device_map` over
//! its own module tree with its layer class as no-split, so the printed map
//! equals what Accelerate plans for the transformers model under the same
//! budget. `--device-map FILE` takes a map as Python writes it. BERT prints
//! its last hidden state under `logits`.

use std::path::PathBuf;

use accel_examples::hf::{self, Placing};
use anyhow::Result;
use candle_core::{Device, Tensor};
use clap::Parser;

#[derive(Parser, Debug)]
#[command(about = "Logits of a Hugging Face checkpoint as JSON")]
struct Args {
    /// Checkpoint folder (config.json and safetensors).
    #[arg(long)]
    model: PathBuf,
    /// Token ids, comma-separated.
    #[arg(long)]
    input_ids: String,
    /// Budget per device for planning, e.g. `cpu=300KB,disk=1GB`.
    #[arg(long)]
    max_memory: Option<String>,
    /// Folder for offloaded weights the checkpoint cannot serve.
    #[arg(long)]
    offload_folder: Option<PathBuf>,
    /// A device map JSON file (`{"model.embed_tokens": "cpu", ...}`).
    #[arg(long)]
    device_map: Option<PathBuf>,
}

fn main() -> Result<()> {
    let args = Args::parse();
    let placing = Placing {
        max_memory: args.max_memory,
        device_map: args.device_map,
        offload_folder: args.offload_folder,
    };
    let (model, map) = hf::load(&args.model, &placing)?;
    let ids = hf::parse_ids(&args.input_ids)?;
    let ids = Tensor::new(ids.as_slice(), &Device::Cpu)?.unsqueeze(0)?;
    let logits: Vec<Vec<f32>> = model.forward(&ids)?.get(0)?.to_vec2()?;
    println!(
        "{{\"logits\": {}, \"device_map\": {}}}",
        serde_json::to_string(&logits)?,
        hf::device_map_json(&map)?
    );
    Ok(())
}
