//! The one error type of accel-kernels.

use candle_core::{DType, DeviceLocation};

/// Everything that can go wrong in a kernel call.
///
/// Every variant names the operation (`op`) and, for list arguments, the
/// position in the list, so a failure inside a 300-tensor optimizer step can
/// be traced back to the parameter that caused it.
#[derive(thiserror::Error)]
pub enum Error {
    /// A tensor operation failed inside candle.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),

    /// The operation does not support tensors of this dtype.
    #[error("{op}: unsupported dtype {dtype:?}")]
    UnsupportedDType {
        /// The operation that was called.
        op: &'static str,
        /// The dtype that was rejected.
        dtype: DType,
    },

    /// A tensor has a different dtype than the one the operation needs.
    #[error("{op}: tensor {index} has dtype {got:?}, expected {expected:?}")]
    DTypeMismatch {
        /// The operation that was called.
        op: &'static str,
        /// Position of the offending tensor in its list (0 for single tensors).
        index: usize,
        /// The dtype the operation needs.
        expected: DType,
        /// The dtype the tensor has.
        got: DType,
    },

    /// Two lists that must pair up element by element have different lengths.
    #[error("{op}: list lengths differ ({left} vs {right})")]
    LengthMismatch {
        /// The operation that was called.
        op: &'static str,
        /// Length of the first list.
        left: usize,
        /// Length of the second list.
        right: usize,
    },

    /// Paired tensors have different shapes.
    #[error("{op}: shape mismatch at index {index}: source {src:?}, destination {dst:?}")]
    ShapeMismatch {
        /// The operation that was called.
        op: &'static str,
        /// Position of the pair in the lists.
        index: usize,
        /// Dimensions of the source (or read-only) tensor.
        src: Vec<usize>,
        /// Dimensions of the destination (or written) tensor.
        dst: Vec<usize>,
    },

    /// The fused path reads and writes storage linearly, so it needs
    /// contiguous tensors.
    #[error("{op}: tensor {index} is not contiguous")]
    RequiresContiguous {
        /// The operation that was called.
        op: &'static str,
        /// Position of the offending tensor in its list (0 for single tensors).
        index: usize,
    },

    /// The tensors of one call live on different devices.
    #[error("{op}: tensor {index} is on {got:?}, expected {expected:?}")]
    DeviceMismatch {
        /// The operation that was called.
        op: &'static str,
        /// Position of the offending tensor in its list.
        index: usize,
        /// Device of the first tensor of the call.
        expected: DeviceLocation,
        /// Device of the offending tensor.
        got: DeviceLocation,
    },

    /// The helper only works on tensors stored in host memory.
    #[error("{op}: needs a CPU tensor, got one on {location:?}")]
    RequiresCpu {
        /// The operation that was called.
        op: &'static str,
        /// Where the tensor lives.
        location: DeviceLocation,
    },

    /// A tensor that is written shares its storage with another tensor of
    /// the same call. Locking both would deadlock and writing both would
    /// race, so such calls are refused.
    #[error("{op}: {first} and {second} share storage")]
    AliasedStorage {
        /// The operation that was called.
        op: &'static str,
        /// The first tensor, as `list[index]`.
        first: String,
        /// The second tensor, as `list[index]`.
        second: String,
    },

    /// An argument is outside the range the operation accepts.
    #[error("{op}: {reason}")]
    InvalidArgument {
        /// The operation that was called.
        op: &'static str,
        /// What is wrong with the argument.
        reason: String,
    },

    // === CUDA
    /// NVRTC could not compile one of the embedded kernel sources for a
    /// device (the log says why; an unknown `sm_XX` means the installed
    /// NVRTC is older than the GPU).
    #[error("nvrtc: compiling {module}.cu for {arch} failed: {log}")]
    Nvrtc {
        /// The kernel source (`cast`, `unscale`, `optim`).
        module: &'static str,
        /// The target architecture, as `sm_XX`.
        arch: String,
        /// NVRTC's error and compile log.
        log: String,
    },

    /// A CUDA driver call made for an operation failed.
    #[error("{op}: CUDA {call} failed: {message}")]
    Cuda {
        /// The operation that was called.
        op: &'static str,
        /// The driver step that failed (`load_module`, `launch`, `memcpy`, ...).
        call: &'static str,
        /// The driver's error name and description.
        message: String,
    },

    /// A code path needs a cargo feature this build was compiled without.
    #[error("{feature} support was not compiled in (enable the `{feature}` feature)")]
    NotCompiled {
        /// The cargo feature that is missing.
        feature: &'static str,
    },
}

// Debug = Display so that `unwrap()` and `?` in main print the readable message
// instead of a nested struct dump.
impl std::fmt::Debug for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(self, f)
    }
}

/// The result type of accel-kernels.
pub type Result<T> = std::result::Result<T, Error>;
