// Shared helpers of the accel-kernels CUDA sources.
//
// The Rust side prepends this file to every .cu source before handing it to
// NVRTC (which has no file system), and defines ACCEL_COMMON_CUH by doing so;
// the guarded #include below each .cu only matters for a standalone
// `nvcc --ptx` syntax check.
//
// No CUDA headers are included: NVRTC may run on a machine without a
// toolkit. The half-precision conversions are written with the very PTX
// instructions that cuda_fp16.hpp / cuda_bf16.hpp (CUDA 12/13) emit for
// __float2half, __half2float, __float2bfloat16 and __bfloat162float under the
// same __CUDA_ARCH__ conditions, which is what candle's `to_dtype` kernels
// use; so results (NaN encodings included) are bitwise those of candle when
// both are compiled for the same architecture.
#ifndef ACCEL_COMMON_CUH
#define ACCEL_COMMON_CUH

typedef unsigned long long u64;
typedef unsigned int u32;
typedef unsigned short u16;

// ============================================================ conversions

__device__ __forceinline__ float f16_to_f32(u16 h) {
    float f;
    asm("{  cvt.f32.f16 %0, %1;}\n" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ u16 f32_to_f16(float f) {
    u16 h;
    asm("{  cvt.rn.f16.f32 %0, %1;}\n" : "=h"(h) : "f"(f));
    return h;
}

__device__ __forceinline__ float bf16_to_f32(u16 h) {
    float f;
#if __CUDA_ARCH__ >= 900
    asm("{ cvt.f32.bf16 %0, %1;}\n" : "=f"(f) : "h"(h));
#else
    asm("{ mov.b32 %0, {0,%1};}\n" : "=f"(f) : "h"(h));
#endif
    return f;
}

__device__ __forceinline__ u16 f32_to_bf16(float f) {
#if __CUDA_ARCH__ >= 800
    u16 h;
    asm("{  cvt.rn.bf16.f32 %0, %1;}\n" : "=h"(h) : "f"(f));
    return h;
#else
    // cuda_bf16.hpp's software path: canonical NaN, else round to nearest even.
    u32 x = __float_as_uint(f);
    if ((x & 0x7fffffffU) > 0x7f800000U) {
        return 0x7fffU;
    }
    return (u16)((x + 0x7fffU + ((x >> 16) & 1U)) >> 16);
#endif
}

// ============================================================ element types

// An element type: how it is stored (`raw`) and how it converts to and from
// the f32 that every kernel computes in.
struct F32 {
    typedef float raw;
    static __device__ __forceinline__ float load(raw x) { return x; }
    static __device__ __forceinline__ raw store(float x) { return x; }
};

struct BF16 {
    typedef u16 raw;
    static __device__ __forceinline__ float load(raw x) { return bf16_to_f32(x); }
    static __device__ __forceinline__ raw store(float x) { return f32_to_bf16(x); }
};

struct F16 {
    typedef u16 raw;
    static __device__ __forceinline__ float load(raw x) { return f16_to_f32(x); }
    static __device__ __forceinline__ raw store(float x) { return f32_to_f16(x); }
};

// ============================================================ vector access

// Elements moved per vector access: a float4 (16 bytes) for f32, 8 bytes
// for the 16-bit types.
#define VEC 4

template <typename R>
struct alignas(sizeof(R) * VEC) Pack {
    R v[VEC];
};

// Can `p` be read VEC elements at a time?
template <typename R>
__device__ __forceinline__ bool vec_aligned(const R *p) {
    return ((u64)p % (sizeof(R) * VEC)) == 0;
}

template <typename R>
__device__ __forceinline__ Pack<R> load_pack(const R *p, u64 i) {
    return reinterpret_cast<const Pack<R> *>(p + i)[0];
}

template <typename R>
__device__ __forceinline__ void store_pack(R *p, u64 i, const Pack<R> &v) {
    reinterpret_cast<Pack<R> *>(p + i)[0] = v;
}

// ============================================================ launch table

// A launch covers up to LAUNCH_TENSORS tensors, described by a `Table`
// passed *by value* as the kernel's first parameter, as PyTorch's
// multi_tensor_apply does: nothing is uploaded per call (a table in device
// memory cost a pageable host-to-device copy per launch, which made the
// host wait for the stream). The host splits longer lists over several
// launches. Each tensor has up to four operands (column j: base address
// p[j][i], 0 when unused, elements of elem[j] bytes), n[i] elements, and is
// cut into chunks of `chunk` elements; chunks of tensor i are numbered
// first[i] .. first[i + 1] - 1, and first[n_tensors] is the launch's chunk
// count. Blocks walk the chunks grid-stride; threads of a block walk the
// elements of a chunk block-stride, VEC at a time when every operand is
// aligned for it, with a scalar tail. The layout is mirrored by `Table` in
// operands.rs (2848 bytes, under the 4 KiB every CUDA version accepts).
#define LAUNCH_TENSORS 64

struct Table {
    u64 p[4][LAUNCH_TENSORS];
    u64 n[LAUNCH_TENSORS];
    u32 first[LAUNCH_TENSORS + 1];
    u32 n_tensors;
    u32 chunk;
    u32 elem[4];
};
static_assert(sizeof(Table) == 2848, "Table must match operands.rs");

// The chunks of a launch.
__device__ __forceinline__ u32 n_chunks(const Table &t) { return t.first[t.n_tensors]; }

// One chunk: its operand addresses (0 where unused) and element count.
struct Chunk {
    u64 p[4];
    u64 n;
};

// Chunk `c` of the launch: the tensor holding it is found by bisecting
// `first` (the same few loads for every thread of the block).
__device__ __forceinline__ Chunk chunk_at(const Table &t, u32 c) {
    u32 lo = 0, hi = t.n_tensors;
    while (hi - lo > 1) {
        u32 mid = (lo + hi) / 2;
        if (t.first[mid] <= c) {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    u64 off = (u64)(c - t.first[lo]) * t.chunk;
    Chunk k;
#pragma unroll
    for (int j = 0; j < 4; j++) {
        u64 base = t.p[j][lo];
        k.p[j] = base ? base + off * t.elem[j] : 0;
    }
    u64 rest = t.n[lo] - off;
    k.n = rest < t.chunk ? rest : t.chunk;
    return k;
}

// Runs `vec(i)` for i = 0, VEC, 2*VEC, ... while a whole vector fits (only
// when `aligned`), then `one(i)` for the remaining elements.
template <typename FV, typename F1>
__device__ __forceinline__ void chunk_loop(u64 n, bool aligned, FV vec, F1 one) {
    u64 nv = aligned ? n / VEC : 0;
    for (u64 i = threadIdx.x; i < nv; i += blockDim.x) {
        vec(i * VEC);
    }
    for (u64 i = nv * VEC + threadIdx.x; i < n; i += blockDim.x) {
        one(i);
    }
}

// Vectors in flight per thread in `chunk_loop_staged`.
#define UNROLL 4

// `chunk_loop` for bandwidth-bound kernels: each thread issues the loads of
// UNROLL vectors (twice as many when what `load` returns is 8 bytes or less,
// such as 4 bf16) before it consumes any. A plain loop of load-compute-store
// keeps one load in flight per thread, since the compiler may not hoist the
// next iteration's load above a store that could alias it; on an H200 that
// held casts and unscale at about 60% of the copy bandwidth. `load(i)`
// returns what `finish(i, loaded)` needs; each element is still touched by
// one thread, once, so in-place kernels stay correct.
template <typename LD, typename FIN, typename F1>
__device__ __forceinline__ void chunk_loop_staged(u64 n, bool aligned, LD load, FIN finish,
                                                  F1 one) {
    typedef decltype(load(0)) Loaded;
    constexpr int U = sizeof(Loaded) <= 8 ? 2 * UNROLL : UNROLL;
    u64 nv = aligned ? n / VEC : 0;
    u64 stride = blockDim.x;
    u64 i = threadIdx.x;
    for (; i + (U - 1) * stride < nv; i += U * stride) {
        Loaded a[U];
#pragma unroll
        for (int u = 0; u < U; u++) {
            a[u] = load((i + u * stride) * VEC);
        }
#pragma unroll
        for (int u = 0; u < U; u++) {
            finish((i + u * stride) * VEC, a[u]);
        }
    }
    for (; i < nv; i += stride) {
        finish(i * VEC, load(i * VEC));
    }
    for (u64 j = nv * VEC + threadIdx.x; j < n; j += stride) {
        one(j);
    }
}

__device__ __forceinline__ bool non_finite(float x) {
    return (__float_as_uint(x) & 0x7f800000U) == 0x7f800000U;
}

#endif // ACCEL_COMMON_CUH
