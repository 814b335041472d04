//! Gradient buckets: flatten, all-reduce, scatter back.
//!
//! Two paths with one meaning. Contiguous fp32 CPU gradients are packed
//! into a host vector and reduced as a buffer (the TCP backend's fast path).
//! Any other gradients (CUDA tensors, bf16/f16) are packed into one tensor
//! per bucket and dtype *on their device* and reduced with the tensor
//! collective in place: NCCL reduces it in device memory on its own stream
//! (ordered by events, see `backend/nccl`), a host backend stages it
//! through host memory. The reduced values are written back into each
//! gradient's storage, so the gradient tensors keep their identity.

use candle_core::{DType, Tensor};
use half::{bf16, f16};

use super::CommHook;
use crate::tensor::write_into;
use crate::{BufferMut, Communicator, ReduceOp, Result};

/// Parameters grouped into buckets of at most `cap` bytes, in reverse
/// registration order as PyTorch DDP builds them (the last layers' gradients
/// are ready first in a backward pass, so they lead).
#[derive(Debug, Clone, PartialEq)]
pub struct GradBuckets {
    buckets: Vec<Vec<usize>>,
}

/// True when every tensor is a contiguous fp32 CPU tensor (the host path).
fn all_host_f32(ts: &[Tensor]) -> bool {
    ts.iter()
        .all(|t| t.device().is_cpu() && t.dtype() == DType::F32 && t.is_contiguous())
}

impl GradBuckets {
    /// Buckets for parameters of `numels` elements (fp32) under `cap_bytes` each;
    /// a parameter larger than the cap gets a bucket of its own.
    pub fn new(numels: &[usize], cap_bytes: usize) -> Self {
        let mut buckets = vec![];
        let mut current: Vec<usize> = vec![];
        let mut bytes = 0usize;
        for i in (0..numels.len()).rev() {
            let b = numels[i] * 4;
            if !current.is_empty() && bytes + b > cap_bytes {
                buckets.push(std::mem::take(&mut current));
                bytes = 0;
            }
            current.push(i);
            bytes += b;
        }
        if !current.is_empty() {
            buckets.push(current);
        }
        Self { buckets }
    }

    /// The parameter indices of each bucket.
    pub fn buckets(&self) -> &[Vec<usize>] {
        &self.buckets
    }

    /// Replaces every gradient by its mean over all ranks, bucket by bucket.
    /// `grads[i]` is parameter `i`'s contiguous gradient, on any device and
    /// of any float dtype (see the module docs for the two paths).
    pub fn all_reduce_mean(
        &self,
        comm: &dyn Communicator,
        grads: &[Tensor],
        hook: CommHook,
    ) -> Result<()> {
        const OP: &str = "ddp all_reduce";
        if comm.world_size() == 1 {
            return Ok(());
        }
        if !all_host_f32(grads) {
            return self.all_reduce_mean_tensors(comm, grads, hook);
        }
        let world = comm.world_size() as f32;
        let mut flat: Vec<f32> = vec![];
        for bucket in &self.buckets {
            flat.clear();
            for &i in bucket {
                accel_kernels::with_slice::<f32, _>(&grads[i], OP, |s| {
                    flat.extend_from_slice(s);
                    Ok(())
                })?;
            }
            match hook {
                CommHook::None => {
                    comm.all_reduce(BufferMut::from(&mut flat[..]), ReduceOp::Mean)?
                }
                CommHook::Fp16 => {
                    let mut wire: Vec<f16> =
                        flat.iter().map(|x| f16::from_f32(x / world)).collect();
                    comm.all_reduce(BufferMut::from(&mut wire[..]), ReduceOp::Sum)?;
                    flat.iter_mut()
                        .zip(&wire)
                        .for_each(|(d, s)| *d = s.to_f32());
                }
                CommHook::Bf16 => {
                    let mut wire: Vec<bf16> =
                        flat.iter().map(|x| bf16::from_f32(x / world)).collect();
                    comm.all_reduce(BufferMut::from(&mut wire[..]), ReduceOp::Sum)?;
                    flat.iter_mut()
                        .zip(&wire)
                        .for_each(|(d, s)| *d = s.to_f32());
                }
            }
            let mut offset = 0;
            for &i in bucket {
                accel_kernels::with_slice_mut::<f32, _>(&grads[i], OP, |s| {
                    s.copy_from_slice(&flat[offset..offset + s.len()]);
                    offset += s.len();
                    Ok(())
                })?;
            }
        }
        Ok(())
    }

