//! A real checkpoint through dispatch with disk offload: all-MiniLM-L6-v2
//! as `accel_models::Bert`, run plain, with `load_checkpoint_and_dispatch`
//! (layers 3-5 on disk, read from the checkpoint) and loaded then
//! `dispatch_model` with an offload folder; the sentence embeddings (mean
//! pooling, L2-normalised) are compared with each other and with
//! transformers' (see `accel_examples::minilm`).
//!
//! ```text
//! scripts/fetch_minilm.sh                       # into target/minilm
//! cargo run --release --example minilm_dispatch [-- --dir DIR]
//! ```
//!
//! Prints one JSON object; exits non-zero when an embedding differs by more
//! than 1e-5 from the plain run or the plain run from transformers'.

use accel_examples::minilm::{run, Args};
use clap::Parser;

// Weights stored in the dtype they are used in are the checkpoint's own
// pages, not copies (see `accel_core::bigmodel::mapped`).
#[global_allocator]
static ALLOC: accel_core::bigmodel::MappedAlloc = accel_core::bigmodel::MappedAlloc::system();

fn main() -> anyhow::Result<()> {
    accel_core::init_logging();
    run(&Args::parse(), &mut std::io::stdout().lock())
}
