//! Datasets and the seedable, resumable data loader.

mod chat;
mod jsonl;
mod loader;
mod prefetch;
mod sampler;
mod shard;

pub use chat::ChatTemplate;
pub use jsonl::{JsonlDataset, JsonlOptions, IGNORE};
pub use loader::{DataLoader, DataLoaderConfig, LoaderIter, LoaderPosition};
pub use sampler::batch_indices;
pub use shard::{remainder, shard_batches, sharded_len, ShardConfig};

use candle_core::Tensor;

use crate::{Error, Result};

/// A map-style dataset that assembles whole batches.
///
/// Batches rather than items, because gathering rows of a tensor in one
/// `index_select` is far cheaper than stacking rows one by one.
pub trait Dataset: Send + Sync + 'static {
    /// What one batch is (e.g. `Vec<Tensor>` of inputs and targets).
    type Batch: Send + 'static;
    /// Number of samples.
    fn len(&self) -> usize;
    /// True when there are no samples.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The batch made of the samples at `indices`, in that order.
    fn get_batch(&self, indices: &[usize]) -> Result<Self::Batch>;
}

/// Samples are the rows (dimension 0) of several tensors, like PyTorch's `TensorDataset`.
#[derive(Debug, Clone)]
pub struct TensorDataset {
    tensors: Vec<Tensor>,
}

impl TensorDataset {
    /// All tensors must have the same size in dimension 0.
    ///
    /// ```
    /// # use candle_core::{Device, Tensor};
    /// let x = Tensor::zeros((10, 3), candle_core::DType::F32, &Device::Cpu).unwrap();
    /// let y = Tensor::zeros(10, candle_core::DType::U32, &Device::Cpu).unwrap();
    /// let ds = accel_core::data::TensorDataset::new(vec![x, y]).unwrap();
    /// ```
    pub fn new(tensors: Vec<Tensor>) -> Result<Self> {
        let Some(first) = tensors.first() else {
            return Err(Error::Usage(
                "TensorDataset needs at least one tensor".into(),
            ));
        };
        let n = first.dim(0)?;
        for (i, t) in tensors.iter().enumerate() {
            if t.dim(0)? != n {
                return Err(Error::Usage(format!(
                    "TensorDataset: tensor {i} has {} rows, tensor 0 has {n}",
                    t.dim(0)?
                )));
            }
        }
        Ok(Self { tensors })
    }
}

impl Dataset for TensorDataset {
    type Batch = Vec<Tensor>;

    fn len(&self) -> usize {
        self.tensors[0].dim(0).unwrap_or(0)
    }

    fn get_batch(&self, indices: &[usize]) -> Result<Vec<Tensor>> {
        let idx: Vec<u32> = indices.iter().map(|&i| i as u32).collect();
        let idx = Tensor::from_vec(idx, indices.len(), self.tensors[0].device())?;
        Ok(self
            .tensors
            .iter()
            .map(|t| t.index_select(&idx, 0))
            .collect::<candle_core::Result<_>>()?)
    }
}
