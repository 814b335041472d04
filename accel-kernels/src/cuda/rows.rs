//! Row-wise kernels on a `[rows, d]` f32 matrix (`rownorm.cu`): layer norm
//! and RMS norm over the last dimension, forward and backward. They take
//! candle storages and layouts, which is what a `CustomOp`'s `cuda_fwd` is
//! handed, so that accel-nn's norm ops run as one kernel forward and three
//! backward on CUDA instead of some thirty composed candle ops, each with its
//! own allocation and launch (the GPU training step of BENCHMARKS.md is bound by
//! exactly that host work).
//!
//! Operands go to the kernels as cudarc views, so cudarc's per-allocation
//! events order them against other streams like any candle op.

use candle_core::cuda::CudaStorage;
use candle_core::Layout;
use cudarc::driver::CudaSlice;

use super::args::{RowArgs, ROWS_PER_PARTIAL};
use super::compile::WrapDriver;
use super::launch::launch_rows;
use super::operands::f32_view;
use crate::{Error, Result};

/// `(rows, d)` of `x` normalised over its last dimension with a `[d]`
/// weight (and bias).
fn rows_and_width(
    op: &'static str,
    xl: &Layout,
    wl: &Layout,
    bl: Option<&Layout>,
) -> Result<(usize, usize)> {
    let d = wl.shape().elem_count();
    let fits =
        xl.dims().last() == Some(&d) && wl.dims() == [d] && bl.is_none_or(|b| b.dims() == [d]);
    if !fits || d == 0 {
        return Err(Error::InvalidArgument {
            op,
            reason: format!(
                "x {:?}, weight {:?}, bias {:?} do not fit",
                xl.dims(),
                wl.dims(),
                bl.map(|b| b.dims().to_vec())
            ),
        });
    }
    let rows = xl.shape().elem_count() / d;
    let small = |n: usize| u32::try_from(n).is_ok();
    if !small(rows) || !small(d) {
        return Err(Error::InvalidArgument {
            op,
            reason: format!("{rows} rows of {d} exceed one launch"),
        });
    }
    Ok((rows, d))
}

/// Layer norm (`rms`: RMS norm, no bias) of the f32 matrix `x` over its last
/// dimension: `(x - mean) * rstd * w [+ b]` with the biased variance, as
/// accel-nn's CPU kernel computes it. Returns a new storage of `x`'s shape.
///
/// # Errors
/// Non-f32 or non-contiguous operands, shapes that do not fit, driver errors.
pub fn row_norm_forward(
    x: (&CudaStorage, &Layout),
    w: (&CudaStorage, &Layout),
    b: Option<(&CudaStorage, &Layout)>,
    eps: f32,
    rms: bool,
) -> Result<CudaStorage> {
    const OP: &str = "row_norm_forward";
    let (rows, d) = rows_and_width(OP, x.1, w.1, b.map(|b| b.1))?;
    let dev = x.0.device.clone();
    let stream = dev.cuda_stream();
    let xv = f32_view(OP, 0, x.0, x.1)?;
    let wv = f32_view(OP, 1, w.0, w.1)?;
    let bv = b.map(|(s, l)| f32_view(OP, 2, s, l)).transpose()?;
    // Zeroed (cudarc's unset `alloc` is unsafe): the kernel writes every
    // element anyway.
    let mut y: CudaSlice<f32> = stream.alloc_zeros(rows * d).w(OP, "alloc")?;
    if rows > 0 {
        launch_rows(
            OP,
            &dev,
            RowArgs::Forward {
                x: &xv,
                w: &wv,
                b: bv.as_ref(),
                y: &mut y,
                rows: rows as u32,
                d: d as u32,
                eps,
                rms,
            },
        )?;
    }
    Ok(CudaStorage::wrap_cuda_slice(y, dev))
}

