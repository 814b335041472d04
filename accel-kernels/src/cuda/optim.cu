// Multi-tensor updates of f32 state from gradients of any float type:
// gradient accumulation and the AdamW / SGD steps.
//
// Each element goes through exactly the f32 operations, in the same order,
// of the CPU kernels (accel-kernels/src/cpu/adamw.rs, unscale.rs); NVRTC is
// run with --fmad=false and IEEE division and square root, so the results
// agree with them bit for bit.
#ifndef ACCEL_COMMON_CUH
#include "common.cuh"
#endif

// Chunk operands: p[0] = f32 destination, p[1] = source of type S.
template <typename S>
__device__ __forceinline__ void add_chunks(const Table &t) {
    typedef typename S::raw SR;
    for (u32 c = blockIdx.x; c < n_chunks(t); c += gridDim.x) {
        Chunk k = chunk_at(t, c);
        float *dst = (float *)k.p[0];
        const SR *src = (const SR *)k.p[1];
        struct Both {
            Pack<float> d;
            Pack<SR> s;
        };
        chunk_loop_staged(
            k.n, vec_aligned(dst) && vec_aligned(src),
            [&](u64 i) { return Both{load_pack(dst, i), load_pack(src, i)}; },
            [&](u64 i, Both b) {
                Pack<float> d = b.d;
                Pack<SR> s = b.s;
#pragma unroll
                for (int j = 0; j < VEC; j++) {
                    d.v[j] = d.v[j] + S::load(s.v[j]);
                }
                store_pack(dst, i, d);
            },
            [&](u64 i) { dst[i] = dst[i] + S::load(src[i]); });
    }
}

// The f32 factors of one AdamW step (see AdamWScalars in optim.rs).
struct AdamW {
    float decay;     // 1 - lr * weight_decay
    int apply_decay; // weight decay on
    float w1;        // 1 - beta1 (lerp weight)
    float beta2;
    float c2;        // 1 - beta2
    float step_size; // lr / (1 - beta1^step)
    float bc2_sqrt;  // sqrt(1 - beta2^step)
    float eps;
};

__device__ __forceinline__ void adamw1(float &p, float &m, float &v, float g, const AdamW &s) {
    float pv = p;
    if (s.apply_decay) {
        pv = pv * s.decay;
    }
    // exp_avg.lerp_(grad, 1 - beta1); torch.lerp switches formula at |w| = 0.5.
    float mv;
    if (fabsf(s.w1) < 0.5f) {
        mv = m + s.w1 * (g - m);
    } else {
        mv = g - (g - m) * (1.0f - s.w1);
    }
    float vv = v * s.beta2 + s.c2 * g * g;
    float denom = sqrtf(vv) / s.bc2_sqrt + s.eps;
    p = pv - s.step_size * mv / denom;
    m = mv;
    v = vv;
}

// Chunk operands: p[0] = param, p[1] = exp_avg, p[2] = exp_avg_sq (f32,
// written), p[3] = grad of type G.
template <typename G>
__device__ __forceinline__ void adamw_chunks(const Table &t, const AdamW &s) {
    typedef typename G::raw GR;
    for (u32 c = blockIdx.x; c < n_chunks(t); c += gridDim.x) {
        Chunk k = chunk_at(t, c);
        float *p = (float *)k.p[0];
        float *m = (float *)k.p[1];
        float *v = (float *)k.p[2];
        const GR *g = (const GR *)k.p[3];
        bool aligned = vec_aligned(p) && vec_aligned(m) && vec_aligned(v) && vec_aligned(g);
        chunk_loop(
            k.n, aligned,
            [&](u64 i) {
                Pack<float> pp = load_pack(p, i);
                Pack<float> mm = load_pack(m, i);
                Pack<float> vv = load_pack(v, i);
                Pack<GR> gg = load_pack(g, i);
#pragma unroll
                for (int j = 0; j < VEC; j++) {
                    adamw1(pp.v[j], mm.v[j], vv.v[j], G::load(gg.v[j]), s);
                }
                store_pack(p, i, pp);
                store_pack(m, i, mm);
                store_pack(v, i, vv);
            },
            [&](u64 i) { adamw1(p[i], m[i], v[i], G::load(g[i]), s); });
    }
}

// The f32 factors of one SGD step (see SgdScalars in optim.rs).
struct Sgd {
    float lr;
    float momentum;
    float weight_decay;
    float one_minus_dampening;
    int has_momentum;
    int has_weight_decay;
    int nesterov;
    int first;
};

__device__ __forceinline__ void sgd1(float &p, float *buf, float g, const Sgd &s) {
    float d = g;
    if (s.has_weight_decay) {
        d = d + s.weight_decay * p;
    }
    if (s.has_momentum) {
        float b = s.first ? d : *buf * s.momentum + s.one_minus_dampening * d;
        *buf = b;
        d = s.nesterov ? d + s.momentum * b : b;
    }
    p = p - s.lr * d;
}

// Chunk operands: p[0] = param (f32, written), p[1] = momentum buffer (f32,
// written; 0 without momentum), p[2] = grad of type G.
template <typename G>
__device__ __forceinline__ void sgd_chunks(const Table &t, const Sgd &s) {
    typedef typename G::raw GR;
    for (u32 c = blockIdx.x; c < n_chunks(t); c += gridDim.x) {
        Chunk k = chunk_at(t, c);
        float *p = (float *)k.p[0];
        float *b = (float *)k.p[1];
        const GR *g = (const GR *)k.p[2];
        float unused = 0.0f;
        chunk_loop(
            k.n, false,
            [&](u64) {},
            [&](u64 i) { sgd1(p[i], s.has_momentum ? &b[i] : &unused, G::load(g[i]), s); });
    }
}

#define OPTIM_OPS(G, SUFFIX)                                            \
    extern "C" __global__ void add_##SUFFIX(const Table t) {            \
        add_chunks<G>(t);                                               \
    }                                                                   \
    extern "C" __global__ void adamw_##SUFFIX(const Table t, AdamW s) { \
        adamw_chunks<G>(t, s);                                          \
    }                                                                   \
    extern "C" __global__ void sgd_##SUFFIX(const Table t, Sgd s) {     \
        sgd_chunks<G>(t, s);                                            \
    }

OPTIM_OPS(F32, f32)
OPTIM_OPS(BF16, bf16)
OPTIM_OPS(F16, f16)
