// softmax.cu and loss.cu run on the host (emulate.h) against double-precision references, launched
// as cuda/launch.rs launches them: softmax and log-softmax forward and backward on rows narrower and
// wider than a warp and more rows than a block holds; mean cross entropy, its count and the logits'
// gradient with ignored rows, every row ignored, and GPT-2's 50257 classes. One line per case;
// exits 1 on a mismatch.
#include <cstdio>
#include <random>

#include "emulate.h"
#include "../../accel-kernels/src/cuda/softmax.cu"
#include "../../accel-kernels/src/cuda/loss.cu"

namespace {

// cuda/launch.rs: row kernels take a warp a row, 8 warps a block.
dim3 row_grid(u32 rows) { return dim3{std::max(1u, std::min((rows + 7) / 8, 1u << 16)), 1, 1}; }
const dim3 ROW_BLOCK{256, 1, 1};

std::vector<float> randn(size_t n, unsigned seed, float scale) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal(0.0f, scale);
    std::vector<float> v(n);
    for (auto& x : v) x = normal(rng);
    return v;
}

double rel_err(const std::vector<float>& got, const std::vector<double>& want) {
    double err = 0, scale = 0;
    for (size_t i = 0; i < got.size(); ++i) {
        err = std::max(err, std::fabs(got[i] - want[i]));
        scale = std::max(scale, std::fabs(want[i]));
    }
    return err / std::max(scale, 1e-12);
}

bool report(const char* what, double err, double tol) {
    bool ok = err <= tol && !std::isnan(err);
    std::printf("%s: relative error %.2e %s\n", what, err, ok ? "ok" : "FAILED");
    return ok;
}

bool softmax_case(u32 rows, u32 d, int log, unsigned seed) {
    std::vector<float> x = randn((size_t)rows * d, seed, 30.0f), g = randn(x.size(), seed + 1, 1.0f);
    std::vector<float> y(x.size()), dx(x.size());
    emu::launch(softmax_fwd, row_grid(rows), ROW_BLOCK, (const float*)x.data(), y.data(), rows, d, log);
    emu::launch(softmax_bwd, row_grid(rows), ROW_BLOCK, (const float*)y.data(), (const float*)g.data(), dx.data(), rows, d, log);
    // The gradient's error is measured against the size of its terms, max |y| (|g| + |<g, y>|),
    // not against its largest entry: with logits of std 30 a row's softmax is nearly one-hot and
    // its gradient nearly 0, so a rounding of g alone is a large part of it.
    std::vector<double> ry(x.size()), rdx(x.size()), terms(x.size());
    for (u32 r = 0; r < rows; ++r) {
        const float* xr = &x[(size_t)r * d];
        double m = -INFINITY, s = 0, dot = 0, gs = 0;
        for (u32 j = 0; j < d; ++j) m = std::max(m, (double)xr[j]);
        for (u32 j = 0; j < d; ++j) s += std::exp(xr[j] - m);
        for (u32 j = 0; j < d; ++j) {
            double p = std::exp(xr[j] - m) / s;
            ry[(size_t)r * d + j] = log ? xr[j] - m - std::log(s) : p;
        }
        // The backward from the forward's own (f32) output, as the kernel and the CPU op read
        // it: this checks the backward's arithmetic, not the forward's rounding again.
        const float* yr = &y[(size_t)r * d];
        for (u32 j = 0; j < d; ++j) {
            dot += g[(size_t)r * d + j] * (double)yr[j];
            gs += g[(size_t)r * d + j];
        }
        for (u32 j = 0; j < d; ++j) {
            double yj = yr[j], gj = g[(size_t)r * d + j];
            rdx[(size_t)r * d + j] = log ? gj - std::exp(yj) * gs : yj * (gj - dot);
            terms[(size_t)r * d + j] =
                log ? std::fabs(gj) + std::exp(yj) * std::fabs(gs) : std::fabs(yj) * (std::fabs(gj) + std::fabs(dot));
        }
    }
    char what[96];
    std::snprintf(what, sizeof what, "softmax log %d [%u, %u] forward", log, rows, d);
    bool ok = report(what, rel_err(y, ry), 1e-5);
    std::snprintf(what, sizeof what, "softmax log %d [%u, %u] gradient", log, rows, d);
    double err = 0, scale = 0;
    for (size_t i = 0; i < dx.size(); ++i) {
        err = std::max(err, std::fabs(dx[i] - rdx[i]));
        scale = std::max(scale, terms[i]);
    }
    return report(what, err / scale, 1e-5) && ok;
}

