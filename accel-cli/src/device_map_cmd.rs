//! `accel device-map`: plan a device map from a model tree and a memory budget.

use std::path::{Path, PathBuf};

use accel_core::bigmodel::CheckpointSource;
use accel_core::bigmodel::{
    compute_module_sizes, get_max_layer_size, infer_auto_device_map, DTypeName, MemorySize,
    ModuleTree, Placement, PlanOptions, SpecialDtypes,
};
use accel_core::models::AutoModel;
use accel_core::nn::Model;
use candle_core::DType;
use serde_json::json;

use accel_core::{Error, Result};

/// Flags of `accel device-map`.
#[derive(Debug, Clone, clap::Args)]
pub struct DeviceMapArgs {
    /// Model tree JSON (the format of accel-bigmodel/tests/data/device_map_cases.md: an object
    /// with `modules`, `parameters`, `buffers`, `tied`, or a case holding one under `model_tree`).
    #[arg(
        long,
        required_unless_present = "checkpoint",
        conflicts_with = "checkpoint"
    )]
    pub model_tree: Option<PathBuf>,
    /// Plan straight from a safetensors checkpoint (file, index or folder),
    /// reading no tensor data: a folder with the `config.json` of an
    /// architecture accel-models builds (Llama, Mistral, Qwen2, Qwen3, Phi-3, Mixtral, Qwen3-MoE, Gemma 3, GPT-2, BERT) is
    /// planned over that model's own module tree, as Accelerate plans the
    /// transformers model; anything else from the headers alone.
    #[arg(long)]
    pub checkpoint: Option<PathBuf>,
    /// Budget per device, e.g. `0=10GiB,1=10GiB,cpu=64GB,disk=1TB` (GPU ordinals, `cpu`, `disk`).
    #[arg(long, value_delimiter = ',', required = true)]
    pub max_memory: Vec<String>,
    /// Module classes that must stay on one device (repeatable).
    #[arg(long = "no-split")]
    pub no_split: Vec<String>,
    /// Size floating-point weights as this torch dtype (e.g. `float16`).
    #[arg(long)]
    pub dtype: Option<String>,
    /// `NAME=DTYPE` for a parameter kept in another dtype (repeatable).
    #[arg(long = "special-dtype")]
    pub special_dtype: Vec<String>,
    /// Let buffers of offloaded modules go to the CPU too.
    #[arg(long)]
    pub offload_buffers: bool,
    /// Try smaller modules when the next one does not fit a GPU.
    #[arg(long)]
    pub fallback_allocation: bool,
    /// Keep every module in the map instead of merging children placed alike.
    #[arg(long)]
    pub no_clean: bool,
}

fn config_err(key: &str, reason: impl std::fmt::Display) -> Error {
    Error::Config {
        key: key.into(),
        reason: reason.to_string(),
    }
}

/// Parses `KEY=VALUE` pairs of `--max-memory`; a value of digits is bytes.
fn parse_max_memory(items: &[String]) -> Result<Vec<(Placement, MemorySize)>> {
    items
        .iter()
        .map(|item| {
            let (k, v) = item.split_once('=').ok_or_else(|| {
                config_err("--max-memory", format!("{item:?} is not DEVICE=SIZE"))
            })?;
            let placement = Placement::parse_key(k.trim())?;
            let v = v.trim();
            let size = match v.parse::<i64>() {
                Ok(n) => MemorySize::from(n),
                Err(_) => MemorySize::from(v),
            };
            Ok((placement, size))
        })
        .collect()
}

/// Reads a model tree JSON file (or a planning case holding one under `model_tree`).
pub fn read_model_tree(path: &std::path::Path) -> Result<ModuleTree> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::io("reading", path, e))?;
    let json_err = |reason: String| Error::Json {
        path: path.to_path_buf(),
        reason,
    };
    let value: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| json_err(e.to_string()))?;
    let tree_json = value.get("model_tree").unwrap_or(&value);
    ModuleTree::from_spec_json(tree_json).map_err(|e| json_err(e.to_string()))
}

/// The module tree of a checkpoint: for a folder whose `config.json` names an
/// architecture accel-models builds, the model's own (its module order,
/// layer classes for `--no-split`, tied weights and buffers: what Accelerate
/// plans over for the transformers model); otherwise the safetensors
/// headers', which know neither module order nor classes. Says on stderr
/// which one it planned over.
fn checkpoint_tree(ckpt: &Path) -> Result<ModuleTree> {
    let config = ckpt.join("config.json");
    if ckpt.is_dir() && config.is_file() {
        match model_tree(ckpt) {
            Ok(tree) => {
                eprintln!(
                    "accel device-map: planning over the model's own module tree ({})",
                    config.display()
                );
                return Ok(tree);
            }
            Err(e) => eprintln!(
                "accel device-map: {e}; planning from the safetensors headers \
                 (module order and classes unknown)"
            ),
        }
    }
    Ok(ModuleTree::from_safetensors(ckpt)?)
}

/// The empty model of a checkpoint folder, in the dtype its floating-point
/// weights are stored in, as a module tree.
fn model_tree(dir: &Path) -> Result<ModuleTree> {
    let source = CheckpointSource::open(dir)?;
    let stored = source
        .names()
        .filter_map(|n| source.locate(n).and_then(|at| at.dtype()))
        .find(|d| d.is_float())
        .unwrap_or(DType::F32);
    drop(source);
    let model = AutoModel::empty(dir, stored)?;
    Ok(model.tree(None)?)
}

/// Runs the plan and returns `{"module_sizes", "max_layer", "device_map", "warnings", "logs"}`.
pub fn device_map(args: &DeviceMapArgs) -> Result<serde_json::Value> {
    let tree = match (&args.model_tree, &args.checkpoint) {
        (Some(path), _) => read_model_tree(path)?,
        (None, Some(ckpt)) => checkpoint_tree(ckpt)?,
        (None, None) => {
            return Err(config_err(
                "--model-tree",
                "give --model-tree or --checkpoint",
            ))
        }
    };
    let dtype = args.dtype.as_deref().map(DTypeName::parse).transpose()?;
    let mut special = SpecialDtypes::new();
    for item in &args.special_dtype {
        let (name, d) = item
            .split_once('=')
            .ok_or_else(|| config_err("--special-dtype", format!("{item:?} is not NAME=DTYPE")))?;
        special.insert(name.to_string(), DTypeName::parse(d)?);
    }
    let special = (!special.is_empty()).then_some(special);
    let options = PlanOptions::new(parse_max_memory(&args.max_memory)?)
        .with_no_split_module_classes(args.no_split.clone())
        .with_dtype(dtype)
        .with_special_dtypes(special.clone())
        .with_offload_buffers(args.offload_buffers)
        .with_fallback_allocation(args.fallback_allocation)
        .with_clean_result(!args.no_clean);
    let sizes = compute_module_sizes(&tree, dtype, special.as_ref());
    let max_layer = get_max_layer_size(&tree, &tree.root_items(), &sizes, &args.no_split);
    let plan = infer_auto_device_map(&tree, &options)?;
    Ok(json!({
        "module_sizes": sizes,
        "max_layer": { "size": max_layer.size, "names": max_layer.names },
        "device_map": plan.device_map,
        "warnings": plan.warnings,
        "logs": plan.logs,
    }))
}
