//! Loading safetensors checkpoints: a memory-mapped [`CheckpointSource`] that
//! serves tensors by name, and [`load_checkpoint_in_model`] on top of it.

mod load;
mod quantized;
mod source;
// The unit tests write checkpoints with the same helpers as the integration
// tests; they use only part of them.
#[cfg(test)]
#[allow(dead_code)]
#[path = "../../tests/support/files.rs"]
mod test_files;

pub use load::{load_checkpoint_in_model, load_checkpoint_in_varmap, LoadOptions, LoadReport};
pub use source::convert;
pub use source::{CheckpointSource, TensorLocation};
