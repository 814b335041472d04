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
