//! The same operations built from plain candle tensor ops, for tensors that
//! do not live in host memory (CUDA, Metal) until fused device kernels
//! exist.
//!
//! Inputs arrive validated by `multi_tensor`. Results are written back with
//! `slice_set`, which copies into the existing storage, so in-place
//! semantics (updates visible through clones and `Var`s) are the same as on
//! the CPU path. Scalars are applied with `broadcast_*` against 0-d tensors
//! rather than `affine`, whose `x * a + 0` would turn -0.0 into +0.0; on the
//! CPU this makes the optimizer fallbacks bitwise equal to the fused path.

use candle_core::{DType, Device, Tensor};

use crate::hyperparams::{AdamWScalars, SgdScalars};
use crate::Result;

/// A 0-d f32 tensor on `dev`, for broadcasting a scalar factor.
fn scalar(v: f32, dev: &Device) -> Result<Tensor> {
    Ok(Tensor::new(v, dev)?)
}

/// Writes `value` into the storage of `dst` (same element count), converting
/// to `dst`'s dtype. `dst` is contiguous (checked by the caller).
pub(crate) fn assign(dst: &Tensor, value: &Tensor) -> Result<()> {
    if dst.elem_count() == 0 {
        return Ok(());
    }
    let value = value.to_dtype(dst.dtype())?.flatten_all()?.contiguous()?;
    // A contiguous tensor's flattened view shares its storage, so this
    // writes through to `dst` and every clone of it.
    dst.flatten_all()?.slice_set(&value, 0, 0)?;
    Ok(())
}

/// 1.0 for each element of `x` that is inf or NaN, as f32 (`x - x` is 0
/// exactly for finite values and NaN otherwise).
fn non_finite_count(x: &Tensor) -> Result<Tensor> {
    let x = x.to_dtype(DType::F32)?;
    Ok(x.broadcast_sub(&x)?
        .ne(0f32)?
        .to_dtype(DType::F32)?
        .sum_all()?)
}

/// Adds up 0-d partial results and fetches the total once, so a list costs
/// one device synchronisation, not one per tensor.
fn total(parts: Vec<Tensor>) -> Result<f64> {
    if parts.is_empty() {
        return Ok(0.0);
    }
    Ok(Tensor::stack(&parts, 0)?
        .to_dtype(DType::F64)?
        .sum_all()?
        .to_scalar::<f64>()?)
}

/// See [`crate::cast_into`].
pub(crate) fn cast_into(src: &[Tensor], dst: &[Tensor]) -> Result<()> {
    for (s, d) in src.iter().zip(dst) {
        assign(d, s)?;
    }
    Ok(())
}

/// See [`crate::unscale_and_check`].
pub(crate) fn unscale_and_check(tensors: &[Tensor], inv_scale: f32) -> Result<bool> {
    let mut flags = Vec::with_capacity(tensors.len());
    for t in tensors {
        flags.push(non_finite_count(t)?);
        if inv_scale != 1.0 {
            let x = t.to_dtype(DType::F32)?;
            assign(t, &x.broadcast_mul(&scalar(inv_scale, t.device())?)?)?;
        }
    }
    Ok(total(flags)? > 0.0)
}

/// See [`crate::has_non_finite`].
pub(crate) fn has_non_finite(tensors: &[Tensor]) -> Result<bool> {
    let flags = tensors
        .iter()
        .map(non_finite_count)
        .collect::<Result<Vec<_>>>()?;
    Ok(total(flags)? > 0.0)
}

/// See [`crate::sum_of_squares`].
pub(crate) fn sum_of_squares(tensors: &[Tensor]) -> Result<f64> {
    let parts = tensors
        .iter()
        .map(|t| Ok(t.to_dtype(DType::F64)?.sqr()?.sum_all()?))
        .collect::<Result<Vec<_>>>()?;
    total(parts)
}

/// See [`crate::max_abs`].
pub(crate) fn max_abs(tensors: &[Tensor]) -> Result<f64> {
    let mut best = 0f64;
    let mut nans = Vec::with_capacity(tensors.len());
    for t in tensors.iter().filter(|t| t.elem_count() > 0) {
        let x = t.to_dtype(DType::F32)?;
        // Device max reductions need not propagate NaN; count them apart.
        nans.push(x.ne(&x)?.to_dtype(DType::F32)?.sum_all()?);
        best = best.max(x.abs()?.max_all()?.to_scalar::<f32>()? as f64);
    }
    Ok(if total(nans)? > 0.0 { f64::NAN } else { best })
}

