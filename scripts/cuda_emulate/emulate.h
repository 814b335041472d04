// Runs accel-kernels' CUDA C++ on the host, for checking a kernel's logic (indexing, masking,
// reductions, shared-memory tiles, warp shuffles) against a reference without a GPU.
//
// Each CUDA thread of a block is an OS thread; blocks run one after another. __syncthreads is a
// barrier of the block's threads, and a warp's shuffles exchange values through a buffer between
// two barriers of its 32 threads, so every thread of a warp must reach each shuffle (as on the
// GPU with a full mask). __shared__ arrays become statics (one block at a time uses them).
// What this cannot check: timing, the memory model beyond these barriers, PTX, and anything
// NVRTC-specific (scripts/check_cuda_sources.sh compiles the sources for that).
#pragma once

#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

// common.cuh's role, on the host: its guard keeps the .cu files from including it.
#define ACCEL_COMMON_CUH
typedef unsigned long long u64;
typedef unsigned int u32;
typedef unsigned short u16;

#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(n)
#define __shared__ static

struct dim3 {
    u32 x = 1, y = 1, z = 1;
};

inline thread_local dim3 threadIdx, blockIdx;
inline dim3 blockDim, gridDim;

namespace emu {
struct Warp {
    std::barrier<> bar{32};
    float buf[32];
};
inline std::barrier<>* block_barrier = nullptr;
inline Warp* warps = nullptr;

inline float exchange(float v, u32 src) {
    Warp& w = warps[threadIdx.x / 32];
    w.buf[threadIdx.x % 32] = v;
    w.bar.arrive_and_wait();
    float r = w.buf[src % 32];
    w.bar.arrive_and_wait();
    return r;
}

// Runs `kernel(args...)` over `grid` x `block` threads: one OS thread per thread of a block,
// going through the blocks in order, with a barrier between blocks (their statics are shared).
template <typename... P, typename... A>
void launch(void (*kernel)(P...), dim3 grid, dim3 block, A... args) {
    gridDim = grid;
    blockDim = block;
    u32 n = block.x * block.y * block.z;
    std::barrier<> bar(n);
    std::unique_ptr<Warp[]> ws(new Warp[(n + 31) / 32]);
    block_barrier = &bar;
    warps = ws.get();
    std::vector<std::thread> threads;
    for (u32 t = 0; t < n; ++t) {
        threads.emplace_back([&, t] {
            threadIdx = {t % block.x, (t / block.x) % block.y, t / (block.x * block.y)};
            for (u32 bz = 0; bz < grid.z; ++bz)
                for (u32 by = 0; by < grid.y; ++by)
                    for (u32 bx = 0; bx < grid.x; ++bx) {
                        blockIdx = {bx, by, bz};
                        kernel(args...);
                        bar.arrive_and_wait();
                    }
        });
    }
    for (auto& th : threads) th.join();
}
}  // namespace emu

inline void __syncthreads() { emu::block_barrier->arrive_and_wait(); }
inline float __shfl_sync(u32, float v, int src) { return emu::exchange(v, (u32)src); }
inline float __shfl_xor_sync(u32, float v, int mask) {
    return emu::exchange(v, (threadIdx.x % 32) ^ (u32)mask);
}
inline float __int_as_float(int i) {
    float f;
    std::memcpy(&f, &i, 4);
    return f;
}
inline float __int_as_float(u32 i) { return __int_as_float((int)i); }
inline u32 __float_as_uint(float f) {
    u32 u;
    std::memcpy(&u, &f, 4);
    return u;
}
inline u32 min(u32 a, u32 b) { return a < b ? a : b; }
// expf, logf and fmaxf are <cmath>'s (C's, in the global namespace).

// The element types of common.cuh, with the same rounding (nearest even; bf16 NaN canonical).
struct F32 {
    typedef float raw;
    static float load(raw x) { return x; }
    static raw store(float x) { return x; }
};
struct BF16 {
    typedef u16 raw;
    static float load(raw x) { return __int_as_float((u32)x << 16); }
    static raw store(float f) {
        u32 x = __float_as_uint(f);
        if ((x & 0x7fffffffU) > 0x7f800000U) return 0x7fff;
        return (u16)((x + 0x7fffU + ((x >> 16) & 1U)) >> 16);
    }
};
struct F16 {
    typedef u16 raw;
    static float load(raw x) {
        _Float16 h;
        std::memcpy(&h, &x, 2);
        return (float)h;
    }
    static raw store(float f) {
        _Float16 h = (_Float16)f;
        u16 x;
        std::memcpy(&x, &h, 2);
        return x;
    }
};
