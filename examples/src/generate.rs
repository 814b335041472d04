//! The `generate` example's program (command line and run), here so the
//! integration tests can run it as a binary of their own crate: greedy
//! decoding with a KV cache from a Hugging Face checkpoint, plain or
//! offloaded; the tokens equal transformers' `generate(do_sample=False)`.
//!
//! Writes one JSON object: `{"tokens": [prompt and new ids], "new_tokens":
//! [...], "text": "..."}` (`text` when the folder has a tokenizer.json).
//! Generation stops at the config's `eos_token_id`, as transformers does,
//! unless `--ignore-eos`.

use std::io::Write;
use std::path::PathBuf;

use accel_core::models::Tokenizer;
use anyhow::{bail, Context, Result};
use clap::Parser;
use serde_json::json;

use crate::hf::{self, Placing};

/// The command line (fixed: scripts outside the repository call it).
#[derive(Parser, Debug)]
#[command(about = "Greedy generation from a Hugging Face checkpoint")]
pub struct Args {
    /// Checkpoint folder (config.json, safetensors, tokenizer.json for --prompt).
    #[arg(long)]
    pub model: PathBuf,
    /// Prompt text, encoded with the folder's tokenizer.json.
    #[arg(long, conflicts_with = "prompt_ids")]
    pub prompt: Option<String>,
    /// Prompt token ids, comma-separated.
    #[arg(long)]
    pub prompt_ids: Option<String>,
    /// Tokens to generate.
    #[arg(long)]
    pub max_new_tokens: usize,
    /// Where the model goes: `--max-memory`, `--device-map`, `--offload-folder`.
    #[command(flatten)]
    pub placing: Placing,
    /// Generate all `--max-new-tokens` even past an end-of-sequence token.
    #[arg(long)]
    pub ignore_eos: bool,
}

/// Loads the model as `args` say, generates, and writes the JSON line to `out`.
///
/// # Errors
/// Bad flags (naming the flag), a bad checkpoint, device map or tokenizer
/// (naming the file).
pub fn run(args: &Args, out: &mut impl Write) -> Result<()> {
    let placing = args.placing.clone();
    // The ids first: a typo should not wait for a model load.
    let prompt_ids = match &args.prompt_ids {
        Some(ids) => Some(hf::parse_ids(ids).context("--prompt-ids")?),
        None => None,
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
    let prompt = match (&args.prompt, prompt_ids, &tokenizer) {
        (Some(text), None, Some(tok)) => tok.encode(text, true)?,
        (None, Some(ids), _) => ids,
        _ => bail!("give --prompt or --prompt-ids"),
    };
    let flag = if args.prompt.is_some() {
        "--prompt"
    } else {
        "--prompt-ids"
    };
    hf::check_ids(&prompt, model.vocab_size(), flag)?;
    let eos = if args.ignore_eos {
        Vec::new()
    } else {
        model.eos_token_ids()
    };
    let tokens = model.generate(&prompt, args.max_new_tokens, &eos)?;
    let new_tokens = &tokens[prompt.len()..];
    let mut line = json!({ "tokens": tokens, "new_tokens": new_tokens });
    if let Some(tok) = &tokenizer {
        line["text"] = tok.decode(new_tokens, true)?.into();
    }
    writeln!(out, "{line}")?;
    Ok(())
}
