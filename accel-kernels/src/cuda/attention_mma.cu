// The attention forward on tensor cores for bf16/f16 operands at head dims 64 and 128 (sm_80+),
// and dq on them too; the shapes, masks and helpers are attention.cuh's, the other kernels
// attention.cu's (which the backward's row dots and dk/dv still are).
#ifndef ACCEL_ATTENTION_CUH
#include "attention.cuh"
#endif

// bf16/f16 operands with head dims 64 and 128: mma.sync m16n8k16 with f32 accumulation, the
// FlashAttention-2 register layout. A block of 4 warps takes 64 query rows (16 a warp, held as
// A fragments for the whole loop) and walks key tiles of 32: S = q k^T is 4 column tiles of 8
// keys, the online softmax runs on the accumulator fragments (a row's 8 values a tile are spread
// over the 4 lanes of a quad, reduced with 2 shuffles), and P, rounded to the operands' dtype,
// is reused in registers as the A fragment of P v (v staged transposed). The row sums l are of
// the f32 probabilities. Same masks, biases, GQA and strides as the scalar kernel, whose
// backward takes this forward's output and log-sum-exps.
#define FA_MMA_BR 64
#define FA_MMA_BC 32
#define FA_MMA_PAD 8

__device__ __forceinline__ u32 fa_pack(u16 lo, u16 hi) { return (u32)lo | ((u32)hi << 16); }

#ifdef ACCEL_EMULATE
template <typename T>
__device__ __forceinline__ void fa_mma(float c[4], const u32 a[4], const u32 b[2]) {
    emu::mma_m16n8k16<T>(c, a, b);
}
#else
template <typename T> struct FaMma;
template <> struct FaMma<BF16> {
    static __device__ __forceinline__ void run(float c[4], const u32 a[4], const u32 b[2]) {
#if __CUDA_ARCH__ >= 800
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
            "{%8,%9}, {%0,%1,%2,%3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
        __trap();  // never launched below sm_80 (cuda/attention.rs checks)
#endif
    }
};
template <> struct FaMma<F16> {
    static __device__ __forceinline__ void run(float c[4], const u32 a[4], const u32 b[2]) {
#if __CUDA_ARCH__ >= 800
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
            "{%8,%9}, {%0,%1,%2,%3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
        __trap();
#endif
    }
};
template <typename T>
__device__ __forceinline__ void fa_mma(float c[4], const u32 a[4], const u32 b[2]) {
    FaMma<T>::run(c, a, b);
}
#endif

// Stages rows r0.. of a [rows, D] operand (row stride `stride`) into `tile`, zero past `rows`.
template <typename T, int D>
__device__ __forceinline__ void fa_stage(typename T::raw (*tile)[D + FA_MMA_PAD],
                                         const typename T::raw *src, u64 stride, u32 r0,
                                         u32 rows) {
    const typename T::raw zero = T::store(0.0f);
    for (u32 e = threadIdx.x; e < FA_MMA_BR * D; e += blockDim.x) {
        u32 r = e / D, c = e % D;
        tile[r][c] = r0 + r < rows ? src[(u64)(r0 + r) * stride + c] : zero;
    }
}

// The A fragments (m16n8k16) of tile rows wr..wr+15, one per 16 columns, for this lane.
template <typename T, int D>
__device__ __forceinline__ void fa_a_frags(const typename T::raw (*tile)[D + FA_MMA_PAD], u32 wr,
                                           u32 lane, u32 (&frag)[D / 16][4]) {
    const u32 g = lane >> 2, tq = lane & 3;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
        const u32 c = kk * 16 + 2 * tq;
        frag[kk][0] = fa_pack(tile[wr + g][c], tile[wr + g][c + 1]);
        frag[kk][1] = fa_pack(tile[wr + g + 8][c], tile[wr + g + 8][c + 1]);
        frag[kk][2] = fa_pack(tile[wr + g][c + 8], tile[wr + g][c + 9]);
        frag[kk][3] = fa_pack(tile[wr + g + 8][c + 8], tile[wr + g + 8][c + 9]);
    }
}

