//! [`StagingPool`]: host buffers that offloaded weights are read into, kept
//! between forwards so that reading a weight faults no fresh pages.
//!
//! Why: a weight read from disk per forward into a new `Vec` is a new
//! allocation of megabytes, which glibc serves with a fresh `mmap`; the
//! kernel then faults and zero-fills every page before the read copies over
//! it. In a profile of a forward with half a 2 GB model on disk, that
//! zero-filling (`clear_page`) was 57% of the time, more than the matmuls.
//! Consecutive decoder layers have identical weight shapes, so the buffers
//! one layer used are exactly those the next needs: the pool hands them
//! over, and a weight read becomes a plain copy out of the page cache.

use std::collections::VecDeque;
use std::sync::Mutex;

use candle_core::{DType, Device, Tensor};

use crate::error::Result;

/// What a [`StagingPool`] has done so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StagingStats {
    /// Buffers handed out that were recycled.
    pub reused: usize,
    /// Buffers handed out that had to be allocated.
    pub allocated: usize,
    /// Buffers returned and kept for reuse.
    pub kept: usize,
    /// Bytes held by free buffers now.
    pub free_bytes: usize,
}

#[derive(Debug, Default)]
struct Pool {
    // Free buffers, oldest return first.
    free: VecDeque<Tensor>,
    free_bytes: usize,
    // The most bytes one borrower returned at once: one block's weights.
    cap_bytes: usize,
    stats: StagingStats,
}

fn bytes_of(t: &Tensor) -> usize {
    t.elem_count() * t.dtype().size_in_bytes()
}

/// A pool of contiguous CPU tensors, matched by shape and dtype, shared by
/// the offload hooks of one model.
///
/// A borrower [takes](StagingPool::take) a buffer, writes all of it (a
/// recycled buffer holds the previous weight's values), lends it to a
/// forward, and [gives it back](StagingPool::give_back) afterwards. The pool
/// keeps at most as many free bytes as the largest set of buffers given back
/// at once (one block's weights), dropping the oldest beyond that, so peak
/// memory grows by at most one block's weights over fresh allocation.
///
/// Giving a buffer back is a promise that no tensor that outlives the call
/// shares its storage: the next borrower overwrites it. candle exposes no
/// reference count, so the pool cannot check this; the offload hook gives
/// back only buffers it can account for (see `AlignDevicesHook` in accel-nn)
/// and lets the others drop.
#[derive(Debug, Default)]
pub struct StagingPool {
    inner: Mutex<Pool>,
}

impl StagingPool {
    /// An empty pool.
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Pool> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A contiguous CPU tensor of `shape` and `dtype`: a free buffer of that
    /// shape and dtype if there is one (its contents are stale), else a new
    /// zeroed one (whose pages the kernel supplies on first write).
    ///
    /// # Errors
    /// [`crate::Error::Candle`] when allocating fails.
    pub fn take(&self, shape: &[usize], dtype: DType) -> Result<Tensor> {
        {
            let mut pool = self.lock();
            let found = pool
                .free
                .iter()
                .position(|t| t.dtype() == dtype && t.dims() == shape);
            if let Some(i) = found {
                let t = pool.free.remove(i).expect("index from position");
                pool.free_bytes -= bytes_of(&t);
                pool.stats.reused += 1;
                return Ok(t);
            }
            pool.stats.allocated += 1;
        }
        Ok(Tensor::zeros(shape, dtype, &Device::Cpu)?)
    }

    /// Keeps `buffers` for later [`take`](StagingPool::take)s. The caller
    /// guarantees that nothing else holds their storage (see the type's
    /// docs). Buffers that are not contiguous CPU tensors are dropped.
    pub fn give_back(&self, buffers: Vec<Tensor>) {
        let mut pool = self.lock();
        let returned: usize = buffers.iter().map(bytes_of).sum();
        pool.cap_bytes = pool.cap_bytes.max(returned);
        for t in buffers {
            if !t.device().is_cpu() || !t.is_contiguous() {
                continue;
            }
            pool.free_bytes += bytes_of(&t);
            pool.free.push_back(t);
            pool.stats.kept += 1;
        }
        while pool.free_bytes > pool.cap_bytes {
            let Some(old) = pool.free.pop_front() else {
                break;
            };
            pool.free_bytes -= bytes_of(&old);
        }
    }

    /// Drops every free buffer (their memory goes back to the allocator).
    pub fn clear(&self) {
        let mut pool = self.lock();
        pool.free.clear();
        pool.free_bytes = 0;
    }

    /// Counters, and the bytes held now.
    pub fn stats(&self) -> StagingStats {
        let pool = self.lock();
        StagingStats {
            free_bytes: pool.free_bytes,
            ..pool.stats
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(t: &Tensor) -> usize {
        accel_kernels::with_slice::<f32, _>(t, "test", |s| Ok(s.as_ptr() as usize)).unwrap()
    }

    #[test]
    fn a_buffer_given_back_is_handed_out_again_for_the_same_shape_and_dtype() {
        let pool = StagingPool::new();
        let a = pool.take(&[4, 8], DType::F32).unwrap();
        let at = addr(&a);
        pool.give_back(vec![a]);
        let other_shape = pool.take(&[8, 4], DType::F32).unwrap();
        assert_ne!(addr(&other_shape), at);
        let b = pool.take(&[4, 8], DType::F32).unwrap();
        assert_eq!(addr(&b), at);
        let s = pool.stats();
        assert_eq!((s.reused, s.allocated, s.free_bytes), (1, 2, 0));
    }

    #[test]
    fn free_bytes_stay_within_the_largest_set_given_back_at_once() {
        let pool = StagingPool::new();
        let block = |n| {
            (0..n)
                .map(|_| pool.take(&[256], DType::F32).unwrap())
                .collect::<Vec<_>>()
        };
        let first = block(2);
        pool.give_back(first);
        // A different shape given back while two 256s are free: the oldest
        // go, so only one block's worth (2 KiB) stays.
        let odd = pool.take(&[512], DType::F32).unwrap();
        pool.give_back(vec![odd]);
        let s = pool.stats();
        assert_eq!(s.free_bytes, 2048);
        assert!(pool.take(&[512], DType::F32).is_ok());
        assert_eq!(pool.stats().reused, 1);
        pool.clear();
        assert_eq!(pool.stats().free_bytes, 0);
    }
}
