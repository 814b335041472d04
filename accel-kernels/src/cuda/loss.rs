//! Mean cross entropy on CUDA (`loss.cu`) for accel-nn's `cross_entropy`:
//! per-row log-sum-exp and loss (a warp a row), their mean over the counted
//! rows in one fixed-order block, and the logits' gradient, with the count
//! and the upstream gradient read on the device, never on the host.

use candle_core::cuda::CudaStorage;
use candle_core::Layout;
use cudarc::driver::{CudaSlice, CudaView};

use super::args::LossArgs;
use super::compile::WrapDriver;
use super::launch::launch_loss;
use super::operands::{f32_view, view};
use crate::{Error, Result};

/// `(rows, classes)` of `[n, c]` logits with `[n]` targets.
fn dims(op: &'static str, xl: &Layout, tl: &Layout) -> Result<(u32, u32)> {
    let fits = matches!(xl.dims(), [n, c] if tl.dims() == [*n] && *c > 0);
    let small = |v: usize| u32::try_from(v).ok();
    match (fits, xl.dims()) {
        (true, &[n, c]) if small(n).is_some() && small(c).is_some() => Ok((n as u32, c as u32)),
        _ => Err(Error::InvalidArgument {
            op,
            reason: format!(
                "logits {:?} and targets {:?} are not [n, c] and [n]",
                xl.dims(),
                tl.dims()
            ),
        }),
    }
}

/// The contiguous u32 targets.
fn u32_view<'a>(op: &'static str, s: &'a CudaStorage, l: &Layout) -> Result<CudaView<'a, u32>> {
    view(op, 1, s, l)
}

/// Per-row log-sum-exp, the mean loss and the count of counted rows.
fn rows_and_mean(
    op: &'static str,
    x: &CudaView<'_, f32>,
    t: &CudaView<'_, u32>,
    dev: &candle_core::cuda::CudaDevice,
    (rows, c): (u32, u32),
) -> Result<(CudaSlice<f32>, CudaSlice<f32>, CudaSlice<f32>)> {
    let stream = dev.cuda_stream();
    let r = rows as usize;
    let mut lse: CudaSlice<f32> = stream.alloc_zeros(r.max(1)).w(op, "alloc")?;
    let mut loss: CudaSlice<f32> = stream.alloc_zeros(r.max(1)).w(op, "alloc")?;
    let mut mean: CudaSlice<f32> = stream.alloc_zeros(1).w(op, "alloc")?;
    let mut count: CudaSlice<f32> = stream.alloc_zeros(1).w(op, "alloc")?;
    if rows > 0 {
        let args = LossArgs::Rows {
            x,
            t,
            lse: &mut lse,
            loss: &mut loss,
            rows,
            c,
        };
        launch_loss(op, dev, args)?;
        let args = LossArgs::Mean {
            loss: &loss,
            t,
            mean: &mut mean,
            count: &mut count,
            rows,
        };
        launch_loss(op, dev, args)?;
    }
    Ok((lse, mean, count))
}

/// The mean cross entropy of f32 logits `[n, c]` against u32 targets `[n]`
/// (`u32::MAX`: ignored), as an f32 scalar storage: accel-nn's CPU kernel's
/// formula, to a few ulps. A target out of range makes it NaN.
///
/// # Errors
/// Wrong dtypes or shapes, non-contiguous operands, driver errors.
pub fn cross_entropy_forward(
    logits: (&CudaStorage, &Layout),
    targets: (&CudaStorage, &Layout),
) -> Result<CudaStorage> {
    const OP: &str = "cross_entropy_forward";
    let (rows, c) = dims(OP, logits.1, targets.1)?;
    let dev = logits.0.device.clone();
    let x = f32_view(OP, 0, logits.0, logits.1)?;
    let t = u32_view(OP, targets.0, targets.1)?;
    let (_, mean, _) = rows_and_mean(OP, &x, &t, &dev, (rows, c))?;
    Ok(CudaStorage::wrap_cuda_slice(mean, dev))
}

/// The logits' gradient of [`cross_entropy_forward`] for the scalar
/// upstream gradient `dy` (read on the device).
///
/// # Errors
/// As [`cross_entropy_forward`]; `dy` must be an f32 scalar.
pub fn cross_entropy_backward(
    logits: (&CudaStorage, &Layout),
    targets: (&CudaStorage, &Layout),
    dy: (&CudaStorage, &Layout),
) -> Result<CudaStorage> {
    const OP: &str = "cross_entropy_backward";
    let (rows, c) = dims(OP, logits.1, targets.1)?;
    if dy.1.shape().elem_count() != 1 {
        return Err(Error::InvalidArgument {
            op: OP,
            reason: format!("the upstream gradient is {:?}, not a scalar", dy.1.dims()),
        });
    }
    let dev = logits.0.device.clone();
    let x = f32_view(OP, 0, logits.0, logits.1)?;
    let t = u32_view(OP, targets.0, targets.1)?;
    let g = f32_view(OP, 2, dy.0, dy.1)?;
    let (lse, _, count) = rows_and_mean(OP, &x, &t, &dev, (rows, c))?;
    let n = rows as usize * c as usize;
    let mut dx: CudaSlice<f32> = dev.cuda_stream().alloc_zeros(n.max(1)).w(OP, "alloc")?;
    if n > 0 {
        let args = LossArgs::Grad {
            x: &x,
            t: &t,
            lse: &lse,
            dy: &g,
            count: &count,
            dx: &mut dx,
            rows,
            c,
        };
        launch_loss(OP, &dev, args)?;
    }
    Ok(CudaStorage::wrap_cuda_slice(dx, dev))
}
