// Frozen quantized weights on CUDA: bitsandbytes' 4-bit blocks (NF4/FP4,
// optionally double-quantized maxima) and LLM.int8 rows. quant.rs runs the
// products through them:
// - many rows of x: `dequant4_*` / `dequant8_*` write one tile of the weight
//   (a band of rows for the forward, of columns for the input's gradient,
//   bounded in size) in the compute dtype, and cuBLAS multiplies it, so the
//   whole dequantized matrix never exists and the products run on tensor
//   cores;
// - a few rows (decoding): `gemv4_*` reads the codes once and multiplies as
//   it goes, a warp per output row.
// Each value is bitsandbytes' (and the CPU kernels'): `code * block maximum`
// rounded to the dtype the weight was quantized from, then to the compute
// dtype; a double-quantized maximum is `map[code] * nested + offset`,
// multiplied and added as two roundings (never contracted to an FMA), as the
// CPU computes it.
#ifndef ACCEL_COMMON_CUH
#include "common.cuh"
#endif

typedef unsigned char u8;

// The code book of a 4-bit type and bitsandbytes' 8-bit dynamic map (the
// codes of double-quantized block maxima), passed by value (1088 bytes;
// `QuantCodes` in args.rs).
struct QuantCodes {
    float codes[16];
    float map[256];
};

// The weight `[out, inp]` and the tile a launch makes: rows r0..r0 + rows,
// columns k0..k0 + cols, row-major into `dst` (`QuantDims` in args.rs).
struct QuantDims {
    u64 out, inp, r0, k0;
    u32 rows, cols;
    // 4-bit: elements per block maximum.
    u32 blocksize;
    // Double quantization: block maxima per nested maximum (0: f32 maxima).
    u32 nested_per;
    // Double quantization: what is added back to each block maximum.
    float offset;
    // The dtype the weight was quantized from: 0 f32, 1 bf16, 2 f16.
    u32 store;
    // gemv4: rows of x (at most GEMV_ROWS).
    u32 n;
    u32 pad;
};
static_assert(sizeof(QuantDims) == 64, "QuantDims must match args.rs");

// Rows of x the few-row product takes, and warps (output rows) per block.
#define GEMV_ROWS 8
#define GEMV_WARPS 8

__device__ __forceinline__ float store_round(float v, u32 store) {
    if (store == 1) return BF16::load(BF16::store(v));
    if (store == 2) return F16::load(F16::store(v));
    return v;
}

// Copies the code book and map into shared memory (every thread of the block
// calls it, then reads `codes` / `map`).
__device__ __forceinline__ void stage_codes(const QuantCodes &q, float *codes, float *map) {
    for (u32 i = threadIdx.x; i < 256; i += blockDim.x) {
        if (i < 16) codes[i] = q.codes[i];
        map[i] = q.map[i];
    }
    __syncthreads();
}

// The maximum of block `b`.
__device__ __forceinline__ float block_max(const float *absmax, const u8 *absmax_codes,
                                           const float *nested, const QuantDims &d,
                                           const float *map, u64 b) {
    if (d.nested_per == 0) return absmax[b];
    return __fadd_rn(__fmul_rn(map[absmax_codes[b]], nested[b / d.nested_per]), d.offset);
}

// Flattened element `e` of a 4-bit weight (the even element of a byte in its
// high nibble), rounded to the dtype it was quantized from.
__device__ __forceinline__ float value4(const u8 *packed, const float *absmax,
                                        const u8 *absmax_codes, const float *nested,
                                        const QuantDims &d, const float *codes,
                                        const float *map, u64 e) {
    const u8 byte = packed[e / 2];
    const u32 c = (e & 1) ? (byte & 15u) : (byte >> 4);
    const float s = block_max(absmax, absmax_codes, nested, d, map, e / d.blocksize);
    return store_round(__fmul_rn(codes[c], s), d.store);
}

