// The shared part of the attention kernels (attention.cu, attention_mma.cu): the call's shapes,
// masks and strides, warp reductions, the score of one (query, key) pair, tile loads. The Rust
// side prepends it (after common.cuh) to both sources for NVRTC, which has no file system.
#ifndef ACCEL_ATTENTION_CUH
#define ACCEL_ATTENTION_CUH
#ifndef ACCEL_COMMON_CUH
#include "common.cuh"
#endif

#define FA_DMAX 128
#define FA_MASK 0xffffffffU
#define FA_NEG_INF __int_as_float(0xff800000)
// Keys per tile in the forward and in dq: one per lane.
#define FA_BC 32
#define FA_WARPS 4
// Query rows per warp (forward) and per block.
#define FA_FWD_ROWS 8
#define FA_FWD_BR (FA_FWD_ROWS * FA_WARPS)
// Query rows per warp and per block in dq.
#define FA_DQ_ROWS 4
#define FA_DQ_BR (FA_DQ_ROWS * FA_WARPS)
// Keys per warp and per block in dk/dv; queries per tile there, one per lane.
#define FA_KV_KEYS 4
#define FA_KV_BC (FA_KV_KEYS * FA_WARPS)
#define FA_KV_BQ 32

// The shapes, mask and strides of one call, passed by value (`FlashDims` in attention.rs:
// twelve 4-byte fields, then thirteen u64s).
struct FlashDims {
    u32 b, h, kvh, t, s, d;
    u32 causal, offset;
    float scale;
    u32 has_bias;
    // With `causal`: a sliding window, key j visible from query i when offset + i - j < window
    // (0: none); `pad0` keeps the u64s 8-aligned.
    u32 window, pad0;
    u64 qs[3], ks[3], vs[3];  // element strides over (batch, head, row)
    u64 bs[4];                // the bias's over (batch, head, query, key)
};

__device__ __forceinline__ float fa_sum(float v) {
    for (int off = 16; off > 0; off >>= 1) {
        v += __shfl_xor_sync(FA_MASK, v, off);
    }
    return v;
}

__device__ __forceinline__ float fa_max(float v) {
    for (int off = 16; off > 0; off >>= 1) {
        v = fmaxf(v, __shfl_xor_sync(FA_MASK, v, off));
    }
    return v;
}

// Element c of tile row r, swizzled: a warp reading one column over 32 rows, or 32 consecutive
// columns of one row, touches 32 different banks (rows are FA_DMAX floats, a multiple of 32).
__device__ __forceinline__ u32 fa_sw(u32 r, u32 c) { return r * FA_DMAX + (c ^ (r & 31)); }

// The scaled score of query i and key j plus the bias, or -inf where j is not visible.
__device__ __forceinline__ float fa_score(const FlashDims &a, const float *bias, float dot, u32 bi,
                                          u32 hi, u32 i, u32 j) {
    bool visible = i < a.t && j < a.s && (!a.causal || (u64)j <= (u64)a.offset + i) &&
                   (a.window == 0 || (u64)a.offset + i < (u64)j + a.window);
    if (!visible) {
        return FA_NEG_INF;
    }
    float sc = dot * a.scale;
    if (a.has_bias) {
        sc += bias[bi * a.bs[0] + hi * a.bs[1] + i * a.bs[2] + j * a.bs[3]];
    }
    return sc;
}

// One past the last key that query rows below `last` may see.
__device__ __forceinline__ u32 fa_key_end(const FlashDims &a, u32 last) {
    if (!a.causal) {
        return a.s;
    }
    u64 end = (u64)a.offset + last;
    return end < a.s ? (u32)end : a.s;
}

// The first key tile (a multiple of `tile`) that query rows from `first` on may see: with a sliding
// window, keys before offset + first + 1 - window are visible to none of them, so their tiles are
// skipped (work O(T * W), not O(T^2)).
__device__ __forceinline__ u32 fa_key_begin(const FlashDims &a, u32 first, u32 tile) {
    if (!a.causal || a.window == 0) {
        return 0;
    }
    u64 reach = (u64)a.offset + first + 1;
    u64 begin = reach > a.window ? reach - a.window : 0;
    return (u32)(begin / tile * tile);
}

// One past the last query that keys below `last` may be seen from: with a sliding window, query i
// sees key j only while offset + i < j + window, so queries from last - 1 + window - offset on see
// none of them (a.t without a window).
__device__ __forceinline__ u32 fa_query_end(const FlashDims &a, u32 last) {
    if (!a.causal || a.window == 0) {
        return a.t;
    }
    u64 end = (u64)last + a.window - 1;  // offset + i < last - 1 + window
    if (end <= a.offset) {
        return 0;
    }
    end -= a.offset;
    return end < a.t ? (u32)end : a.t;
}

// Loads rows r0.. of a [rows, d] operand (row stride `stride`) into a tile of `n` rows, zero past
// `rows`; swizzled when `swizzle`.
template <typename T>
__device__ __forceinline__ void fa_load(float *tile, const typename T::raw *src, u64 stride,
                                        u32 r0, u32 n, u32 rows, u32 d, bool swizzle) {
    for (u32 e = threadIdx.x; e < n * d; e += blockDim.x) {
        u32 r = e / d, c = e % d;
        float x = r0 + r < rows ? T::load(src[(u64)(r0 + r) * stride + c]) : 0.0f;
        tile[swizzle ? fa_sw(r, c) : r * FA_DMAX + c] = x;
    }
}

#endif  // ACCEL_ATTENTION_CUH
