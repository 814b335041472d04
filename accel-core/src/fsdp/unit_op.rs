//! The autograd node of a wrapped unit: its forward runs outside the graph
//! on gathered parameters that are freed right after, and its backward
//! gathers them again, recomputes the unit with a graph, backpropagates the
//! upstream gradient through it and reduce-scatters the parameter gradients.
//!
//! candle has no backward hooks, so the unit enters the graph as
//! `x.apply_op1(UnitOp) + out.detach()`: the op's forward yields zeros (its
//! value never matters), the addition passes the output gradient to the
//! op's `bwd`, and only the unit's input and output stay in the graph.

use std::sync::Arc;

use accel_dist::fsdp::ShardingStrategy;
use accel_nn::block::{Activations, ForwardFn};
use candle_core::backend::{BackendDevice, BackendStorage};
use candle_core::cpu_backend::CpuDevice;
use candle_core::{CpuStorage, CudaStorage, CustomOp1, DType, Layout, Shape, Tensor, Var};

use super::model::{wrap, FsdpModel};
use super::sharding::{grads_of, lock};

// Lives here rather than in model.rs so that the node and the code that
// builds it sit together and model.rs does not import this file back.
impl FsdpModel {
    /// Runs wrapped unit `u` (one block) on `args`; `forward` builds the
    /// block from the weights it is given and applies it.
    ///
    /// Under `FullShard`/`ShardGradOp` the parameters are gathered here and
    /// the block's activations are not kept: the backward gathers (or, for
    /// `ShardGradOp`, reuses) the parameters, runs `forward` again and
    /// reduce-scatters the gradients at once.
    pub(crate) fn forward_unit(
        &self,
        u: usize,
        args: &Activations,
        forward: &Arc<ForwardFn>,
    ) -> accel_nn::Result<Tensor> {
        if !self.sharding().uses_unit_op(u) {
            let tensors = self.tracked_params(u).map_err(wrap)?;
            return forward(&self.unit_weights(u, &tensors)?, args);
        }
        let full = self.unit_params(u).map_err(wrap)?;
        let input = args.hidden.clone();
        let args = args.detach();
        let out = forward(&self.unit_weights(u, &full)?, &args)?;
        if self.sharding().strategy == ShardingStrategy::ShardGradOp {
            lock(&self.sharding().kept).insert(u, full);
        } else {
            drop(full);
        }
        // The op needs a tracked input to be reached by the backward.
        let x = if input.track_op() || !input.dtype().is_float() {
            input
        } else {
            Var::from_tensor(&input)?.as_tensor().clone()
        };
        let node = x.apply_op1(UnitOp {
            model: self.clone(),
            unit: u,
            f: forward.clone(),
            args,
            out_shape: out.shape().clone(),
            out_dtype: out.dtype(),
        })?;
        Ok((node + out)?)
    }
}

pub(crate) struct UnitOp {
    pub model: FsdpModel,
    pub unit: usize,
    /// The block's computation on given weights.
    pub f: Arc<ForwardFn>,
    /// The block's input, detached (only the hidden states get a gradient).
    pub args: Activations,
    pub out_shape: Shape,
    pub out_dtype: DType,
}

impl CustomOp1 for UnitOp {
    fn name(&self) -> &'static str {
        "fsdp_unit"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let zeros = CpuDevice.zeros_impl(&self.out_shape, self.out_dtype)?;
        Ok((zeros, self.out_shape.clone()))
    }

    fn cuda_fwd(&self, s: &CudaStorage, _: &Layout) -> candle_core::Result<(CudaStorage, Shape)> {
        let zeros = s.device().zeros_impl(&self.out_shape, self.out_dtype)?;
        Ok((zeros, self.out_shape.clone()))
    }

    fn bwd(
        &self,
        arg: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        let sharding = self.model.sharding();
        let kept = lock(&sharding.kept).remove(&self.unit);
        let full = match kept {
            Some(full) => full,
            None => self.model.unit_params(self.unit).map_err(wrap)?,
        };
        let vars = full
            .iter()
            .map(Var::from_tensor)
            .collect::<candle_core::Result<Vec<_>>>()?;
        drop(full);
        let tensors: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
        let x = Var::from_tensor(&arg.detach())?;
        let weights = self.model.unit_weights(self.unit, &tensors)?;
        let out = (self.f)(&weights, &self.args.with_hidden(x.as_tensor().clone()))?;
        // d/d(out) of sum(out * g) is exactly g, whatever the dtype.
        let grads = (out * grad.detach())?.sum_all()?.backward()?;
        let (param_grads, found) = grads_of(&grads, &tensors)?;
        self.model.mark_unit_reached(self.unit, &found);
        let gx = grads.get(x.as_tensor()).cloned();
        // The recomputation's own gradients go before the collective.
        drop(grads);
        self.model
            .deposit_unit_grads(self.unit, param_grads)
            .map_err(wrap)?;
        Ok(gx)
    }
}
