// Attention on CUDA, FlashAttention-2's algorithm: the twin of the CPU's tiled kernel
// (accel-nn/src/kernels/flash.rs), with the same masks, GQA and conventions.
//
// softmax(q k^T * scale + bias) v per (batch, head) for q [b, h, t, d] and k, v [b, kvh, s, d]
// (query head i reads kv head i / (h / kvh)); key j is visible from query i when j < s and, with
// a causal mask, j <= offset + i. The forward walks key tiles with an online softmax and keeps
// one log-sum-exp per query row (-inf for a row that sees no key: it outputs 0 and passes no
// gradient). The backward recomputes each tile's probabilities from it, in two kernels that
// each own what they write (dq per query tile; dk and dv per key tile, over every query head of
// its kv head), so no atomics are needed and results do not depend on scheduling.
//
// This is the correct-first version: f32 arithmetic on CUDA cores (bf16/f16 operands converted
// on load, as the CPU kernel converts them), head dims up to FA_DMAX, every tile staged in
// shared memory within the 48 KiB a block may use without opting in. Scores go lane per key,
// the products with V (and with dO, Q, K in the backward) row by row with the lane's entries
// broadcast by shuffles. q, k and v may be strided views with a contiguous last dimension; the
// output, its gradient and the log-sum-exps are contiguous; the bias is f32 with any strides.
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