/// See [`crate::scale_in_place`].
pub(crate) fn scale(tensors: &[Tensor], factor: f32) -> Result<()> {
    for t in tensors {
        let x = t.to_dtype(DType::F32)?;
        assign(t, &x.broadcast_mul(&scalar(factor, t.device())?)?)?;
    }
    Ok(())
}

/// See [`crate::clamp_in_place`].
pub(crate) fn clamp(tensors: &[Tensor], lo: f32, hi: f32) -> Result<()> {
    for t in tensors {
        let x = t.to_dtype(DType::F32)?;
        let dev = t.device();
        let y = x
            .broadcast_maximum(&scalar(lo, dev)?)?
            .broadcast_minimum(&scalar(hi, dev)?)?;
        assign(t, &y)?;
    }
    Ok(())
}

/// See [`crate::add_in_place`].
pub(crate) fn add(dst: &[Tensor], src: &[Tensor]) -> Result<()> {
    for (d, s) in dst.iter().zip(src) {
        let sum = (d + s.to_dtype(DType::F32)?.reshape(d.shape())?)?;
        assign(d, &sum)?;
    }
    Ok(())
}

/// See [`crate::adamw_step`]; the same formula as the fused kernel, op by op.
pub(crate) fn adamw(
    params: &[Tensor],
    grads: &[Tensor],
    exp_avg: &[Tensor],
    exp_avg_sq: &[Tensor],
    s: &AdamWScalars,
) -> Result<()> {
    for (((p, g), m), v) in params.iter().zip(grads).zip(exp_avg).zip(exp_avg_sq) {
        let dev = p.device();
        let c = |x: f32| scalar(x, dev);
        let g = g.to_dtype(DType::F32)?.reshape(p.shape())?;
        let pd = match s.decay {
            Some(d) => p.broadcast_mul(&c(d)?)?,
            None => p.clone(),
        };
        let diff = (&g - m)?;
        let m_new = if s.w1.abs() < 0.5 {
            (m + diff.broadcast_mul(&c(s.w1)?)?)?
        } else {
            (&g - diff.broadcast_mul(&c(1.0 - s.w1)?)?)?
        };
        let v_new = (v.broadcast_mul(&c(s.beta2)?)? + g.broadcast_mul(&c(s.c2)?)?.mul(&g)?)?;
        let denom = v_new
            .sqrt()?
            .broadcast_div(&c(s.bc2_sqrt)?)?
            .broadcast_add(&c(s.eps)?)?;
        let p_new = (pd - m_new.broadcast_mul(&c(s.step_size)?)?.div(&denom)?)?;
        assign(p, &p_new)?;
        assign(m, &m_new)?;
        assign(v, &v_new)?;
    }
    Ok(())
}

/// See [`crate::sgd_step`]; the same formula as the fused kernel, op by op.
pub(crate) fn sgd(
    params: &[Tensor],
    grads: &[Tensor],
    bufs: Option<&[Tensor]>,
    s: &SgdScalars,
) -> Result<()> {
    for (i, (p, g)) in params.iter().zip(grads).enumerate() {
        let dev = p.device();
        let c = |x: f32| scalar(x, dev);
        let mut d = g.to_dtype(DType::F32)?.reshape(p.shape())?;
        if let Some(wd) = s.weight_decay {
            d = (d + p.broadcast_mul(&c(wd)?)?)?;
        }
        if let (Some(mom), Some(bufs)) = (s.momentum, bufs) {
            let b = if s.first {
                d.clone()
            } else {
                (bufs[i].broadcast_mul(&c(mom)?)? + d.broadcast_mul(&c(s.one_minus_dampening)?)?)?
            };
            assign(&bufs[i], &b)?;
            d = if s.nesterov {
                (d + b.broadcast_mul(&c(mom)?)?)?
            } else {
                b
            };
        }
        assign(p, &(p - d.broadcast_mul(&c(s.lr)?)?)?)?;
    }
    Ok(())
}
