//! The one error type of accel-nn.

/// Everything that can go wrong while building or running accel-nn layers and blocks.
#[derive(thiserror::Error)]
pub enum Error {
    // === tensors ===
    /// A tensor op failed.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),

    /// A fused multi-tensor kernel (casts) failed.
    #[error(transparent)]
    Kernels(#[from] accel_kernels::Error),

    // === hooks ===
    /// Two hooks of one block both wrap its computation (e.g. FSDP and
    /// activation checkpointing, which FSDP already does for its units).
    #[error("block {block:?}: hook {second} cannot be added after {first}: both wrap the forward")]
    HookConflict {
        /// The block.
        block: String,
        /// The hook already attached.
        first: &'static str,
        /// The hook being added.
        second: &'static str,
    },

    // === kernels ===
    /// A kernel path asked for that this CPU does not have.
    #[error("bf16 path {path} is not available on this CPU (it lacks the instructions)")]
    PathUnavailable {
        /// The path's name.
        path: &'static str,
    },

    // === big-model mechanisms (weights handles, planning, loading, offload) ===
    /// A hook, weights handle or offload operation failed.
    #[error(transparent)]
    BigModel(#[from] accel_bigmodel::Error),
}

impl std::fmt::Debug for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(self, f)
    }
}

/// accel-nn's result type.
pub type Result<T> = std::result::Result<T, Error>;
