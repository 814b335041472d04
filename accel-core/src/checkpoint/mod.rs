//! Checkpoint files: safetensors I/O, sharded model saving and atomic folders.
//!
//! This is the file layer under `Accelerator::save_state` / `load_state`:
//!
//! - [`StateDict`] is the unit every checkpointable object (model, optimizer,
//!   scheduler, gradient scaler, data loader, RNG, custom objects) turns into:
//!   named tensors plus a JSON value for everything that is not a tensor.
//!   [`Checkpointable`] is the trait those objects implement.
//! - `safetensors_io` reads and writes single safetensors and JSON files,
//!   atomically, with errors that name the file and tensor at fault, and
//!   restores model weights into candle `Var`s all-or-nothing.
//! - `shards` splits model weights into `model-0000i-of-0000N.safetensors`
//!   shards plus `model.safetensors.index.json`, byte-compatible with
//!   Accelerate / `huggingface_hub`, and reads them back.
//! - `atomic` makes a whole checkpoint folder appear at once
//!   ([`AtomicDir`]) and manages `checkpoint_{n}` folders (listing, the total
//!   limit, cleaning up after crashed saves).
//!
//! The three files are private: their items are re-exported here, so the
//! files can be rearranged without breaking a user's imports.

use std::collections::BTreeMap;

use candle_core::Tensor;

use crate::Result;

mod atomic;
mod fs_util;
mod safetensors_io;
mod shards;
mod st_format;

pub use atomic::{
    checkpoint_path, clean_stale_temps, enforce_total_limit, list_checkpoints, AtomicDir,
};
pub(crate) use fs_util::write_bytes_atomic;
pub use safetensors_io::{
    load_into, load_state_dict, read_json, read_safetensors, read_safetensors_with_metadata,
    restore_vars, save_state_dict, specs_of, write_json, write_safetensors, write_safetensors_as,
    TensorSpec,
};
pub use shards::{
    load_model_tensors, load_sharded, parse_size, save_model, save_sharded, save_sharded_as,
    ShardPlan, SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME,
};

/// The saved state of one checkpointable object: its tensors and everything
/// else as JSON.
///
/// Tensors go to `{stem}.safetensors` and `meta` to `{stem}.json` (see
/// [`save_state_dict`]); keeping the two apart means tensors never pass
/// through JSON (exact bits, no size blow-up) and the JSON stays readable.
#[derive(Debug, Clone, Default)]
pub struct StateDict {
    /// Named tensors, saved bit-exactly. Ordered so files and iteration are
    /// deterministic across runs and processes.
    pub tensors: BTreeMap<String, Tensor>,
    /// Everything that is not a tensor (step counters, hyper-parameters, RNG
    /// seeds, ...). `Value::Null` means "nothing" and writes no JSON file.
    pub meta: serde_json::Value,
}

impl StateDict {
    /// An empty state: no tensors, `meta` is `Null`.
    pub fn new() -> Self {
        Self::default()
    }

    /// A state made only of tensors.
    pub fn from_tensors(tensors: BTreeMap<String, Tensor>) -> Self {
        Self {
            tensors,
            meta: serde_json::Value::Null,
        }
    }

    /// A state made only of JSON metadata.
    pub fn from_meta(meta: serde_json::Value) -> Self {
        Self {
            tensors: BTreeMap::new(),
            meta,
        }
    }

    /// True when there is nothing to save: no tensors and `meta` is `Null`.
    pub fn is_empty(&self) -> bool {
        self.tensors.is_empty() && self.meta.is_null()
    }
}

/// An object whose state can be saved into and restored from a checkpoint.
///
/// Implemented by models, optimizers, schedulers, scalers, data loaders, RNGs
/// and user objects registered with the Accelerator.
pub trait Checkpointable {
    /// Captures the current state. Tensors may live on any device; the writer
    /// moves them to the CPU.
    fn state_dict(&self) -> Result<StateDict>;

    /// Restores a state produced by [`Checkpointable::state_dict`].
    ///
    /// Implementations should validate the whole state before changing
    /// anything, so a bad checkpoint leaves the object as it was.
    fn load_state_dict(&mut self, state: StateDict) -> Result<()>;
}
