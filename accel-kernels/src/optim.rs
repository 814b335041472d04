//! Fused optimizer steps (AdamW, SGD) over whole parameter lists, their
//! hyper-parameters, and the per-step scalar factors derived from them.
//!
//! PyTorch computes these factors in Python floats (f64) and hands them to
//! f32 kernels, which round each to f32 once; doing the same here is what
//! makes our f32 results match its single-tensor implementation.

use candle_core::{DType, Tensor};

use crate::cpu::{self, Plan};
use crate::multi_tensor::f32_slice;
use crate::slices::{check_no_alias, with_float_slices, with_float_slices_mut, ListArg};
use crate::validate::{
    check_contiguous, check_dtype, check_float, check_pairs, common_device, contiguous_inputs,
    groups,
};
use crate::{cuda, fallback, Error, Result};

/// Hyper-parameters of AdamW (`torch.optim.AdamW`, `amsgrad=False`,
/// `maximize=False`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWParams {
    /// Learning rate.
    pub lr: f64,
    /// Decay rate of the first-moment estimate.
    pub beta1: f64,
    /// Decay rate of the second-moment estimate.
    pub beta2: f64,
    /// Term added to the denominator for numerical stability.
    pub eps: f64,
    /// Decoupled weight decay coefficient.
    pub weight_decay: f64,
}

impl Default for AdamWParams {
    /// PyTorch's defaults: `lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
    /// weight_decay=1e-2`.
    fn default() -> Self {
        AdamWParams {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 1e-2,
        }
    }
}

/// Hyper-parameters of SGD (`torch.optim.SGD`, `maximize=False`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SgdParams {
    /// Learning rate.
    pub lr: f64,
    /// Momentum factor; 0 disables the momentum buffers.
    pub momentum: f64,
    /// L2 penalty added to the gradient.
    pub weight_decay: f64,
    /// Dampening of the gradient's contribution to the momentum buffer.
    pub dampening: f64,
    /// Nesterov momentum (needs `momentum > 0` and `dampening == 0`).
    pub nesterov: bool,
}

impl Default for SgdParams {
    /// PyTorch's defaults, with `lr=1e-3` since PyTorch has no default lr.
    fn default() -> Self {
        SgdParams {
            lr: 1e-3,
            momentum: 0.0,
            weight_decay: 0.0,
            dampening: 0.0,
            nesterov: false,
        }
    }
}

/// The f32 factors of one AdamW step.
#[derive(Clone, Copy, Debug)]
pub(crate) struct AdamWScalars {
    /// `1 - lr * weight_decay`, or `None` when weight decay is off (PyTorch
    /// skips the multiply then).
    pub decay: Option<f32>,
    /// Lerp weight `1 - beta1`.
    pub w1: f32,
    /// `beta2`.
    pub beta2: f32,
    /// `1 - beta2`.
    pub c2: f32,
    /// `lr / (1 - beta1^step)`.
    pub step_size: f32,
    /// `sqrt(1 - beta2^step)`.
    pub bc2_sqrt: f32,
    /// `eps`.
    pub eps: f32,
}

impl AdamWScalars {
    /// Factors for 1-based step `step`, computed in f64 like Python would.
    pub fn new(hp: &AdamWParams, step: u64) -> Self {
        let t = step as f64;
        // `powf`, not `powi`: Python's `beta ** step` is C `pow`.
        let bc1 = 1.0 - hp.beta1.powf(t);
        let bc2 = 1.0 - hp.beta2.powf(t);
        AdamWScalars {
            decay: (hp.weight_decay != 0.0).then_some((1.0 - hp.lr * hp.weight_decay) as f32),
            w1: (1.0 - hp.beta1) as f32,
            beta2: hp.beta2 as f32,
            c2: (1.0 - hp.beta2) as f32,
            step_size: (hp.lr / bc1) as f32,
            bc2_sqrt: bc2.sqrt() as f32,
            eps: hp.eps as f32,
        }
    }
}

/// The f32 factors of one SGD step.
#[derive(Clone, Copy, Debug)]
pub(crate) struct SgdScalars {
    /// `lr`.
    pub lr: f32,
    /// `momentum`, `None` when momentum is off.
    pub momentum: Option<f32>,
    /// `weight_decay`, `None` when off.
    pub weight_decay: Option<f32>,
    /// `1 - dampening`.
    pub one_minus_dampening: f32,
    /// Nesterov momentum.
    pub nesterov: bool,
    /// First step: the momentum buffer is set to the gradient, as PyTorch
    /// initialises a missing buffer with a clone of it.
    pub first: bool,
}

impl SgdScalars {
    /// Factors for 1-based step `step`.
    pub fn new(hp: &SgdParams, step: u64) -> Self {
        SgdScalars {
            lr: hp.lr as f32,
            momentum: (hp.momentum != 0.0).then_some(hp.momentum as f32),
            weight_decay: (hp.weight_decay != 0.0).then_some(hp.weight_decay as f32),
            one_minus_dampening: (1.0 - hp.dampening) as f32,
            nesterov: hp.nesterov,
            first: step <= 1,
        }
    }
}

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
