//! The activations the CUDA kernels know, named the same in builds with and without CUDA.

/// A pointwise activation of the CUDA kernels (the `act` codes of `act.cu`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    /// The identity.
    Identity = 0,
    /// `max(x, 0)`.
    Relu = 1,
    /// GELU, tanh approximation.
    GeluTanh = 2,
    /// GELU, exact (erf).
    Gelu = 3,
    /// `x * sigmoid(x)`.
    Silu = 4,
}
