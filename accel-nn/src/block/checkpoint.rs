//! Activation checkpointing as a hook: the block's forward keeps no
//! activations, and its backward recomputes it (PyTorch's
//! `torch.utils.checkpoint` with `use_reentrant=False`, applied per block as
//! Accelerate's and transformers' `gradient_checkpointing_enable` do).
//!
//! candle has no backward hooks, so the block enters the graph as
//! `XOp(x, s) + out.detach()`, where `out` was computed on detached weights
//! (no graph kept) and `s` is a chain of scalar "ghost" ops, one per weight
//! that needs a gradient. The chain makes the backward reach `XOp` first: its
//! `bwd` receives the output gradient `g`, recomputes the block with a graph
//! on the real weights, backpropagates `sum(out * g)` and keeps every
//! weight's gradient; each ghost's `bwd` then hands its weight's gradient to
//! the outer backward, as if the block had kept its graph.

use std::sync::{Arc, Mutex};

use accel_bigmodel::ModuleWeights;
use candle_core::backend::{BackendDevice, BackendStorage};
use candle_core::cpu_backend::CpuDevice;
use candle_core::op::Neg;
use candle_core::{
    CpuStorage, CudaStorage, CustomOp1, CustomOp2, DType, Layout, Shape, Tensor, Var,
};

use super::{Activations, ForwardFn, Model};
use crate::hooks::{add_hook_to_module, ModelHook};
use crate::Result;

/// Recomputes the block in backward instead of keeping its activations.
#[derive(Debug, Default, Clone, Copy)]
pub struct CheckpointHook;

/// Adds a [`CheckpointHook`] to each block of `model` whose class name is in
/// `classes` (all blocks when `classes` is empty), after any hook it has.
///
/// # Errors
/// [`crate::Error::HookConflict`] for a block whose hook already wraps its
/// forward (an FSDP unit checkpoints by itself).
pub fn apply_activation_checkpointing(model: &dyn Model, classes: &[&str]) -> Result<()> {
    for block in model.blocks() {
        if classes.is_empty() || classes.contains(&block.class_name()) {
            add_hook_to_module(block, Box::new(CheckpointHook), true)?;
        }
    }
    Ok(())
}

/// What the recomputation found, shared by the ops of one forward.
struct Recomputed {
    grads: Vec<Option<Tensor>>,
}

struct Shared {
    weights: ModuleWeights,
    /// Indices into `weights.tensors()` of the weights that need gradients.
    tracked: Vec<usize>,
    args: Activations,
    forward: Arc<ForwardFn>,
    result: Mutex<Option<Recomputed>>,
}

impl ModelHook for CheckpointHook {
    fn wraps_forward(&self) -> bool {
        true
    }

    fn run_forward(
        &mut self,
        weights: &ModuleWeights,
        args: Activations,
        forward: &Arc<ForwardFn>,
    ) -> Result<Tensor> {
        let all = weights.tensors();
        let tracked: Vec<usize> = (0..all.len()).filter(|&i| all[i].1.track_op()).collect();
        let x = &args.hidden;
        if tracked.is_empty() && !x.track_op() {
            // Nothing to differentiate: a plain forward keeps no graph anyway.
            return forward(weights, &args);
        }
        // The forward on detached weights and input builds no graph.
        let detached = all.iter().map(|(n, t)| (n.clone(), t.detach())).collect();
        let detached = ModuleWeights::new(weights.prefix(), detached)?;
        let out = forward(&detached, &args.detach())?;
        drop(detached);
        let shared = Arc::new(Shared {
            weights: weights.clone(),
            tracked: tracked.clone(),
            args: args.detach(),
            forward: forward.clone(),
            result: Mutex::new(None),
        });
        // The ghost chain: a scalar per tracked weight, each depending on the last.
        let mut chain: Option<Tensor> = None;
        for (k, &i) in tracked.iter().enumerate() {
            let ghost = Ghost {
                shared: shared.clone(),
                k,
            };
            let w = &all[i].1;
            chain = Some(match chain {
                None => w.apply_op1(ghost)?,
                Some(prev) => prev.apply_op2(w, ghost)?,
            });
        }
        let chain = match chain {
            Some(c) => c,
            None => Tensor::zeros((), DType::F32, x.device())?,
        };
        // The op needs a tracked input to be reached by the backward.
        let x = if x.track_op() || !x.dtype().is_float() {
            x.clone()
        } else {
            Var::from_tensor(x)?.as_tensor().clone()
        };
        let node = x.apply_op2(
            &chain,
            XOp {
                shared,
                out_shape: out.shape().clone(),
                out_dtype: out.dtype(),
            },
        )?;
        Ok((node + out.detach())?)
    }

