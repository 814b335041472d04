//! Collectives on candle tensors, built on the buffer collectives.
//!
//! Host-memory backends (TCP, shared memory) move host buffers, so a tensor
//! on another device (CUDA) is staged through host memory: copied out,
//! reduced on the host, copied back (in place for the `_inplace` forms,
//! through candle's write lock, so the device orders the copy like any
//! other write). That is what lets two processes share one GPU over TCP,
//! as PyTorch's gloo does with CUDA tensors. NCCL overrides these for CUDA
//! tensors and runs in device memory.

use candle_core::{DType, Device, Tensor};

use crate::{Communicator, Error, ReduceOp, Result};

/// Runs `$body` with `$T` aliased to the Rust type of a supported dtype.
macro_rules! with_dtype {
    ($op:expr, $dtype:expr, $T:ident => $body:expr) => {
        match $dtype {
            DType::F32 => {
                type $T = f32;
                $body
            }
            DType::F64 => {
                type $T = f64;
                $body
            }
            DType::BF16 => {
                type $T = half::bf16;
                $body
            }
            DType::F16 => {
                type $T = half::f16;
                $body
            }
            DType::U32 => {
                type $T = u32;
                $body
            }
            DType::I64 => {
                type $T = i64;
                $body
            }
            DType::U8 => {
                type $T = u8;
                $body
            }
            dtype => Err(Error::UnsupportedDType { op: $op, dtype }),
        }
    };
}

/// The checks every tensor collective makes before touching storage.
fn check(op: &'static str, t: &Tensor) -> Result<()> {
    if !t.is_contiguous() {
        return Err(Error::RequiresContiguous { op });
    }
    Ok(())
}

/// A host copy of a tensor of another device, for staging; `None` for a
/// CPU tensor (used as it is).
fn staged(t: &Tensor) -> Result<Option<Tensor>> {
    Ok(match t.device() {
        Device::Cpu => None,
        _ => Some(t.to_device(&Device::Cpu)?),
    })
}

/// Writes `value` (same element count; any device and dtype) into `dst`'s
/// own storage, in place on `dst`'s device, through candle's write lock.
pub(crate) fn write_into(op: &'static str, dst: &Tensor, value: &Tensor) -> Result<()> {
    if !dst.is_contiguous() {
        // Flattening would copy, and the write would land in the copy.
        return Err(Error::RequiresContiguous { op });
    }
    let value = value
        .to_device(dst.device())?
        .to_dtype(dst.dtype())?
        .flatten_all()?
        .contiguous()?;
    dst.flatten_all()?.slice_set(&value, 0, 0)?;
    Ok(())
}

/// The tensor's elements in storage order (one copy).
fn elements<T: crate::Element + candle_core::WithDType>(
    op: &'static str,
    t: &Tensor,
) -> Result<Vec<T>> {
    Ok(accel_kernels::with_slice::<T, _>(
        t,
        op,
        |s| Ok(s.to_vec()),
    )?)
}

pub(crate) fn all_reduce<C: Communicator + ?Sized>(
    c: &C,
    t: &Tensor,
    op: ReduceOp,
) -> Result<Tensor> {
    const OP: &str = "all_reduce_tensor";
    check(OP, t)?;
    if let Some(host) = staged(t)? {
        return Ok(all_reduce(c, &host, op)?.to_device(t.device())?);
    }
    with_dtype!(OP, t.dtype(), T => {
        let mut v = elements::<T>(OP, t)?;
        c.all_reduce((&mut v).into(), op)?;
        Ok(Tensor::from_vec(v, t.shape(), t.device())?)
    })
}

pub(crate) fn all_reduce_inplace<C: Communicator + ?Sized>(
    c: &C,
    t: &Tensor,
    op: ReduceOp,
) -> Result<()> {
    const OP: &str = "all_reduce_tensor_inplace";
    check(OP, t)?;
    if let Some(host) = staged(t)? {
        all_reduce_inplace(c, &host, op)?;
        return write_into(OP, t, &host);
    }
    with_dtype!(OP, t.dtype(), T => {
        accel_kernels::with_slice_mut::<T, _>(t, OP, |s| Ok(c.all_reduce(s.into(), op)))?
    })
}

pub(crate) fn broadcast<C: Communicator + ?Sized>(
    c: &C,
    t: &Tensor,
    root: usize,
) -> Result<Tensor> {
    const OP: &str = "broadcast_tensor";
    check(OP, t)?;
    if let Some(host) = staged(t)? {
        return Ok(broadcast(c, &host, root)?.to_device(t.device())?);
    }
    with_dtype!(OP, t.dtype(), T => {
        let mut v = elements::<T>(OP, t)?;
        c.broadcast((&mut v).into(), root)?;
        Ok(Tensor::from_vec(v, t.shape(), t.device())?)
    })
}

