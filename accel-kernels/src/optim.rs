//! Fused optimizer steps (AdamW, SGD) over whole parameter lists: checks,
//! then dispatch to the CPU, CUDA or fallback kernels. The hyper-parameters
//! and per-step factors the kernels share live in `hyperparams.rs`, so the
//! kernels need not import this file back.

use candle_core::{DType, Tensor};

use crate::cpu::{self, Plan};
use crate::hyperparams::{AdamWParams, AdamWScalars, SgdParams, SgdScalars};
use crate::multi_tensor::f32_slice;
use crate::slices::{check_no_alias, with_float_slices, with_float_slices_mut, ListArg};
use crate::validate::{
    check_contiguous, check_dtype, check_float, check_pairs, common_device, contiguous_inputs,
    groups,
};
use crate::{cuda, fallback, Error, Result};

const ADAMW: &str = "adamw_step";
const SGD: &str = "sgd_step";

/// One AdamW step over a whole parameter list, in place.
///
/// `params`, `exp_avg` and `exp_avg_sq` are f32 tensors (typically the
/// tensors of candle `Var`s, so the update is visible through them) and are
/// updated in place; `grads` may be f32, bf16 or f16 and are widened on the
/// fly. `step` is the 1-based number of this step (bias correction). Per
/// element, in f32, with the scalar factors computed in f64 and rounded
/// once (as PyTorch's single-tensor AdamW does):
///
/// ```text
/// p *= 1 - lr*wd
/// m  = m + (1-beta1)*(g - m)            // torch.lerp
/// v  = v*beta2 + (1-beta2)*g*g
/// p  = p - (lr/(1-beta1^step)) * m / (sqrt(v)/sqrt(1-beta2^step) + eps)
/// ```
///
/// Host tensors are updated in one fused parallel pass; other devices use
/// candle tensor ops with the same formula.
pub fn adamw_step(
    params: &[Tensor],
    grads: &[Tensor],
    exp_avg: &[Tensor],
    exp_avg_sq: &[Tensor],
    step: u64,
    hp: &AdamWParams,
) -> Result<()> {
    adamw_step_with(
        params,
        grads,
        exp_avg,
        exp_avg_sq,
        step,
        hp,
        Plan::default(),
    )
}

/// [`adamw_step`] with an explicit work split (tests vary it).
pub(crate) fn adamw_step_with(
    params: &[Tensor],
    grads: &[Tensor],
    exp_avg: &[Tensor],
    exp_avg_sq: &[Tensor],
    step: u64,
    hp: &AdamWParams,
    plan: Plan,
) -> Result<()> {
    if step == 0 {
        return Err(Error::InvalidArgument {
            op: ADAMW,
            reason: "step is 1-based, got 0".into(),
        });
    }
    check_pairs(ADAMW, grads, params)?;
    check_pairs(ADAMW, exp_avg, params)?;
    check_pairs(ADAMW, exp_avg_sq, params)?;
    for list in [params, exp_avg, exp_avg_sq] {
        check_dtype(ADAMW, list, DType::F32)?;
        check_contiguous(ADAMW, list)?;
    }
    check_float(ADAMW, grads)?;
    let Some(dev) = common_device(ADAMW, &[params, grads, exp_avg, exp_avg_sq])? else {
        return Ok(());
    };
    let s = AdamWScalars::new(hp, step);
    if !dev.is_cpu() && !dev.is_cuda() {
        return fallback::adamw(params, grads, exp_avg, exp_avg_sq, &s);
    }
    let grads = contiguous_inputs(grads)?;
    check_no_alias(
        ADAMW,
        &[
            ListArg {
                name: "params",
                tensors: params,
                written: true,
            },
            ListArg {
                name: "exp_avg",
                tensors: exp_avg,
                written: true,
            },
            ListArg {
                name: "exp_avg_sq",
                tensors: exp_avg_sq,
                written: true,
            },
            ListArg {
                name: "grads",
                tensors: &grads,
                written: false,
            },
        ],
    )?;
    if dev.is_cuda() {
        return cuda::adamw(params, &grads, exp_avg, exp_avg_sq, &s);
    }
    let grad_refs: Vec<&Tensor> = grads.iter().collect();
    with_float_slices(&grad_refs, ADAMW, |g| {
        for r in groups(params.len(), 3) {
            let n = r.len();
            let locked: Vec<&Tensor> = params[r.clone()]
                .iter()
                .chain(&exp_avg[r.clone()])
                .chain(&exp_avg_sq[r.clone()])
                .collect();
            with_float_slices_mut(&locked, ADAMW, |pmv| {
                let mut pmv = pmv.into_iter().map(f32_slice);
                let p: Vec<_> = pmv.by_ref().take(n).collect();
                let m: Vec<_> = pmv.by_ref().take(n).collect();
                let pieces = p
                    .into_iter()
                    .zip(m)
                    .zip(pmv)
                    .zip(&g[r])
                    .map(|(((p, m), v), g)| (p, m, v, *g));
                cpu::adamw::adamw(pieces.collect(), &s, plan);
                Ok(())
            })?;
        }
        Ok(())
    })
}