    fn name(&self) -> &'static str {
        "CheckpointHook"
    }
}

// The checkpointed output is `XOp`'s zeros plus the detached output, so the
// zeros are negative: x + (-0) is x for every x, -0 included, while +0 would
// turn every -0 of the block's output into +0 (GELU of a large negative input
// is -0, so the plain and the checkpointed forward differed in its sign bit).

fn negative<S: BackendStorage>(
    zeros: S,
    shape: &Shape,
    dtype: DType,
) -> candle_core::Result<(S, Shape)> {
    let zeros = match dtype.is_float() {
        true => zeros.unary_impl::<Neg>(&Layout::contiguous(shape))?,
        false => zeros,
    };
    Ok((zeros, shape.clone()))
}

fn zeros_cpu(shape: &Shape, dtype: DType) -> candle_core::Result<(CpuStorage, Shape)> {
    negative(CpuDevice.zeros_impl(shape, dtype)?, shape, dtype)
}

fn zeros_cuda(
    s: &CudaStorage,
    shape: &Shape,
    dtype: DType,
) -> candle_core::Result<(CudaStorage, Shape)> {
    negative(s.device().zeros_impl(shape, dtype)?, shape, dtype)
}

/// Negative zeros of the block's output shape (see `zeros_cpu`); its
/// backward recomputes the block.
struct XOp {
    shared: Arc<Shared>,
    out_shape: Shape,
    out_dtype: DType,
}

impl CustomOp2 for XOp {
    fn name(&self) -> &'static str {
        "checkpoint"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        zeros_cpu(&self.out_shape, self.out_dtype)
    }

    fn cuda_fwd(
        &self,
        s: &CudaStorage,
        _: &Layout,
        _: &CudaStorage,
        _: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        zeros_cuda(s, &self.out_shape, self.out_dtype)
    }

    fn bwd(
        &self,
        x: &Tensor,
        chain: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let sh = &self.shared;
        let xv = match x.dtype().is_float() {
            true => Some(Var::from_tensor(&x.detach())?),
            false => None,
        };
        let mut args = sh.args.clone();
        if let Some(xv) = &xv {
            args.hidden = xv.as_tensor().clone();
        }
        // On the block's own handle: the real weights, with a graph this time.
        let out = (sh.forward)(&sh.weights, &args)?;
        // d/d(out) of sum(out * g) is exactly g, whatever the dtype.
        let store = (out * grad.detach())?.sum_all()?.backward()?;
        let all = sh.weights.tensors();
        let grads = sh
            .tracked
            .iter()
            .map(|&i| store.get(&all[i].1).cloned())
            .collect();
        let grad_x = xv.and_then(|v| store.get(v.as_tensor()).cloned());
        *sh.result.lock().unwrap_or_else(|e| e.into_inner()) = Some(Recomputed { grads });
        Ok((grad_x, Some(chain.zeros_like()?)))
    }
}

/// A scalar zero depending on one weight (and on the previous ghost); its
/// backward hands that weight's recomputed gradient on.
struct Ghost {
    shared: Arc<Shared>,
    k: usize,
}

impl Ghost {
    fn grad(&self) -> candle_core::Result<Option<Tensor>> {
        let result = self.shared.result.lock().unwrap_or_else(|e| e.into_inner());
        match result.as_ref() {
            Some(r) => Ok(r.grads[self.k].clone()),
            None => candle_core::bail!(
                "checkpoint: a weight's gradient was asked for before the block was recomputed"
            ),
        }
    }
}

impl CustomOp1 for Ghost {
    fn name(&self) -> &'static str {
        "checkpoint_weight"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        zeros_cpu(&Shape::from(()), DType::F32)
    }

    fn cuda_fwd(&self, s: &CudaStorage, _: &Layout) -> candle_core::Result<(CudaStorage, Shape)> {
        zeros_cuda(s, &Shape::from(()), DType::F32)
    }

    fn bwd(
        &self,
        _w: &Tensor,
        _res: &Tensor,
        _grad: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        self.grad()
    }
}

impl CustomOp2 for Ghost {
    fn name(&self) -> &'static str {
        "checkpoint_weight"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        zeros_cpu(&Shape::from(()), DType::F32)
    }

    fn cuda_fwd(
        &self,
        s: &CudaStorage,
        _: &Layout,
        _: &CudaStorage,
        _: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        zeros_cuda(s, &Shape::from(()), DType::F32)
    }

    fn bwd(
        &self,
        prev: &Tensor,
        _w: &Tensor,
        _res: &Tensor,
        _grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        Ok((Some(prev.zeros_like()?), self.grad()?))
    }
}