// acc (16 x D in accumulator fragments) += x (16 x FA_MMA_BC in accumulator fragments, rounded to
// T to become A fragments, as FlashAttention-2 reuses P and dS in registers) times the
// FA_MMA_BC x D operand staged transposed in `tile_t`.
template <typename T, int D>
__device__ __forceinline__ void fa_mma_acc(float (&acc)[D / 8][4],
                                           const float (&x)[FA_MMA_BC / 8][4],
                                           const typename T::raw (*tile_t)[FA_MMA_BC + FA_MMA_PAD],
                                           u32 lane) {
    const u32 g = lane >> 2, tq = lane & 3;
#pragma unroll
    for (int kk = 0; kk < FA_MMA_BC / 16; ++kk) {
        const u32 xa[4] = {
            fa_pack(T::store(x[2 * kk][0]), T::store(x[2 * kk][1])),
            fa_pack(T::store(x[2 * kk][2]), T::store(x[2 * kk][3])),
            fa_pack(T::store(x[2 * kk + 1][0]), T::store(x[2 * kk + 1][1])),
            fa_pack(T::store(x[2 * kk + 1][2]), T::store(x[2 * kk + 1][3])),
        };
#pragma unroll
        for (int nt = 0; nt < D / 8; ++nt) {
            const u32 dim = nt * 8 + g, key = kk * 16 + 2 * tq;
            const u32 b[2] = {fa_pack(tile_t[dim][key], tile_t[dim][key + 1]),
                              fa_pack(tile_t[dim][key + 8], tile_t[dim][key + 9])};
            fa_mma<T>(acc[nt], xa, b);
        }
    }
}

template <typename T, int D>
__device__ void flash_fwd_mma(const typename T::raw *q, const typename T::raw *k,
                              const typename T::raw *v, const float *bias, typename T::raw *o,
                              float *lse, FlashDims a) {
    typedef typename T::raw R;
    __shared__ R qs[FA_MMA_BR][D + FA_MMA_PAD];
    __shared__ R ks[FA_MMA_BC][D + FA_MMA_PAD];
    __shared__ R vt[D][FA_MMA_BC + FA_MMA_PAD];
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, tq = lane & 3;
    const u32 bh = blockIdx.x, bi = bh / a.h, hi = bh % a.h, kv = hi / (a.h / a.kvh);
    const u32 r0 = blockIdx.y * FA_MMA_BR, wr = warp * 16;
    const R *qb = q + bi * a.qs[0] + hi * a.qs[1];
    const R *kb = k + bi * a.ks[0] + kv * a.ks[1];
    const R *vb = v + bi * a.vs[0] + kv * a.vs[1];
    const R zero = T::store(0.0f);
    fa_stage<T, D>(qs, qb, a.qs[2], r0, a.t);
    __syncthreads();
    u32 qa[D / 16][4];
    fa_a_frags<T, D>(qs, wr, lane, qa);
    float m[2] = {FA_NEG_INF, FA_NEG_INF}, l[2] = {0.0f, 0.0f}, acc[D / 8][4];
#pragma unroll
    for (int nt = 0; nt < D / 8; ++nt) {
        acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.0f;
    }
    const u32 rows[2] = {r0 + wr + g, r0 + wr + g + 8};
    const u32 end = fa_key_end(a, min(r0 + FA_MMA_BR, a.t));
    for (u32 j0 = fa_key_begin(a, r0, FA_MMA_BC); j0 < end; j0 += FA_MMA_BC) {
        __syncthreads();
        for (u32 e = threadIdx.x; e < FA_MMA_BC * D; e += blockDim.x) {
            u32 jj = e / D, c = e % D, j = j0 + jj;
            bool in = j < a.s;
            ks[jj][c] = in ? kb[(u64)j * a.ks[2] + c] : zero;
            vt[c][jj] = in ? vb[(u64)j * a.vs[2] + c] : zero;
        }
        __syncthreads();
        float sc[FA_MMA_BC / 8][4];
        float mx[2] = {m[0], m[1]};
#pragma unroll
        for (int nt = 0; nt < FA_MMA_BC / 8; ++nt) {
            sc[nt][0] = sc[nt][1] = sc[nt][2] = sc[nt][3] = 0.0f;
#pragma unroll
            for (int kk = 0; kk < D / 16; ++kk) {
                const u32 key = nt * 8 + g, c = kk * 16 + 2 * tq;
                const u32 b[2] = {fa_pack(ks[key][c], ks[key][c + 1]),
                                  fa_pack(ks[key][c + 8], ks[key][c + 9])};
                fa_mma<T>(sc[nt], qa[kk], b);
            }
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const u32 j = j0 + nt * 8 + 2 * tq + (i & 1);
                sc[nt][i] = fa_score(a, bias, sc[nt][i], bi, hi, rows[i >> 1], j);
                mx[i >> 1] = fmaxf(mx[i >> 1], sc[nt][i]);
            }
        }
        float alpha[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(FA_MASK, mx[r], 1));
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(FA_MASK, mx[r], 2));
            alpha[r] = m[r] == FA_NEG_INF ? 0.0f : expf(m[r] - mx[r]);
            m[r] = mx[r];
            l[r] *= alpha[r];
        }
