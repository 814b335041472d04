//! The one error type of accel-bigmodel.

use std::path::PathBuf;

/// Everything that can go wrong while describing a model, planning where it goes
/// or loading its checkpoint.
///
/// Where Accelerate raises for the same input, the message says what Accelerate
/// says (and, for Python-level failures such as `KeyError`, which exception it
/// raises), so a user porting a script recognises the failure.
#[derive(thiserror::Error)]
pub enum Error {
    // === model trees ===
    /// A model-tree description (spec JSON) is malformed.
    #[error("model tree: {field}: {reason}")]
    InvalidSpec {
        /// The JSON field at fault, e.g. `parameters[3].shape`.
        field: String,
        /// What is wrong with it.
        reason: String,
    },

    /// A module or tensor name is registered twice, or used for both a module and a tensor.
    #[error("model tree: name {name:?} is already registered")]
    DuplicateName {
        /// The name at fault.
        name: String,
    },

    /// A module that the tree does not have: the parent of a new tensor or module, or a lookup.
    #[error("model tree: module {module:?} (needed for {name:?}) is not in the tree")]
    UnknownModule {
        /// The tensor or module being added, or the operation that looked the module up.
        name: String,
        /// The missing parent module.
        module: String,
    },

    /// A name that should be a parameter of the tree is not.
    #[error("{op}: {name:?} is not a parameter of the model")]
    UnknownParameter {
        /// The operation that looked the name up.
        op: &'static str,
        /// The name at fault.
        name: String,
    },

    /// Parameters declared as tied (one storage) differ in shape or dtype.
    #[error("tie: {first:?} and {other:?} cannot share storage: {reason}")]
    TiedMismatch {
        /// The first parameter of the group.
        first: String,
        /// The parameter that differs from it.
        other: String,
        /// Shapes or dtypes, as found.
        reason: String,
    },

    /// A dtype name that torch does not have (`getattr(torch, name)` fails in Accelerate).
    #[error("dtype {dtype:?}: module 'torch' has no attribute '{dtype}'")]
    UnknownDtype {
        /// The name as given.
        dtype: String,
    },

    /// A candle or safetensors dtype with no torch counterpart.
    #[error("dtype {dtype}: no torch dtype has this layout")]
    NoTorchDtype {
        /// The dtype as the source library prints it.
        dtype: String,
    },