// The shapes, mask and strides of one call, passed by value (`FlashDims` in launch.rs: ten
// 4-byte fields, then thirteen u64s).
struct FlashDims {
    u32 b, h, kvh, t, s, d;
    u32 causal, offset;
    float scale;
    u32 has_bias;
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
    bool visible = i < a.t && j < a.s && (!a.causal || (u64)j <= (u64)a.offset + i);
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

template <typename T>
__device__ void flash_fwd(const typename T::raw *q, const typename T::raw *k,
                          const typename T::raw *v, const float *bias, typename T::raw *o,
                          float *lse, FlashDims a) {
    __shared__ float qs[FA_FWD_BR * FA_DMAX];
    __shared__ float ks[FA_BC * FA_DMAX];  // swizzled
    __shared__ float vs[FA_BC * FA_DMAX];
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5, d = a.d;
    const u32 bh = blockIdx.x, bi = bh / a.h, hi = bh % a.h, kv = hi / (a.h / a.kvh);
    const u32 r0 = blockIdx.y * FA_FWD_BR;
    const typename T::raw *kb = k + bi * a.ks[0] + kv * a.ks[1];
    const typename T::raw *vb = v + bi * a.vs[0] + kv * a.vs[1];
    fa_load<T>(qs, q + bi * a.qs[0] + hi * a.qs[1], a.qs[2], r0, FA_FWD_BR, a.t, d, false);
    float m[FA_FWD_ROWS], l[FA_FWD_ROWS], acc[FA_FWD_ROWS][4];
#pragma unroll
    for (int rr = 0; rr < FA_FWD_ROWS; ++rr) {
        m[rr] = FA_NEG_INF;
        l[rr] = 0.0f;
#pragma unroll
        for (int c4 = 0; c4 < 4; ++c4) {
            acc[rr][c4] = 0.0f;
        }
    }
    const u32 last = min(r0 + FA_FWD_BR, a.t);
    const u32 end = fa_key_end(a, last);
    for (u32 j0 = 0; j0 < end; j0 += FA_BC) {
        __syncthreads();
        fa_load<T>(ks, kb, a.ks[2], j0, FA_BC, a.s, d, true);
        fa_load<T>(vs, vb, a.vs[2], j0, FA_BC, a.s, d, false);
        __syncthreads();
        const u32 j = j0 + lane;
#pragma unroll
        for (int rr = 0; rr < FA_FWD_ROWS; ++rr) {
            const u32 r = warp * FA_FWD_ROWS + rr, i = r0 + r;
            if (i >= a.t) {
                break;  // the same for the whole warp
            }
            float dot = 0.0f;
            for (u32 c = 0; c < d; ++c) {
                dot += qs[r * FA_DMAX + c] * ks[fa_sw(lane, c)];
            }
            const float sc = fa_score(a, bias, dot, bi, hi, i, j);
            const float mn = fmaxf(m[rr], fa_max(sc));
            if (mn == FA_NEG_INF) {
                continue;  // nothing visible to this row yet
            }
            const float alpha = m[rr] == FA_NEG_INF ? 0.0f : expf(m[rr] - mn);
            const float p = sc == FA_NEG_INF ? 0.0f : expf(sc - mn);
            l[rr] = l[rr] * alpha + fa_sum(p);
            m[rr] = mn;
#pragma unroll
            for (int c4 = 0; c4 < 4; ++c4) {
                acc[rr][c4] *= alpha;
            }
            for (u32 jj = 0; jj < FA_BC; ++jj) {
                const float pj = __shfl_sync(FA_MASK, p, jj);
#pragma unroll
                for (int c4 = 0; c4 < 4; ++c4) {
                    const u32 c = lane + 32 * c4;
                    if (c < d) {
                        acc[rr][c4] += pj * vs[jj * FA_DMAX + c];
                    }
                }
            }
        }
    }
#pragma unroll
    for (int rr = 0; rr < FA_FWD_ROWS; ++rr) {
        const u32 i = r0 + warp * FA_FWD_ROWS + rr;
        if (i >= a.t) {
            break;
        }
        const u64 row = (u64)bh * a.t + i;
        const float inv = l[rr] > 0.0f ? 1.0f / l[rr] : 0.0f;
#pragma unroll
        for (int c4 = 0; c4 < 4; ++c4) {
            const u32 c = lane + 32 * c4;
            if (c < d) {
                o[row * d + c] = T::store(acc[rr][c4] * inv);
            }
        }
        if (lane == 0) {
            lse[row] = l[rr] > 0.0f ? m[rr] + logf(l[rr]) : FA_NEG_INF;
        }
    }
}

// delta[row] = <o[row], g[row]> over the contiguous [rows, d] output and its gradient: the
// row sums of dP * P the backward needs. A warp per row.
template <typename T>
__device__ void flash_delta(const typename T::raw *o, const typename T::raw *g, float *delta,
                            u64 rows, u32 d) {
    const u32 warps = blockDim.x / 32, lane = threadIdx.x % 32;
    for (u64 r = (u64)blockIdx.x * warps + threadIdx.x / 32; r < rows;
         r += (u64)gridDim.x * warps) {
        float s = 0.0f;
        for (u32 c = lane; c < d; c += 32) {
            s += T::load(o[r * d + c]) * T::load(g[r * d + c]);
        }
        s = fa_sum(s);
        if (lane == 0) {
            delta[r] = s;
        }
    }
}

// dq for a tile of FA_DQ_BR query rows of one (batch, head): dq_i = scale * sum_j p_ij
// (dp_ij - delta_i) k_j with p_ij = exp(s_ij - lse_i) and dp_ij = <g_i, v_j>.
template <typename T>
__device__ void flash_dq(const typename T::raw *q, const typename T::raw *k,
                         const typename T::raw *v, const float *bias, const typename T::raw *g,
                         const float *lse, const float *delta, typename T::raw *dq, FlashDims a) {
    __shared__ float qs[FA_DQ_BR * FA_DMAX];
    __shared__ float gs[FA_DQ_BR * FA_DMAX];
    __shared__ float ks[FA_BC * FA_DMAX];  // swizzled
    __shared__ float vs[FA_BC * FA_DMAX];  // swizzled
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5, d = a.d;
    const u32 bh = blockIdx.x, bi = bh / a.h, hi = bh % a.h, kv = hi / (a.h / a.kvh);
    const u32 r0 = blockIdx.y * FA_DQ_BR;
    const typename T::raw *kb = k + bi * a.ks[0] + kv * a.ks[1];
    const typename T::raw *vb = v + bi * a.vs[0] + kv * a.vs[1];
    fa_load<T>(qs, q + bi * a.qs[0] + hi * a.qs[1], a.qs[2], r0, FA_DQ_BR, a.t, d, false);
    fa_load<T>(gs, g + (u64)bh * a.t * d, d, r0, FA_DQ_BR, a.t, d, false);
    float acc[FA_DQ_ROWS][4], li[FA_DQ_ROWS], di[FA_DQ_ROWS];
#pragma unroll
    for (int rr = 0; rr < FA_DQ_ROWS; ++rr) {
        const u32 i = r0 + warp * FA_DQ_ROWS + rr;
        const u64 row = (u64)bh * a.t + i;
        li[rr] = i < a.t ? lse[row] : FA_NEG_INF;
        di[rr] = i < a.t ? delta[row] : 0.0f;
#pragma unroll
        for (int c4 = 0; c4 < 4; ++c4) {
            acc[rr][c4] = 0.0f;
        }
    }
    const u32 end = fa_key_end(a, min(r0 + FA_DQ_BR, a.t));
    for (u32 j0 = 0; j0 < end; j0 += FA_BC) {
        __syncthreads();
        fa_load<T>(ks, kb, a.ks[2], j0, FA_BC, a.s, d, true);
        fa_load<T>(vs, vb, a.vs[2], j0, FA_BC, a.s, d, true);
        __syncthreads();
        const u32 j = j0 + lane;
#pragma unroll
        for (int rr = 0; rr < FA_DQ_ROWS; ++rr) {
            const u32 r = warp * FA_DQ_ROWS + rr, i = r0 + r;
            if (i >= a.t) {
                break;
            }
            if (li[rr] == FA_NEG_INF) {
                continue;  // a row that sees no key passes no gradient
            }
            float qk = 0.0f, gv = 0.0f;
            for (u32 c = 0; c < d; ++c) {
                qk += qs[r * FA_DMAX + c] * ks[fa_sw(lane, c)];
                gv += gs[r * FA_DMAX + c] * vs[fa_sw(lane, c)];
            }
            const float sc = fa_score(a, bias, qk, bi, hi, i, j);
            const float p = sc == FA_NEG_INF ? 0.0f : expf(sc - li[rr]);
            const float ds = p * (gv - di[rr]);
            for (u32 jj = 0; jj < FA_BC; ++jj) {
                const float dsj = __shfl_sync(FA_MASK, ds, jj);
#pragma unroll
                for (int c4 = 0; c4 < 4; ++c4) {
                    const u32 c = lane + 32 * c4;
                    if (c < d) {
                        acc[rr][c4] += dsj * ks[fa_sw(jj, c)];
                    }
                }
            }
        }
    }
#pragma unroll
    for (int rr = 0; rr < FA_DQ_ROWS; ++rr) {
        const u32 i = r0 + warp * FA_DQ_ROWS + rr;
        if (i >= a.t) {
            break;
        }
        const u64 row = (u64)bh * a.t + i;
#pragma unroll
        for (int c4 = 0; c4 < 4; ++c4) {
            const u32 c = lane + 32 * c4;
            if (c < d) {
                dq[row * d + c] = T::store(acc[rr][c4] * a.scale);
            }
        }
    }
}

// dk and dv for a tile of FA_KV_BC keys of one (batch, kv head), over every query of the query
// heads that read it: dv_j = sum_i p_ij g_i, dk_j = scale * sum_i p_ij (dp_ij - delta_i) q_i.
template <typename T>
__device__ void flash_dkdv(const typename T::raw *q, const typename T::raw *k,
                           const typename T::raw *v, const float *bias, const typename T::raw *g,
                           const float *lse, const float *delta, typename T::raw *dk,
                           typename T::raw *dv, FlashDims a) {
    __shared__ float ks[FA_KV_BC * FA_DMAX];
    __shared__ float vs[FA_KV_BC * FA_DMAX];
    __shared__ float qs[FA_KV_BQ * FA_DMAX];  // swizzled
    __shared__ float gs[FA_KV_BQ * FA_DMAX];  // swizzled
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5, d = a.d;
    const u32 bk = blockIdx.x, bi = bk / a.kvh, kv = bk % a.kvh, rep = a.h / a.kvh;
    const u32 j0 = blockIdx.y * FA_KV_BC;
    fa_load<T>(ks, k + bi * a.ks[0] + kv * a.ks[1], a.ks[2], j0, FA_KV_BC, a.s, d, false);
    fa_load<T>(vs, v + bi * a.vs[0] + kv * a.vs[1], a.vs[2], j0, FA_KV_BC, a.s, d, false);
    float dks[FA_KV_KEYS][4], dvs[FA_KV_KEYS][4];
#pragma unroll
    for (int kk = 0; kk < FA_KV_KEYS; ++kk) {
#pragma unroll
        for (int c4 = 0; c4 < 4; ++c4) {
            dks[kk][c4] = 0.0f;
            dvs[kk][c4] = 0.0f;
        }
    }
    // Causal: queries below j0 - offset see none of these keys.
    u32 first = 0;
    if (a.causal && j0 > a.offset) {
        first = (j0 - a.offset) / FA_KV_BQ * FA_KV_BQ;
    }
    for (u32 hr = 0; hr < rep; ++hr) {
        const u32 hi = kv * rep + hr, bh = bi * a.h + hi;
        const typename T::raw *qb = q + bi * a.qs[0] + hi * a.qs[1];
        const typename T::raw *gb = g + (u64)bh * a.t * d;
        for (u32 i0 = first; i0 < a.t; i0 += FA_KV_BQ) {
            __syncthreads();
            fa_load<T>(qs, qb, a.qs[2], i0, FA_KV_BQ, a.t, d, true);
            fa_load<T>(gs, gb, d, i0, FA_KV_BQ, a.t, d, true);
            __syncthreads();
            const u32 i = i0 + lane;
            const u64 row = (u64)bh * a.t + i;
            const float li = i < a.t ? lse[row] : FA_NEG_INF;
            const float di = i < a.t ? delta[row] : 0.0f;
#pragma unroll
            for (int kk = 0; kk < FA_KV_KEYS; ++kk) {
                const u32 jl = warp * FA_KV_KEYS + kk, j = j0 + jl;
                if (j >= a.s) {
                    break;
                }
                float qk = 0.0f, gv = 0.0f;
                for (u32 c = 0; c < d; ++c) {
                    qk += qs[fa_sw(lane, c)] * ks[jl * FA_DMAX + c];
                    gv += gs[fa_sw(lane, c)] * vs[jl * FA_DMAX + c];
                }
                const float sc = fa_score(a, bias, qk, bi, hi, i, j);
                const float p = (sc == FA_NEG_INF || li == FA_NEG_INF) ? 0.0f : expf(sc - li);
                const float ds = p * (gv - di);
                for (u32 ii = 0; ii < FA_KV_BQ; ++ii) {
                    const float pi = __shfl_sync(FA_MASK, p, ii);
                    const float dsi = __shfl_sync(FA_MASK, ds, ii);
#pragma unroll
                    for (int c4 = 0; c4 < 4; ++c4) {
                        const u32 c = lane + 32 * c4;
                        if (c < d) {
                            dvs[kk][c4] += pi * gs[fa_sw(ii, c)];
                            dks[kk][c4] += dsi * qs[fa_sw(ii, c)];
                        }
                    }
                }
            }
        }
    }
#pragma unroll
    for (int kk = 0; kk < FA_KV_KEYS; ++kk) {
        const u32 j = j0 + warp * FA_KV_KEYS + kk;
        if (j >= a.s) {
            break;
        }
        const u64 row = (u64)bk * a.s + j;
#pragma unroll
        for (int c4 = 0; c4 < 4; ++c4) {
            const u32 c = lane + 32 * c4;
            if (c < d) {
                dk[row * d + c] = T::store(dks[kk][c4] * a.scale);
                dv[row * d + c] = T::store(dvs[kk][c4]);
            }
        }
    }
}

// ======================================================= the forward on tensor cores (sm_80+)
//
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
    for (u32 e = threadIdx.x; e < FA_MMA_BR * D; e += blockDim.x) {
        u32 r = e / D, c = e % D;
        qs[r][c] = r0 + r < a.t ? qb[(u64)(r0 + r) * a.qs[2] + c] : zero;
    }
    __syncthreads();
    u32 qa[D / 16][4];
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
        const u32 c = kk * 16 + 2 * tq;
        qa[kk][0] = fa_pack(qs[wr + g][c], qs[wr + g][c + 1]);
        qa[kk][1] = fa_pack(qs[wr + g + 8][c], qs[wr + g + 8][c + 1]);
        qa[kk][2] = fa_pack(qs[wr + g][c + 8], qs[wr + g][c + 9]);
        qa[kk][3] = fa_pack(qs[wr + g + 8][c + 8], qs[wr + g + 8][c + 9]);
    }
    float m[2] = {FA_NEG_INF, FA_NEG_INF}, l[2] = {0.0f, 0.0f}, acc[D / 8][4];
