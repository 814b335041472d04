// Mean cross entropy of [rows, c] f32 logits against u32 targets (0xffffffff: ignored, as
// accel-nn's IGNORED), for accel-nn's cross_entropy on CUDA, with no host read: the count of
// counted rows and the upstream gradient stay on the device. The formulas are the CPU kernel's
// (accel-nn/src/kernels/loss.rs): lse = max + log(sum(exp(x - max))), loss = lse - x[t], mean in
// f64 over counted rows (0 when none); gradient (exp(x - lse) * scale) - scale at the target, with
// scale = dy / count. A target >= c that is not ignored makes the loss NaN, not a read out of
// bounds (the CPU path names it; here it would need a host read).
#ifndef ACCEL_COMMON_CUH
#include "common.cuh"
#endif

#define XE_FULL_MASK 0xffffffffU
#define XE_IGNORED 0xffffffffU
#define XE_THREADS 1024

__device__ __forceinline__ float xe_warp_sum(float v) {
    for (int off = 16; off > 0; off >>= 1) {
        v += __shfl_xor_sync(XE_FULL_MASK, v, off);
    }
    return v;
}

__device__ __forceinline__ float xe_warp_max(float v) {
    for (int off = 16; off > 0; off >>= 1) {
        v = fmaxf(v, __shfl_xor_sync(XE_FULL_MASK, v, off));
    }
    return v;
}

// Per row (a warp each): lse[r], and loss[r] = lse - x[t] (0 for an ignored row, NaN for a target
// out of range).
extern "C" __global__ void xent_rows(const float *x, const u32 *t, float *lse, float *loss, u32 rows,
                                     u32 c) {
    u32 warps = blockDim.x / 32, lane = threadIdx.x % 32;
    for (u64 r = (u64)blockIdx.x * warps + threadIdx.x / 32; r < rows;
         r += (u64)gridDim.x * warps) {
        const float *xr = x + r * c;
        u32 target = t[r];
        float m = __int_as_float(0xff800000);  // -inf
        for (u32 j = lane; j < c; j += 32) {
            m = fmaxf(m, xr[j]);
        }
        m = xe_warp_max(m);
        float s = 0.0f;
        for (u32 j = lane; j < c; j += 32) {
            s += expf(xr[j] - m);
        }
        s = xe_warp_sum(s);
        if (lane == 0) {
            float l = m + logf(s);
            lse[r] = l;
            if (target == XE_IGNORED) {
                loss[r] = 0.0f;
            } else if (target >= c) {
                loss[r] = __int_as_float(0x7fc00000);  // NaN
            } else {
                loss[r] = l - xr[target];
            }
        }
    }
}

// One block of XE_THREADS threads: mean[0] = sum(loss) / count as f32 (0 when no row counts) and
// count[0] = count, summed in f64 in a fixed order (thread i takes rows i, i + XE_THREADS, ..., then
// a tree over the threads), so the result does not depend on scheduling.
extern "C" __global__ void xent_mean(const float *loss, const u32 *t, float *mean, float *count,
                                     u32 rows) {
    __shared__ double sums[XE_THREADS];
    __shared__ u32 counts[XE_THREADS];
    u32 i = threadIdx.x;
    double s = 0.0;
    u32 n = 0;
    for (u64 r = i; r < rows; r += XE_THREADS) {
        s += (double)loss[r];
        n += t[r] != XE_IGNORED;
    }
    sums[i] = s;
    counts[i] = n;
    __syncthreads();
    for (u32 half = XE_THREADS / 2; half > 0; half >>= 1) {
        if (i < half) {
            sums[i] += sums[i + half];
            counts[i] += counts[i + half];
        }
        __syncthreads();
    }
    if (i == 0) {
        mean[0] = counts[0] ? (float)(sums[0] / (double)counts[0]) : 0.0f;
        count[0] = (float)counts[0];
    }
}

// The logits' gradient: (exp(x - lse) * scale) for every class, minus scale at the target, with
// scale = dy[0] / max(count[0], 1); 0 for ignored rows. A thread per element.
extern "C" __global__ void xent_grad(const float *x, const u32 *t, const float *lse, const float *dy,
                                     const float *count, float *dx, u32 rows, u32 c) {
    u64 n = (u64)rows * c;
    float scale = dy[0] / fmaxf(count[0], 1.0f);
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (u64)gridDim.x * blockDim.x) {
        u64 r = i / c;
        u32 j = (u32)(i % c), target = t[r];
        if (target == XE_IGNORED) {
            dx[i] = 0.0f;
        } else {
            float g = expf(x[i] - lse[r]) * scale;
            dx[i] = j == target ? g - scale : g;
        }
    }
}
