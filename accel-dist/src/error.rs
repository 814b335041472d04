//! The one error type of accel-dist.

/// Everything that can go wrong in a collective, the rendezvous or the launcher.
#[derive(thiserror::Error)]
pub enum Error {
    /// A tensor operation failed inside candle.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    /// An environment variable holds a value that cannot be used.
    #[error("environment variable {var}={value:?}: {reason}")]
    Env {
        /// The variable name.
        var: &'static str,
        /// Its value.
        value: String,
        /// Why it is rejected.
        reason: String,
    },
}

impl std::fmt::Debug for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(self, f)
    }
}

/// The result type of accel-dist.
pub type Result<T> = std::result::Result<T, Error>;
