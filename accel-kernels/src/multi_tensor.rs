//! The public multi-tensor API: validates the lists, then runs the fused
//! CPU kernels for host tensors, the fused CUDA kernels for CUDA tensors
//! (with the `cuda` feature) and the tensor-op fallback for any other
//! device.

use candle_core::{DType, Device, Tensor};
use half::vec::HalfBitsVecExt;
use half::{bf16, f16};

use crate::cpu::{self, Plan};
use crate::slices::{
    check_no_alias, with_float_slices, with_float_slices_mut, FloatSlice, FloatSliceMut, ListArg,
};
use crate::validate::{
    check_contiguous, check_dtype, check_float, check_pairs, common_device, contiguous_inputs,
    for_each_group_mut, groups, is_float,
};
use crate::{cuda, fallback, Error, Result};

/// Converts every tensor of `src` to `dtype`, as new tensors.
///
/// Bitwise identical to candle's `to_dtype` (round to nearest even; NaN,
/// infinities, subnormals and -0.0 preserved as `half` does). Supports f32,
/// bf16 and f16 in any direction; a tensor already of `dtype` is returned
/// as a cheap clone sharing its storage. Contiguous host tensors are
/// converted together in one parallel pass; others go through `to_dtype`.
pub fn cast_tensors(src: &[Tensor], dtype: DType) -> Result<Vec<Tensor>> {
    const OP: &str = "cast_tensors";
    if !is_float(dtype) {
        return Err(Error::UnsupportedDType { op: OP, dtype });
    }
    check_float(OP, src)?;
    if let Ok(Some(dev)) = common_device(OP, &[src]) {
        if dev.is_cuda() {
            return cuda::cast_tensors(src, dtype);
        }
    }
    let fused: Vec<&Tensor> = src
        .iter()
        .filter(|t| t.dtype() != dtype && t.device().is_cpu() && t.is_contiguous())
        .collect();
    // Output buffers start as zeroed u16/f32 vectors: those come from
    // `calloc`, so the pages are first touched by the parallel conversion.
    let mut bufs: Vec<Buf> = fused
        .iter()
        .map(|t| Buf::zeroed(dtype, t.elem_count()))
        .collect();
    with_float_slices(&fused, OP, |slices| {
        let pairs = slices
            .into_iter()
            .zip(bufs.iter_mut().map(Buf::as_slice_mut))
            .collect();
        cpu::cast::convert_all(pairs, Plan::default());
        Ok(())
    })?;
    let mut bufs = bufs.into_iter();
    src.iter()
        .map(|t| {
            if t.dtype() == dtype {
                Ok(t.clone())
            } else if t.device().is_cpu() && t.is_contiguous() {
                let buf = bufs.next().expect("one buffer per fused tensor");
                buf.into_tensor(t.shape())
            } else {
                Ok(t.to_dtype(dtype)?)
            }
        })
        .collect()
}

/// An owned output buffer of `cast_tensors`.
enum Buf {
    F32(Vec<f32>),
    BF16(Vec<bf16>),
    F16(Vec<f16>),
}

impl Buf {
    fn zeroed(dtype: DType, n: usize) -> Self {
        match dtype {
            DType::BF16 => Buf::BF16(vec![0u16; n].reinterpret_into()),
            DType::F16 => Buf::F16(vec![0u16; n].reinterpret_into()),
            _ => Buf::F32(vec![0f32; n]),
        }
    }

    fn as_slice_mut(&mut self) -> FloatSliceMut<'_> {
        match self {
            Buf::F32(v) => FloatSliceMut::F32(v),
            Buf::BF16(v) => FloatSliceMut::BF16(v),
            Buf::F16(v) => FloatSliceMut::F16(v),
        }
    }

    fn into_tensor(self, shape: &candle_core::Shape) -> Result<Tensor> {
        let dev = Device::Cpu;
        Ok(match self {
            Buf::F32(v) => Tensor::from_vec(v, shape, &dev)?,
            Buf::BF16(v) => Tensor::from_vec(v, shape, &dev)?,
            Buf::F16(v) => Tensor::from_vec(v, shape, &dev)?,
        })
    }
}

