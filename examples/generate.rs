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
//! unless `--ignore-eos`. The program is `accel_examples::generate`, which
//! `tests/tests/hf_examples.rs` runs.

use accel_examples::generate::{run, Args};
use clap::Parser;

// Weights stored in the dtype they are used in are the checkpoint's own
// pages, not copies (see `accel_core::bigmodel::mapped`).
#[global_allocator]
static ALLOC: accel_core::bigmodel::MappedAlloc = accel_core::bigmodel::MappedAlloc::system();

fn main() -> anyhow::Result<()> {
    accel_core::init_logging();
    run(&Args::parse(), &mut std::io::stdout().lock())
}
