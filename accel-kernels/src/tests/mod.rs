//! Unit tests that need crate-internal items (work plans, the fallback).

mod cast;
mod ops;
mod optim;
mod slices;

use candle_core::{DType, Device, Tensor};
use half::{bf16, f16};

use crate::cpu::Plan;

/// A plan that cuts work into tiny bundles and always runs them on the pool.
pub(crate) const TINY_PARALLEL: Plan = Plan {
    chunk: 777,
    min_parallel: 0,
};
/// A plan that never goes parallel and never cuts.
pub(crate) const SEQUENTIAL: Plan = Plan {
    chunk: usize::MAX,
    min_parallel: usize::MAX,
};

/// Runs `f` as if candle's pool had 4 threads, so the parallel paths are
/// taken even on a machine with fewer cores (they run on the pool's
/// threads, in parallel wherever it has more than one).
pub(crate) fn on_pool<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    crate::par::with_threads(4, f)
}

/// Deterministic pseudo-random f32 values in [-scale, scale).
pub(crate) fn randn(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut x = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((x >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect()
}

/// A CPU f32 tensor.
pub(crate) fn tf32(v: &[f32], shape: &[usize]) -> Tensor {
    Tensor::from_vec(v.to_vec(), shape, &Device::Cpu).unwrap()
}

/// The bit patterns of a float tensor's elements, widened to u32.
pub(crate) fn bits(t: &Tensor) -> Vec<u32> {
    let t = t.flatten_all().unwrap();
    match t.dtype() {
        DType::F32 => t
            .to_vec1::<f32>()
            .unwrap()
            .iter()
            .map(|v| v.to_bits())
            .collect(),
        DType::BF16 => t
            .to_vec1::<bf16>()
            .unwrap()
            .iter()
            .map(|v| v.to_bits() as u32)
            .collect(),
        DType::F16 => t
            .to_vec1::<f16>()
            .unwrap()
            .iter()
            .map(|v| v.to_bits() as u32)
            .collect(),
        d => panic!("bits: unexpected dtype {d:?}"),
    }
}

/// An f32 tensor's values.
pub(crate) fn vals(t: &Tensor) -> Vec<f32> {
    t.flatten_all()
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
}