    // === memory budgets ===
    /// A memory size string that `convert_file_size_to_int` rejects.
    #[error(
        "`size` {size} is not in a valid format. Use an integer for bytes, or a string with an unit (like '5.0GB')."
    )]
    InvalidSize {
        /// The size string as given.
        size: String,
    },

    /// A size string whose number is infinite (`"infGB"`, `"1e400KB"`); Accelerate
    /// lets Python's `OverflowError` through instead of its own message.
    #[error("`size` {size}: OverflowError: cannot convert float infinity to integer")]
    SizeOverflow {
        /// The size string as given.
        size: String,
    },

    /// A `max_memory` key that is neither a GPU ordinal nor `cpu`/`disk`.
    #[error("Device {device} is not recognized, available devices are integers(for GPU/XPU), 'mps', 'cpu' and 'disk'")]
    UnrecognizedDevice {
        /// The key as given.
        device: String,
    },

    /// A device key that `torch.device` rejects; `get_balanced_memory` resolves
    /// every non-integer key through it, so a `disk` key makes Accelerate raise.
    #[error("{op}: RuntimeError: Expected one of cpu, cuda, ipu, xpu, mkldnn, opengl, opencl, ideep, hip, ve, fpga, maia, xla, lazy, vulkan, mps, meta, hpu, mtia, privateuseone device type at start of device string: {device}")]
    NotATorchDevice {
        /// The operation that resolved the key.
        op: &'static str,
        /// The key at fault.
        device: String,
    },

    /// An operation indexes GPUs `0..n` of `max_memory` and one is missing (a `KeyError` in Accelerate).
    #[error("{op}: KeyError: {gpu} (max_memory has no GPU {gpu}; {reason})")]
    MissingGpu {
        /// The operation at fault.
        op: &'static str,
        /// The GPU ordinal it looked for.
        gpu: usize,
        /// Why the operation needs it.
        reason: &'static str,
    },

    // === device-map planning ===
    /// A tied parameter lies in no module still waiting to be placed, so Accelerate's
    /// lookup of its module fails with `IndexError: list index out of range`.
    #[error("{op}: IndexError: list index out of range (tied parameter {param:?} is not inside any module left to place)")]
    TiedParameterNotQueued {
        /// The planner step at fault.
        op: &'static str,
        /// The tied parameter whose module was not found.
        param: String,
    },

    /// The fallback search got a fractional size limit; Accelerate passes it to
    /// `convert_file_size_to_int`, which raises `AttributeError` on a float.
    #[error("fallback_allocate: AttributeError: 'float' object has no attribute 'upper' (size limit {limit} is fractional)")]
    FractionalSizeLimit {
        /// The limit, as Python prints it.
        limit: String,
    },

    // === device maps ===
    /// A device-map value that is neither a GPU ordinal nor `cpu`/`disk`.
    #[error(
        "device map: {value} is not a placement (expected a GPU ordinal, \"cpu\" or \"disk\")"
    )]
    InvalidPlacement {
        /// The value as given.
        value: String,
    },

    /// Tensors of the model that no device-map entry covers (Accelerate's `check_device_map`).
    #[error("The device_map provided does not give any device for the following parameters: {}", tensors.join(", "))]
    UncoveredTensors {
        /// State-dict names left without a device, in state-dict order.
        tensors: Vec<String>,
    },

    // === checkpoint files ===
    /// Reading a file failed.
    #[error("{op} {}: {source}", path.display())]
    Io {
        /// What was being done ("reading", "memory-mapping", ...).
        op: &'static str,
        /// The file at fault.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },

    /// A checkpoint file the loader needs is not there.
    #[error("{}: missing checkpoint file ({what})", path.display())]
    MissingFile {
        /// The expected path.
        path: PathBuf,
        /// What the file should have held (and who asked for it, e.g. the index).
        what: String,
    },

    /// A safetensors file is damaged or disagrees with its index: the reason names
    /// the tensor and byte offsets where there are some.
    #[error("{}: invalid safetensors file: {reason}", path.display())]
    Safetensors {
        /// The file at fault.
        path: PathBuf,
        /// The tensor at fault, when one is.
        tensor: Option<String>,
        /// What is wrong, e.g. "tensor `w` data ends at byte 400 but the file has 320".
        reason: String,
    },

    /// A `*.safetensors.index.json` file is unreadable or malformed.
    #[error("{}: invalid checkpoint index: {reason}", path.display())]
    BadIndex {
        /// The index file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },

    /// A checkpoint path that is neither a safetensors file, an index, nor a
    /// folder holding exactly one of those.
    #[error("{}: {reason}", path.display())]
    InvalidCheckpoint {
        /// The path as given.
        path: PathBuf,
        /// Why it cannot be loaded.
        reason: String,
    },

    /// A tensor the caller asked for is not in the checkpoint.
    #[error("{}: no tensor named `{name}` in this checkpoint", checkpoint.display())]
    MissingTensor {
        /// The tensor name.
        name: String,
        /// The checkpoint (file, index or folder) that was searched.
        checkpoint: PathBuf,
    },

    // === loading into a model ===
    /// The checkpoint's names and the model's differ (strict loading); lists all of them.
    #[error("{}: checkpoint does not match the model: {} missing key(s) {missing:?}, {} unexpected key(s) {unexpected:?}", checkpoint.display(), missing.len(), unexpected.len())]
    KeyMismatch {
        /// The checkpoint as given.
        checkpoint: PathBuf,
        /// Names the model has and the checkpoint lacks, sorted.
        missing: Vec<String>,
        /// Names the checkpoint has and the model lacks, sorted.
        unexpected: Vec<String>,
    },

    /// A checkpoint tensor does not have the shape the model expects.
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

    /// A model `Var` has a dtype other than the one the load options ask for; candle
    /// `Var`s cannot change dtype, so the model must be built in the dtype it loads.
    #[error("load_checkpoint_in_model: `{tensor}` is a {got:?} Var but {rule} asks for {expected:?}; build the model in the dtype you load")]
    VarDtypeMismatch {
        /// The tensor name.
        tensor: String,
        /// The dtype the options ask for.
        expected: candle_core::DType,
        /// The Var's dtype.
        got: candle_core::DType,
        /// Which option decided `expected` (`LoadOptions::dtype` or `keep_in_fp32_modules`).
        rule: &'static str,
    },

    /// A model `Var` cannot be written in place because it is a strided view.
    #[error(
        "load_checkpoint_in_model: Var `{tensor}` is not contiguous, so it cannot be set in place"
    )]
    NonContiguousVar {
        /// The tensor name.
        tensor: String,
    },

    // === hooks, offload and dispatch ===
    /// A device map that cannot be applied to a hooked model: an entry naming
    /// no module of it, a model part left without a device, or a part split
    /// across devices.
    #[error("device map: module {module:?}: {reason}")]
    InvalidDeviceMap {
        /// The module (device-map key or model part) at fault.
        module: String,
        /// What is wrong.
        reason: String,
    },

    /// A module is placed on a device this build or machine cannot execute on.
    #[error("module {module:?}: cannot execute on {device}: {reason}")]
    DeviceUnavailable {
        /// The module placed there.
        module: String,
        /// The device as the device map names it (`cuda:0`).
        device: String,
        /// Why it is unavailable (candle's message).
        reason: String,
    },

    /// A module is placed on disk but nothing says where its weights live.
    #[error(
        "module {module:?} is placed on disk but no offload folder (or weights map) was given"
    )]
    MissingOffloadFolder {
        /// The module placed on disk.
        module: String,
    },

    /// A weight a hook needs is not in its weights map (offload folder, CPU map or checkpoint).
    #[error("{source_desc}: no offloaded weight `{name}`")]
    MissingOffloadedWeight {
        /// The tensor name.
        name: String,
        /// The weights map searched (an offload folder's path, "CPU weights map", ...).
        source_desc: String,
    },

    /// A tensor handed to a hooked module's weights has the wrong shape.
    #[error("module {module:?}: weight `{tensor}` has shape {got:?}, expected {expected:?}")]
    WeightShapeMismatch {
        /// The hooked module.
        module: String,
        /// The tensor name.
        tensor: String,
        /// The shape the module was built with.
        expected: Vec<usize>,
        /// The shape handed in.
        got: Vec<usize>,
    },

    /// A weight name that the hooked module does not hold.
    #[error("module {module:?} has no weight `{tensor}`")]
    UnknownWeight {
        /// The hooked module.
        module: String,
        /// The tensor name asked for.
        tensor: String,
    },

    /// An offload folder's `index.json` is malformed or names a dtype this crate cannot read.
    #[error("{}: invalid offload index: `{key}`: {reason}", path.display())]
    BadOffloadIndex {
        /// The index file.
        path: PathBuf,
        /// The entry at fault.
        key: String,
        /// What is wrong with it.
        reason: String,
    },

    // === quantized weights ===
    /// A quantization setting that does not exist or cannot run here.
    #[error("quantization: {key}: {reason}")]
    BadQuantConfig {
        /// The setting (flag, or file and key).
        key: String,
        /// What is wrong with it.
        reason: String,
    },

    /// A quantized weight's stored state disagrees with itself or the model.
    #[error("quantized weight `{tensor}`: {reason}")]
    BadQuantState {
        /// The tensor at fault.
        tensor: String,
        /// What is wrong with it.
        reason: String,
    },

    // === wrapped errors from lower layers ===
    /// A tensor operation failed inside candle.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),

    /// A fused conversion kernel failed.
    #[error(transparent)]
    Kernels(#[from] accel_kernels::Error),

    /// Reading or writing JSON failed.
    #[error(transparent)]
    Json(#[from] serde_json::Error),
}

// Debug prints the same text as Display (as candle does), so `?` in tests and
// `unwrap()` show a readable message instead of a struct dump.
impl std::fmt::Debug for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(self, f)
    }
}

impl Error {
    /// Wraps an I/O error with the operation and path it came from.
    pub(crate) fn io(op: &'static str, path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            op,
            path: path.into(),
            source,
        }
    }
}

/// The result type of accel-bigmodel.
pub type Result<T> = std::result::Result<T, Error>;

/// Returns early with an [`Error::InvalidSpec`] built from a field and a formatted reason.
macro_rules! bail_spec {
    ($field:expr, $($arg:tt)*) => {
        return Err($crate::Error::InvalidSpec {
            field: ($field).to_string(),
            reason: format!($($arg)*),
        })
    };
}
pub(crate) use bail_spec;