    /// The device path of [`GradBuckets::all_reduce_mean`]: per bucket, the
    /// gradients of each dtype packed into one tensor on their device,
    /// reduced in place, and written back.
    fn all_reduce_mean_tensors(
        &self,
        comm: &dyn Communicator,
        grads: &[Tensor],
        hook: CommHook,
    ) -> Result<()> {
        let world = comm.world_size() as f32;
        if grads.iter().any(|g| !g.is_contiguous()) {
            return Err(crate::Error::RequiresContiguous {
                op: "ddp all_reduce",
            });
        }
        for bucket in &self.buckets {
            let mut dtypes: Vec<DType> = bucket.iter().map(|&i| grads[i].dtype()).collect();
            dtypes.sort_by_key(|d| d.as_str());
            dtypes.dedup();
            for dtype in dtypes {
                let idx: Vec<usize> = bucket
                    .iter()
                    .copied()
                    .filter(|&i| grads[i].dtype() == dtype)
                    .collect();
                // A lone gradient is reduced in its own storage (a
                // contiguous tensor's flattened view shares it); several are
                // packed into a new tensor.
                let flat = idx
                    .iter()
                    .map(|&i| grads[i].flatten_all())
                    .collect::<candle_core::Result<Vec<_>>>()?;
                let single = flat.len() == 1;
                let packed = if single {
                    flat[0].clone()
                } else {
                    Tensor::cat(&flat, 0)?
                };
                let reduced = match hook {
                    CommHook::None => {
                        comm.all_reduce_tensor_inplace(&packed, ReduceOp::Mean)?;
                        if single {
                            continue;
                        }
                        packed
                    }
                    CommHook::Fp16 | CommHook::Bf16 => {
                        let wire = if hook == CommHook::Fp16 {
                            DType::F16
                        } else {
                            DType::BF16
                        };
                        let n = Tensor::new(world, packed.device())?;
                        let wire = packed
                            .to_dtype(DType::F32)?
                            .broadcast_div(&n)?
                            .to_dtype(wire)?;
                        comm.all_reduce_tensor_inplace(&wire, ReduceOp::Sum)?;
                        wire
                    }
                };
                let mut offset = 0;
                for &i in &idx {
                    let n = grads[i].elem_count();
                    write_into("ddp all_reduce", &grads[i], &reduced.narrow(0, offset, n)?)?;
                    offset += n;
                }
            }
        }
        Ok(())
    }
}

/// Overwrites every parameter with rank `root`'s values, in place (DDP does
/// this once when it wraps a model so all replicas start equal). Parameters
/// may live on any device, in any dtype (see the module docs).
pub fn broadcast_parameters(comm: &dyn Communicator, params: &[Tensor], root: usize) -> Result<()> {
    const OP: &str = "ddp broadcast_parameters";
    if comm.world_size() == 1 {
        return Ok(());
    }
    if !all_host_f32(params) {
        for p in params {
            let from_root = comm.broadcast_tensor(&p.contiguous()?, root)?;
            write_into(OP, p, &from_root)?;
        }
        return Ok(());
    }
    for p in params {
        let mut buf: Vec<f32> = accel_kernels::with_slice::<f32, _>(p, OP, |s| Ok(s.to_vec()))?;
        comm.broadcast(BufferMut::from(&mut buf[..]), root)?;
        accel_kernels::with_slice_mut::<f32, _>(p, OP, |s| {
            s.copy_from_slice(&buf);
            Ok(())
        })?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_fill_in_reverse_order_up_to_the_cap() {
        // 4 bytes per element: sizes 400, 400, 4000, 40 bytes; cap 1000.
        let b = GradBuckets::new(&[100, 100, 1000, 10], 1000);
        assert_eq!(b.buckets(), &[vec![3], vec![2], vec![1, 0]]);
    }

    #[test]
    fn a_single_process_leaves_gradients_alone() {
        let g = Tensor::new(&[1f32, 2.0], &candle_core::Device::Cpu).unwrap();
        let b = GradBuckets::new(&[2], 1 << 20);
        b.all_reduce_mean(
            &crate::LocalCommunicator::new(),
            std::slice::from_ref(&g),
            CommHook::Bf16,
        )
        .unwrap();
        assert_eq!(g.to_vec1::<f32>().unwrap(), vec![1.0, 2.0]);
    }
}
