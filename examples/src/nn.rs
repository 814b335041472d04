//! Small building blocks shared by the models, written so that every op has
//! a backward pass in candle 0.11.
//!
//! Three candle conveniences are avoided on purpose:
//! * `candle_nn::LayerNorm::forward` dispatches contiguous inputs to
//!   `candle_nn::ops::layer_norm`, a custom op registered *without* backward,
//!   so gradients would silently stop there; [`layer_norm`] composes it from
//!   differentiable ops instead.
//! * `candle_nn::ops::softmax_last_dim` is likewise registered without
//!   backward; attention uses the composed `candle_nn::ops::softmax`.
//! * candle's CPU matmul has no bf16 kernel; [`matmul`] routes that one case
//!   through f32 so bf16 models still train on CPU.

use candle_core::{DType, Result, Tensor, D};

use crate::kernels::{self, Activation};

/// `a @ b`, with bf16 on CPU computed in f32 (candle's CPU gemm rejects
/// bf16) and cast back, so callers can stay dtype-agnostic. `to_dtype` has a
/// backward, so gradients still flow.
pub(crate) fn matmul(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    if a.dtype() == DType::BF16 && a.device().is_cpu() {
        a.to_dtype(DType::F32)?
            .matmul(&b.to_dtype(DType::F32)?)?
            .to_dtype(DType::BF16)
    } else {
        a.matmul(b)
    }
}

/// PyTorch `nn.Linear` on a 2-D input: `x [n, in] @ weight [out, in]^T + bias`.
///
/// The transposed weight is a strided view that gemm consumes directly, so
/// no copy of the weight is made in the forward or the backward pass.
pub(crate) fn linear(x: &Tensor, weight: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    let y = matmul(x, &weight.t()?)?;
    match bias {
        Some(b) => y.broadcast_add(b),
        None => Ok(y),
    }
}

/// `act(x @ weight^T + bias)`: one fused CPU op when `fused`, else the
/// composed candle ops (any device).
pub(crate) fn dense(
    x: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    act: Activation,
    fused: bool,
) -> Result<Tensor> {
    if fused {
        return kernels::linear(x, weight, bias, act);
    }
    let y = linear(x, weight, bias)?;
    match act {
        Activation::None => Ok(y),
        Activation::Relu => y.relu(),
        Activation::Gelu => y.gelu(),
    }
}

/// Layer normalisation over the last dimension, built from differentiable
/// ops. Statistics are computed in f32 for half-precision inputs (as
/// PyTorch autocast does), because a bf16 variance loses most of its bits.
pub(crate) fn layer_norm(x: &Tensor, weight: &Tensor, bias: &Tensor, eps: f64) -> Result<Tensor> {
    let dtype = x.dtype();
    let x = match dtype {
        DType::F16 | DType::BF16 => x.to_dtype(DType::F32)?,
        _ => x.clone(),
    };
    let mean = x.mean_keepdim(D::Minus1)?;
    let centred = x.broadcast_sub(&mean)?;
    let var = centred.sqr()?.mean_keepdim(D::Minus1)?;
    let normed = centred.broadcast_div(&(var + eps)?.sqrt()?)?;
    normed
        .to_dtype(dtype)?
        .broadcast_mul(weight)?
        .broadcast_add(bias)
}

/// Cross entropy of `logits [n, classes]` against `targets [n]` (u32),
/// averaged over `n`. Half-precision logits are promoted to f32 first: the
/// log-sum-exp of thousands of bf16 values is too coarse to train on.
pub(crate) fn cross_entropy(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    let logits = match logits.dtype() {
        DType::F32 | DType::F64 => logits.clone(),
        _ => logits.to_dtype(DType::F32)?,
    };
    candle_nn::loss::cross_entropy(&logits, targets)
}
