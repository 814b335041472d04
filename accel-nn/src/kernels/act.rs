//! Pointwise activations and SwiGLU as single ops with fused backward.
//!
//! A composed exact GELU backward is a dozen candle ops, each a pass over
//! memory and a thread hand-off; here forward and backward are one pass.

use candle_core::backend::BackendStorage;
use candle_core::{
    bail, CpuStorage, CudaStorage, CustomOp1, CustomOp2, CustomOp3, Layout, Result, Shape, Tensor,
};

use super::raw::par;
use super::{as_f32, from_f32, math, tensor_from_f32, with_f32, CHUNK};

/// Pointwise function of the fused kernels (`None` is the identity, used
/// by `linear` without an activation).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Act {
    /// Identity.
    None,
    /// `max(x, 0)`.
    Relu,
    /// GELU, tanh approximation.
    GeluTanh,
    /// GELU, exact (erf).
    Gelu,
    /// `x * sigmoid(x)`.
    Silu,
}

multiversion! {
    /// `y = act(x)` elementwise.
    fn act_forward(act: Act, x: &[f32], y: &mut [f32]) {
        let it = y.iter_mut().zip(x);
        match act {
            Act::None => it.for_each(|(y, &x)| *y = x),
            Act::Relu => it.for_each(|(y, &x)| *y = x.max(0.0)),
            Act::GeluTanh => it.for_each(|(y, &x)| *y = math::gelu_tanh(x)),
            Act::Gelu => it.for_each(|(y, &x)| *y = math::gelu_erf(x)),
            Act::Silu => it.for_each(|(y, &x)| *y = math::silu(x)),
        }
    }
}

multiversion! {
    /// `g *= act'(x)` elementwise.
    fn act_backward(act: Act, x: &[f32], g: &mut [f32]) {
        let it = g.iter_mut().zip(x);
        match act {
            Act::None => {}
            Act::Relu => it.for_each(|(g, &x)| if x <= 0.0 { *g = 0.0 }),
            Act::GeluTanh => it.for_each(|(g, &x)| *g *= math::gelu_tanh_grad(x)),
            Act::Gelu => it.for_each(|(g, &x)| *g *= math::gelu_erf_grad(x)),
            Act::Silu => it.for_each(|(g, &x)| *g *= math::silu_grad(x)),
        }
    }
}

/// `act(x)` as a new buffer, in parallel chunks.
pub(super) fn forward_new(act: Act, x: &[f32]) -> Vec<f32> {
    par::new_vec(x.len(), CHUNK, |i, y| {
        act_forward(act, &x[i * CHUNK..][..y.len()], y)
    })
}

/// `g * act'(x)` as a new buffer, in parallel chunks.
pub(super) fn copy_backward(act: Act, x: &[f32], g: &[f32]) -> Vec<f32> {
    par::new_vec(g.len(), CHUNK, |i, d| {
        d.copy_from_slice(&g[i * CHUNK..][..d.len()]);
        act_backward(act, &x[i * CHUNK..][..d.len()], d)
    })
}

struct Pointwise(Act);

impl Act {
    /// The same function in the CUDA kernels.
    fn cuda(self) -> accel_kernels::cuda::Activation {
        use accel_kernels::cuda::Activation as A;
        match self {
            Act::None => A::Identity,
            Act::Relu => A::Relu,
            Act::GeluTanh => A::GeluTanh,
            Act::Gelu => A::Gelu,
            Act::Silu => A::Silu,
        }
    }
}

/// `act(x)` elementwise, differentiable: a CPU tensor of the fused dtypes,
/// or an f32 CUDA tensor (`act.cu`; see `ops::CUDA_ACTIVATIONS_CHECKED`).
pub(crate) fn pointwise(x: &Tensor, act: Act) -> Result<Tensor> {
    x.contiguous()?.apply_op1(Pointwise(act))
}

impl CustomOp1 for Pointwise {
    fn name(&self) -> &'static str {
        "accel-activation"
    }

    fn backward_reads_output(&self) -> bool {
        false
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let x = as_f32(s, l)?;
        let y = forward_new(self.0, &x);
        Ok((from_f32(y, s.dtype())?, l.shape().clone()))
    }

    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
        let y = accel_kernels::cuda::activation_forward((s, l), self.0.cuda())
            .map_err(candle_core::Error::wrap)?;
        Ok((y, l.shape().clone()))
    }

    fn bwd(&self, x: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        if x.device().is_cuda() {
            let dx = grad
                .contiguous()?
                .apply_op2_no_bwd(x, &PointwiseGrad(self.0))?;
            return Ok(Some(dx));
        }
        let g = with_f32(grad, |g| with_f32(x, |x| Ok(copy_backward(self.0, x, g))))?;
        Ok(Some(tensor_from_f32(g, x.shape(), x.dtype())?))
    }
}

struct SwiGlu;

