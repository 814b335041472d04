//! The one error type of accel-kernels.

/// Everything that can go wrong in a kernel call.
#[derive(thiserror::Error)]
pub enum Error {
    /// A tensor operation failed inside candle.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

impl std::fmt::Debug for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(self, f)
    }
}

/// The result type of accel-kernels.
pub type Result<T> = std::result::Result<T, Error>;
