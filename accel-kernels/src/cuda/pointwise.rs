//! Element-wise kernels on f32 storages (`act.cu`): SwiGLU and the
//! pointwise activations, forward and backward, for accel-nn's `swiglu` and
//! activations on CUDA, one launch each instead of the composed path's
//! several ops forward and more backward (an exact GELU backward composes a
//! dozen). Like the row norms
//! they take candle storages and layouts, what a `CustomOp`'s `cuda_fwd` is
//! handed, and write a new storage.

use candle_core::cuda::CudaStorage;
use candle_core::Layout;
use cudarc::driver::CudaSlice;

use super::args::PointwiseArgs;
use super::compile::WrapDriver;
use super::launch::launch_pointwise;
use super::operands::f32_view;
pub use crate::activation::Activation;
use crate::{Error, Result};

/// The element count every operand must share.
fn same_shape(op: &'static str, layouts: &[&Layout]) -> Result<usize> {
    let first = layouts[0].dims();
    if let Some(other) = layouts.iter().find(|l| l.dims() != first) {
        return Err(Error::InvalidArgument {
            op,
            reason: format!("operands {first:?} and {:?} differ", other.dims()),
        });
    }
    Ok(layouts[0].shape().elem_count())
}

/// `silu(g) * u` of two f32 storages of one shape, as accel-nn's CPU
/// kernel computes it (to a few ulps: `expf` is not its `exp`).
///
/// # Errors
/// Non-f32 or non-contiguous operands, different shapes, driver errors.
pub fn swiglu_forward(
    g: (&CudaStorage, &Layout),
    u: (&CudaStorage, &Layout),
) -> Result<CudaStorage> {
    const OP: &str = "swiglu_forward";
    let n = same_shape(OP, &[g.1, u.1])?;
    let dev = g.0.device.clone();
    let gv = f32_view(OP, 0, g.0, g.1)?;
    let uv = f32_view(OP, 1, u.0, u.1)?;
    // Zeroed (cudarc's unset `alloc` is unsafe): the kernel writes every element.
    let mut y: CudaSlice<f32> = dev.cuda_stream().alloc_zeros(n).w(OP, "alloc")?;
    if n > 0 {
        let args = PointwiseArgs::SwigluForward {
            g: &gv,
            u: &uv,
            y: &mut y,
            n: n as u64,
        };
        launch_pointwise(OP, &dev, args)?;
    }
    Ok(CudaStorage::wrap_cuda_slice(y, dev))
}

/// The gradients of [`swiglu_forward`] for the output gradient `dy`: one
/// f32 storage of `2 n` elements, the gate's gradient then the up
/// projection's.
///
/// # Errors
/// As [`swiglu_forward`]; `dy` must have the operands' shape.
pub fn swiglu_backward(
    g: (&CudaStorage, &Layout),
    u: (&CudaStorage, &Layout),
    dy: (&CudaStorage, &Layout),
) -> Result<CudaStorage> {
    const OP: &str = "swiglu_backward";
    let n = same_shape(OP, &[g.1, u.1, dy.1])?;
    let dev = g.0.device.clone();
    let gv = f32_view(OP, 0, g.0, g.1)?;
    let uv = f32_view(OP, 1, u.0, u.1)?;
    let dyv = f32_view(OP, 2, dy.0, dy.1)?;
    let mut dgu: CudaSlice<f32> = dev.cuda_stream().alloc_zeros(2 * n).w(OP, "alloc")?;
    if n > 0 {
        let args = PointwiseArgs::SwigluBackward {
            g: &gv,
            u: &uv,
            dy: &dyv,
            dgu: &mut dgu,
            n: n as u64,
        };
        launch_pointwise(OP, &dev, args)?;
    }
    Ok(CudaStorage::wrap_cuda_slice(dgu, dev))
}