/// `silu(gate) * up` on tensors of one shape, differentiable in both: CPU
/// tensors of the fused dtypes, or f32 CUDA tensors (`act.cu`, one kernel
/// each way; `ops::swiglu` does not route CUDA tensors here until a GPU run
/// has checked them against this CPU kernel, see
/// `ops::CUDA_ACTIVATIONS_CHECKED`).
pub(crate) fn swiglu(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    gate.contiguous()?.apply_op2(&up.contiguous()?, SwiGlu)
}

multiversion! {
    /// `y = silu(g) * u`.
    fn swiglu_forward(g: &[f32], u: &[f32], y: &mut [f32]) {
        for ((y, &g), &u) in y.iter_mut().zip(g).zip(u) {
            *y = math::silu(g) * u;
        }
    }
}

multiversion! {
    /// `dg = dy * u * silu'(g)` and `du = dy * silu(g)`.
    fn swiglu_backward(g: &[f32], u: &[f32], dy: &[f32], dg: &mut [f32], du: &mut [f32]) {
        for i in 0..dg.len() {
            dg[i] = dy[i] * u[i] * math::silu_grad(g[i]);
            du[i] = dy[i] * math::silu(g[i]);
        }
    }
}

impl CustomOp2 for SwiGlu {
    fn name(&self) -> &'static str {
        "accel-swiglu"
    }

    fn backward_reads_output(&self) -> bool {
        false
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        if l1.shape() != l2.shape() {
            bail!("swiglu: gate {:?} and up {:?} differ", l1.dims(), l2.dims())
        }
        let (g, u) = (as_f32(s1, l1)?, as_f32(s2, l2)?);
        let y = par::new_vec(g.len(), CHUNK, |i, y| {
            let at = i * CHUNK..i * CHUNK + y.len();
            swiglu_forward(&g[at.clone()], &u[at], y)
        });
        Ok((from_f32(y, s1.dtype())?, l1.shape().clone()))
    }

    fn cuda_fwd(
        &self,
        s1: &CudaStorage,
        l1: &Layout,
        s2: &CudaStorage,
        l2: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let y = accel_kernels::cuda::swiglu_forward((s1, l1), (s2, l2))
            .map_err(candle_core::Error::wrap)?;
        Ok((y, l1.shape().clone()))
    }

    fn bwd(
        &self,
        gate: &Tensor,
        up: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        if gate.device().is_cuda() {
            // One op computing both gradients into one buffer (`[dg | du]`),
            // then views of it.
            let n = gate.elem_count();
            let packed = grad.contiguous()?.apply_op3_no_bwd(gate, up, &SwiGluGrad)?;
            return Ok((
                Some(packed.narrow(0, 0, n)?.reshape(gate.shape())?),
                Some(packed.narrow(0, n, n)?.reshape(up.shape())?),
            ));
        }
        let n = gate.elem_count();
        let (mut dg, mut du) = (vec![0f32; n], vec![0f32; n]);
        with_f32(gate, |g| {
            with_f32(up, |u| {
                with_f32(grad, |dy| {
                    par::chunks_mut2(&mut dg, CHUNK, &mut du, CHUNK, |i, dg, du| {
                        let at = i * CHUNK..i * CHUNK + dg.len();
                        swiglu_backward(&g[at.clone()], &u[at.clone()], &dy[at], dg, du)
                    });
                    Ok(())
                })
            })
        })?;
        Ok((
            Some(tensor_from_f32(dg, gate.shape(), gate.dtype())?),
            Some(tensor_from_f32(du, up.shape(), up.dtype())?),
        ))
    }
}

/// The input gradient of [`Pointwise`] on CUDA, as one op over `(grad, x)`
/// with no backward of its own.
struct PointwiseGrad(Act);

impl CustomOp2 for PointwiseGrad {
    fn name(&self) -> &'static str {
        "accel-activation-grad"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        bail!("accel-activation-grad runs on CUDA only (the CPU backward is Pointwise::bwd)")
    }

    fn cuda_fwd(
        &self,
        dy: &CudaStorage,
        dyl: &Layout,
        x: &CudaStorage,
        xl: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let dx = accel_kernels::cuda::activation_backward((x, xl), (dy, dyl), self.0.cuda())
            .map_err(candle_core::Error::wrap)?;
        Ok((dx, xl.shape().clone()))
    }
}

/// The gradients of [`SwiGlu`] on CUDA, as one op over `(grad, gate, up)`
/// with no backward of its own.
struct SwiGluGrad;

impl CustomOp3 for SwiGluGrad {
    fn name(&self) -> &'static str {
        "accel-swiglu-grad"
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
        bail!("accel-swiglu-grad runs on CUDA only (the CPU backward is SwiGlu::bwd)")
    }

    fn cuda_fwd(
        &self,
        dy: &CudaStorage,
        dyl: &Layout,
        g: &CudaStorage,
        gl: &Layout,
        u: &CudaStorage,
        ul: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let out = accel_kernels::cuda::swiglu_backward((g, gl), (u, ul), (dy, dyl))
            .map_err(candle_core::Error::wrap)?;
        Ok((out, Shape::from(2 * gl.shape().elem_count())))
    }
}
