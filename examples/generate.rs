//! Greedy decoding with a KV cache from a Hugging Face checkpoint, plain or
//! offloaded; the tokens equal transformers' `generate(do_sample=False)`.
//!
//! ```text
//! cargo run --release --example generate -- --model DIR --prompt "..." --max-new-tokens N
//! cargo run --release --example generate -- --model DIR --prompt-ids 1,2,3 --max-new-tokens N \
//!     [--max-memory cpu=300KB,disk=1GB] [--offload-folder DIR] [--device-map FILE]
//! ```
//!
//! Prints one JSON object: `{"tokens": [prompt and new ids], "new_tokens":
//! [...], "text": "..."}` (`text` when the folder has a tokenizer.json).
//! Generation stops at the config's `eos_token_id`, as transformers does,
//! unless `--ignore-eos`.

use std::path::PathBuf;

use accel_core::models::Tokenizer;
use accel_examples::hf::{self, Placing};
use anyhow::{bail, Result};
use clap::Parser;
use serde_json::json;

#[derive(Parser, Debug)]
#[command(about = "Greedy generation from a Hugging Face checkpoint")]
struct Args {
    /// Checkpoint folder (config.json, safetensors, tokenizer.json for --prompt).
    #[arg(long)]
    model: PathBuf,
    /// Prompt text, encoded with the folder's tokenizer.json.
    #[arg(long, conflicts_with = "prompt_ids")]
    prompt: Option<String>,
    /// Prompt token ids, comma-separated.
    #[arg(long)]
    prompt_ids: Option<String>,
    /// Tokens to generate.
    #[arg(long)]
    max_new_tokens: usize,
    /// Budget per device for planning, e.g. `cpu=300KB,disk=1GB`.
    #[arg(long)]
    max_memory: Option<String>,
    /// Folder for offloaded weights the checkpoint cannot serve.
    #[arg(long)]
    offload_folder: Option<PathBuf>,
    /// A device map JSON file.
    #[arg(long)]
    device_map: Option<PathBuf>,
    /// Generate all `--max-new-tokens` even past an end-of-sequence token.
    #[arg(long)]
    ignore_eos: bool,
}

fn main() -> Result<()> {
    let args = Args::parse();
    let placing = Placing {
        max_memory: args.max_memory,
        device_map: args.device_map,
        offload_folder: args.offload_folder,
    };
    let (model, _) = hf::load(&args.model, &placing)?;
    let has_tokenizer = args.model.join("tokenizer.json").is_file();
    let tokenizer = match (&args.prompt, has_tokenizer) {
        (_, true) => Some(Tokenizer::for_model(&args.model, model.vocab_size())?),
        (Some(_), false) => bail!(
            "--prompt needs {}",
            args.model.join("tokenizer.json").display()
        ),
        (None, false) => None,
    };
    let prompt = match (&args.prompt, &args.prompt_ids, &tokenizer) {
        (Some(text), None, Some(tok)) => tok.encode(text, true)?,
        (None, Some(ids), _) => hf::parse_ids(ids)?,
        _ => bail!("give --prompt or --prompt-ids"),
    };
    let eos = if args.ignore_eos {
        Vec::new()
    } else {
        model.eos_token_ids()
    };
    let tokens = model.generate(&prompt, args.max_new_tokens, &eos)?;
    let new_tokens = &tokens[prompt.len()..];
    let mut out = json!({ "tokens": tokens, "new_tokens": new_tokens });
    if let Some(tok) = &tokenizer {
        out["text"] = tok.decode(new_tokens, true)?.into();
    }
    println!("{out}");
    Ok(())
}