pub(crate) fn all_gather<C: Communicator + ?Sized>(c: &C, t: &Tensor) -> Result<Tensor> {
    const OP: &str = "all_gather_tensor";
    check(OP, t)?;
    if let Some(host) = staged(t)? {
        return Ok(all_gather(c, &host)?.to_device(t.device())?);
    }
    let n = c.world_size();
    let mut dims = t.dims().to_vec();
    match dims.first_mut() {
        Some(d0) => *d0 *= n,
        None => dims.push(n),
    }
    with_dtype!(OP, t.dtype(), T => {
        let mut out = vec![<T as bytemuck::Zeroable>::zeroed(); t.elem_count() * n];
        accel_kernels::with_slice::<T, _>(t, OP, |s| Ok(c.all_gather(s.into(), (&mut out).into())))??;
        Ok(Tensor::from_vec(out, dims, t.device())?)
    })
}

pub(crate) fn reduce_scatter<C: Communicator + ?Sized>(
    c: &C,
    t: &Tensor,
    op: ReduceOp,
) -> Result<Tensor> {
    const OP: &str = "reduce_scatter_tensor";
    check(OP, t)?;
    if let Some(host) = staged(t)? {
        return Ok(reduce_scatter(c, &host, op)?.to_device(t.device())?);
    }
    let n = c.world_size();
    let mut dims = t.dims().to_vec();
    match dims.first_mut() {
        Some(d0) if *d0 % n == 0 => *d0 /= n,
        _ => {
            return Err(Error::BadShape {
                op: OP,
                reason: format!(
                    "dimension 0 of shape {:?} must divide by the world size {n}",
                    t.dims()
                ),
            })
        }
    }
    with_dtype!(OP, t.dtype(), T => {
        let mut out = vec![<T as bytemuck::Zeroable>::zeroed(); t.elem_count() / n];
        accel_kernels::with_slice::<T, _>(t, OP, |s| Ok(c.reduce_scatter(s.into(), (&mut out).into(), op)))??;
        Ok(Tensor::from_vec(out, dims, t.device())?)
    })
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, IndexOp};

    use super::*;
    use crate::LocalCommunicator;

    #[test]
    fn local_tensor_collectives_keep_values_and_shapes() -> Result<()> {
        let c = LocalCommunicator::new();
        let t = Tensor::arange(0f32, 6.0, &Device::Cpu)?.reshape((2, 3))?;
        let r = c.all_reduce_tensor(&t, ReduceOp::Mean)?;
        assert_eq!(r.to_vec2::<f32>()?, t.to_vec2::<f32>()?);
        assert_eq!(c.all_gather_tensor(&t)?.dims(), &[2, 3]);
        assert_eq!(c.reduce_scatter_tensor(&t, ReduceOp::Sum)?.dims(), &[2, 3]);
        assert_eq!(
            c.broadcast_tensor(&t, 0)?.to_vec2::<f32>()?,
            t.to_vec2::<f32>()?
        );
        let scalar = Tensor::new(3u32, &Device::Cpu)?;
        assert_eq!(c.all_gather_tensor(&scalar)?.to_vec1::<u32>()?, [3]);
        c.all_reduce_tensor_inplace(&t, ReduceOp::Sum)?;
        Ok(())
    }

    #[test]
    fn non_contiguous_and_unsupported_tensors_are_rejected() -> Result<()> {
        let c = LocalCommunicator::new();
        let t = Tensor::zeros((2, 3), DType::F32, &Device::Cpu)?.t()?;
        let err = c.all_reduce_tensor(&t, ReduceOp::Sum).unwrap_err();
        assert!(matches!(err, Error::RequiresContiguous { .. }), "{err}");
        let t = Tensor::zeros(4, DType::I32, &Device::Cpu)?;
        let err = c.all_reduce_tensor(&t, ReduceOp::Sum).unwrap_err();
        assert!(matches!(err, Error::UnsupportedDType { .. }), "{err}");
        let t = Tensor::zeros(4, DType::I64, &Device::Cpu)?;
        let err = c.all_reduce_tensor(&t, ReduceOp::Mean).unwrap_err();
        assert!(matches!(err, Error::UnsupportedReduce { .. }), "{err}");
        let row = Tensor::arange(0f32, 6.0, &Device::Cpu)?
            .reshape((2, 3))?
            .i(1)?;
        assert_eq!(
            c.all_reduce_tensor(&row, ReduceOp::Sum)?.to_vec1::<f32>()?,
            [3.0, 4.0, 5.0]
        );
        Ok(())
    }
}