#pragma unroll
        for (int nt = 0; nt < FA_MMA_BC / 8; ++nt) {
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const float p = sc[nt][i] == FA_NEG_INF ? 0.0f : expf(sc[nt][i] - m[i >> 1]);
                sc[nt][i] = p;
                l[i >> 1] += p;
            }
        }
#pragma unroll
        for (int nt = 0; nt < D / 8; ++nt) {
            acc[nt][0] *= alpha[0];
            acc[nt][1] *= alpha[0];
            acc[nt][2] *= alpha[1];
            acc[nt][3] *= alpha[1];
        }
        fa_mma_acc<T, D>(acc, sc, vt, lane);
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        l[r] += __shfl_xor_sync(FA_MASK, l[r], 1);
        l[r] += __shfl_xor_sync(FA_MASK, l[r], 2);
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        if (rows[r] >= a.t) {
            continue;
        }
        const u64 row = (u64)bh * a.t + rows[r];
        const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
#pragma unroll
        for (int nt = 0; nt < D / 8; ++nt) {
            const u32 col = nt * 8 + 2 * tq;
            o[row * D + col] = T::store(acc[nt][2 * r] * inv);
            o[row * D + col + 1] = T::store(acc[nt][2 * r + 1] * inv);
        }
        if (tq == 0) {
            lse[row] = l[r] > 0.0f ? m[r] + logf(l[r]) : FA_NEG_INF;
        }
    }
}

// dq on tensor cores, the same tiling: a block of 4 warps takes 64 query rows (16 a warp) and
// walks key tiles of 32. S = q k^T and dP = do v^T come from A fragments of q and do held for the
// whole loop; P = exp(S - lse) and dS = P (dP - delta) are computed in the accumulator layout, and
// dS, rounded to the operands' dtype (as FlashAttention-2 does), is the A fragment of dq += dS k
// (k staged transposed). One buffer stages q, then do, to build the fragments (45 KiB at d 128).
template <typename T, int D>
__device__ void flash_dq_mma(const typename T::raw *q, const typename T::raw *k,
                             const typename T::raw *v, const float *bias,
                             const typename T::raw *g, const float *lse, const float *delta,
                             typename T::raw *dq, FlashDims a) {
    typedef typename T::raw R;
    __shared__ R rs[FA_MMA_BR][D + FA_MMA_PAD];
    __shared__ R ks[FA_MMA_BC][D + FA_MMA_PAD];
    __shared__ R vs[FA_MMA_BC][D + FA_MMA_PAD];
    __shared__ R kt[D][FA_MMA_BC + FA_MMA_PAD];
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g4 = lane >> 2, tq = lane & 3;
    const u32 bh = blockIdx.x, bi = bh / a.h, hi = bh % a.h, kv = hi / (a.h / a.kvh);
    const u32 r0 = blockIdx.y * FA_MMA_BR, wr = warp * 16;
    const R *qb = q + bi * a.qs[0] + hi * a.qs[1];
    const R *gb = g + (u64)bh * a.t * D;
    const R *kb = k + bi * a.ks[0] + kv * a.ks[1];
    const R *vb = v + bi * a.vs[0] + kv * a.vs[1];
    const R zero = T::store(0.0f);
    u32 qa[D / 16][4], ga[D / 16][4];
    fa_stage<T, D>(rs, qb, a.qs[2], r0, a.t);
    __syncthreads();
    fa_a_frags<T, D>(rs, wr, lane, qa);
    __syncthreads();
    fa_stage<T, D>(rs, gb, D, r0, a.t);
    __syncthreads();
    fa_a_frags<T, D>(rs, wr, lane, ga);
    const u32 rows[2] = {r0 + wr + g4, r0 + wr + g4 + 8};
    float li[2], di[2], acc[D / 8][4];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const u64 row = (u64)bh * a.t + rows[r];
        li[r] = rows[r] < a.t ? lse[row] : FA_NEG_INF;
        di[r] = rows[r] < a.t ? delta[row] : 0.0f;
    }