/// Writes `src[i]` converted to `dst[i]`'s dtype into the existing storage
/// of `dst[i]`, for every `i`.
///
/// This is how low-precision model weights are refreshed from f32 master
/// weights after every optimizer step, without allocating. Conversions are
/// bitwise identical to `to_dtype`. Shapes must match pairwise; `dst`
/// tensors must be contiguous and must not share storage with anything else
/// in the call.
pub fn cast_into(src: &[Tensor], dst: &[Tensor]) -> Result<()> {
    const OP: &str = "cast_into";
    check_pairs(OP, src, dst)?;
    check_float(OP, src)?;
    check_float(OP, dst)?;
    check_contiguous(OP, dst)?;
    let Some(dev) = common_device(OP, &[src, dst])? else {
        return Ok(());
    };
    if !dev.is_cpu() && !dev.is_cuda() {
        return fallback::cast_into(src, dst);
    }
    let src = contiguous_inputs(src)?;
    check_no_alias(
        OP,
        &[
            ListArg {
                name: "src",
                tensors: &src,
                written: false,
            },
            ListArg {
                name: "dst",
                tensors: dst,
                written: true,
            },
        ],
    )?;
    if dev.is_cuda() {
        return cuda::cast_into(&src, dst);
    }
    for r in groups(dst.len(), 1) {
        let s: Vec<&Tensor> = src[r.clone()].iter().collect();
        let d: Vec<&Tensor> = dst[r].iter().collect();
        with_float_slices(&s, OP, |s| {
            with_float_slices_mut(&d, OP, |d| {
                cpu::cast::convert_all(s.into_iter().zip(d).collect(), Plan::default());
                Ok(())
            })
        })?;
    }
    Ok(())
}

/// Multiplies every element of every tensor by `inv_scale` in place and
/// returns whether any element was inf or NaN before scaling.
///
/// Like PyTorch's `_amp_foreach_non_finite_check_and_unscale_`, everything
/// is scaled even when a non-finite value is found. bf16/f16 tensors are
/// computed in f32 and rounded once. One fused pass over the whole list.
pub fn unscale_and_check(tensors: &[Tensor], inv_scale: f32) -> Result<bool> {
    const OP: &str = "unscale_and_check";
    check_float(OP, tensors)?;
    check_contiguous(OP, tensors)?;
    let Some(dev) = common_device(OP, &[tensors])? else {
        return Ok(false);
    };
    if !dev.is_cpu() && !dev.is_cuda() {
        return fallback::unscale_and_check(tensors, inv_scale);
    }
    check_no_alias(
        OP,
        &[ListArg {
            name: "tensors",
            tensors,
            written: true,
        }],
    )?;
    if dev.is_cuda() {
        return cuda::unscale_and_check(tensors, inv_scale);
    }
    let mut found = false;
    for_each_group_mut(OP, tensors, |s| {
        found |= cpu::unscale::unscale_and_check(s, inv_scale, Plan::default());
        Ok(())
    })?;
    Ok(found)
}

