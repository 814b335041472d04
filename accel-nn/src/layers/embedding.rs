//! `Embedding`, as candle-nn's (its `index_select` already has a backward).

use candle_core::{Module, Result, Tensor};
use candle_nn::{Init, VarBuilder};

/// A lookup table `[n, hidden_size]` indexed by token ids of any shape.
#[derive(Debug, Clone)]
pub struct Embedding {
    embeddings: Tensor,
    hidden_size: usize,
}

impl Embedding {
    /// Wraps an existing table, as `candle_nn::Embedding::new`.
    pub fn new(embeddings: Tensor, hidden_size: usize) -> Self {
        Self {
            embeddings,
            hidden_size,
        }
    }

    /// The `[n, hidden_size]` table (e.g. to tie an lm_head to it).
    pub fn embeddings(&self) -> &Tensor {
        &self.embeddings
    }

    /// The width of one embedding.
    pub fn hidden_size(&self) -> usize {
        self.hidden_size
    }
}

impl Module for Embedding {
    fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        let mut dims = ids.dims().to_vec();
        dims.push(self.hidden_size);
        self.embeddings
            .index_select(&ids.flatten_all()?, 0)?
            .reshape(dims)
    }
}

/// An `[n, d]` table under `vb` (`weight`), initialised N(0, 1) like
/// `candle_nn::embedding`.
pub fn embedding(n: usize, d: usize, vb: VarBuilder) -> Result<Embedding> {
    let init = Init::Randn {
        mean: 0.0,
        stdev: 1.0,
    };
    Ok(Embedding::new(
        vb.get_with_hints((n, d), "weight", init)?,
        d,
    ))
}
