// Multi-tensor element-wise ops on one list: unscale with an overflow flag,
// the overflow check alone, scaling and clamping. Chunk operand: p[0] =
// the tensor's data (read, and written except by `nonfinite_*`).
//
// Every op computes in f32 and rounds once to the storage type. The flag is
// a u32 in device memory that any thread seeing inf or NaN sets to 1 (a
// benign race: every writer writes the same value); it is never cleared
// here, so one flag can collect the launches of several dtypes.
#ifndef ACCEL_COMMON_CUH
#include "common.cuh"
#endif

// Multiplies by `factor` (when WRITE) and raises `*found` on a non-finite
// input (when CHECK).
template <typename T, bool CHECK, bool WRITE>
__device__ __forceinline__ void scale_chunks(const Table &t, float factor,
                                             u32 *found) {
    typedef typename T::raw R;
    bool seen = false;
    for (u32 c = blockIdx.x; c < n_chunks(t); c += gridDim.x) {
        Chunk k = chunk_at(t, c);
        R *x = (R *)k.p[0];
        chunk_loop_staged(
            k.n, vec_aligned(x), [&](u64 i) { return load_pack(x, i); },
            [&](u64 i, Pack<R> a) {
#pragma unroll
                for (int j = 0; j < VEC; j++) {
                    float v = T::load(a.v[j]);
                    if (CHECK) {
                        seen |= non_finite(v);
                    }
                    a.v[j] = T::store(v * factor);
                }
                if (WRITE) {
                    store_pack(x, i, a);
                }
            },
            [&](u64 i) {
                float v = T::load(x[i]);
                if (CHECK) {
                    seen |= non_finite(v);
                }
                if (WRITE) {
                    x[i] = T::store(v * factor);
                }
            });
    }
    if (CHECK && seen) {
        *found = 1;
    }
}

// torch.clamp_: min(max(x, lo), hi), written with comparisons so that NaN
// (false in both) stays NaN; lo > hi gives hi. The same code as the CPU path.
template <typename T>
__device__ __forceinline__ void clamp_chunks(const Table &t, float lo, float hi) {
    typedef typename T::raw R;
    for (u32 c = blockIdx.x; c < n_chunks(t); c += gridDim.x) {
        Chunk k = chunk_at(t, c);
        R *x = (R *)k.p[0];
        auto clamp1 = [&](R r) {
            float v = T::load(r);
            v = v < lo ? lo : v;
            v = v > hi ? hi : v;
            return T::store(v);
        };
        chunk_loop_staged(
            k.n, vec_aligned(x), [&](u64 i) { return load_pack(x, i); },
            [&](u64 i, Pack<R> a) {
#pragma unroll
                for (int j = 0; j < VEC; j++) {
                    a.v[j] = clamp1(a.v[j]);
                }
                store_pack(x, i, a);
            },
            [&](u64 i) { x[i] = clamp1(x[i]); });
    }
}

#define SCALE_OPS(T, SUFFIX)                                                \
    extern "C" __global__ void unscale_##SUFFIX(const Table t,              \
                                                float factor, u32 *found) { \
        scale_chunks<T, true, true>(t, factor, found);                      \
    }                                                                       \
    extern "C" __global__ void nonfinite_##SUFFIX(const Table t,            \
                                                  u32 *found) {             \
        scale_chunks<T, true, false>(t, 1.0f, found);                       \
    }                                                                       \
    extern "C" __global__ void scale_##SUFFIX(const Table t,                \
                                              float factor) {               \
        scale_chunks<T, false, true>(t, factor, 0);                         \
    }                                                                       \
    extern "C" __global__ void clamp_##SUFFIX(const Table t, float lo,      \
                                              float hi) {                   \
        clamp_chunks<T>(t, lo, hi);                                         \
    }

SCALE_OPS(F32, f32)
SCALE_OPS(BF16, bf16)
SCALE_OPS(F16, f16)
