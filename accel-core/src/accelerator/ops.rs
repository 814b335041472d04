//! Collective utilities on tensors: `gather`, `reduce`, `broadcast`,
//! `pad_across_processes` and `gather_for_metrics`, as Accelerate's.

use accel_dist::ReduceOp;
use candle_core::{DType, Tensor};

use super::Accelerator;
use crate::Result;

impl Accelerator {
    /// Concatenates `tensor` from every rank along dimension 0, in rank order.
    pub fn gather(&self, tensor: &Tensor) -> Result<Tensor> {
        if self.num_processes() == 1 {
            return Ok(tensor.clone());
        }
        Ok(self.comm().all_gather_tensor(&tensor.contiguous()?)?)
    }

    /// Combines `tensor` over ranks with `op` (sum, mean, max, ...); every rank gets the result.
    pub fn reduce(&self, tensor: &Tensor, op: ReduceOp) -> Result<Tensor> {
        if self.num_processes() == 1 {
            return Ok(tensor.clone());
        }
        Ok(self.comm().all_reduce_tensor(&tensor.contiguous()?, op)?)
    }

    /// Rank `root`'s `tensor`, on every rank (same shape and dtype everywhere).
    pub fn broadcast(&self, tensor: &Tensor, root: usize) -> Result<Tensor> {
        if self.num_processes() == 1 {
            return Ok(tensor.clone());
        }
        Ok(self.comm().broadcast_tensor(&tensor.contiguous()?, root)?)
    }

    /// Pads `tensor` along `dim` with `pad_index` to the largest size any rank
    /// has, at the end (or the start with `pad_first`), so it can be gathered.
    pub fn pad_across_processes(
        &self,
        tensor: &Tensor,
        dim: usize,
        pad_index: f64,
        pad_first: bool,
    ) -> Result<Tensor> {
        let size = Tensor::new(&[tensor.dim(dim)? as u32], tensor.device())?;
        let max = self.reduce(&size, ReduceOp::Max)?.to_vec1::<u32>()?[0] as usize;
        let have = tensor.dim(dim)?;
        if max == have {
            return Ok(tensor.clone());
        }
        let mut shape = tensor.dims().to_vec();
        shape[dim] = max - have;
        let pad = Tensor::full(pad_index, shape, tensor.device())?.to_dtype(tensor.dtype())?;
        let parts = if pad_first {
            [&pad, tensor]
        } else {
            [tensor, &pad]
        };
        Ok(Tensor::cat(&parts, dim)?)
    }

    /// Gathers per-sample results of an evaluation batch from every rank and,
    /// on the last batch of a prepared loader, drops the samples that
    /// `even_batches` duplicated to give every rank a full batch.
    pub fn gather_for_metrics(&self, tensor: &Tensor) -> Result<Tensor> {
        let all = self.gather(tensor)?;
        let remainder = self.grad_state.remainder();
        if self.grad_state.end_of_dataloader() && remainder > 0 && remainder < all.dim(0)? {
            return Ok(all.narrow(0, 0, remainder)?);
        }
        Ok(all)
    }

    /// The mean of a scalar (e.g. a loss) over ranks, as an f64.
    pub fn mean_scalar(&self, value: f64) -> Result<f64> {
        let t = Tensor::new(&[value], self.device())?.to_dtype(DType::F64)?;
        Ok(self.reduce(&t, ReduceOp::Mean)?.to_vec1::<f64>()?[0])
    }
}