#pragma unroll
    for (int nt = 0; nt < D / 8; ++nt) {
        acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.0f;
    }
    const u32 rows[2] = {r0 + wr + g, r0 + wr + g + 8};
    const u32 end = fa_key_end(a, min(r0 + FA_MMA_BR, a.t));
    for (u32 j0 = 0; j0 < end; j0 += FA_MMA_BC) {
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
#pragma unroll
        for (int kk = 0; kk < FA_MMA_BC / 16; ++kk) {
            const u32 pa[4] = {
                fa_pack(T::store(sc[2 * kk][0]), T::store(sc[2 * kk][1])),
                fa_pack(T::store(sc[2 * kk][2]), T::store(sc[2 * kk][3])),
                fa_pack(T::store(sc[2 * kk + 1][0]), T::store(sc[2 * kk + 1][1])),
                fa_pack(T::store(sc[2 * kk + 1][2]), T::store(sc[2 * kk + 1][3])),
            };
#pragma unroll
            for (int nt = 0; nt < D / 8; ++nt) {
                const u32 dim = nt * 8 + g, key = kk * 16 + 2 * tq;
                const u32 b[2] = {fa_pack(vt[dim][key], vt[dim][key + 1]),
                                  fa_pack(vt[dim][key + 8], vt[dim][key + 9])};
                fa_mma<T>(acc[nt], pa, b);
            }
        }
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

#define FA_MMA_KERNEL(NAME, T, D)                                                                \
    extern "C" __global__ void __launch_bounds__(32 * FA_WARPS)                                  \
        flash_fwd_mma_##NAME##_d##D(const T::raw *q, const T::raw *k, const T::raw *v,           \
                                    const float *bias, T::raw *o, float *lse, FlashDims a) {      \
        flash_fwd_mma<T, D>(q, k, v, bias, o, lse, a);                                           \
    }

