//! The `hf_logits` example's program (command line and run), here so the
//! integration tests can run it as a binary of their own crate: logits of a
//! Hugging Face checkpoint for one sequence, plain or dispatched with CPU/disk
//! offload, as one JSON object
//! `{"logits": [[...vocab floats...] per position], "device_map": {...}}`.
//!
//! With `--max-memory` the model is planned by `infer_auto_device_map` over
//! its own module tree with its layer class as no-split, so the printed map
//! equals what Accelerate plans for the transformers model under the same
//! budget. `--device-map FILE` takes a map as Python writes it. BERT prints
//! its last hidden state under `logits`.

use std::io::Write;
use std::path::PathBuf;

use anyhow::{Context, Result};
use candle_core::{Device, Tensor};
use clap::Parser;

use crate::hf::{self, Placing};

/// The command line (fixed: scripts outside the repository call it).
#[derive(Parser, Debug, Clone)]
#[command(about = "Logits of a Hugging Face checkpoint as JSON")]
pub struct Args {
    /// Checkpoint folder (config.json and safetensors), or a Hugging Face
    /// model id (`org/name`) found in the Hugging Face cache or downloaded.
    #[arg(long)]
    pub model: PathBuf,
    /// A model id's revision (branch, tag or commit) when `--model` is a
    /// Hugging Face Hub id rather than a folder.
    #[arg(long)]
    pub revision: Option<String>,
    /// Token ids, comma-separated.
    #[arg(long)]
    pub input_ids: String,
    /// Where the model goes: `--max-memory`, `--device-map`, `--offload-folder`.
    #[command(flatten)]
    pub placing: Placing,
}

/// Loads the model as `args` say and writes the JSON line to `out`.
///
/// # Errors
/// Bad flags (naming the flag), a bad checkpoint or device map (naming the file).
pub fn run(args: &Args, out: &mut impl Write) -> Result<()> {
    // A model id becomes its folder in the Hugging Face cache first.
    let resolved = Args {
        model: accel_core::models::hub::resolve_model(&args.model, args.revision.as_deref())?,
        ..args.clone()
    };
    let args = &resolved;
    let placing = args.placing.clone();
    // The ids first: a typo should not wait for a model load.
    let ids = hf::parse_ids(&args.input_ids).context("--input-ids")?;
    let (model, map) = hf::load(&args.model, &placing)?;
    hf::check_ids(&ids, model.vocab_size(), "--input-ids")?;
    let ids = Tensor::new(ids.as_slice(), &Device::Cpu)?.unsqueeze(0)?;
    let logits: Vec<Vec<f32>> = model.forward(&ids)?.get(0)?.to_vec2()?;
    writeln!(
        out,
        "{{\"logits\": {}, \"device_map\": {}}}",
        serde_json::to_string(&logits)?,
        hf::device_map_json(&map)?
    )?;
    Ok(())
}