/// `act(x)` of an f32 storage, as accel-nn's CPU kernel computes it (to a
/// few ulps: `erff`, `tanhf` and `expf` are not its approximations).
///
/// # Errors
/// A non-f32 or non-contiguous operand, driver errors.
pub fn activation_forward(x: (&CudaStorage, &Layout), act: Activation) -> Result<CudaStorage> {
    const OP: &str = "activation_forward";
    let n = x.1.shape().elem_count();
    let dev = x.0.device.clone();
    let xv = f32_view(OP, 0, x.0, x.1)?;
    let mut y: CudaSlice<f32> = dev.cuda_stream().alloc_zeros(n).w(OP, "alloc")?;
    if n > 0 {
        let args = PointwiseArgs::ActForward {
            x: &xv,
            y: &mut y,
            n: n as u64,
            act: act as i32,
        };
        launch_pointwise(OP, &dev, args)?;
    }
    Ok(CudaStorage::wrap_cuda_slice(y, dev))
}

/// `dy * act'(x)`, the input gradient of [`activation_forward`].
///
/// # Errors
/// As [`activation_forward`]; `dy` must have `x`'s shape.
pub fn activation_backward(
    x: (&CudaStorage, &Layout),
    dy: (&CudaStorage, &Layout),
    act: Activation,
) -> Result<CudaStorage> {
    const OP: &str = "activation_backward";
    let n = same_shape(OP, &[x.1, dy.1])?;
    let dev = x.0.device.clone();
    let xv = f32_view(OP, 0, x.0, x.1)?;
    let dyv = f32_view(OP, 1, dy.0, dy.1)?;
    let mut dx: CudaSlice<f32> = dev.cuda_stream().alloc_zeros(n).w(OP, "alloc")?;
    if n > 0 {
        let args = PointwiseArgs::ActBackward {
            x: &xv,
            dy: &dyv,
            dx: &mut dx,
            n: n as u64,
            act: act as i32,
        };
        launch_pointwise(OP, &dev, args)?;
    }
    Ok(CudaStorage::wrap_cuda_slice(dx, dev))
}

/// Rotates `x [b, h, t, d]` (f32) by the angles whose cos and sin are
/// `[t, d/2]`: pairs `(i, i + d/2)`, or `(2i, 2i + 1)` when `interleaved`;
/// `inverse` rotates back (the backward). Bitwise accel-nn's CPU kernel.
///
/// # Errors
/// Non-f32 or non-contiguous operands, tables that do not fit `x`, driver errors.
pub fn rope_rotate(
    x: (&CudaStorage, &Layout),
    cos: (&CudaStorage, &Layout),
    sin: (&CudaStorage, &Layout),
    interleaved: bool,
    inverse: bool,
) -> Result<CudaStorage> {
    const OP: &str = "rope_rotate";
    let dims = x.1.dims();
    let fits = dims.len() == 4
        && dims[3].is_multiple_of(2)
        && cos.1.dims() == [dims[2], dims[3] / 2]
        && sin.1.dims() == cos.1.dims();
    let (t, d) = (dims.get(2).copied(), dims.get(3).copied());
    let small = |v: Option<usize>| v.and_then(|v| u32::try_from(v).ok()).filter(|&v| v > 0);
    let (Some(t), Some(d), true) = (small(t), small(d), fits) else {
        return Err(Error::InvalidArgument {
            op: OP,
            reason: format!(
                "x {dims:?} needs cos and sin [t, d/2], got {:?} and {:?}",
                cos.1.dims(),
                sin.1.dims()
            ),
        });
    };
    let n = x.1.shape().elem_count();
    let dev = x.0.device.clone();
    let xv = f32_view(OP, 0, x.0, x.1)?;
    let cv = f32_view(OP, 1, cos.0, cos.1)?;
    let sv = f32_view(OP, 2, sin.0, sin.1)?;
    let mut y: CudaSlice<f32> = dev.cuda_stream().alloc_zeros(n).w(OP, "alloc")?;
    if n > 0 {
        let args = PointwiseArgs::Rope {
            x: &xv,
            cos: &cv,
            sin: &sv,
            y: &mut y,
            rows: (n / d as usize) as u64,
            t,
            d,
            interleaved,
            sign: if inverse { -1.0 } else { 1.0 },
        };
        launch_pointwise(OP, &dev, args)?;
    }
    Ok(CudaStorage::wrap_cuda_slice(y, dev))
}
