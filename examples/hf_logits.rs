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
//! its last hidden state under `logits`. The program is
//! `accel_examples::hf_logits`, which `tests/tests/hf_examples.rs` runs.

use accel_examples::hf_logits::{run, Args};
use clap::Parser;

// Weights stored in the dtype they are used in are the checkpoint's own
// pages, not copies (see `accel_core::bigmodel::mapped`).
#[global_allocator]
static ALLOC: accel_core::bigmodel::MappedAlloc = accel_core::bigmodel::MappedAlloc::system();

fn main() -> anyhow::Result<()> {
    accel_core::init_logging();
    run(&Args::parse(), &mut std::io::stdout().lock())
}
