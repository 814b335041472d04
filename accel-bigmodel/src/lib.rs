//! Model size accounting, device-map planning, checkpoint loading and offload.
//!
//! The planning half mirrors Hugging Face Accelerate 1.15's `accelerate.utils.modeling`:
//! describe a model as a [`ModuleTree`] (from a spec JSON, from checkpoint
//! headers, or by hand), size it with [`compute_module_sizes`], resolve budgets
//! with [`get_max_memory`] / [`get_balanced_memory`], and plan with
//! [`infer_auto_device_map`]. Results, including key order, int-versus-float
//! sizes and warning texts, match Accelerate's.
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
#![forbid(unsafe_code)]

mod bytes;
mod device_map;
mod dtype;
mod error;
mod memory;
mod ordered_map;
mod planner;
mod planner_fallback;
mod sizes;
mod tree;
mod tree_spec;

pub use bytes::Bytes;
pub use device_map::{clean_device_map, DeviceMap, Placement};
pub use dtype::DTypeName;
pub use error::{Error, Result};
pub use memory::{
    convert_file_size_to_int, get_balanced_memory, get_max_memory, parse_max_memory_json,
    MaxMemory, MemorySize,
};
pub use planner::{infer_auto_device_map, Plan, PlanOptions};
pub use sizes::{
    compute_module_sizes, compute_module_total_buffer_size, get_max_layer_size, MaxLayer,
    ModuleSizes, SpecialDtypes,
};
pub use tree::{ModuleId, ModuleInfo, ModuleTree, TensorId, TensorInfo, TensorKind, TreeItem};
