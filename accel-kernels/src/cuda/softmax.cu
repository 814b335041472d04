// Softmax and log-softmax over the last dimension of a [rows, d] f32 matrix, forward and backward,
// for accel-nn's softmax ops on CUDA. One warp per row, as the row norms. The formulas are the CPU
// kernel's (accel-nn/src/kernels/softmax.rs): y = exp(x - max) * (1 / sum) or x - (max + log(sum));
// the backward reads the output, y * (g - <g, y>) or g - exp(y) * sum(g). expf and the warp's sum
// order are not the CPU's, so the two agree to a few ulps, not bit for bit.
#ifndef ACCEL_COMMON_CUH
#include "common.cuh"
#endif

#define SM_FULL_MASK 0xffffffffU

__device__ __forceinline__ float sm_warp_sum(float v) {
    for (int off = 16; off > 0; off >>= 1) {
        v += __shfl_xor_sync(SM_FULL_MASK, v, off);
    }
    return v;
}

__device__ __forceinline__ float sm_warp_max(float v) {
    for (int off = 16; off > 0; off >>= 1) {
        v = fmaxf(v, __shfl_xor_sync(SM_FULL_MASK, v, off));
    }
    return v;
}

extern "C" __global__ void softmax_fwd(const float *x, float *y, u32 rows, u32 d, int log) {
    u32 warps = blockDim.x / 32, lane = threadIdx.x % 32;
    for (u64 r = (u64)blockIdx.x * warps + threadIdx.x / 32; r < rows;
         r += (u64)gridDim.x * warps) {
        const float *xr = x + r * d;
        float *yr = y + r * d;
        float m = __int_as_float(0xff800000);  // -inf
        for (u32 j = lane; j < d; j += 32) {
            m = fmaxf(m, xr[j]);
        }
        m = sm_warp_max(m);
        float s = 0.0f;
        for (u32 j = lane; j < d; j += 32) {
            s += expf(xr[j] - m);
        }
        s = sm_warp_sum(s);
        if (log) {
            float lse = m + logf(s);
            for (u32 j = lane; j < d; j += 32) {
                yr[j] = xr[j] - lse;
            }
        } else {
            float inv = 1.0f / s;
            for (u32 j = lane; j < d; j += 32) {
                yr[j] = expf(xr[j] - m) * inv;
            }
        }
    }
}

extern "C" __global__ void softmax_bwd(const float *y, const float *g, float *dx, u32 rows, u32 d,
                                       int log) {
    u32 warps = blockDim.x / 32, lane = threadIdx.x % 32;
    for (u64 r = (u64)blockIdx.x * warps + threadIdx.x / 32; r < rows;
         r += (u64)gridDim.x * warps) {
        const float *yr = y + r * d, *gr = g + r * d;
        float *dr = dx + r * d;
        float s = 0.0f;
        for (u32 j = lane; j < d; j += 32) {
            s += log ? gr[j] : gr[j] * yr[j];
        }
        s = sm_warp_sum(s);
        for (u32 j = lane; j < d; j += 32) {
            dr[j] = log ? gr[j] - expf(yr[j]) * s : yr[j] * (gr[j] - s);
        }
    }
}
