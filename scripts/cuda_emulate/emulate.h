// Runs accel-kernels' CUDA C++ on the host, for checking a kernel's logic (indexing, masking,
// reductions, shared-memory tiles, warp shuffles) against a reference without a GPU.
//
// Each CUDA thread of a block is a fiber (ucontext) of one OS thread; blocks run one after
// another. __syncthreads is a barrier of the block's fibers, and a warp's shuffles exchange values
// through a buffer between two barriers of its 32 fibers, so every thread of a warp must reach
// each shuffle (as on the GPU with a full mask). A fiber runs until it waits at a barrier; the
// scheduler goes through the fibers forwards, then backwards, so a read of shared memory that
// misses a barrier sees the other threads' writes on one pass and not on the next. (OS threads,
// as before, spent 5 of the 6 minutes of this check in the kernel waking 128 threads on 2 cores.)
// __shared__ arrays become statics (one block at a time uses them).
// What this cannot check: timing, the memory model beyond these barriers, PTX, and anything
// NVRTC-specific (scripts/check_cuda_sources.sh compiles the sources for that).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <csetjmp>
#include <ucontext.h>
#include <vector>

// common.cuh's role, on the host: its guard keeps the .cu files from including it.
#define ACCEL_COMMON_CUH
// Kernel sources pick host versions of their inline PTX under this.
#define ACCEL_EMULATE
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

// The running fiber's; the scheduler sets them at each switch.
inline dim3 threadIdx, blockIdx;
inline dim3 blockDim, gridDim;

