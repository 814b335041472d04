// SwiGLU, y = silu(g) * u, and its gradients, element by element on f32, for accel-nn's swiglu on
// CUDA (half inputs are converted to f32 around them, as for the row norms). The formulas are the
// CPU kernel's (accel-nn/src/kernels/math.rs): sigmoid(x) = 1 / (1 + exp(-x)), silu(x) = x * sigmoid(x),
// silu'(x) = s * (1 + x * (1 - s)). `expf` is not the CPU kernel's exp, so the two agree to a few
// ulps, not bit for bit.
#ifndef ACCEL_COMMON_CUH
#include "common.cuh"
#endif

__device__ __forceinline__ float act_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// y[i] = silu(g[i]) * u[i] for i < n.
extern "C" __global__ void swiglu_fwd(const float *g, const float *u, float *y, u64 n) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (u64)gridDim.x * blockDim.x) {
        float x = g[i];
        y[i] = x * act_sigmoid(x) * u[i];
    }
}

// dgu[i] = dy[i] * u[i] * silu'(g[i]) (the gate's gradient) and dgu[n + i] = dy[i] * silu(g[i])
// (the up projection's) for i < n.
extern "C" __global__ void swiglu_bwd(const float *g, const float *u, const float *dy, float *dgu,
                                      u64 n) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (u64)gridDim.x * blockDim.x) {
        float x = g[i], s = act_sigmoid(x), d = dy[i];
        dgu[i] = d * u[i] * (s * (1.0f + x * (1.0f - s)));
        dgu[n + i] = d * (x * s);
    }
}

// The pointwise activations of accel-nn's kernels (Act in accel-nn/src/kernels/act.rs, same order):
// 0 identity, 1 relu, 2 gelu tanh approximation, 3 gelu exact (erf), 4 silu. The formulas are the
// CPU kernel's; erff, tanhf and expf are not its approximations, so the two agree to a few ulps.
#define ACT_C 0.7978846f   // sqrt(2 / pi)
#define ACT_A 0.044715f
#define ACT_INV_SQRT2 0.70710678f
#define ACT_INV_SQRT_2PI 0.39894228f

__device__ __forceinline__ float act_apply(float x, int act) {
    switch (act) {
    case 1: return fmaxf(x, 0.0f);
    case 2: return 0.5f * x * (1.0f + tanhf(ACT_C * (x + ACT_A * x * x * x)));
    case 3: return 0.5f * x * (1.0f + erff(x * ACT_INV_SQRT2));
    case 4: return x * act_sigmoid(x);
    default: return x;
    }
}

__device__ __forceinline__ float act_grad(float x, int act) {
    switch (act) {
    case 1: return x <= 0.0f ? 0.0f : 1.0f;
    case 2: {
        float t = tanhf(ACT_C * (x + ACT_A * x * x * x));
        return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * ACT_C * (1.0f + 3.0f * ACT_A * x * x);
    }
    case 3:
        return 0.5f * (1.0f + erff(x * ACT_INV_SQRT2)) + x * ACT_INV_SQRT_2PI * expf(-0.5f * x * x);
    case 4: {
        float s = act_sigmoid(x);
        return s * (1.0f + x * (1.0f - s));
    }
    default: return 1.0f;
    }
}

// y[i] = act(x[i]) for i < n.
extern "C" __global__ void act_fwd(const float *x, float *y, u64 n, int act) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (u64)gridDim.x * blockDim.x) {
        y[i] = act_apply(x[i], act);
    }
}

// dx[i] = dy[i] * act'(x[i]) for i < n (relu: dy where x > 0, else 0, as on the CPU).
extern "C" __global__ void act_bwd(const float *x, const float *dy, float *dx, u64 n, int act) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (u64)gridDim.x * blockDim.x) {
        float g = dy[i];
        dx[i] = act == 1 ? (x[i] <= 0.0f ? 0.0f : g) : g * act_grad(x[i], act);
    }
}