/// One SGD step over a whole parameter list, in place, with PyTorch
/// `torch.optim.SGD` semantics (`maximize=False`):
///
/// ```text
/// g = g + wd*p                       // if weight_decay != 0
/// b = g                              // step 1 (PyTorch's missing buffer)
/// b = b*momentum + (1-dampening)*g   // later steps
/// g = nesterov ? g + momentum*b : b  // if momentum != 0
/// p = p - lr*g
/// ```
///
/// `params` (and `momentum_bufs`, required when `momentum != 0`, ignored
/// otherwise) are f32 and updated in place; `grads` may be f32, bf16 or
/// f16. `step` is 1-based: at step 1 the buffers are overwritten with the
/// gradient, the way PyTorch initialises them, so their prior contents do
/// not matter.
pub fn sgd_step(
    params: &[Tensor],
    grads: &[Tensor],
    momentum_bufs: Option<&[Tensor]>,
    step: u64,
    hp: &SgdParams,
) -> Result<()> {
    sgd_step_with(params, grads, momentum_bufs, step, hp, Plan::default())
}

/// [`sgd_step`] with an explicit work split (tests vary it).
pub(crate) fn sgd_step_with(
    params: &[Tensor],
    grads: &[Tensor],
    momentum_bufs: Option<&[Tensor]>,
    step: u64,
    hp: &SgdParams,
    plan: Plan,
) -> Result<()> {
    let invalid = |reason: &str| {
        Err(Error::InvalidArgument {
            op: SGD,
            reason: reason.into(),
        })
    };
    if step == 0 {
        return invalid("step is 1-based, got 0");
    }
    if hp.nesterov && (hp.momentum <= 0.0 || hp.dampening != 0.0) {
        return invalid("Nesterov momentum requires a momentum and zero dampening");
    }
    let bufs = match (hp.momentum != 0.0, momentum_bufs) {
        (false, _) => None,
        (true, None) => return invalid("momentum != 0 needs momentum buffers"),
        (true, Some(b)) => Some(b),
    };
    check_pairs(SGD, grads, params)?;
    check_dtype(SGD, params, DType::F32)?;
    check_contiguous(SGD, params)?;
    check_float(SGD, grads)?;
    if let Some(b) = bufs {
        check_pairs(SGD, b, params)?;
        check_dtype(SGD, b, DType::F32)?;
        check_contiguous(SGD, b)?;
    }
    let Some(dev) = common_device(SGD, &[params, grads, bufs.unwrap_or(&[])])? else {
        return Ok(());
    };
    let s = SgdScalars::new(hp, step);
    if !dev.is_cpu() && !dev.is_cuda() {
        return fallback::sgd(params, grads, bufs, &s);
    }
    let grads = contiguous_inputs(grads)?;
    check_no_alias(
        SGD,
        &[
            ListArg {
                name: "params",
                tensors: params,
                written: true,
            },
            ListArg {
                name: "momentum_bufs",
                tensors: bufs.unwrap_or(&[]),
                written: true,
            },
            ListArg {
                name: "grads",
                tensors: &grads,
                written: false,
            },
        ],
    )?;
    if dev.is_cuda() {
        return cuda::sgd(params, &grads, bufs, &s);
    }
    let grad_refs: Vec<&Tensor> = grads.iter().collect();
    let per_index = if bufs.is_some() { 2 } else { 1 };
    with_float_slices(&grad_refs, SGD, |g| {
        for r in groups(params.len(), per_index) {
            let n = r.len();
            let mut locked: Vec<&Tensor> = params[r.clone()].iter().collect();
            if let Some(b) = bufs {
                locked.extend(&b[r.clone()]);
            }
            with_float_slices_mut(&locked, SGD, |pb| {
                let mut pb = pb.into_iter().map(f32_slice);
                let p: Vec<_> = pb.by_ref().take(n).collect();
                let b: Vec<Option<&mut [f32]>> = match bufs {
                    Some(_) => pb.map(Some).collect(),
                    None => (0..n).map(|_| None).collect(),
                };
                let pieces = p.into_iter().zip(b.into_iter().zip(g[r].iter().copied()));
                cpu::adamw::sgd(pieces.collect(), &s, plan);
                Ok(())
            })?;
        }
        Ok(())
    })
}
