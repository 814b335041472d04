//! The `generate` example's program (command line and run), here so the
//! integration tests can run it as a binary of their own crate: decoding
//! with a KV cache from a Hugging Face checkpoint, plain or offloaded,
//! greedy (the tokens equal transformers' `generate(do_sample=False)`) or
//! sampled as transformers samples (repetition penalty, temperature, top-k,
//! top-p; seeded). The folder's `generation_config.json` sets the defaults,
//! as `generate` reads it; the flags override it.
//!
//! Writes one JSON object: `{"tokens": [prompt and new ids], "new_tokens":
//! [...], "text": "..."}` (`text` when the folder has a tokenizer.json).
//! Generation stops at the config's `eos_token_id`, as transformers does,
//! unless `--ignore-eos`.

use std::io::Write;
use std::path::PathBuf;

use accel_core::data::ChatTemplate;
use accel_core::models::{Sampling, Tokenizer};
use anyhow::{bail, Context, Result};
use clap::Parser;
use serde_json::json;

use crate::hf::{self, Placing};

/// The command line (fixed: scripts outside the repository call it).
#[derive(Parser, Debug, Clone)]
#[command(about = "Greedy generation from a Hugging Face checkpoint")]
pub struct Args {
    /// Checkpoint folder (config.json, safetensors, tokenizer.json for
    /// --prompt), or a Hugging Face model id (`org/name`).
    #[arg(long)]
    pub model: PathBuf,
    /// A model id's revision (branch, tag or commit) when `--model` is a
    /// Hugging Face Hub id rather than a folder.
    #[arg(long)]
    pub revision: Option<String>,
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
    /// `--prompt` is a user message: rendered with the folder's chat
    /// template and the generation prompt (`apply_chat_template`).
    #[arg(long, requires = "prompt")]
    pub chat: bool,
    /// Sample (`do_sample=True`); implied by `--temperature`, `--top-k`, `--top-p`.
    #[arg(long, conflicts_with = "greedy")]
    pub do_sample: bool,
    /// Greedy decoding whatever generation_config.json says.
    #[arg(long)]
    pub greedy: bool,
    /// Sampling temperature (> 0).
    #[arg(long)]
    pub temperature: Option<f64>,
    /// Keep the k most likely tokens.
    #[arg(long)]
    pub top_k: Option<usize>,
    /// Keep the smallest set of tokens whose probability reaches p.
    #[arg(long)]
    pub top_p: Option<f64>,
    /// Penalise tokens already in the sequence (> 0; 1 is none).
    #[arg(long)]
    pub repetition_penalty: Option<f64>,
    /// Seed of the draws.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

/// The sampling settings: `generation_config.json`'s, then the flags'.
///
/// # Errors
/// An unreadable generation config; a bad value (naming the flag).
fn sampling(args: &Args) -> Result<Sampling> {
    let mut s = Sampling::default();
    let path = args.model.join("generation_config.json");
    if path.is_file() {
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("reading {}", path.display()))?;
        let g: serde_json::Value =
            serde_json::from_str(&text).with_context(|| format!("{}: not JSON", path.display()))?;
        s.do_sample = g["do_sample"].as_bool().unwrap_or(false);
        s.temperature = g["temperature"].as_f64().unwrap_or(1.0);
        s.top_k = g["top_k"].as_u64().map(|k| k as usize);
        s.top_p = g["top_p"].as_f64();
        s.repetition_penalty = g["repetition_penalty"].as_f64();
    }
    let sampled = args.temperature.is_some() || args.top_k.is_some() || args.top_p.is_some();
    s.do_sample = !args.greedy && (s.do_sample || args.do_sample || sampled);
    s.temperature = args.temperature.unwrap_or(s.temperature);
    s.top_k = args.top_k.or(s.top_k);
    s.top_p = args.top_p.or(s.top_p);
    s.repetition_penalty = args.repetition_penalty.or(s.repetition_penalty);
    s.seed = args.seed;
    s.validate()
        .map_err(|e| anyhow::anyhow!("--{}", e.to_string().replace('_', "-")))?;
    Ok(s)
}

/// Loads the model as `args` say, generates, and writes the JSON line to `out`.
///
/// # Errors
/// Bad flags (naming the flag), a bad checkpoint, device map or tokenizer
/// (naming the file).
pub fn run(args: &Args, out: &mut impl Write) -> Result<()> {
    // A model id becomes its folder in the Hugging Face cache first.
    let resolved = Args {
        model: accel_core::models::hub::resolve_model(&args.model, args.revision.as_deref())?,
        ..args.clone()
    };
    let args = &resolved;
    let placing = args.placing.clone();
    // The ids first: a typo should not wait for a model load.
    let prompt_ids = match &args.prompt_ids {
        Some(ids) => Some(hf::parse_ids(ids).context("--prompt-ids")?),
        None => None,
    };
    let sampling = sampling(args)?;
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
        (Some(text), None, Some(tok)) if args.chat => {
            let template = ChatTemplate::from_folder(&args.model)?;
            let messages = json!([{"role": "user", "content": text}]);
            let (rendered, _) = template.render(&messages, true)?;
            // The template writes the special tokens itself.
            tok.encode(&rendered, false)?
        }
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
    let tokens = model.generate_with(&prompt, args.max_new_tokens, &eos, &sampling)?;
    let new_tokens = &tokens[prompt.len()..];
    let mut line = json!({ "tokens": tokens, "new_tokens": new_tokens });
    if let Some(tok) = &tokenizer {
        line["text"] = tok.decode(new_tokens, true)?.into();
    }
    writeln!(out, "{line}")?;
    Ok(())
}
