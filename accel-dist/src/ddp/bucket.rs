//! Gradient buckets: flatten, all-reduce, scatter back.

use candle_core::{DType, Tensor};
use half::{bf16, f16};

use super::CommHook;
use crate::{BufferMut, Communicator, Error, ReduceOp, Result};

/// Parameters grouped into buckets of at most `cap` bytes, in reverse
/// registration order as PyTorch DDP builds them (the last layers' gradients
/// are ready first in a backward pass, so they lead).
#[derive(Debug, Clone, PartialEq)]
pub struct GradBuckets {
    buckets: Vec<Vec<usize>>,
}

fn check_cpu_f32(op: &'static str, t: &Tensor) -> Result<()> {
    if !t.device().is_cpu() {
        return Err(Error::RequiresCpu {
            op,
            device: format!("{:?}", t.device()),
        });
    }
    if t.dtype() != DType::F32 {
        return Err(Error::UnsupportedDType {
            op,
            dtype: t.dtype(),
        });
    }
    Ok(())
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
    /// `grads[i]` is parameter `i`'s contiguous fp32 CPU gradient.
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
        let world = comm.world_size() as f32;
        let mut flat: Vec<f32> = vec![];
        for bucket in &self.buckets {
            flat.clear();
            for &i in bucket {
                check_cpu_f32(OP, &grads[i])?;
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
}

/// Overwrites every parameter with rank `root`'s values, in place (DDP does
/// this once when it wraps a model so all replicas start equal).
pub fn broadcast_parameters(comm: &dyn Communicator, params: &[Tensor], root: usize) -> Result<()> {
    const OP: &str = "ddp broadcast_parameters";
    if comm.world_size() == 1 {
        return Ok(());
    }
    for p in params {
        check_cpu_f32(OP, p)?;
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
