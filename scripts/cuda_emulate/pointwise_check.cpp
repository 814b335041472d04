// act.cu and rope.cu run on the host (emulate.h) against double-precision references: every
// activation's value and derivative (the derivative against a central difference of the same
// formula in doubles), SwiGLU's value and both gradients, and rotary embeddings in both pair
// conventions, whose backward (the inverse rotation) must give the input back. One line each;
// exits 1 on a mismatch.
#include <cstdio>
#include <random>

#include "emulate.h"
#include "../../accel-kernels/src/cuda/act.cu"
#include "../../accel-kernels/src/cuda/rope.cu"

namespace {

const dim3 BLOCK{256, 1, 1};
dim3 grid_for(u64 n) { return dim3{(u32)std::max<u64>(1, std::min<u64>((n + 255) / 256, 64)), 1, 1}; }

double act_ref(double x, int act) {
    switch (act) {
    case 1: return std::max(x, 0.0);
    case 2: return 0.5 * x * (1 + std::tanh(std::sqrt(2 / M_PI) * (x + 0.044715 * x * x * x)));
    case 3: return 0.5 * x * (1 + std::erf(x / std::sqrt(2.0)));
    case 4: return x / (1 + std::exp(-x));
    default: return x;
    }
}

double diff(double x, int act) {
    if (act == 1) return x <= 0 ? 0 : 1;
    const double h = 1e-5;
    return (act_ref(x + h, act) - act_ref(x - h, act)) / (2 * h);
}

bool report(const char* what, double err, double tol) {
    bool ok = err <= tol && !std::isnan(err);
    std::printf("%s: relative error %.2e %s\n", what, err, ok ? "ok" : "FAILED");
    return ok;
}

// max |got - want| / max |want|.
template <typename F>
double rel(size_t n, F pair) {
    double err = 0, scale = 0;
    for (size_t i = 0; i < n; ++i) {
        auto [got, want] = pair(i);
        err = std::max(err, std::fabs(got - want));
        scale = std::max(scale, std::fabs(want));
    }
    return err / std::max(scale, 1e-30);
}

}  // namespace

int main() {
    std::mt19937 rng(7);
    std::normal_distribution<float> normal(0.0f, 3.0f);
    const u64 n = 10007;
    std::vector<float> x(n), dy(n), u(n), y(n), dx(n), dgu(2 * n);
    for (u64 i = 0; i < n; ++i) x[i] = normal(rng), dy[i] = normal(rng), u[i] = normal(rng);
    bool ok = true;
    const char* names[] = {"identity", "relu", "gelu tanh", "gelu", "silu"};
    for (int act = 0; act < 5; ++act) {
        emu::launch(act_fwd, grid_for(n), BLOCK, (const float*)x.data(), y.data(), n, act);
        emu::launch(act_bwd, grid_for(n), BLOCK, (const float*)x.data(), (const float*)dy.data(), dx.data(), n, act);
        char what[64];
        std::snprintf(what, sizeof what, "%s forward", names[act]);
        ok &= report(what, rel(n, [&](size_t i) { return std::pair<double, double>{y[i], act_ref(x[i], act)}; }), 1e-6);
        std::snprintf(what, sizeof what, "%s gradient", names[act]);
        ok &= report(what, rel(n, [&](size_t i) { return std::pair<double, double>{dx[i], dy[i] * diff(x[i], act)}; }), 1e-5);
    }
    emu::launch(swiglu_fwd, grid_for(n), BLOCK, (const float*)x.data(), (const float*)u.data(), y.data(), n);
    emu::launch(swiglu_bwd, grid_for(n), BLOCK, (const float*)x.data(), (const float*)u.data(), (const float*)dy.data(), dgu.data(), n);
    ok &= report("swiglu forward", rel(n, [&](size_t i) { return std::pair<double, double>{y[i], act_ref(x[i], 4) * u[i]}; }), 1e-6);
    ok &= report("swiglu gate gradient", rel(n, [&](size_t i) { return std::pair<double, double>{dgu[i], dy[i] * u[i] * diff(x[i], 4)}; }), 1e-5);
    ok &= report("swiglu up gradient", rel(n, [&](size_t i) { return std::pair<double, double>{dgu[n + i], dy[i] * act_ref(x[i], 4)}; }), 1e-6);

    // Rope: rows cycle through t positions; cos/sin [t, d/2].
    const u32 t = 7, d = 10;
    const u64 rows = 3 * t;
    std::vector<float> xs(rows * d), cs(t * d / 2), sn(t * d / 2), ry(rows * d), back(rows * d);
    for (auto& v : xs) v = normal(rng);
    for (u32 p = 0; p < t; ++p)
        for (u32 i = 0; i < d / 2; ++i) {
            double theta = p * std::pow(10000.0, -2.0 * i / d);
            cs[p * d / 2 + i] = (float)std::cos(theta), sn[p * d / 2 + i] = (float)std::sin(theta);
        }
    for (int inter = 0; inter < 2; ++inter) {
        emu::launch(rope_f32, grid_for(rows * d / 2), BLOCK, (const float*)xs.data(), (const float*)cs.data(), (const float*)sn.data(), ry.data(), rows, t, d, inter, 1.0f);
        emu::launch(rope_f32, grid_for(rows * d / 2), BLOCK, (const float*)ry.data(), (const float*)cs.data(), (const float*)sn.data(), back.data(), rows, t, d, inter, -1.0f);
        std::vector<double> want(rows * d);
        for (u64 r = 0; r < rows; ++r)
            for (u32 i = 0; i < d / 2; ++i) {
                double c = cs[(r % t) * d / 2 + i], s = sn[(r % t) * d / 2 + i];
                u64 ia = r * d + (inter ? 2 * i : i), ib = r * d + (inter ? 2 * i + 1 : i + d / 2);
                want[ia] = xs[ia] * c - xs[ib] * s;
                want[ib] = xs[ib] * c + xs[ia] * s;
            }
        char what[64];
        std::snprintf(what, sizeof what, "rope interleaved %d forward", inter);
        ok &= report(what, rel(rows * d, [&](size_t i) { return std::pair<double, double>{ry[i], want[i]}; }), 1e-6);
        std::snprintf(what, sizeof what, "rope interleaved %d backward of forward", inter);
        ok &= report(what, rel(rows * d, [&](size_t i) { return std::pair<double, double>{back[i], xs[i]}; }), 1e-6);
    }
    return ok ? 0 : 1;
}
