//! The CUDA twin of the tiled attention ([`super::flash`]): accel-kernels'
//! `attention.cu` as a candle op with backward. The forward keeps one
//! log-sum-exp per query row (`[b, h, t]` f32) for the backward, which
//! recomputes the probabilities tile by tile; nothing `[t, s]` is stored.

use std::sync::Mutex;

use candle_core::op::BackpropOp;
use candle_core::{
    bail, CpuStorage, CudaStorage, CustomOp3, Layout, Result, Shape, Storage, Tensor,
};

use accel_kernels::cuda::FlashMask;

use super::MaskSpec;

/// Whether the CUDA kernels take these operands: one float dtype, a head
/// dim up to `FLASH_MAX_HEAD_DIM`, a bias (if any) that is a constant.
pub(crate) fn cuda_supported(q: &Tensor, k: &Tensor, v: &Tensor) -> bool {
    let d = q.dims().last().copied().unwrap_or(0);
    let same = k.dtype() == q.dtype() && v.dtype() == q.dtype();
    same && accel_kernels::cuda::flash_supported(q.dtype(), d)
}

/// `softmax(q k^T * scale + mask) v` on CUDA for q `[b, h, t, d]` and k, v
/// `[b, kv_h, s, d]`, differentiable in q, k and v. Views are read in place
/// when their last dimension is contiguous.
pub(crate) fn attention_cuda(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: MaskSpec,
    scale: f64,
) -> Result<Tensor> {
    let unit = |t: &Tensor| -> Result<Tensor> {
        if t.stride().last() == Some(&1) {
            Ok(t.clone())
        } else {
            t.contiguous()
        }
    };
    let op = FlashCuda {
        mask: FlashMask {
            scale: scale as f32,
            causal_offset: mask.causal_offset,
            window: mask.window,
        },
        bias: mask.bias,
        lse: Mutex::new(None),
    };
    unit(q)?.apply_op3(&unit(k)?, &unit(v)?, op)
}

struct FlashCuda {
    mask: FlashMask,
    /// f32, broadcast to `[b, h, t, s]`.
    bias: Option<Tensor>,
    /// The forward's log-sum-exps, for backward.
    lse: Mutex<Option<Tensor>>,
}

/// Runs `f` on the CUDA storage of `t`.
fn with_cuda<R>(t: &Tensor, f: impl FnOnce(&CudaStorage, &Layout) -> Result<R>) -> Result<R> {
    let (storage, layout) = t.storage_and_layout();
    match &*storage {
        Storage::Cuda(s) => f(s, layout),
        _ => bail!("accel-attention-cuda: an operand is not on a CUDA device"),
    }
}

/// Runs `f` with the bias's storage, if there is a bias.
fn with_bias<R>(
    bias: Option<&Tensor>,
    f: impl FnOnce(Option<(&CudaStorage, &Layout)>) -> Result<R>,
) -> Result<R> {
    match bias {
        Some(b) => with_cuda(b, |s, l| f(Some((s, l)))),
        None => f(None),
    }
}

fn tensor(s: CudaStorage, shape: &[usize]) -> Tensor {
    Tensor::from_storage(Storage::Cuda(s), shape, BackpropOp::none(), false)
}

impl CustomOp3 for FlashCuda {
    fn name(&self) -> &'static str {
        "accel-attention-cuda"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        bail!("accel-attention-cuda runs on CUDA only (CPU tensors take the tiled CPU kernel)")
    }

    fn cuda_fwd(
        &self,
        q: &CudaStorage,
        ql: &Layout,
        k: &CudaStorage,
        kl: &Layout,
        v: &CudaStorage,
        vl: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let (o, lse) = with_bias(self.bias.as_ref(), |bias| {
            accel_kernels::cuda::flash_attention_forward((q, ql), (k, kl), (v, vl), bias, self.mask)
                .map_err(candle_core::Error::wrap)
        })?;
        let dims = ql.dims();
        *self.lse.lock().unwrap() = Some(tensor(lse, &dims[..3]));
        Ok((o, ql.shape().clone()))
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let Some(lse) = self.lse.lock().unwrap().clone() else {
            bail!("accel-attention-cuda: backward without its forward state")
        };
        let (o, g) = (res.contiguous()?, grad.contiguous()?);
        let (dq, dk, dv) = with_cuda(q, |qs, ql| {
            with_cuda(k, |ks, kl| {
                with_cuda(v, |vs, vl| {
                    with_cuda(&o, |os, ol| {
                        with_cuda(&g, |gs, gl| {
                            with_cuda(&lse, |ls, ll| {
                                with_bias(self.bias.as_ref(), |bias| {
                                    accel_kernels::cuda::flash_attention_backward(
                                        (qs, ql),
                                        (ks, kl),
                                        (vs, vl),
                                        (os, ol),
                                        (gs, gl),
                                        (ls, ll),
                                        bias,
                                        self.mask,
                                    )
                                    .map_err(candle_core::Error::wrap)
                                })
                            })
                        })
                    })
                })
            })
        })?;
        let grad_of = |t: &Tensor, s: CudaStorage| t.track_op().then(|| tensor(s, t.dims()));
        Ok((grad_of(q, dq), grad_of(k, dk), grad_of(v, dv)))
    }
}
