// Multi-tensor dtype conversions: one launch converts a whole list.
// Chunk operands: p[0] = source, p[1] = destination.
#ifndef ACCEL_COMMON_CUH
#include "common.cuh"
#endif

template <typename S, typename D>
__device__ __forceinline__ void cast_chunks(const Table &t) {
    typedef typename S::raw SR;
    typedef typename D::raw DR;
    for (u32 c = blockIdx.x; c < n_chunks(t); c += gridDim.x) {
        Chunk k = chunk_at(t, c);
        const SR *src = (const SR *)k.p[0];
        DR *dst = (DR *)k.p[1];
        chunk_loop_staged(
            k.n, vec_aligned(src) && vec_aligned(dst),
            [&](u64 i) { return load_pack(src, i); },
            [&](u64 i, const Pack<SR> &a) {
                Pack<DR> b;
#pragma unroll
                for (int j = 0; j < VEC; j++) {
                    b.v[j] = D::store(S::load(a.v[j]));
                }
                store_pack(dst, i, b);
            },
            [&](u64 i) { dst[i] = D::store(S::load(src[i])); });
    }
}

#define CAST(S, D, NAME)                             \
    extern "C" __global__ void NAME(const Table t) { \
        cast_chunks<S, D>(t);                        \
    }

CAST(F32, BF16, cast_f32_bf16)
CAST(F32, F16, cast_f32_f16)
CAST(BF16, F32, cast_bf16_f32)
CAST(F16, F32, cast_f16_f32)
// candle converts between the 16-bit types through f32 as well.
CAST(BF16, F16, cast_bf16_f16)
CAST(F16, BF16, cast_f16_bf16)
