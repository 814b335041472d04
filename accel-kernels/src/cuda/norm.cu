// Multi-tensor reductions for gradient clipping: the sum of squares (f64
// accumulation) behind the global L2 norm, and the largest magnitude (NaN
// if any element is NaN) behind the inf-norm. Chunk operand: p[0] = data.
//
// Each chunk's result goes to partial[chunk] and the host combines the
// partials in chunk order, so the result does not depend on the grid size
// or on scheduling (no atomics).
#ifndef ACCEL_COMMON_CUH
#include "common.cuh"
#endif

#define BLOCK_MAX_WARPS 32

// Sum over the block; every thread must call it. The result is valid in
// thread 0.
__device__ __forceinline__ double block_sum(double v, double *scratch) {
    for (int off = 16; off > 0; off >>= 1) {
        v += __shfl_down_sync(0xffffffffU, v, off);
    }
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) {
        scratch[warp] = v;
    }
    __syncthreads();
    int warps = (blockDim.x + 31) / 32;
    v = (threadIdx.x < warps) ? scratch[threadIdx.x] : 0.0;
    if (warp == 0) {
        for (int off = 16; off > 0; off >>= 1) {
            v += __shfl_down_sync(0xffffffffU, v, off);
        }
    }
    __syncthreads(); // scratch is reused by the next chunk
    return v;
}

// Maximum over the block (NaN-free inputs: NaN is tracked apart).
__device__ __forceinline__ float block_max(float v, float *scratch) {
    for (int off = 16; off > 0; off >>= 1) {
        float o = __shfl_down_sync(0xffffffffU, v, off);
        v = o > v ? o : v;
    }
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) {
        scratch[warp] = v;
    }
    __syncthreads();
    int warps = (blockDim.x + 31) / 32;
    v = (threadIdx.x < warps) ? scratch[threadIdx.x] : 0.0f;
    if (warp == 0) {
        for (int off = 16; off > 0; off >>= 1) {
            float o = __shfl_down_sync(0xffffffffU, v, off);
            v = o > v ? o : v;
        }
    }
    __syncthreads();
    return v;
}

template <typename T>
__device__ __forceinline__ void sumsq_chunks(const Table &t, double *partial) {
    typedef typename T::raw R;
    __shared__ double scratch[BLOCK_MAX_WARPS];
    for (u32 c = blockIdx.x; c < n_chunks(t); c += gridDim.x) {
        Chunk k = chunk_at(t, c);
        const R *x = (const R *)k.p[0];
        double acc = 0.0;
        chunk_loop(
            k.n, vec_aligned(x),
            [&](u64 i) {
                Pack<R> a = load_pack(x, i);
#pragma unroll
                for (int j = 0; j < VEC; j++) {
                    double v = (double)T::load(a.v[j]);
                    acc += v * v;
                }
            },
            [&](u64 i) {
                double v = (double)T::load(x[i]);
                acc += v * v;
            });
        double total = block_sum(acc, scratch);
        if (threadIdx.x == 0) {
            partial[c] = total;
        }
    }
}

template <typename T>
__device__ __forceinline__ void maxabs_chunks(const Table &t, double *partial) {
    typedef typename T::raw R;
    __shared__ float scratch[BLOCK_MAX_WARPS];
    __shared__ int any_nan;
    for (u32 c = blockIdx.x; c < n_chunks(t); c += gridDim.x) {
        if (threadIdx.x == 0) {
            any_nan = 0;
        }
        __syncthreads();
        Chunk k = chunk_at(t, c);
        const R *x = (const R *)k.p[0];
        float best = 0.0f;
        bool nan = false;
        auto visit = [&](float v) {
            float a = fabsf(v);
            best = a > best ? a : best;
            nan |= v != v;
        };
        chunk_loop(
            k.n, vec_aligned(x),
            [&](u64 i) {
                Pack<R> a = load_pack(x, i);
#pragma unroll
                for (int j = 0; j < VEC; j++) {
                    visit(T::load(a.v[j]));
                }
            },
            [&](u64 i) { visit(T::load(x[i])); });
        if (nan) {
            any_nan = 1;
        }
        float m = block_max(best, scratch); // its __syncthreads publishes any_nan
        if (threadIdx.x == 0) {
            partial[c] = any_nan ? __longlong_as_double(0x7ff8000000000000LL) : (double)m;
        }
        __syncthreads();
    }
}

#define NORM_OPS(T, SUFFIX)                                       \
    extern "C" __global__ void sumsq_##SUFFIX(const Table t,      \
                                              double *partial) {  \
        sumsq_chunks<T>(t, partial);                              \
    }                                                             \
    extern "C" __global__ void maxabs_##SUFFIX(const Table t,     \
                                               double *partial) { \
        maxabs_chunks<T>(t, partial);                             \
    }

NORM_OPS(F32, f32)
NORM_OPS(BF16, bf16)
NORM_OPS(F16, f16)
