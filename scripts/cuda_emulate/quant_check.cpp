// quant.cu runs on the host (emulate.h), launched as cuda/launch.rs launches it: tiles of 4-bit
// weights (f32 and double-quantized maxima, each store dtype, f32/bf16/f16 output) and of 8-bit
// weights, bit for bit against the values computed here the way the CPU kernels compute them
// (accel-nn's quant/dequant.rs), on tiles that start mid-byte and cross blocks and rows; and the
// few-row product off the codes against a double-precision product of those values. One line per
// case; exits 1 on a mismatch.
#include <cstdio>
#include <random>

#include "emulate.h"
#include "../../accel-kernels/src/cuda/quant.cu"

namespace {

// bitsandbytes' NF4 code book.
const float NF4[16] = {-1.0f, -0.6961928009986877f, -0.5250730514526367f, -0.39491748809814453f,
                       -0.28444138169288635f, -0.18477343022823334f, -0.09105003625154495f, 0.0f,
                       0.07958029955625534f, 0.16093020141124725f, 0.24611230194568634f,
                       0.33791524171829224f, 0.44070982933044434f, 0.5626170039176941f,
                       0.7229568362236023f, 1.0f};

struct Weight {
    u64 out, inp;
    u32 blocksize = 64;
    std::vector<u8> packed, absmax_codes;
    std::vector<float> absmax, nested;
    float offset = 0.0f;
};

Weight make_weight(u64 out, u64 inp, unsigned seed) {
    std::mt19937 rng(seed);
    std::uniform_int_distribution<int> byte(0, 255);
    std::uniform_real_distribution<float> pos(0.01f, 2.0f);
    Weight w{out, inp};
    u64 n = out * inp, blocks = (n + w.blocksize - 1) / w.blocksize;
    w.packed.resize((n + 1) / 2);
    for (auto& b : w.packed) b = (u8)byte(rng);
    w.absmax.resize(blocks);
    for (auto& a : w.absmax) a = pos(rng);
    w.absmax_codes.resize(blocks);
    for (auto& c : w.absmax_codes) c = (u8)byte(rng);
    w.nested.resize((blocks + 255) / 256);
    for (auto& v : w.nested) v = pos(rng);
    w.offset = 0.37f;
    return w;
}

QuantCodes make_codes(unsigned seed) {
    QuantCodes q;
    for (int i = 0; i < 16; ++i) q.codes[i] = NF4[i];
    std::mt19937 rng(seed);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    for (auto& m : q.map) m = u(rng);
    return q;
}

// What the CPU's dequant::tile computes for element (r, k), before the compute rounding.
float cpu_value(const Weight& w, const QuantCodes& q, bool nested, u32 store, u64 r, u64 k) {
    u64 e = r * w.inp + k, b = e / w.blocksize;
    float s = nested ? q.map[w.absmax_codes[b]] * w.nested[b / 256] + w.offset : w.absmax[b];
    u8 byte = w.packed[e / 2];
    float v = q.codes[(e & 1) ? (byte & 15) : (byte >> 4)] * s;
    if (store == 1) v = BF16::load(BF16::store(v));
    if (store == 2) v = F16::load(F16::store(v));
    return v;
}

QuantDims dims(const Weight& w, bool nested, u32 store, u64 r0, u32 rows, u64 k0, u32 cols) {
    QuantDims d{};
    d.out = w.out, d.inp = w.inp, d.r0 = r0, d.k0 = k0, d.rows = rows, d.cols = cols;
    d.blocksize = w.blocksize, d.nested_per = nested ? 256 : 0, d.offset = w.offset;
    d.store = store;
    return d;
}

const dim3 BLOCK{256, 1, 1};
dim3 grid_for(u64 n) { return dim3{(u32)std::max<u64>(1, std::min<u64>((n + 255) / 256, 16)), 1, 1}; }

bool report(const char* what, double err, double tol) {
    bool ok = err <= tol && !std::isnan(err);
    std::printf("%s: %.2e %s\n", what, err, ok ? "ok" : "FAILED");
    return ok;
}

// Tiles of a 4-bit weight in output type T, against cpu_value rounded to T: mismatches.
template <typename T>
u64 tile_mismatches(const Weight& w, const QuantCodes& q, bool nested, u32 store, u64 r0, u32 rows,
                    u64 k0, u32 cols, void (*kernel)(const u8*, const float*, const u8*,
                                                     const float*, QuantDims, QuantCodes,
                                                     typename T::raw*)) {
    std::vector<typename T::raw> dst((u64)rows * cols);
    QuantDims d = dims(w, nested, store, r0, rows, k0, cols);
    emu::launch(kernel, grid_for(dst.size()), BLOCK, w.packed.data(), w.absmax.data(),
                w.absmax_codes.data(), w.nested.data(), d, q, dst.data());
    u64 bad = 0;
    for (u32 r = 0; r < rows; ++r)
        for (u32 c = 0; c < cols; ++c) {
            typename T::raw want = T::store(cpu_value(w, q, nested, store, r0 + r, k0 + c));
            bad += std::memcmp(&dst[(u64)r * cols + c], &want, sizeof want) != 0;
        }
    return bad;
}

}  // namespace

