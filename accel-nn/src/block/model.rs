//! [`Model`]: what model-level features need of a model, its blocks in order.

use std::collections::HashSet;

use accel_bigmodel::{DTypeName, ModuleTree};
use candle_core::{DType, Tensor};

use super::{Activations, AnyBlock, Block, BlockForward};
use crate::Result;

/// A model made of [`Block`]s. Every parameter belongs to a block, so
/// sharding, offload and casting reach all of them by acting on blocks.
pub trait Model {
    /// The blocks, in the order the forward runs them (the order device maps
    /// are planned in). The default, none, suits a model that is only ever
    /// run plainly or data-parallel; sharding, offload and checkpointing act
    /// on blocks and refuse a model whose weights are outside them.
    fn blocks(&self) -> Vec<&dyn AnyBlock> {
        Vec::new()
    }

    /// Every weight with its current tensor, block by block; a weight two
    /// blocks share (tied embeddings) is listed once, at its first block.
    fn named_tensors(&self) -> Vec<(String, Tensor)> {
        let mut seen = HashSet::new();
        let all = self
            .blocks()
            .into_iter()
            .flat_map(|b| b.weights().tensors());
        all.filter(|(n, _)| seen.insert(n.clone())).collect()
    }

    /// The tensors a planning tree holds, in block order: name, shape and
    /// the dtype they are sized as (`dtype` when given, for float tensors).
    ///
    /// A quantized weight's maxima and state are no parameters of the
    /// module (attributes of bitsandbytes' `Params4bit`): Accelerate's sizes
    /// count the packed codes alone, which keep their own dtype.
    ///
    /// # Errors
    /// A dtype torch lacks.
    fn tree_tensors(&self, dtype: Option<DType>) -> Result<Vec<(String, Vec<usize>, DTypeName)>> {
        self.named_tensors()
            .into_iter()
            .filter(|(n, _)| !accel_bigmodel::quant::is_quant_part(n))
            .map(|(n, v)| {
                let own = v.dtype();
                let d = DTypeName::try_from(if own.is_float() {
                    dtype.unwrap_or(own)
                } else {
                    own
                })?;
                Ok((n, v.dims().to_vec(), d))
            })
            .collect()
    }

    /// The model as a [`ModuleTree`] for planning: weights as parameters in
    /// block order, block class names set, weights typed as `dtype` when given.
    ///
    /// # Errors
    /// A dtype torch lacks, a name used for both a module and a weight.
    fn tree(&self, dtype: Option<DType>) -> Result<ModuleTree> {
        let mut tree = ModuleTree::from_tensors(self.tree_tensors(dtype)?)?;
        for block in self.blocks() {
            let name = block.name();
            if !block.class_name().is_empty() && tree.module_id(&name).is_some() {
                tree.set_class_name(&name, block.class_name())?;
            }
        }
        Ok(tree)
    }
}

/// Blocks run one after the other on the hidden states (an embedding, the
/// layers, a head): the simplest [`Model`].
#[derive(Debug)]
pub struct Sequential<B> {
    /// The blocks, in execution order.
    pub blocks: Vec<Block<B>>,
}

impl<B: BlockForward> Sequential<B> {
    /// A model from its blocks.
    pub fn new(blocks: Vec<Block<B>>) -> Self {
        Self { blocks }
    }

    /// Runs every block in order, each on the previous one's output.
    ///
    /// # Errors
    /// The first block's error.
    pub fn forward(&self, x: &Activations) -> Result<Tensor> {
        let mut x = x.clone();
        for block in &self.blocks {
            x.hidden = block.forward(&x)?;
        }
        Ok(x.hidden)
    }

    /// [`Sequential::forward`] on hidden states alone.
    ///
    /// # Errors
    /// The first block's error.
    pub fn forward_hidden(&self, xs: &Tensor) -> Result<Tensor> {
        self.forward(&Activations::new(xs.clone()))
    }
}

impl<B: BlockForward> Model for Sequential<B> {
    fn blocks(&self) -> Vec<&dyn AnyBlock> {
        self.blocks.iter().map(|b| b as &dyn AnyBlock).collect()
    }
}
