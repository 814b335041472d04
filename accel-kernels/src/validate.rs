//! Argument checks shared by the public operations, and the grouping of
//! written tensors into lock sets.
//!
//! All checks run before anything is locked or written, so a rejected call
//! leaves every tensor untouched.

use std::borrow::Cow;
use std::ops::Range;

use candle_core::{DType, Device, Tensor};

use crate::slices::{with_float_slices_mut, FloatSliceMut};
use crate::{Error, Result};

/// Most tensors write-locked at once. Locks nest one stack frame chain per
/// tensor, so lists are processed in groups of this many written tensors,
/// each group in one parallel pass.
pub(crate) const MAX_LOCKED: usize = 96;

/// Is `dtype` one the kernels handle?
pub(crate) fn is_float(dtype: DType) -> bool {
    matches!(dtype, DType::F32 | DType::BF16 | DType::F16)
}

/// The device shared by every tensor of `lists` (`None` if all are empty).
pub(crate) fn common_device(op: &'static str, lists: &[&[Tensor]]) -> Result<Option<Device>> {
    let mut all = lists.iter().flat_map(|l| l.iter().enumerate());
    let Some((_, first)) = all.next() else {
        return Ok(None);
    };
    let dev = first.device().clone();
    for (index, t) in all {
        if !t.device().same_device(&dev) {
            let (expected, got) = (dev.location(), t.device().location());
            return Err(Error::DeviceMismatch {
                op,
                index,
                expected,
                got,
            });
        }
    }
    Ok(Some(dev))
}

/// Every tensor is f32, bf16 or f16.
pub(crate) fn check_float(op: &'static str, ts: &[Tensor]) -> Result<()> {
    match ts.iter().find(|t| !is_float(t.dtype())) {
        Some(t) => Err(Error::UnsupportedDType {
            op,
            dtype: t.dtype(),
        }),
        None => Ok(()),
    }
}

/// Every tensor has exactly `dtype`.
pub(crate) fn check_dtype(op: &'static str, ts: &[Tensor], dtype: DType) -> Result<()> {
    match ts.iter().position(|t| t.dtype() != dtype) {
        Some(index) => Err(Error::DTypeMismatch {
            op,
            index,
            expected: dtype,
            got: ts[index].dtype(),
        }),
        None => Ok(()),
    }
}

/// Every written tensor is contiguous, since results go back into its storage.
pub(crate) fn check_contiguous(op: &'static str, ts: &[Tensor]) -> Result<()> {
    match ts.iter().position(|t| !t.is_contiguous()) {
        Some(index) => Err(Error::RequiresContiguous { op, index }),
        None => Ok(()),
    }
}

/// Two paired lists have the same length and pairwise the same shape.
pub(crate) fn check_pairs(op: &'static str, src: &[Tensor], dst: &[Tensor]) -> Result<()> {
    if src.len() != dst.len() {
        return Err(Error::LengthMismatch {
            op,
            left: src.len(),
            right: dst.len(),
        });
    }
    for (index, (s, d)) in src.iter().zip(dst).enumerate() {
        if s.dims() != d.dims() {
            return Err(Error::ShapeMismatch {
                op,
                index,
                src: s.dims().to_vec(),
                dst: d.dims().to_vec(),
            });
        }
    }
    Ok(())
}

/// Read-only inputs may be strided views; copying those few to contiguous
/// memory is cheaper for callers than an error.
pub(crate) fn contiguous_inputs(ts: &[Tensor]) -> Result<Cow<'_, [Tensor]>> {
    if ts.iter().all(Tensor::is_contiguous) {
        return Ok(Cow::Borrowed(ts));
    }
    Ok(Cow::Owned(
        ts.iter()
            .map(Tensor::contiguous)
            .collect::<candle_core::Result<_>>()?,
    ))
}

/// Index ranges of `n` list positions, each writing at most [`MAX_LOCKED`]
/// tensors when every position writes `written_per_index` of them.
pub(crate) fn groups(n: usize, written_per_index: usize) -> impl Iterator<Item = Range<usize>> {
    let step = (MAX_LOCKED / written_per_index.max(1)).max(1);
    (0..n).step_by(step).map(move |s| s..(s + step).min(n))
}

/// Write-locks `ts` group by group and runs `f` on each group's slices.
pub(crate) fn for_each_group_mut(
    op: &'static str,
    ts: &[Tensor],
    mut f: impl FnMut(Vec<FloatSliceMut<'_>>) -> Result<()>,
) -> Result<()> {
    for r in groups(ts.len(), 1) {
        let refs: Vec<&Tensor> = ts[r].iter().collect();
        with_float_slices_mut(&refs, op, &mut f)?;
    }
    Ok(())
}