/// The gradients of [`row_norm_forward`] for the output gradient `g`:
/// one f32 storage holding `dx` (`rows * d` elements, `x`'s layout), then
/// `dw` and `db` (`d` each; `db` is the bias gradient, unused for RMS norm).
///
/// # Errors
/// As [`row_norm_forward`]; `g` must have `x`'s shape.
pub fn row_norm_backward(
    x: (&CudaStorage, &Layout),
    w: (&CudaStorage, &Layout),
    g: (&CudaStorage, &Layout),
    eps: f32,
    rms: bool,
) -> Result<CudaStorage> {
    const OP: &str = "row_norm_backward";
    let (rows, d) = rows_and_width(OP, x.1, w.1, None)?;
    if g.1.dims() != x.1.dims() {
        return Err(Error::InvalidArgument {
            op: OP,
            reason: format!("gradient {:?} for x {:?}", g.1.dims(), x.1.dims()),
        });
    }
    let dev = x.0.device.clone();
    let stream = dev.cuda_stream();
    let xv = f32_view(OP, 0, x.0, x.1)?;
    let wv = f32_view(OP, 1, w.0, w.1)?;
    let gv = f32_view(OP, 2, g.0, g.1)?;
    let n = rows * d;
    let mut out: CudaSlice<f32> = stream.alloc_zeros(n + 2 * d).w(OP, "alloc")?;
    if rows > 0 {
        let blocks = rows.div_ceil(ROWS_PER_PARTIAL);
        let mut stats: CudaSlice<f32> = stream.alloc_zeros(2 * rows).w(OP, "alloc")?;
        let mut pw: CudaSlice<f32> = stream.alloc_zeros(blocks * d).w(OP, "alloc")?;
        let mut pb: CudaSlice<f32> = stream.alloc_zeros(blocks * d).w(OP, "alloc")?;
        let (rows32, d32) = (rows as u32, d as u32);
        {
            let mut dx = out.slice_mut(0..n);
            launch_rows(
                OP,
                &dev,
                RowArgs::BackwardDx {
                    x: &xv,
                    w: &wv,
                    g: &gv,
                    dx: &mut dx,
                    stats: &mut stats,
                    rows: rows32,
                    d: d32,
                    eps,
                    rms,
                },
            )?;
        }
        launch_rows(
            OP,
            &dev,
            RowArgs::BackwardPartials {
                x: &xv,
                g: &gv,
                stats: &stats,
                pw: &mut pw,
                pb: &mut pb,
                rows: rows32,
                d: d32,
            },
        )?;
        let mut dwdb = out.slice_mut(n..n + 2 * d);
        launch_rows(
            OP,
            &dev,
            RowArgs::BackwardSum {
                pw: &pw,
                pb: &pb,
                dwdb: &mut dwdb,
                blocks: blocks as u32,
                d: d32,
            },
        )?;
    }
    Ok(CudaStorage::wrap_cuda_slice(out, dev))
}

/// `(rows, d)` of a matrix taken over its last dimension, both within one launch.
fn rows_of(op: &'static str, l: &Layout) -> Result<(usize, usize)> {
    let d = l.dims().last().copied().unwrap_or(1).max(1);
    let rows = l.shape().elem_count() / d;
    if u32::try_from(rows).is_err() || u32::try_from(d).is_err() {
        return Err(Error::InvalidArgument {
            op,
            reason: format!("{rows} rows of {d} exceed one launch"),
        });
    }
    Ok((rows, d))
}

/// Softmax (`log`: log-softmax) of the f32 matrix `x` over its last
/// dimension, as accel-nn's CPU kernel computes it (to a few ulps).
///
/// # Errors
/// A non-f32 or non-contiguous operand, too many rows, driver errors.
pub fn softmax_rows(x: (&CudaStorage, &Layout), log: bool) -> Result<CudaStorage> {
    const OP: &str = "softmax_rows";
    let (rows, d) = rows_of(OP, x.1)?;
    let dev = x.0.device.clone();
    let xv = f32_view(OP, 0, x.0, x.1)?;
    let mut y: CudaSlice<f32> = dev.cuda_stream().alloc_zeros(rows * d).w(OP, "alloc")?;
    if rows > 0 {
        let args = RowArgs::Softmax {
            x: &xv,
            y: &mut y,
            rows: rows as u32,
            d: d as u32,
            log,
        };
        launch_rows(OP, &dev, args)?;
    }
    Ok(CudaStorage::wrap_cuda_slice(y, dev))
}

/// The input gradient of [`softmax_rows`] from its output `y` and the output
/// gradient `g`.
///
/// # Errors
/// As [`softmax_rows`]; `g` must have `y`'s shape.
pub fn softmax_rows_backward(
    y: (&CudaStorage, &Layout),
    g: (&CudaStorage, &Layout),
    log: bool,
) -> Result<CudaStorage> {
    const OP: &str = "softmax_rows_backward";
    if y.1.dims() != g.1.dims() {
        return Err(Error::InvalidArgument {
            op: OP,
            reason: format!("gradient {:?} for output {:?}", g.1.dims(), y.1.dims()),
        });
    }
    let (rows, d) = rows_of(OP, y.1)?;
    let dev = y.0.device.clone();
    let yv = f32_view(OP, 0, y.0, y.1)?;
    let gv = f32_view(OP, 1, g.0, g.1)?;
    let mut dx: CudaSlice<f32> = dev.cuda_stream().alloc_zeros(rows * d).w(OP, "alloc")?;
    if rows > 0 {
        let args = RowArgs::SoftmaxBackward {
            y: &yv,
            g: &gv,
            dx: &mut dx,
            rows: rows as u32,
            d: d as u32,
            log,
        };
        launch_rows(OP, &dev, args)?;
    }
    Ok(CudaStorage::wrap_cuda_slice(dx, dev))
}
