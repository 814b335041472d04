//! The one error type of accel-core, with the context a user needs to act on it.

use std::path::PathBuf;

/// Everything that can go wrong in accel-core.
///
/// Variants carry the file, tensor, key or step at fault so the message alone
/// tells the user what to fix.
#[derive(thiserror::Error)]
pub enum Error {
    // === wrapped errors from lower layers ===
    /// A tensor operation failed inside candle.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    /// A fused kernel failed.
    #[error(transparent)]
    Kernels(#[from] accel_kernels::Error),
    /// A collective or launcher error.
    #[error(transparent)]
    Dist(#[from] accel_dist::Error),
    /// A planning, loading or offload error.
    #[error(transparent)]
    Bigmodel(#[from] accel_bigmodel::Error),
    /// A layer, block or hook error (boxed: it can carry a big-model error).
    #[error(transparent)]
    Nn(Box<accel_nn::Error>),
    /// A model architecture, config or checkpoint-folder error (boxed as `Nn`).
    #[error(transparent)]
    Models(Box<accel_models::Error>),

    // === files and formats ===
    /// A dataset file that cannot be used: a bad line (`line`, 1-based), or
    /// the whole file (`line` 0: empty, too short for a window).
    #[error("{}{}: {reason}", path.display(), if *line > 0 { format!(", line {line}") } else { String::new() })]
    Dataset {
        /// The file.
        path: PathBuf,
        /// The line at fault, from 1; 0 for the file as a whole.
        line: usize,
        /// What is wrong.
        reason: String,
    },
    /// Reading or writing a file failed.
    #[error("{op} {}: {source}", path.display())]
    Io {
        /// What was being done ("reading", "writing", "renaming", ...).
        op: &'static str,
        /// The file or folder at fault.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// A safetensors file could not be parsed or written.
    #[error("{}: invalid safetensors file: {reason}", path.display())]
    Safetensors {
        /// The file at fault.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// A JSON file could not be parsed or written.
    #[error("{}: invalid JSON: {reason}", path.display())]
    Json {
        /// The file at fault.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// A YAML file (Accelerate's `default_config.yaml`) could not be parsed or written.
    #[error("{}: invalid YAML: {reason}", path.display())]
    Yaml {
        /// The file at fault.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// A checkpoint file the loader needs is not there.
    #[error("{}: missing checkpoint file ({what})", path.display())]
    MissingFile {
        /// The expected path.
        path: PathBuf,
        /// What the file should have held.
        what: String,
    },
    /// A tensor in a file does not have the shape the model expects.
    #[error("{}: tensor `{tensor}` has shape {got:?}, expected {expected:?}", path.display())]
    ShapeMismatch {
        /// The file holding the tensor.
        path: PathBuf,
        /// The tensor name.
        tensor: String,
        /// The shape the model wants.
        expected: Vec<usize>,
        /// The shape in the file.
        got: Vec<usize>,
    },
    /// A tensor in a file does not have the dtype the model expects.
    #[error("{}: tensor `{tensor}` has dtype {got:?}, expected {expected:?}", path.display())]
    DtypeMismatch {
        /// The file holding the tensor.
        path: PathBuf,
        /// The tensor name.
        tensor: String,
        /// The dtype the model wants.
        expected: candle_core::DType,
        /// The dtype in the file.
        got: candle_core::DType,
    },
    /// A file lacks tensors the model has, or has tensors the model lacks.
    #[error("{}: keys do not match the model: missing {missing:?}, unexpected {unexpected:?}", path.display())]
    KeyMismatch {
        /// The file at fault.
        path: PathBuf,
        /// Names the model has and the file lacks.
        missing: Vec<String>,
        /// Names the file has and the model lacks.
        unexpected: Vec<String>,
    },

    // === configuration and usage ===
    /// A setting has a value the Accelerator cannot use.
    #[error("invalid configuration `{key}`: {reason}")]
    Config {
        /// The setting at fault.
        key: String,
        /// Why it is rejected.
        reason: String,
    },
    /// An API was used in an order or a way it does not support.
    #[error("{0}")]
    Usage(String),
    /// Training stopped on a termination signal after saving a checkpoint
    /// (see `Accelerator::should_stop`); a process should exit with
    /// `accel_dist::signals::TERMINATED_STATUS`.
    #[error("stopped by a termination signal after step {step}; saved {} (resume from it)", checkpoint.display())]
    Stopped {
        /// The last optimizer step taken.
        step: u64,
        /// The checkpoint written.
        checkpoint: std::path::PathBuf,
    },
    /// Trainable parameters received no gradient in the first backward at
    /// more than one rank (PyTorch DDP's unused-parameter error).
    #[error("rank {rank}: {report}")]
    UnusedParameters {
        /// The rank reporting.
        rank: usize,
        /// Which parameters, and how to accept or freeze them.
        report: String,
    },

    // === tracking servers ===
    /// An experiment-tracking server (MLflow) could not be reached at
    /// start-up, or refused a request: the message names the server, the run
    /// when there is one, and what was sent (the metric, the param).
    #[error("{tracker} server {uri}{}: {reason}", run.as_ref().map(|r| format!(", run {r}")).unwrap_or_default())]
    TrackerServer {
        /// The tracker (`"mlflow"`).
        tracker: &'static str,
        /// The tracking URI, without credentials.
        uri: String,
        /// The run id, once the run exists.
        run: Option<String>,
        /// What failed: the request, the key, the server's own message.
        reason: String,
    },

    // === other ranks ===
    /// Another rank failed a step every rank takes together (a save, a load);
    /// this rank stops too instead of waiting for it at the next collective.
    #[error("{op}: rank {rank} failed: {reason}")]
    RankFailed {
        /// The step (`"save_state"`, `"load_state"`, ...).
        op: &'static str,
        /// The first rank that failed.
        rank: usize,
        /// Its error, as it printed it.
        reason: String,
    },

    // === resources ===
    /// An allocation did not fit: a device out of memory, or a memory cap the
    /// program set for itself. `find_executable_batch_size` retries smaller.
    #[error("out of memory: {what}")]
    OutOfMemory {
        /// What could not be allocated (e.g. "batch of 128 needs 3.1 GiB, cap 2 GiB").
        what: String,
    },
}

// candle's convention: Debug prints the same text as Display so `main() -> Result`
// and `unwrap()` show the readable message, not a struct dump.
impl std::fmt::Debug for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(self, f)
    }
}

/// The result type of accel-core.
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    /// Wraps an I/O error with the operation and path it came from.
    pub fn io(op: &'static str, path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            op,
            path: path.into(),
            source,
        }
    }
}

/// Returns early with [`Error::Usage`] built from a format string.
#[macro_export]
macro_rules! bail {
    ($($arg:tt)*) => {
        return Err($crate::Error::Usage(format!($($arg)*)))
    };
}

impl From<accel_nn::Error> for Error {
    fn from(e: accel_nn::Error) -> Self {
        Error::Nn(Box::new(e))
    }
}

impl From<accel_models::Error> for Error {
    fn from(e: accel_models::Error) -> Self {
        Error::Models(Box::new(e))
    }
}