/// Runs a read-only reduction over `tensors`, on the fused path for host
/// tensors and `fb` otherwise.
fn reduce<R>(
    op: &'static str,
    tensors: &[Tensor],
    empty: R,
    cpu_fn: impl FnOnce(Vec<FloatSlice<'_>>) -> R,
    fb: impl FnOnce(&[Tensor]) -> Result<R>,
) -> Result<R> {
    check_float(op, tensors)?;
    let Some(dev) = common_device(op, &[tensors])? else {
        return Ok(empty);
    };
    if !dev.is_cpu() {
        // `fb` is the CUDA kernel where one exists, the tensor-op fallback
        // otherwise.
        return fb(&contiguous_inputs(tensors)?);
    }
    let tensors = contiguous_inputs(tensors)?;
    let refs: Vec<&Tensor> = tensors.iter().collect();
    with_float_slices(&refs, op, |s| Ok(cpu_fn(s)))
}

/// Runs the CUDA kernel for CUDA tensors, the fallback for other devices.
fn on_device<R>(
    ts: &[Tensor],
    cuda_fn: impl FnOnce(&[Tensor]) -> Result<R>,
    fallback_fn: impl FnOnce(&[Tensor]) -> Result<R>,
) -> Result<R> {
    match ts.first() {
        Some(t) if t.device().is_cuda() => cuda_fn(ts),
        _ => fallback_fn(ts),
    }
}

/// True if any element of any tensor is inf or NaN.
pub fn has_non_finite(tensors: &[Tensor]) -> Result<bool> {
    reduce(
        "has_non_finite",
        tensors,
        false,
        |s| cpu::unscale::has_non_finite(s, Plan::default()),
        |ts| on_device(ts, cuda::has_non_finite, fallback::has_non_finite),
    )
}

/// Sum of the squares of all elements of all tensors, accumulated in f64:
/// the square of the global L2 norm used by `clip_grad_norm`.
///
/// The result does not depend on the number of threads. On CUDA the
/// partial sums are combined in a fixed order too, so runs repeat
/// bitwise, but the order differs from the CPU's (last-bits differences).
pub fn sum_of_squares(tensors: &[Tensor]) -> Result<f64> {
    reduce(
        "sum_of_squares",
        tensors,
        0.0,
        |s| cpu::norm::sum_of_squares(s, Plan::default()),
        |ts| on_device(ts, cuda::sum_of_squares, fallback::sum_of_squares),
    )
}

/// Largest absolute value over all tensors (the inf-norm); NaN if any
/// element is NaN, 0 for an empty list.
pub fn max_abs(tensors: &[Tensor]) -> Result<f64> {
    reduce(
        "max_abs",
        tensors,
        0.0,
        |s| cpu::norm::max_abs(s, Plan::default()),
        |ts| on_device(ts, cuda::max_abs, fallback::max_abs),
    )
}

/// Validation shared by the in-place element-wise ops.
fn in_place(op: &'static str, tensors: &[Tensor]) -> Result<Option<Device>> {
    check_float(op, tensors)?;
    check_contiguous(op, tensors)?;
    let dev = common_device(op, &[tensors])?;
    if dev.as_ref().is_some_and(|d| d.is_cpu() || d.is_cuda()) {
        check_no_alias(
            op,
            &[ListArg {
                name: "tensors",
                tensors,
                written: true,
            }],
        )?;
    }
    Ok(dev)
}

/// Multiplies every element of every tensor by `factor` in place (computed
/// in f32, rounded once for bf16/f16).
pub fn scale_in_place(tensors: &[Tensor], factor: f32) -> Result<()> {
    const OP: &str = "scale_in_place";
    match in_place(OP, tensors)? {
        None => Ok(()),
        Some(dev) if dev.is_cuda() => cuda::scale(tensors, factor),
        Some(dev) if !dev.is_cpu() => fallback::scale(tensors, factor),
        Some(_) => for_each_group_mut(OP, tensors, |s| {
            cpu::unscale::scale(s, factor, Plan::default());
            Ok(())
        }),
    }
}

/// Clamps every element of every tensor to `[lo, hi]` in place, like
/// `torch.clamp_` (`clip_grad_value_`): NaN stays NaN, and `lo > hi` sets
/// everything to `hi`.
pub fn clamp_in_place(tensors: &[Tensor], lo: f32, hi: f32) -> Result<()> {
    const OP: &str = "clamp_in_place";
    match in_place(OP, tensors)? {
        None => Ok(()),
        Some(dev) if dev.is_cuda() => cuda::clamp(tensors, lo, hi),
        Some(dev) if !dev.is_cpu() => fallback::clamp(tensors, lo, hi),
        Some(_) => for_each_group_mut(OP, tensors, |s| {
            cpu::unscale::clamp(s, lo, hi, Plan::default());
            Ok(())
        }),
    }
}

/// `dst[i] += src[i]` in place for every `i`: `dst` is f32, `src` is f32,
/// bf16 or f16 and is widened exactly on the fly. Accumulates gradients
/// across micro-steps without allocating.
pub fn add_in_place(dst: &[Tensor], src: &[Tensor]) -> Result<()> {
    const OP: &str = "add_in_place";
    check_pairs(OP, src, dst)?;
    check_dtype(OP, dst, DType::F32)?;
    check_float(OP, src)?;
    check_contiguous(OP, dst)?;
    let Some(dev) = common_device(OP, &[dst, src])? else {
        return Ok(());
    };
    if !dev.is_cpu() && !dev.is_cuda() {
        return fallback::add(dst, src);
    }
    let src = contiguous_inputs(src)?;
    check_no_alias(
        OP,
        &[
            ListArg {
                name: "dst",
                tensors: dst,
                written: true,
            },
            ListArg {
                name: "src",
                tensors: &src,
                written: false,
            },
        ],
    )?;
    if dev.is_cuda() {
        return cuda::add(dst, &src);
    }
    for r in groups(dst.len(), 1) {
        let s: Vec<&Tensor> = src[r.clone()].iter().collect();
        let d: Vec<&Tensor> = dst[r].iter().collect();
        with_float_slices(&s, OP, |s| {
            with_float_slices_mut(&d, OP, |d| {
                let pairs = d.into_iter().map(f32_slice).zip(s).collect();
                cpu::unscale::add(pairs, Plan::default());
                Ok(())
            })
        })?;
    }
    Ok(())
}

/// The f32 slice of a tensor already checked to be f32.
pub(crate) fn f32_slice(s: FloatSliceMut<'_>) -> &mut [f32] {
    match s {
        FloatSliceMut::F32(s) => s,
        _ => unreachable!("dtype checked to be f32 before locking"),
    }
}