bool xent_case(u32 rows, u32 c, bool all_ignored, unsigned seed) {
    std::vector<float> x = randn((size_t)rows * c, seed, 4.0f);
    std::vector<u32> t(rows);
    for (u32 i = 0; i < rows; ++i)
        t[i] = (all_ignored || i % 5 == 3) ? XE_IGNORED : (u32)(((u64)i * 7919) % c);
    std::vector<float> lse(rows), loss(rows), mean(1), count(1), dx(x.size());
    float dy = 3.0f;
    emu::launch(xent_rows, row_grid(rows), ROW_BLOCK, (const float*)x.data(), (const u32*)t.data(), lse.data(), loss.data(), rows, c);
    emu::launch(xent_mean, dim3{1, 1, 1}, dim3{XE_THREADS, 1, 1}, (const float*)loss.data(), (const u32*)t.data(), mean.data(), count.data(), rows);
    u64 n = (u64)rows * c;
    dim3 grid{(u32)std::max<u64>(1, std::min<u64>((n + 255) / 256, 8192)), 1, 1};
    emu::launch(xent_grad, grid, dim3{256, 1, 1}, (const float*)x.data(), (const u32*)t.data(), (const float*)lse.data(), (const float*)&dy, (const float*)count.data(), dx.data(), rows, c);
    double total = 0;
    u32 counted = 0;
    std::vector<double> rlse(rows), rdx(x.size(), 0.0);
    for (u32 r = 0; r < rows; ++r) {
        const float* xr = &x[(size_t)r * c];
        double m = -INFINITY, s = 0;
        for (u32 j = 0; j < c; ++j) m = std::max(m, (double)xr[j]);
        for (u32 j = 0; j < c; ++j) s += std::exp(xr[j] - m);
        rlse[r] = m + std::log(s);
        if (t[r] != XE_IGNORED) {
            total += rlse[r] - xr[t[r]];
            counted += 1;
        }
    }
    double scale = dy / std::max(1.0, (double)counted);
    for (u32 r = 0; r < rows; ++r) {
        if (t[r] == XE_IGNORED) continue;
        for (u32 j = 0; j < c; ++j)
            rdx[(size_t)r * c + j] = std::exp(x[(size_t)r * c + j] - rlse[r]) * scale - (j == t[r] ? scale : 0.0);
    }
    double want = counted ? total / counted : 0.0;
    char what[96];
    std::snprintf(what, sizeof what, "cross entropy [%u, %u]%s loss %.6f vs %.6f", rows, c,
                  all_ignored ? " all ignored" : "", mean[0], want);
    double loss_err = std::fabs(mean[0] - want) / std::max(1.0, std::fabs(want));
    bool ok = report(what, loss_err, 1e-5) && count[0] == (float)counted;
    std::snprintf(what, sizeof what, "cross entropy [%u, %u]%s gradient", rows, c, all_ignored ? " all ignored" : "");
    if (all_ignored) {
        double sum = 0;
        for (float v : dx) sum += std::fabs(v);
        return report(what, sum, 0.0) && mean[0] == 0.0f && ok;
    }
    return report(what, rel_err(dx, rdx), 1e-5) && ok;
}

}  // namespace

int main() {
    bool ok = true;
    unsigned seed = 90;
    for (auto [rows, d] : {std::pair<u32, u32>{3, 7}, {130, 256}, {2, 5000}})
        for (int log : {0, 1}) ok &= softmax_case(rows, d, log, seed++);
    for (auto [rows, c] : {std::pair<u32, u32>{6, 7}, {2100, 50}, {3, 50257}})
        for (bool none : {false, true}) ok &= xent_case(rows, c, none, seed++);
    return ok ? 0 : 1;
}
