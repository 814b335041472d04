// Layer norm and RMS norm over the last dimension of a [rows, d] f32 matrix, forward and backward,
// for accel-nn's norm ops on CUDA (half inputs are converted to f32 around them, as the composed
// path does). The statistics are those of the CPU kernels (accel-nn/src/kernels/norm.rs): mean,
// then the biased variance of the centred row, rstd = 1 / sqrt(var + eps); for RMS norm the mean
// is 0 and there is no bias. Like the CPU path, the backward recomputes the statistics.
//
// One warp per row for the row passes; the weight and bias gradients are reduced over rows in
// fixed blocks of ROWS_PER_PARTIAL rows and then over the blocks in order, so the results do not
// depend on the launch shape or on scheduling (no atomics).
#ifndef ACCEL_COMMON_CUH
#include "common.cuh"
#endif

#define FULL_MASK 0xffffffffU
#define ROWS_PER_PARTIAL 64

__device__ __forceinline__ float warp_sum(float v) {
    for (int off = 16; off > 0; off >>= 1) {
        v += __shfl_xor_sync(FULL_MASK, v, off);
    }
    return v;
}

// (mean, rstd) of one row; every lane of the warp gets them.
__device__ __forceinline__ void row_stats(const float *xr, u32 d, float eps, int rms, u32 lane,
                                          float &mean, float &rstd) {
    mean = 0.0f;
    if (!rms) {
        float s = 0.0f;
        for (u32 j = lane; j < d; j += 32) {
            s += xr[j];
        }
        mean = warp_sum(s) / (float)d;
    }
    float v = 0.0f;
    for (u32 j = lane; j < d; j += 32) {
        float c = xr[j] - mean;
        v += c * c;
    }
    rstd = 1.0f / sqrtf(warp_sum(v) / (float)d + eps);
}

// y = (x - mean) * rstd * w [+ b], row by row. `b` may be null.
extern "C" __global__ void rownorm_fwd(const float *x, const float *w, const float *b, float *y,
                                       u32 rows, u32 d, float eps, int rms) {
    u32 warps = blockDim.x / 32, lane = threadIdx.x % 32;
    for (u64 r = (u64)blockIdx.x * warps + threadIdx.x / 32; r < rows;
         r += (u64)gridDim.x * warps) {
        const float *xr = x + r * d;
        float *yr = y + r * d;
        float mean, rstd;
        row_stats(xr, d, eps, rms, lane, mean, rstd);
        for (u32 j = lane; j < d; j += 32) {
            float o = (xr[j] - mean) * rstd * w[j];
            yr[j] = b ? o + b[j] : o;
        }
    }
}

// The input gradient, row by row: with xhat = (x - mean) * rstd and gw = g * w,
// dx = rstd * (gw - mean(gw) - xhat * mean(gw * xhat)) (no mean(gw) term for RMS norm).
// Also writes each row's (mean, rstd) to stats[2r], stats[2r + 1] for the weight gradients.
extern "C" __global__ void rownorm_bwd_dx(const float *x, const float *w, const float *g,
                                          float *dx, float *stats, u32 rows, u32 d, float eps,
                                          int rms) {
    u32 warps = blockDim.x / 32, lane = threadIdx.x % 32;
    for (u64 r = (u64)blockIdx.x * warps + threadIdx.x / 32; r < rows;
         r += (u64)gridDim.x * warps) {
        const float *xr = x + r * d;
        const float *gr = g + r * d;
        float *dxr = dx + r * d;
        float mean, rstd;
        row_stats(xr, d, eps, rms, lane, mean, rstd);
        float s1 = 0.0f, s2 = 0.0f;
        for (u32 j = lane; j < d; j += 32) {
            float gw = gr[j] * w[j];
            s1 += gw;
            s2 += gw * ((xr[j] - mean) * rstd);
        }
        float m1 = rms ? 0.0f : warp_sum(s1) / (float)d;
        float m2 = warp_sum(s2) / (float)d;
        for (u32 j = lane; j < d; j += 32) {
            float xhat = (xr[j] - mean) * rstd;
            dxr[j] = rstd * (gr[j] * w[j] - m1 - xhat * m2);
        }
        if (lane == 0) {
            stats[2 * r] = mean;
            stats[2 * r + 1] = rstd;
        }
    }
}

// Partial weight and bias gradients: thread (column j, block p) sums g * xhat and g over rows
// [p * ROWS_PER_PARTIAL, (p + 1) * ROWS_PER_PARTIAL) into pw[p * d + j], pb[p * d + j].
extern "C" __global__ void rownorm_bwd_partials(const float *x, const float *g, const float *stats,
                                                float *pw, float *pb, u32 rows, u32 d) {
    u32 j = blockIdx.x * blockDim.x + threadIdx.x;
    u32 p = blockIdx.y;
    if (j >= d) {
        return;
    }
    u64 r0 = (u64)p * ROWS_PER_PARTIAL;
    u64 r1 = r0 + ROWS_PER_PARTIAL < rows ? r0 + ROWS_PER_PARTIAL : rows;
    float sw = 0.0f, sb = 0.0f;
    for (u64 r = r0; r < r1; r++) {
        float gv = g[r * d + j];
        sw += gv * ((x[r * d + j] - stats[2 * r]) * stats[2 * r + 1]);
        sb += gv;
    }
    pw[(u64)p * d + j] = sw;
    pb[(u64)p * d + j] = sb;
}

// dw[j] = sum over blocks p, in order, of pw[p * d + j]; db likewise.
// `dwdb` holds dw then db.
extern "C" __global__ void rownorm_bwd_sum(const float *pw, const float *pb, float *dwdb,
                                           u32 blocks, u32 d) {
    u32 j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= d) {
        return;
    }
    float sw = 0.0f, sb = 0.0f;
    for (u32 p = 0; p < blocks; p++) {
        sw += pw[(u64)p * d + j];
        sb += pb[(u64)p * d + j];
    }
    dwdb[j] = sw;
    dwdb[d + j] = sb;
}
