// attention.cu run on the host (emulate.h) against a double-precision reference: the output,
// the log-sum-exps and the three gradients, for the cases the GPU check covers (every mask kind,
// fully masked rows, GQA 2:1 and 4:1, decode, head dims 64/80/128, sizes that are no multiple of
// a tile, strided q/k/v views of a fused projection, f32, bf16 and f16). Launch shapes are the
// ones cuda/attention.rs uses. Prints one line per case; exits 1 on the first mismatch.
#include <cstdio>
#include <random>
#include <string>

#include "emulate.h"
#include "../../accel-kernels/src/cuda/attention.cu"
#include "../../accel-kernels/src/cuda/attention_mma.cu"

namespace {

struct Case {
    u32 b, h, kvh, t, s, d;
    bool causal;
    u32 offset;
    bool pad;        // a [b, 1, 1, s] padding bias: row i of the batch masks its last i + 1 keys
    float fill;      // the padding value (-inf, or -1e9)
    int dtype;       // 0 f32, 1 bf16, 2 f16
    bool strided;    // q, k, v as head views of one [b, t, 3, h, d] buffer (needs s == t, kvh == h)
    u32 window;      // with causal: a sliding window (0: none)
};

template <typename T>
std::vector<typename T::raw> to_raw(const std::vector<float>& v) {
    std::vector<typename T::raw> r(v.size());
    for (size_t i = 0; i < v.size(); ++i) r[i] = T::store(v[i]);
    return r;
}

template <typename T>
std::vector<double> from_raw(const std::vector<typename T::raw>& v) {
    std::vector<double> r(v.size());
    for (size_t i = 0; i < v.size(); ++i) r[i] = T::load(v[i]);
    return r;
}

double rel_err(const std::vector<double>& got, const std::vector<double>& want) {
    double err = 0, scale = 0;
    for (size_t i = 0; i < got.size(); ++i) {
        if (std::isinf(want[i]) && got[i] == want[i]) continue;
        err = std::max(err, std::fabs(got[i] - want[i]));
        scale = std::max(scale, std::fabs(want[i]));
    }
    return err / std::max(scale, 1e-12);
}

template <typename T>
bool run(const Case& c, int n) {
    const u32 b = c.b, h = c.h, kvh = c.kvh, t = c.t, s = c.s, d = c.d, rep = h / kvh;
    std::mt19937 rng(1000 + n);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    auto randn = [&](size_t len) {
        std::vector<float> v(len);
        for (auto& x : v) x = normal(rng);
        return v;
    };
    // Operands, rounded to the dtype first so the reference sees what the kernel reads.
    FlashDims a{};
    a.b = b, a.h = h, a.kvh = kvh, a.t = t, a.s = s, a.d = d;
    a.causal = c.causal, a.offset = c.offset, a.scale = 1.0f / std::sqrt((float)d);
    a.has_bias = c.pad;
    a.window = c.window;
    std::vector<typename T::raw> qkv, qbuf, kbuf, vbuf;
    size_t qoff = 0, koff = 0, voff = 0;
    const typename T::raw *qp, *kp, *vp;
    if (c.strided) {
        qkv = to_raw<T>(randn((size_t)b * t * 3 * h * d));
        u64 row = 3ull * h * d;
        a.qs[0] = a.ks[0] = a.vs[0] = t * row;
        a.qs[1] = a.ks[1] = a.vs[1] = d;
        a.qs[2] = a.ks[2] = a.vs[2] = row;
        qoff = 0, koff = (size_t)h * d, voff = 2ull * h * d;
        qp = qkv.data() + qoff, kp = qkv.data() + koff, vp = qkv.data() + voff;
    } else {
        qbuf = to_raw<T>(randn((size_t)b * h * t * d));
        kbuf = to_raw<T>(randn((size_t)b * kvh * s * d));
        vbuf = to_raw<T>(randn((size_t)b * kvh * s * d));
        a.qs[0] = (u64)h * t * d, a.qs[1] = (u64)t * d, a.qs[2] = d;
        a.ks[0] = a.vs[0] = (u64)kvh * s * d, a.ks[1] = a.vs[1] = (u64)s * d, a.ks[2] = a.vs[2] = d;
        qp = qbuf.data(), kp = kbuf.data(), vp = vbuf.data();
    }
    std::vector<float> bias(c.pad ? (size_t)b * s : 1, 0.0f);
    if (c.pad) {
        for (u32 bi = 0; bi < b; ++bi)
            for (u32 j = 0; j < s; ++j) bias[bi * s + j] = (j + bi + 1 >= s) ? c.fill : 0.0f;
        a.bs[0] = s, a.bs[1] = 0, a.bs[2] = 0, a.bs[3] = 1;
    }
    auto Q = [&](u32 bi, u32 hi, u32 i, u32 k) { return (double)T::load(qp[bi * a.qs[0] + hi * a.qs[1] + i * a.qs[2] + k]); };
    auto K = [&](u32 bi, u32 kv, u32 j, u32 k) { return (double)T::load(kp[bi * a.ks[0] + kv * a.ks[1] + j * a.ks[2] + k]); };
    auto V = [&](u32 bi, u32 kv, u32 j, u32 k) { return (double)T::load(vp[bi * a.vs[0] + kv * a.vs[1] + j * a.vs[2] + k]); };
    std::vector<typename T::raw> g = to_raw<T>(randn((size_t)b * h * t * d));

    // The reference, in doubles.
    std::vector<double> ro((size_t)b * h * t * d, 0), rl((size_t)b * h * t), rdq(ro.size(), 0);
    std::vector<double> rdk((size_t)b * kvh * s * d, 0), rdv(rdk.size(), 0);
    std::vector<double> p(s), dp(s);
    for (u32 bi = 0; bi < b; ++bi)
        for (u32 hi = 0; hi < h; ++hi)
            for (u32 i = 0; i < t; ++i) {
                u32 kv = hi / rep;
                u64 row = ((u64)bi * h + hi) * t + i;
                double m = -INFINITY;
                for (u32 j = 0; j < s; ++j) {
                    bool vis = (!c.causal || j <= c.offset + i) &&
                               (c.window == 0 || c.offset + i < j + c.window);
                    double sc = -INFINITY;
                    if (vis) {
                        double dot = 0;
                        for (u32 k = 0; k < d; ++k) dot += Q(bi, hi, i, k) * K(bi, kv, j, k);
                        sc = dot * a.scale + (c.pad ? bias[bi * s + j] : 0.0);
                    }
                    p[j] = sc;
                    m = std::max(m, sc);
                }
                if (m == -INFINITY) {
                    rl[row] = -INFINITY;
                    continue;
                }
                double l = 0;
                for (u32 j = 0; j < s; ++j) l += (p[j] = p[j] == -INFINITY ? 0 : std::exp(p[j] - m));
                rl[row] = m + std::log(l);
                for (u32 j = 0; j < s; ++j) p[j] /= l;
                double delta = 0;
                for (u32 j = 0; j < s; ++j) {
                    dp[j] = 0;
                    for (u32 k = 0; k < d; ++k) dp[j] += T::load(g[row * d + k]) * V(bi, kv, j, k);
                    delta += p[j] * dp[j];
                }
                for (u32 j = 0; j < s; ++j) {
                    double ds = p[j] * (dp[j] - delta) * a.scale;
                    u64 kr = ((u64)bi * kvh + kv) * s + j;
                    for (u32 k = 0; k < d; ++k) {
                        ro[row * d + k] += p[j] * V(bi, kv, j, k);
                        rdq[row * d + k] += ds * K(bi, kv, j, k);
                        rdk[kr * d + k] += ds * Q(bi, hi, i, k);
                        rdv[kr * d + k] += p[j] * T::load(g[row * d + k]);
                    }
                }
            }

    // The kernels, launched as cuda/attention.rs launches them.
    const float* bp = bias.data();
    std::vector<typename T::raw> o((size_t)b * h * t * d), dq(o.size()), dk((size_t)b * kvh * s * d), dv(dk.size());
    std::vector<float> lse((size_t)b * h * t), delta(lse.size());
    typedef typename T::raw R;
    void (*fwd)(const R*, const R*, const R*, const float*, R*, float*, FlashDims);
    void (*dlt)(const R*, const R*, float*, u64, u32);
    void (*dqk)(const R*, const R*, const R*, const float*, const R*, const float*, const float*, R*, FlashDims);
    void (*dkv)(const R*, const R*, const R*, const float*, const R*, const float*, const float*, R*, R*, FlashDims);
    if constexpr (std::is_same_v<T, F32>) fwd = flash_fwd_f32, dlt = flash_delta_f32, dqk = flash_dq_f32, dkv = flash_dkdv_f32;
    if constexpr (std::is_same_v<T, BF16>) fwd = flash_fwd_bf16, dlt = flash_delta_bf16, dqk = flash_dq_bf16, dkv = flash_dkdv_bf16;
    if constexpr (std::is_same_v<T, F16>) fwd = flash_fwd_f16, dlt = flash_delta_f16, dqk = flash_dq_f16, dkv = flash_dkdv_f16;
    dim3 block{128, 1, 1};
    emu::launch(fwd, dim3{b * h, (t + 31) / 32, 1}, block, qp, kp, vp, bp, o.data(), lse.data(), a);
    u64 rows = (u64)b * h * t;
    emu::launch(dlt, dim3{(u32)std::min<u64>((rows + 7) / 8, 65535), 1, 1}, dim3{256, 1, 1}, (const R*)o.data(), (const R*)g.data(), delta.data(), rows, d);
    emu::launch(dqk, dim3{b * h, (t + 15) / 16, 1}, block, qp, kp, vp, bp, (const R*)g.data(), (const float*)lse.data(), (const float*)delta.data(), dq.data(), a);
    emu::launch(dkv, dim3{b * kvh, (s + 15) / 16, 1}, block, qp, kp, vp, bp, (const R*)g.data(), (const float*)lse.data(), (const float*)delta.data(), dk.data(), dv.data(), a);

    std::vector<double> glse(lse.begin(), lse.end());
    double tol = std::is_same_v<T, F32> ? 1e-5 : 1e-2;
    // The tensor-core forward, for half operands at head dims 64 and 128 (what cuda/attention.rs
    // launches there on sm_80+).
    bool mma_ok = true;
    std::string mma_line;
    if constexpr (!std::is_same_v<T, F32>) {
        if (d == 64 || d == 128) {
            std::vector<R> mo(o.size());
            std::vector<float> ml(lse.size());
            void (*mma)(const R*, const R*, const R*, const float*, R*, float*, FlashDims);
            if constexpr (std::is_same_v<T, BF16>) mma = d == 64 ? flash_fwd_mma_bf16_d64 : flash_fwd_mma_bf16_d128;
            else mma = d == 64 ? flash_fwd_mma_f16_d64 : flash_fwd_mma_f16_d128;
            emu::launch(mma, dim3{b * h, (t + 63) / 64, 1}, block, qp, kp, vp, bp, mo.data(), ml.data(), a);
            std::vector<double> mlse(ml.begin(), ml.end());
            // dq on tensor cores, from the scalar forward's log-sum-exps and row dots above.
            std::vector<R> mdq(dq.size());
            void (*mdqk)(const R*, const R*, const R*, const float*, const R*, const float*, const float*, R*, FlashDims);
            if constexpr (std::is_same_v<T, BF16>) mdqk = d == 64 ? flash_dq_mma_bf16_d64 : flash_dq_mma_bf16_d128;
            else mdqk = d == 64 ? flash_dq_mma_f16_d64 : flash_dq_mma_f16_d128;
            emu::launch(mdqk, dim3{b * h, (t + 63) / 64, 1}, block, qp, kp, vp, bp, (const R*)g.data(), (const float*)lse.data(), (const float*)delta.data(), mdq.data(), a);
            double eo = rel_err(from_raw<T>(mo), ro), el = rel_err(mlse, rl), eq = rel_err(from_raw<T>(mdq), rdq);
            mma_ok = eo <= tol && el <= tol && eq <= tol && !std::isnan(eo + el + eq);
            char buf[96];
            std::snprintf(buf, sizeof buf, " | mma o %.2e lse %.2e dq %.2e", eo, el, eq);
            mma_line = buf;
        }
    }
    double errs[5] = {rel_err(from_raw<T>(o), ro), rel_err(glse, rl), rel_err(from_raw<T>(dq), rdq),
                      rel_err(from_raw<T>(dk), rdk), rel_err(from_raw<T>(dv), rdv)};
    const char* names[5] = {"o", "lse", "dq", "dk", "dv"};
    bool ok = mma_ok;
    std::string line;
    for (int k = 0; k < 5; ++k) {
        ok &= errs[k] <= tol && !std::isnan(errs[k]);
        char buf[64];
        std::snprintf(buf, sizeof buf, " %s %.2e", names[k], errs[k]);
        line += buf;
    }
    std::printf("case %d: b %u h %u kvh %u t %u s %u d %u causal %d offset %u window %u pad %d dtype %d strided %d:%s %s\n",
                n, b, h, kvh, t, s, d, c.causal, c.offset, c.window, c.pad, c.dtype, c.strided,
                (line + mma_line).c_str(), ok ? "ok" : "FAILED");
    return ok;
}

}  // namespace

