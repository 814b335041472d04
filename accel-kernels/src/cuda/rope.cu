// Rotary position embeddings on f32, for accel-nn's rope on CUDA: x is [rows, d] with rows cycling
// through the t positions (x [b, h, t, d] flattened), cos and sin are [t, d/2]. Pairs are (i, i + d/2)
// (HF rotate_half) or, when `interleaved`, (2i, 2i + 1). `sign` = -1 gives the inverse rotation,
// the backward. The arithmetic is the CPU kernel's (accel-nn/src/kernels/rope.rs), products and
// sums in the same order with no contraction (the crate compiles with fmad off), so the results
// are bitwise the CPU's.
#ifndef ACCEL_COMMON_CUH
#include "common.cuh"
#endif

extern "C" __global__ void rope_f32(const float *x, const float *cos, const float *sin, float *y,
                                    u64 rows, u32 t, u32 d, int interleaved, float sign) {
    u32 half = d / 2;
    u64 pairs = rows * half;
    for (u64 p = (u64)blockIdx.x * blockDim.x + threadIdx.x; p < pairs;
         p += (u64)gridDim.x * blockDim.x) {
        u64 r = p / half;
        u32 i = (u32)(p % half);
        u64 at = (r % t) * half + i;
        float c = cos[at], s = sign * sin[at];
        const float *xr = x + r * d;
        float *yr = y + r * d;
        if (interleaved) {
            float a = xr[2 * i], b = xr[2 * i + 1];
            yr[2 * i] = a * c - b * s;
            yr[2 * i + 1] = a * s + b * c;
        } else {
            float a = xr[i], b = xr[i + half];
            yr[i] = a * c - b * s;
            yr[i + half] = b * c + a * s;
        }
    }
}
