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
#ifndef ACCEL_ATTENTION_CUH
#include "attention.cuh"
#endif

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
    for (u32 j0 = fa_key_begin(a, r0, FA_BC); j0 < end; j0 += FA_BC) {
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
    for (u32 j0 = fa_key_begin(a, r0, FA_BC); j0 < end; j0 += FA_BC) {
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
        // A sliding window: queries past the window of the last key see none of these keys.
        const u32 q_end = fa_query_end(a, min(j0 + FA_KV_BC, a.s));
        for (u32 i0 = first; i0 < q_end; i0 += FA_KV_BQ) {
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