int main() {
    bool ok = true;
    QuantCodes q = make_codes(3);
    // 99 columns: rows start mid-byte and blocks of 64 straddle rows.
    for (u64 inp : {128ull, 99ull}) {
        Weight w = make_weight(37, inp, 5 + (unsigned)inp);
        struct Tile { u64 r0; u32 rows; u64 k0; u32 cols; };
        for (Tile t : {Tile{0, 37, 0, (u32)inp}, Tile{3, 20, 5, 61}, Tile{36, 1, 1, (u32)inp - 1}}) {
            for (int nested = 0; nested < 2; ++nested)
                for (u32 store = 0; store < 3; ++store) {
                    char what[128];
                    std::snprintf(what, sizeof what,
                                  "4-bit [37, %llu] tile rows %llu+%u cols %llu+%u nested %d store %u: mismatches",
                                  inp, t.r0, t.rows, t.k0, t.cols, nested, store);
                    u64 bad = tile_mismatches<F32>(w, q, nested, store, t.r0, t.rows, t.k0, t.cols, dequant4_f32) +
                              tile_mismatches<BF16>(w, q, nested, store, t.r0, t.rows, t.k0, t.cols, dequant4_bf16) +
                              tile_mismatches<F16>(w, q, nested, store, t.r0, t.rows, t.k0, t.cols, dequant4_f16);
                    ok &= report(what, (double)bad, 0);
                }
        }
        // The few-row product, f32 and bf16 x, 1 and 8 rows.
        for (u32 n : {1u, 8u}) {
            std::mt19937 rng(11 + n);
            std::normal_distribution<float> normal(0.0f, 1.0f);
            std::vector<float> x(n * inp), y(n * w.out);
            std::vector<u16> xb(n * inp), yb(n * w.out);
            for (u64 i = 0; i < x.size(); ++i) {
                xb[i] = BF16::store(normal(rng));
                x[i] = BF16::load(xb[i]);
            }
            for (int nested = 0; nested < 2; ++nested) {
                QuantDims d = dims(w, nested, 0, 0, 0, 0, 0);
                d.n = n;
                dim3 grid{(u32)((w.out + GEMV_WARPS - 1) / GEMV_WARPS), 1, 1};
                emu::launch(gemv4_f32, grid, dim3{GEMV_WARPS * 32, 1, 1}, (const float*)x.data(), w.packed.data(),
                            w.absmax.data(), w.absmax_codes.data(), w.nested.data(), d, q, y.data());
                emu::launch(gemv4_bf16, grid, dim3{GEMV_WARPS * 32, 1, 1}, (const u16*)xb.data(), w.packed.data(),
                            w.absmax.data(), w.absmax_codes.data(), w.nested.data(), d, q, yb.data());
                double err = 0, errb = 0, scale = 0;
                for (u32 r = 0; r < n; ++r)
                    for (u64 o = 0; o < w.out; ++o) {
                        double acc = 0, accb = 0;
                        for (u64 k = 0; k < inp; ++k) {
                            float v = cpu_value(w, q, nested, 0, o, k);
                            acc += (double)v * x[r * inp + k];
                            accb += (double)BF16::load(BF16::store(v)) * x[r * inp + k];
                        }
                        err = std::max(err, std::fabs(y[r * w.out + o] - acc));
                        errb = std::max(errb, std::fabs(BF16::load(yb[r * w.out + o]) - accb));
                        scale = std::max(scale, std::fabs(acc));
                    }
                char what[128];
                std::snprintf(what, sizeof what, "gemv4 [37, %llu] %u rows nested %d f32: relative error", inp, n, nested);
                ok &= report(what, err / scale, 1e-5);
                std::snprintf(what, sizeof what, "gemv4 [37, %llu] %u rows nested %d bf16: relative error", inp, n, nested);
                ok &= report(what, errb / scale, 1e-2);
            }
        }
    }
    // 8-bit rows.
    {
        const u64 out = 21, inp = 77;
        std::mt19937 rng(9);
        std::uniform_int_distribution<int> byte(0, 255);
        std::uniform_real_distribution<float> pos(0.01f, 3.0f);
        std::vector<u8> codes(out * inp);
        for (auto& c : codes) c = (u8)byte(rng);
        std::vector<float> row_max(out);
        for (auto& m : row_max) m = pos(rng);
        QuantDims d{};
        d.out = out, d.inp = inp, d.r0 = 2, d.k0 = 3, d.rows = 17, d.cols = 70;
        std::vector<float> dst(d.rows * d.cols);
        std::vector<u16> dstb(d.rows * d.cols);
        emu::launch(dequant8_f32, grid_for(dst.size()), BLOCK, (const u8*)codes.data(), (const float*)row_max.data(), d, dst.data());
        emu::launch(dequant8_bf16, grid_for(dst.size()), BLOCK, (const u8*)codes.data(), (const float*)row_max.data(), d, dstb.data());
        u64 bad = 0;
        for (u32 r = 0; r < d.rows; ++r)
            for (u32 c = 0; c < d.cols; ++c) {
                u64 i = (u64)r * d.cols + c;
                float want = (float)(signed char)codes[(d.r0 + r) * inp + d.k0 + c] * row_max[d.r0 + r] * INV_127;
                bad += std::memcmp(&dst[i], &want, 4) != 0;
                bad += dstb[i] != BF16::store(want);
            }
        ok &= report("8-bit [21, 77] tile rows 2+17 cols 3+70 f32 and bf16: mismatches", (double)bad, 0);
    }
    return ok ? 0 : 1;
}