#pragma unroll
    for (int nt = 0; nt < D / 8; ++nt) {
        acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.0f;
    }
    const u32 end = fa_key_end(a, min(r0 + FA_MMA_BR, a.t));
    for (u32 j0 = fa_key_begin(a, r0, FA_MMA_BC); j0 < end; j0 += FA_MMA_BC) {
        __syncthreads();
        for (u32 e = threadIdx.x; e < FA_MMA_BC * D; e += blockDim.x) {
            u32 jj = e / D, c = e % D, j = j0 + jj;
            bool in = j < a.s;
            R kx = in ? kb[(u64)j * a.ks[2] + c] : zero;
            ks[jj][c] = kx;
            kt[c][jj] = kx;
            vs[jj][c] = in ? vb[(u64)j * a.vs[2] + c] : zero;
        }
        __syncthreads();
        float ds[FA_MMA_BC / 8][4];
#pragma unroll
        for (int nt = 0; nt < FA_MMA_BC / 8; ++nt) {
            float sc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            ds[nt][0] = ds[nt][1] = ds[nt][2] = ds[nt][3] = 0.0f;  // dP first
#pragma unroll
            for (int kk = 0; kk < D / 16; ++kk) {
                const u32 key = nt * 8 + g4, c = kk * 16 + 2 * tq;
                const u32 bk[2] = {fa_pack(ks[key][c], ks[key][c + 1]),
                                   fa_pack(ks[key][c + 8], ks[key][c + 9])};
                const u32 bv[2] = {fa_pack(vs[key][c], vs[key][c + 1]),
                                   fa_pack(vs[key][c + 8], vs[key][c + 9])};
                fa_mma<T>(sc, qa[kk], bk);
                fa_mma<T>(ds[nt], ga[kk], bv);
            }
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const u32 r = i >> 1, j = j0 + nt * 8 + 2 * tq + (i & 1);
                const float s = fa_score(a, bias, sc[i], bi, hi, rows[r], j);
                const float p = (s == FA_NEG_INF || li[r] == FA_NEG_INF) ? 0.0f : expf(s - li[r]);
                ds[nt][i] = p * (ds[nt][i] - di[r]);
            }
        }
        fa_mma_acc<T, D>(acc, ds, kt, lane);
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        if (rows[r] >= a.t) {
            continue;
        }
        const u64 row = (u64)bh * a.t + rows[r];
#pragma unroll
        for (int nt = 0; nt < D / 8; ++nt) {
            const u32 col = nt * 8 + 2 * tq;
            dq[row * D + col] = T::store(acc[nt][2 * r] * a.scale);
            dq[row * D + col + 1] = T::store(acc[nt][2 * r + 1] * a.scale);
        }
    }
}

#define FA_MMA_KERNEL(NAME, T, D)                                                                \
    extern "C" __global__ void __launch_bounds__(32 * FA_WARPS)                                  \
        flash_fwd_mma_##NAME##_d##D(const T::raw *q, const T::raw *k, const T::raw *v,           \
                                    const float *bias, T::raw *o, float *lse, FlashDims a) {      \
        flash_fwd_mma<T, D>(q, k, v, bias, o, lse, a);                                           \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(32 * FA_WARPS)                                  \
        flash_dq_mma_##NAME##_d##D(const T::raw *q, const T::raw *k, const T::raw *v,            \
                                   const float *bias, const T::raw *g, const float *lse,         \
                                   const float *delta, T::raw *dq, FlashDims a) {                \
        flash_dq_mma<T, D>(q, k, v, bias, g, lse, delta, dq, a);                                 \
    }

FA_MMA_KERNEL(bf16, BF16, 64)
FA_MMA_KERNEL(bf16, BF16, 128)
FA_MMA_KERNEL(f16, F16, 64)
FA_MMA_KERNEL(f16, F16, 128)

