//! The crate's one error type: every variant names the file and the key or
//! tensor a user has to fix.

use std::path::PathBuf;

/// Errors of accel-models.
#[derive(thiserror::Error)]
pub enum Error {
    // === config.json
    /// A file could not be read.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// `config.json` lacks a key the architecture needs.
    #[error("{path}: missing key `{key}`")]
    MissingKey {
        /// The config file.
        path: PathBuf,
        /// The key.
        key: String,
    },
    /// `config.json` is not JSON, or a key holds a value of the wrong type.
    #[error("{path}: {reason}")]
    BadConfig {
        /// The config file.
        path: PathBuf,
        /// What serde reported (it names the key or position).
        reason: String,
    },
    /// A key holds a value the implementation does not support.
    #[error("{path}: key `{key}`: {reason}")]
    Unsupported {
        /// The config file.
        path: PathBuf,
        /// The key.
        key: String,
        /// Why, with the value found.
        reason: String,
    },
    /// `model_type` names an architecture this crate does not implement.
    #[error("{path}: key `model_type`: unknown model type {model_type:?} (known: {known})")]
    UnknownModelType {
        /// The config file.
        path: PathBuf,
        /// The value found.
        model_type: String,
        /// The supported values.
        known: &'static str,
    },

    // === model ids
    /// A model id found neither in the Hugging Face cache nor on the Hub.
    #[error("model `{model}` (revision {revision}): {reason}")]
    ModelNotFound {
        /// The id or path given.
        model: String,
        /// The revision asked for.
        revision: String,
        /// Where it looked and why it failed.
        reason: String,
    },

    // === tokenizer.json
    /// `tokenizer.json` could not be parsed or used.
    #[error("{path}: {reason}")]
    Tokenizer {
        /// The tokenizer file.
        path: PathBuf,
        /// The tokenizers crate's message.
        reason: String,
    },
    /// The tokenizer produces ids the model has no embedding for.
    #[error("{path}: the tokenizer's vocabulary has {tokenizer_vocab} tokens but the model's `vocab_size` is {model_vocab}")]
    VocabMismatch {
        /// The tokenizer file.
        path: PathBuf,
        /// Ids the tokenizer can produce.
        tokenizer_vocab: usize,
        /// `vocab_size` of the model.
        model_vocab: usize,
    },

    // === inputs
    /// A call's arguments do not fit the model (empty prompt, too long, ...).
    #[error("{op}: {reason}")]
    BadInput {
        /// The method.
        op: &'static str,
        /// What is wrong.
        reason: String,
    },

    // === lower crates
    /// From accel-nn (blocks, dispatch); weight errors name tensor and file.
    #[error(transparent)]
    Nn(#[from] accel_nn::Error),
    /// From accel-bigmodel (checkpoints, device maps).
    #[error(transparent)]
    BigModel(#[from] accel_bigmodel::Error),
    /// From candle.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

impl std::fmt::Debug for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(self, f)
    }
}

/// The crate's result type.
pub type Result<T> = std::result::Result<T, Error>;

/// Returns early with [`Error::BadInput`].
macro_rules! bail_input {
    ($op:expr, $($arg:tt)*) => {
        return Err($crate::Error::BadInput { op: $op, reason: format!($($arg)*) })
    };
}
pub(crate) use bail_input;
