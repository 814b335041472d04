//! The one error type of accel-nn.

/// Everything that can go wrong while building or running accel-nn layers and blocks.
#[derive(thiserror::Error)]
pub enum Error {
    // === tensors ===
    /// A tensor op failed.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),

    // === big-model mechanisms (weights handles, hooks, offload) ===
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
