//! torch's float32 `sum` on the CPU (`cascade_sum` in ATen's
//! `SumKernel.cpp`), reproduced in its order of additions: double
//! quantization's offset is `absmax.mean()`, which torch computes as this sum
//! divided by the count, and bitsandbytes stores the result bit for bit.
//!
//! The order: lanes of 8 (torch's `Vectorized<float>` as its sum kernel
//! runs, checked against torch 2.15 on AVX-512 and AVX2 CPUs), four lanes of
//! those interleaved (`row_sum`'s ILP), each accumulated in up to four
//! levels of `2^k`-element chunks (`multi_row_sum`), then the tail and the
//! lanes added in order. torch splits a tensor of more than 32768 values
//! between its threads; this is its one-thread order.

// The loops index the accumulators as ATen's do, so the order reads off it.
#![allow(clippy::needless_range_loop)]

/// Lanes of torch's float vector in the sum kernel.
const LANES: usize = 8;

/// Something summed lane-wise: an f32, or a vector of [`LANES`] of them.
trait Acc: Copy {
    const ZERO: Self;
    fn add(self, o: Self) -> Self;
}

impl Acc for f32 {
    const ZERO: Self = 0.0;
    fn add(self, o: Self) -> Self {
        self + o
    }
}

impl Acc for [f32; LANES] {
    const ZERO: Self = [0.0; LANES];
    fn add(self, o: Self) -> Self {
        std::array::from_fn(|i| self[i] + o[i])
    }
}

/// ATen's `CeilLog2` (1 for 0, 1 and 2).
fn ceil_log2(x: usize) -> u32 {
    if x <= 2 {
        1
    } else {
        usize::BITS - (x - 1).leading_zeros()
    }
}

/// `multi_row_sum` over `size` items of `NROWS` rows each (`load(i, k)`).
fn multi_row_sum<T: Acc, const NROWS: usize>(
    load: impl Fn(usize, usize) -> T,
    size: usize,
) -> [T; NROWS] {
    const LEVELS: usize = 4;
    let power = 4.max(ceil_log2(size) / LEVELS as u32);
    let step = 1usize << power;
    let mask = step - 1;
    let mut acc = [[T::ZERO; NROWS]; LEVELS];
    let mut i = 0;
    while i + step <= size {
        for _ in 0..step {
            for k in 0..NROWS {
                acc[0][k] = acc[0][k].add(load(i, k));
            }
            i += 1;
        }
        for j in 1..LEVELS {
            for k in 0..NROWS {
                acc[j][k] = acc[j][k].add(acc[j - 1][k]);
                acc[j - 1][k] = T::ZERO;
            }
            if i & (mask << (j as u32 * power)) != 0 {
                break;
            }
        }
    }
    for i in i..size {
        for k in 0..NROWS {
            acc[0][k] = acc[0][k].add(load(i, k));
        }
    }
    for j in 1..LEVELS {
        for k in 0..NROWS {
            acc[0][k] = acc[0][k].add(acc[j][k]);
        }
    }
    acc[0]
}

/// `row_sum`: `size` items read four interleaved rows at a time.
fn row_sum<T: Acc>(load: impl Fn(usize) -> T, size: usize) -> T {
    const ILP: usize = 4;
    let rows = size / ILP;
    let mut p = multi_row_sum::<T, ILP>(|i, k| load(i * ILP + k), rows);
    for i in rows * ILP..size {
        p[0] = p[0].add(load(i));
    }
    for k in 1..ILP {
        p[0] = p[0].add(p[k]);
    }
    p[0]
}

/// `torch.sum` of a contiguous f32 vector, in torch's order on one thread.
pub(crate) fn torch_sum(x: &[f32]) -> f32 {
    if x.len() < LANES {
        return row_sum(|i| x[i], x.len());
    }
    let vectors = x.len() / LANES;
    let lanes = row_sum(
        |i| -> [f32; LANES] { std::array::from_fn(|k| x[i * LANES + k]) },
        vectors,
    );
    let tail = x[vectors * LANES..].iter().fold(0.0, |s, v| s + v);
    lanes.iter().fold(tail, |s, v| s + v)
}

/// `torch.mean` of a contiguous f32 vector: its [`torch_sum`] over the count.
pub(crate) fn torch_mean(x: &[f32]) -> f32 {
    torch_sum(x) / x.len() as f32
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Sums torch 2.15 printed for `torch.arange(n) * 0.1 + 1/3` (f32), one
    /// thread (`(torch.arange(n) * 0.1 + 1/3).sum()`): 528.3333740234375 for
    /// 100, where the exact sum rounds to 528.33331298828125.
    #[test]
    fn sums_follow_torch_s_order() {
        let vals = |n: usize| -> Vec<f32> { (0..n).map(|i| i as f32 * 0.1 + 1.0 / 3.0).collect() };
        for (n, want) in [
            (7, 4.433_333_4),
            (100, 528.333_4),
            (1000, 50_283.34),
            (4099, 841_251.44),
        ] {
            let got = torch_sum(&vals(n));
            assert_eq!(got, want, "n = {n}");
        }
    }
}