namespace emu {
// A fiber: one CUDA thread's stack and context.
// makecontext gives a fiber its stack and first entry; after that, switches are _setjmp and
// _longjmp, which (unlike swapcontext) make no system call for the signal mask.
struct Fiber {
    ucontext_t ctx;
    jmp_buf at;
    std::unique_ptr<char[]> stack;
    dim3 tid, bid;
    bool started = false, done = false;
};
inline ucontext_t scheduler_ctx;
inline jmp_buf scheduler;
inline Fiber* running = nullptr;
inline std::function<void()> fiber_body;

// Back to the scheduler; the fiber resumes here at its next turn.
inline void yield() {
    if (!_setjmp(running->at)) _longjmp(scheduler, 1);
}

// Arrive, then wait (yielding) until all `n` have arrived; the last one goes on at once.
struct Barrier {
    u32 n, count = 0, gen = 0;
    explicit Barrier(u32 n) : n(n) {}
    void arrive_and_wait() {
        u32 g = gen;
        if (++count == n) {
            count = 0;
            ++gen;
            return;
        }
        while (gen == g) yield();
    }
};

inline void fiber_main() {
    fiber_body();
    running->done = true;
    _longjmp(scheduler, 1);  // never returns: its stack is freed with the fiber
}

struct Warp {
    Barrier bar{32};
    float buf[32];
    // mma.sync's fragments, by lane.
    u32 a[32][4], b[32][2];
};
inline Barrier* block_barrier = nullptr;
inline Warp* warps = nullptr;

inline float exchange(float v, u32 src) {
    Warp& w = warps[threadIdx.x / 32];
    w.buf[threadIdx.x % 32] = v;
    w.bar.arrive_and_wait();
    float r = w.buf[src % 32];
    w.bar.arrive_and_wait();
    return r;
}

// Runs `kernel(args...)` over `grid` x `block` threads: one fiber per thread of a block, going
// through the blocks in order, with a barrier between blocks (their statics are shared).
template <typename... P, typename... A>
void launch(void (*kernel)(P...), dim3 grid, dim3 block, A... args) {
    gridDim = grid;
    blockDim = block;
    u32 n = block.x * block.y * block.z;
    Barrier bar(n);
    std::unique_ptr<Warp[]> ws(new Warp[(n + 31) / 32]);
    block_barrier = &bar;
    warps = ws.get();
    fiber_body = [&] {
        for (u32 bz = 0; bz < grid.z; ++bz)
            for (u32 by = 0; by < grid.y; ++by)
                for (u32 bx = 0; bx < grid.x; ++bx) {
                    blockIdx = {bx, by, bz};
                    kernel(args...);
                    bar.arrive_and_wait();
                }
    };
    constexpr size_t STACK = 256 << 10;
    std::vector<Fiber> fibers(n);
    for (u32 t = 0; t < n; ++t) {
        Fiber& f = fibers[t];
        f.tid = {t % block.x, (t / block.x) % block.y, t / (block.x * block.y)};
        f.stack.reset(new char[STACK]);
        getcontext(&f.ctx);
        f.ctx.uc_stack.ss_sp = f.stack.get();
        f.ctx.uc_stack.ss_size = STACK;
        f.ctx.uc_link = nullptr;
        makecontext(&f.ctx, fiber_main, 0);
    }
    u32 left = n;
    for (bool forward = true; left > 0; forward = !forward) {
        for (u32 k = 0; k < n; ++k) {
            Fiber& f = fibers[forward ? k : n - 1 - k];
            if (f.done) continue;
            running = &f;
            threadIdx = f.tid;
            blockIdx = f.bid;
            if (!_setjmp(scheduler)) {
                if (f.started) _longjmp(f.at, 1);
                f.started = true;
                swapcontext(&scheduler_ctx, &f.ctx);
            }
            f.bid = blockIdx;
            if (f.done) --left;
        }
    }
    running = nullptr;
}

// The 16-bit element of `reg` at `half` (0: low, 1: high) as f32, for `T` (BF16 or F16).
template <typename T>
float half_of(u32 reg, int half) {
    return T::load((u16)(half ? reg >> 16 : reg & 0xffff));
}

// PTX's mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}: d = a (16x16) b (16x8) + c, each lane
// holding the fragments the PTX ISA lays out (groupID g = lane / 4, t = lane % 4):
// a: regs 0..3 = (row g, k 2t..2t+1), (row g+8, same k), (row g, k 2t+8..), (row g+8, k 2t+8..);
// b: regs 0..1 = (k 2t..2t+1, col g), (k 2t+8.., col g); c/d: (row g, cols 2t, 2t+1),
// (row g+8, cols 2t, 2t+1). Products are summed in f32 in k order.
template <typename T>
void mma_m16n8k16(float c[4], const u32 a[4], const u32 b[2]) {
    Warp& w = warps[threadIdx.x / 32];
    u32 lane = threadIdx.x % 32;
    for (int i = 0; i < 4; ++i) w.a[lane][i] = a[i];
    w.b[lane][0] = b[0], w.b[lane][1] = b[1];
    w.bar.arrive_and_wait();
    float A[16][16], B[16][8];
    for (u32 l = 0; l < 32; ++l) {
        u32 g = l / 4, t = l % 4;
        for (int h = 0; h < 2; ++h) {
            A[g][2 * t + h] = half_of<T>(w.a[l][0], h);
            A[g + 8][2 * t + h] = half_of<T>(w.a[l][1], h);
            A[g][2 * t + 8 + h] = half_of<T>(w.a[l][2], h);
            A[g + 8][2 * t + 8 + h] = half_of<T>(w.a[l][3], h);
            B[2 * t + h][g] = half_of<T>(w.b[l][0], h);
            B[2 * t + 8 + h][g] = half_of<T>(w.b[l][1], h);
        }
    }
    w.bar.arrive_and_wait();
    u32 g = lane / 4, t = lane % 4;
    for (int i = 0; i < 4; ++i) {
        u32 row = g + (i >= 2 ? 8 : 0), col = 2 * t + (i % 2);
        float acc = c[i];
        for (int k = 0; k < 16; ++k) acc += A[row][k] * B[k][col];
        c[i] = acc;
    }
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
// Round-to-nearest products and sums that the compiler may not contract (ISO C++ mode: g++
// contracts nothing, and x86-64 without -mfma has no FMA to contract to).
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
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