int main() {
    const float NEG = -INFINITY;
    // The cases of accel-nn's cuda_attention_matches_... (GPU) check.
    Case cases[] = {
        {2, 4, 4, 37, 37, 64, true, 0, false, 0, 0, false},
        {1, 8, 2, 130, 130, 128, true, 0, false, 0, 0, false},
        {2, 4, 1, 33, 70, 64, false, 0, true, -1e9f, 0, false},
        {4, 2, 2, 3, 3, 64, false, 0, true, NEG, 0, false},
        {1, 4, 4, 5, 133, 64, true, 128, false, 0, 0, false},
        {3, 2, 2, 1, 50, 80, true, 49, false, 0, 0, false},
        {2, 3, 3, 65, 65, 64, true, 0, true, -1e9f, 0, true},
        {1, 8, 2, 130, 130, 128, true, 0, false, 0, 1, false},
        {2, 4, 4, 100, 100, 64, true, 0, false, 0, 2, true},
        // The tensor-core forward's other paths: padding (whole rows masked), a KV cache's
        // offset, non-causal GQA with more keys than queries, 64 and 128 dims in both dtypes.
        {4, 2, 2, 3, 3, 64, false, 0, true, NEG, 1, false},
        {1, 4, 4, 5, 133, 128, true, 128, false, 0, 2, false},
        {2, 4, 1, 70, 97, 64, false, 0, true, -1e9f, 1, false},
        // Sliding windows (Mistral, Gemma's local layers): from position 0 over several key
        // tiles, after a KV cache, and on the tensor-core paths.
        {1, 4, 2, 70, 70, 64, true, 0, false, 0, 0, false, 16},
        {1, 4, 4, 5, 133, 128, true, 128, false, 0, 2, false, 40},
        {2, 4, 4, 100, 100, 64, true, 0, false, 0, 1, false, 33},
    };
    int n = 0;
    bool ok = true;
    for (const Case& c : cases) {
        bool good = c.dtype == 0 ? run<F32>(c, n) : c.dtype == 1 ? run<BF16>(c, n) : run<F16>(c, n);
        ok &= good;
        ++n;
    }
    return ok ? 0 : 1;
}
