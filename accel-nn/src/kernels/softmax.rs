//! Softmax and log-softmax over the last dimension, with backward.
//!
//! candle's fused `softmax_last_dim` has no backward and its composed
//! `softmax` is five ops each way; these are one pass per row. Backward
//! reads the op's output (`res`), so nothing is kept between passes.

use candle_core::backend::BackendStorage;
use candle_core::{
    bail, CpuStorage, CudaStorage, CustomOp1, CustomOp2, Layout, Result, Shape, Tensor,
};

use super::raw::par;
use super::{as_f32, from_f32, math, rows_per_task, tensor_from_f32, with_f32};

/// Softmax (`log == false`) or log-softmax of every row.
struct Softmax {
    log: bool,
}

/// Softmax over the last dimension of a CPU tensor (or an f32 CUDA tensor,
/// `softmax.cu`; see `ops::softmax::CUDA_SOFTMAX_CHECKED`), differentiable.
pub(crate) fn softmax_last_dim(x: &Tensor) -> Result<Tensor> {
    x.contiguous()?.apply_op1(Softmax { log: false })
}

/// Log-softmax over the last dimension of a CPU tensor (or an f32 CUDA
/// tensor), differentiable.
pub(crate) fn log_softmax_last_dim(x: &Tensor) -> Result<Tensor> {
    x.contiguous()?.apply_op1(Softmax { log: true })
}

multiversion! {
    /// Softmax or log-softmax of every `d`-wide row of `x` into `y`.
    fn forward_rows(x: &[f32], y: &mut [f32], d: usize, log: bool) {
        for (y, x) in y.chunks_exact_mut(d).zip(x.chunks_exact(d)) {
            let max = math::max(x);
            let sum = math::sum_exp_shifted(x, max);
            if log {
                let lse = max + sum.ln();
                y.iter_mut().zip(x).for_each(|(y, &x)| *y = x - lse);
            } else {
                let inv = 1.0 / sum;
                y.iter_mut().zip(x).for_each(|(y, &x)| *y = math::exp(x - max) * inv);
            }
        }
    }
}

multiversion! {
    /// Input gradient of every row, in place over `g`: softmax
    /// `y * (g - <g, y>)`, log-softmax `g - exp(y) * sum(g)`.
    fn backward_rows(y: &[f32], g: &mut [f32], d: usize, log: bool) {
        for (g, y) in g.chunks_exact_mut(d).zip(y.chunks_exact(d)) {
            if log {
                let s = math::sum(g);
                g.iter_mut().zip(y).for_each(|(g, &y)| *g -= math::exp(y) * s);
            } else {
                let dot = math::dot(g, y);
                g.iter_mut().zip(y).for_each(|(g, &y)| *g = y * (*g - dot));
            }
        }
    }
}

impl CustomOp1 for Softmax {
    fn name(&self) -> &'static str {
        if self.log {
            "accel-log-softmax"
        } else {
            "accel-softmax"
        }
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let x = as_f32(s, l)?;
        let d = l.dims().last().copied().unwrap_or(1).max(1);
        let chunk = rows_per_task(x.len() / d, d) * d;
        let y = par::new_vec(x.len(), chunk, |i, y| {
            forward_rows(&x[i * chunk..][..y.len()], y, d, self.log)
        });
        Ok((from_f32(y, s.dtype())?, l.shape().clone()))
    }

    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
        let y = accel_kernels::cuda::softmax_rows((s, l), self.log)
            .map_err(candle_core::Error::wrap)?;
        Ok((y, l.shape().clone()))
    }

    fn bwd(&self, x: &Tensor, res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        if x.device().is_cuda() {
            let op = SoftmaxGrad { log: self.log };
            return Ok(Some(grad.contiguous()?.apply_op2_no_bwd(res, &op)?));
        }
        let d = x.dims().last().copied().unwrap_or(1).max(1);
        let g = with_f32(grad, |g| {
            with_f32(res, |y| {
                let chunk = rows_per_task(y.len() / d, d) * d;
                Ok(par::new_vec(g.len(), chunk, |i, out| {
                    out.copy_from_slice(&g[i * chunk..][..out.len()]);
                    backward_rows(&y[i * chunk..][..out.len()], out, d, self.log)
                }))
            })
        })?;
        Ok(Some(tensor_from_f32(g, x.shape(), x.dtype())?))
    }
}

/// The input gradient of [`Softmax`] on CUDA, as one op over `(grad, y)`
/// with no backward of its own.
struct SoftmaxGrad {
    log: bool,
}

impl CustomOp2 for SoftmaxGrad {
    fn name(&self) -> &'static str {
        "accel-softmax-grad"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        bail!("accel-softmax-grad runs on CUDA only (the CPU backward is Softmax::bwd)")
    }

    fn cuda_fwd(
        &self,
        g: &CudaStorage,
        gl: &Layout,
        y: &CudaStorage,
        yl: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let dx = accel_kernels::cuda::softmax_rows_backward((y, yl), (g, gl), self.log)
            .map_err(candle_core::Error::wrap)?;
        Ok((dx, yl.shape().clone()))
    }
}
