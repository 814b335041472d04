//! Model size accounting, device-map planning, checkpoint loading and offload.
//!
//! The planning half mirrors Hugging Face Accelerate 1.15's `accelerate.utils.modeling`:
//! describe a model as a [`ModuleTree`] (from a spec JSON, from checkpoint
//! headers, or by hand), size it with [`compute_module_sizes`], resolve budgets
//! with [`get_max_memory`] / [`get_balanced_memory`], and plan with
//! [`infer_auto_device_map`]. Results, including key order, int-versus-float
//! sizes and warning texts, match Accelerate's.
//!
//! The loading half reads safetensors checkpoints: [`ModuleTree::from_safetensors`]
//! describes a checkpoint from its headers alone, [`CheckpointSource`] memory-maps
//! a file or shard set and serves tensors by name (also as a candle
//! `SimpleBackend`), and [`load_checkpoint_in_model`] fills a model's `Var`s,
//! validating everything first. [`init_empty_weights`] builds a candle model of
//! any size without memory for its weights, so it can be planned before loading.
//!
//! ```
//! use accel_bigmodel::{infer_auto_device_map, DTypeName, ModuleTree, Placement, PlanOptions};
//!
//! let tree = ModuleTree::from_tensors([
//!     ("embed.weight", vec![1000, 64], DTypeName::FLOAT32),
//!     ("layers.0.weight", vec![256, 256], DTypeName::FLOAT32),
//!     ("layers.1.weight", vec![256, 256], DTypeName::FLOAT32),
//! ])?;
//! let budget = vec![(Placement::Gpu(0), "600KB".into()), (Placement::Cpu, "1GB".into())];
//! let plan = infer_auto_device_map(&tree, &PlanOptions::new(budget))?;
//! // GPU 0 keeps room for the largest layer, so only the embedding fits there.
//! let placed: Vec<_> = plan.device_map.iter().collect();
//! assert_eq!(placed, [("embed", Placement::Gpu(0)), ("layers", Placement::Cpu)]);
//! # Ok::<(), accel_bigmodel::Error>(())
//! ```
#![warn(missing_docs)]
// Denied rather than forbidden so that `mapped/mod.rs` (memory maps, tensors
// over them and the allocator that frees those) can allow its audited
// `unsafe`; nothing else may use it.
#![deny(unsafe_code)]

mod bytes;
pub mod checkpoint;
mod device_map;
mod dtype;
mod empty;
mod error;
pub mod lora;
pub mod mapped;
mod memory;
pub mod offload;
mod ordered_map;
mod planner;
mod planner_fallback;
pub mod quant;
pub mod safetensors;
mod sizes;
mod tree;
mod tree_safetensors;
mod tree_spec;
mod weights;

pub use bytes::Bytes;
pub use checkpoint::{
    load_checkpoint_in_model, load_checkpoint_in_varmap, CheckpointSource, LoadOptions, LoadReport,
    TensorLocation,
};
pub use device_map::{check_device_map, clean_device_map, DeviceMap, Placement};
pub use dtype::DTypeName;
pub use empty::{init_empty_weights, placeholder, Describer, EmptyTensor, EmptyWeights};
pub use error::{Error, Result};
pub use mapped::{MappedAlloc, MappedStats};
pub use memory::{
    convert_file_size_to_int, get_balanced_memory, get_max_memory, parse_max_memory_json,
    MaxMemory, MemorySize,
};
pub use offload::{
    offload_state_dict, CpuWeights, OffloadedWeightsLoader, StagingPool, StagingStats, WeightSource,
};
pub use planner::{infer_auto_device_map, Plan, PlanOptions};
pub use safetensors::{
    MmapFile, SafetensorsHeader, WeightIndex, SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME,
};
pub use sizes::{
    compute_module_sizes, compute_module_total_buffer_size, get_max_layer_size, MaxLayer,
    ModuleSizes, SpecialDtypes,
};
pub use tree::{ModuleId, ModuleInfo, ModuleTree, TensorId, TensorInfo, TensorKind, TreeItem};
pub use weights::{is_placeholder, ModuleWeights, SlotBackend};

// The unit tests run with tensors over mapped files, as programs that
// install the allocator do.
#[cfg(test)]
#[global_allocator]
static ALLOC: MappedAlloc = MappedAlloc::system();
