//! Hyper-parameters of the fused optimizers (AdamW, SGD) and the per-step
//! scalar factors derived from them.
//!
//! PyTorch computes these factors in Python floats (f64) and hands them to
//! f32 kernels, which round each to f32 once; doing the same here is what
//! makes our f32 results match its single-tensor implementation. A file of
//! its own because every kernel (CPU, CUDA, fallback) reads the factors and
//! `optim.rs` calls those kernels: kept in `optim.rs`, they made a loop.

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