template <typename T>
__device__ void dequant4(const u8 *packed, const float *absmax, const u8 *absmax_codes,
                         const float *nested, QuantDims d, QuantCodes q, typename T::raw *dst) {
    __shared__ float codes[16];
    __shared__ float map[256];
    stage_codes(q, codes, map);
    const u64 n = (u64)d.rows * d.cols;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (u64)gridDim.x * blockDim.x) {
        const u64 e = (d.r0 + i / d.cols) * d.inp + d.k0 + i % d.cols;
        dst[i] = T::store(value4(packed, absmax, absmax_codes, nested, d, codes, map, e));
    }
}

// bitsandbytes' 1/127 as the f32 its Python literal becomes.
#define INV_127 7.874016e-3f

template <typename T>
__device__ void dequant8(const u8 *codes, const float *row_max, QuantDims d,
                         typename T::raw *dst) {
    const u64 n = (u64)d.rows * d.cols;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (u64)gridDim.x * blockDim.x) {
        const u64 r = d.r0 + i / d.cols;
        const float c = (float)(signed char)codes[r * d.inp + d.k0 + i % d.cols];
        dst[i] = T::store(__fmul_rn(__fmul_rn(c, row_max[r]), INV_127));
    }
}

// y [n, out] = x [n, inp] W^T for n <= GEMV_ROWS: warp w of block b makes
// output column o = b * GEMV_WARPS + w for every row of x, its lanes taking
// a byte (two elements) each of 64 consecutive ones, so a warp reads 32
// consecutive bytes of the row at a time; the lanes' sums are combined by
// shuffles in a fixed order.
template <typename T>
__device__ void gemv4(const typename T::raw *x, const u8 *packed, const float *absmax,
                      const u8 *absmax_codes, const float *nested, QuantDims d, QuantCodes q,
                      typename T::raw *y) {
    __shared__ float codes[16];
    __shared__ float map[256];
    stage_codes(q, codes, map);
    const u32 lane = threadIdx.x % 32;
    const u64 o = (u64)blockIdx.x * GEMV_WARPS + threadIdx.x / 32;
    if (o >= d.out) return;
    float acc[GEMV_ROWS];
#pragma unroll
    for (int r = 0; r < GEMV_ROWS; ++r) acc[r] = 0.0f;
    for (u64 k0 = 0; k0 < d.inp; k0 += 64) {
#pragma unroll
        for (u32 h = 0; h < 2; ++h) {
            const u64 k = k0 + 2 * lane + h;
            if (k >= d.inp) continue;
            // Rounded to the compute dtype, as the tiles are.
            const float w = T::load(T::store(
                value4(packed, absmax, absmax_codes, nested, d, codes, map, o * d.inp + k)));
#pragma unroll
            for (u32 r = 0; r < GEMV_ROWS; ++r) {
                if (r < d.n) acc[r] += w * T::load(x[r * d.inp + k]);
            }
        }
    }
#pragma unroll
    for (u32 r = 0; r < GEMV_ROWS; ++r) {
        float v = acc[r];
        for (int off = 16; off > 0; off /= 2) v += __shfl_xor_sync(0xffffffffu, v, off);
        if (lane == 0 && r < d.n) y[r * d.out + o] = T::store(v);
    }
}

#define QUANT_KERNELS(SUFFIX, T)                                                              \
    extern "C" __global__ void dequant4_##SUFFIX(const u8 *packed, const float *absmax,      \
                                                 const u8 *absmax_codes, const float *nested, \
                                                 QuantDims d, QuantCodes q, T::raw *dst) {    \
        dequant4<T>(packed, absmax, absmax_codes, nested, d, q, dst);                        \
    }                                                                                         \
    extern "C" __global__ void dequant8_##SUFFIX(const u8 *codes, const float *row_max,      \
                                                 QuantDims d, T::raw *dst) {                  \
        dequant8<T>(codes, row_max, d, dst);                                                  \
    }                                                                                         \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)                             \
        gemv4_##SUFFIX(const T::raw *x, const u8 *packed, const float *absmax,                \
                       const u8 *absmax_codes, const float *nested, QuantDims d,             \
                       QuantCodes q, T::raw *y) {                                             \
        gemv4<T>(x, packed, absmax, absmax_codes, nested, d, q, y);                          \
    }

QUANT_KERNELS(f32, F32)
QUANT_KERNELS(bf16, BF16)
QUANT_KERNELS(f16, F16)
