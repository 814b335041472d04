//! Where offloaded weights live between forwards (Accelerate's `utils/offload.py`
//! ): the [`WeightSource`] seam, a CPU map and the disk folder format.
//! The hooks that act on a model with them (`cpu_offload`, `disk_offload`)
//! live in accel-nn, beside the blocks they act on.

mod disk;
mod read;
mod staging;

use std::collections::BTreeMap;

use candle_core::{DType, Device, Tensor};

pub use disk::{
    dtype_from_numpy, numpy_dtype_name, offload_state_dict, offload_weight, save_offload_index,
    OffloadEntry, OffloadedWeightsLoader, OFFLOAD_INDEX_NAME,
};
pub use staging::{StagingPool, StagingStats};

use crate::checkpoint::CheckpointSource;
use crate::error::{Error, Result};

/// A map from tensor names to weights that hooks materialise from
/// (Accelerate's `weights_map`): CPU tensors, an offload folder, a checkpoint.
pub trait WeightSource: Send + Sync {
    /// Names the source in error messages (a folder path, "CPU weights").
    fn describe(&self) -> String;

    /// Whether the source holds `name`.
    fn contains(&self, name: &str) -> bool;

    /// Materialises `name` on `device`, in the dtype it is stored in.
    ///
    /// # Errors
    /// [`Error::MissingOffloadedWeight`] (or the source's own missing-tensor
    /// error) naming the tensor, I/O and device errors.
    fn load(&self, name: &str, device: &Device) -> Result<Tensor>;

    /// `name` read into a buffer taken from `pool`, of `shape` and `dtype`,
    /// bitwise as [`WeightSource::load`] followed by a conversion to `dtype`
    /// would give it.
    ///
    /// What offload hooks call every forward: a source that reads bytes (a
    /// disk folder, checkpoint shards) copies into recycled memory that is
    /// already faulted in instead of a fresh allocation. `Ok(None)` (the
    /// default) means the source hands out tensors it holds, or cannot read
    /// this one that way: the caller uses `load`.
    ///
    /// # Errors
    /// As [`WeightSource::load`].
    fn load_staged(
        &self,
        name: &str,
        shape: &[usize],
        dtype: DType,
        pool: &StagingPool,
    ) -> Result<Option<Tensor>> {
        let _ = (name, shape, dtype, pool);
        Ok(None)
    }
}

/// Weights kept in host memory (the `weights_map` of Accelerate's `cpu_offload`).
#[derive(Clone, Debug, Default)]
pub struct CpuWeights {
    tensors: BTreeMap<String, Tensor>,
}

impl CpuWeights {
    /// A map over `tensors`, each moved to the CPU (a cheap clone when already there).
    ///
    /// # Errors
    /// [`Error::Candle`] when a device copy fails.
    pub fn new(tensors: impl IntoIterator<Item = (String, Tensor)>) -> Result<Self> {
        let tensors = tensors
            .into_iter()
            .map(|(n, t)| Ok((n, t.to_device(&Device::Cpu)?)))
            .collect::<Result<_>>()?;
        Ok(CpuWeights { tensors })
    }

    /// The tensors.
    pub fn tensors(&self) -> &BTreeMap<String, Tensor> {
        &self.tensors
    }
}

impl WeightSource for CpuWeights {
    fn describe(&self) -> String {
        "CPU weights map".to_string()
    }

    fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    fn load(&self, name: &str, device: &Device) -> Result<Tensor> {
        let t = self
            .tensors
            .get(name)
            .ok_or_else(|| Error::MissingOffloadedWeight {
                name: name.to_string(),
                source_desc: self.describe(),
            })?;
        Ok(t.to_device(device)?)
    }
}

/// A memory-mapped checkpoint as a weights map: each load copies the tensor
/// out of the mapping (whose pages then count as resident until the OS drops
/// them; [`OffloadedWeightsLoader::from_checkpoint`] reads without mapping).
impl WeightSource for CheckpointSource {
    fn describe(&self) -> String {
        self.checkpoint().display().to_string()
    }

    fn contains(&self, name: &str) -> bool {
        CheckpointSource::contains(self, name)
    }

    fn load(&self, name: &str, device: &Device) -> Result<Tensor> {
        self.tensor(name, device, None)
    }
}