FA_MMA_KERNEL(bf16, BF16, 64)
FA_MMA_KERNEL(bf16, BF16, 128)
FA_MMA_KERNEL(f16, F16, 64)
FA_MMA_KERNEL(f16, F16, 128)

#define FA_KERNELS(NAME, T)                                                                      \
    extern "C" __global__ void __launch_bounds__(32 * FA_WARPS)                                  \
        flash_fwd_##NAME(const T::raw *q, const T::raw *k, const T::raw *v, const float *bias,   \
                         T::raw *o, float *lse, FlashDims a) {                                   \
        flash_fwd<T>(q, k, v, bias, o, lse, a);                                                  \
    }                                                                                            \
    extern "C" __global__ void flash_delta_##NAME(const T::raw *o, const T::raw *g,              \
                                                  float *delta, u64 rows, u32 d) {               \
        flash_delta<T>(o, g, delta, rows, d);                                                    \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(32 * FA_WARPS)                                  \
        flash_dq_##NAME(const T::raw *q, const T::raw *k, const T::raw *v, const float *bias,    \
                        const T::raw *g, const float *lse, const float *delta, T::raw *dq,       \
                        FlashDims a) {                                                           \
        flash_dq<T>(q, k, v, bias, g, lse, delta, dq, a);                                        \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(32 * FA_WARPS)                                  \
        flash_dkdv_##NAME(const T::raw *q, const T::raw *k, const T::raw *v, const float *bias,  \
                          const T::raw *g, const float *lse, const float *delta, T::raw *dk,     \
                          T::raw *dv, FlashDims a) {                                             \
        flash_dkdv<T>(q, k, v, bias, g, lse, delta, dk, dv, a);                                  \
    }

FA_KERNELS(f32, F32)
FA_KERNELS(bf16, BF16)
FA_KERNELS(f16, F16)
