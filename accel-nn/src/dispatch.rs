//! Placing a model's blocks by a device map (Accelerate's `dispatch_model` and
//! `load_checkpoint_and_dispatch`).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::{DType, Device};
use rayon::prelude::*;

use accel_bigmodel::lora::LoraAdapter;
use accel_bigmodel::offload::OFFLOAD_INDEX_NAME;
use accel_bigmodel::{
    infer_auto_device_map, is_placeholder, offload_state_dict, CheckpointSource, DeviceMap,
    Error as BmError, OffloadedWeightsLoader, Placement, PlanOptions, StagingPool, WeightSource,
};

use crate::block::{AnyBlock, Model};
use crate::hooks::{add_hook_to_module, AlignDevicesHook};
use crate::Result;

/// The optional arguments of [`dispatch_model`].
#[derive(Clone, Default)]
pub struct DispatchOptions {
    /// Where offloaded parts execute; by default the first GPU of the map, else the CPU.
    pub main_device: Option<Device>,
    /// Folder that disk-placed parts are written to when `weights_map` lacks them.
    pub offload_dir: Option<PathBuf>,
    /// Where placeholder weights are read from (e.g. a checkpoint's shards).
    pub weights_map: Option<Arc<dyn WeightSource>>,
}

/// Where [`dispatch_model`] put each part.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DispatchReport {
    /// Part name and placement, in model order.
    pub placements: Vec<(String, Placement)>,
}

impl DispatchReport {
    /// How many parts went to `placement`.
    pub fn count(&self, placement: Placement) -> usize {
        self.placements
            .iter()
            .filter(|(_, p)| *p == placement)
            .count()
    }
}

fn covers(key: &str, name: &str) -> bool {
    key.is_empty() || name == key || name.starts_with(&format!("{key}."))
}

/// The placement of each part, checking that every key names something of the
/// model and that no part is split across devices.
fn part_placements(model: &dyn Model, map: &DeviceMap) -> Result<Vec<(String, Placement)>> {
    let vars = model.named_tensors();
    // Python's maps also place modules that hold only buffers the model
    // recomputes (`model.rotary_emb`): keys naming a module or tensor of the
    // model's tree are known too; they place nothing.
    let mut tree = None;
    for key in map.keys() {
        let known = vars.iter().any(|(n, _)| covers(key, n))
            || model.blocks().iter().any(|p| p.name() == key)
            || {
                let tree = match &tree {
                    Some(t) => t,
                    None => tree.insert(model.tree(None)?),
                };
                tree.module_id(key).is_some() || tree.tensor_id(key).is_some()
            };
        if !known {
            return Err(BmError::InvalidDeviceMap {
                module: key.to_string(),
                reason: "no module or weight of the model has this name".to_string(),
            }
            .into());
        }
    }
    let mut out = Vec::new();
    for part in model.blocks() {
        let prefix = part.name();
        let mut found: Vec<Placement> = map.placement_of(&prefix).into_iter().collect();
        let inner = map
            .iter()
            .filter(|(k, _)| !k.is_empty() && covers(&prefix, k));
        found.extend(inner.map(|(_, p)| p));
        found.dedup();
        match found.as_slice() {
            [p] => out.push((prefix, *p)),
            [] => {
                return Err(BmError::InvalidDeviceMap {
                    module: prefix,
                    reason: "the device map gives this model part no device".to_string(),
                }.into())
            }
            many => {
                return Err(BmError::InvalidDeviceMap {
                    module: prefix,
                    reason: format!("the device map splits this model part across {many:?}; hooks place whole parts"),
                }.into())
            }
        }
    }
    Ok(out)
}

/// candle's device for a GPU ordinal, or an error naming the module placed there.
fn cuda_device(module: &str, ordinal: usize) -> accel_bigmodel::Result<Device> {
    accel_kernels::cuda_device(ordinal).map_err(|e| BmError::DeviceUnavailable {
        module: module.to_string(),
        device: format!("cuda:{ordinal}"),
        reason: e.to_string(),
    })
}

/// Attaches an [`AlignDevicesHook`] to every part as the device map says
/// (Accelerate's `dispatch_model`).
///
/// A GPU part executes on that GPU with its weights moved there once. A
/// `"cpu"` part executes on the CPU when the main device is the CPU;
/// otherwise its weights stay on the CPU and visit the main device per
/// forward. A `"disk"` part executes on the main device and reads its
/// weights per forward from `opts.weights_map` when that holds them (zero
/// copy from a checkpoint), else from `opts.offload_dir`, which is written
/// from the part's current weights unless its index already lists them.
/// A map as Python writes it may also place modules that hold only buffers
/// the model recomputes (`model.rotary_emb`); such keys place nothing.
///
/// # Errors
/// [`accel_bigmodel::Error::InvalidDeviceMap`] naming a key that matches nothing, a part
/// without device or a part split across devices;
/// [`accel_bigmodel::Error::DeviceUnavailable`] for a GPU without CUDA support;
/// [`accel_bigmodel::Error::MissingOffloadFolder`]; [`accel_bigmodel::Error::MissingOffloadedWeight`] naming
/// a tensor neither the map nor the folder holds.
pub fn dispatch_model(
    model: &dyn Model,
    device_map: &DeviceMap,
    opts: &DispatchOptions,
) -> Result<DispatchReport> {
    let placements = part_placements(model, device_map)?;
    let main = match &opts.main_device {
        Some(d) => d.clone(),
        None => match placements.iter().find(|(_, p)| p.is_gpu()) {
            Some((m, Placement::Gpu(i))) => cuda_device(m, *i)?,
            _ => Device::Cpu,
        },
    };
    // Resolve every device before attaching anything, so a bad map changes nothing.
    let mut hooks = Vec::new();
    // One pool for the model: consecutive offloaded blocks of one shape
    // read into the same buffers.
    let staging = Arc::new(StagingPool::new());
    for (part, (name, placement)) in model.blocks().into_iter().zip(&placements) {
        let hook = match placement {
            Placement::Gpu(i) => AlignDevicesHook::new(cuda_device(name, *i)?),
            Placement::Cpu => AlignDevicesHook::new(main.clone()).with_offload(!main.is_cpu()),
            Placement::Disk => AlignDevicesHook::new(main.clone())
                .with_offload(true)
                .with_weights_map(disk_map(part, opts)?),
        };
        let hook = match (&hook.weights_map, &opts.weights_map) {
            (None, Some(map)) => hook.with_weights_map(map.clone()),
            _ => hook,
        };
        hooks.push(hook.with_staging(staging.clone()));
    }
    for (part, hook) in model.blocks().into_iter().zip(hooks) {
        add_hook_to_module(part, Box::new(hook), false)?;
    }
    Ok(DispatchReport { placements })
}

/// The weights map of a disk-placed part: the given map when it holds every
/// weight, else the offload folder (written now if it lacks them).
fn disk_map(part: &dyn AnyBlock, opts: &DispatchOptions) -> Result<Arc<dyn WeightSource>> {
    let names = part.weights().names();
    if let Some(map) = &opts.weights_map {
        if names.iter().all(|n| map.contains(n)) {
            return Ok(map.clone());
        }
    }
    let Some(dir) = &opts.offload_dir else {
        return Err(BmError::MissingOffloadFolder {
            module: part.name(),
        }
        .into());
    };
    let existing = match dir.join(OFFLOAD_INDEX_NAME).is_file() {
        true => Some(OffloadedWeightsLoader::open(dir)?),
        false => None,
    };
    let tensors = part.weights().tensors();
    let missing: Vec<_> = tensors
        .iter()
        .filter(|(n, _)| !existing.as_ref().is_some_and(|l| l.contains(n)))
        .collect();
    if let Some((name, _)) = missing.iter().find(|(_, t)| is_placeholder(t)) {
        return Err(BmError::MissingOffloadedWeight {
            name: name.clone(),
            source_desc: dir.display().to_string(),
        }
        .into());
    }
    offload_state_dict(dir, missing.iter().map(|(n, t)| (n.as_str(), t)))?;
    Ok(Arc::new(OffloadedWeightsLoader::open(dir)?))
}

/// How [`load_checkpoint_and_dispatch`] decides placements.
#[derive(Clone, Debug)]
pub enum DeviceMapChoice {
    /// This map.
    Map(DeviceMap),
    /// Plan with [`infer_auto_device_map`] over the model (Accelerate's `"auto"`).
    Auto(PlanOptions),
}

/// The arguments of [`load_checkpoint_and_dispatch`].
#[derive(Clone, Debug)]
pub struct LoadDispatchOptions {
    /// The device map, or how to plan one.
    pub device_map: DeviceMapChoice,
    /// Convert floating-point weights to this dtype while loading.
    pub dtype: Option<DType>,
    /// Folder for disk parts whose weights cannot be read from the checkpoint.
    pub offload_folder: Option<PathBuf>,
    /// Where offloaded parts execute (see [`DispatchOptions::main_device`]).
    pub main_device: Option<Device>,
    /// A PEFT LoRA adapter folder merged into the weights as they are read
    /// (`PeftModel.from_pretrained(...).merge_and_unload()`).
    pub adapter: Option<PathBuf>,
}

impl LoadDispatchOptions {
    /// Placing by `device_map`, weights kept in the checkpoint's dtype, no
    /// offload folder, the default main device.
    pub fn new(device_map: DeviceMapChoice) -> Self {
        LoadDispatchOptions {
            device_map,
            dtype: None,
            offload_folder: None,
            main_device: None,
            adapter: None,
        }
    }

    /// Sets `offload_folder`.
    pub fn with_offload_folder(mut self, folder: impl Into<PathBuf>) -> Self {
        self.offload_folder = Some(folder.into());
        self
    }
}

/// Loads a safetensors checkpoint into an (empty) hooked model and dispatches
/// it (Accelerate's `load_checkpoint_and_dispatch`).
///
/// GPU and CPU parts are read into memory once; disk parts are never copied:
/// their weights map points into the checkpoint's shards (as Accelerate's
/// does), read with positioned reads per forward, converted to `dtype`.
/// Everything (names, shapes, the device map) is checked before any weight is read.
///
/// # Errors
/// Those of [`CheckpointSource::open`], [`infer_auto_device_map`] and
/// [`dispatch_model`]; [`accel_bigmodel::Error::MissingTensor`] / [`accel_bigmodel::Error::ShapeMismatch`]
/// naming a model weight the checkpoint lacks or holds in another shape.
pub fn load_checkpoint_and_dispatch(
    model: &dyn Model,
    checkpoint: impl AsRef<Path>,
    opts: &LoadDispatchOptions,
) -> Result<DispatchReport> {
    let mut source = CheckpointSource::open(checkpoint.as_ref())?;
    if let Some(dir) = &opts.adapter {
        source = source.with_adapter(std::sync::Arc::new(LoraAdapter::open(dir)?))?;
    }
    let vars = model.named_tensors();
    for (name, var) in &vars {
        let at = source.locate(name).ok_or_else(|| BmError::MissingTensor {
            name: name.clone(),
            checkpoint: source.checkpoint().to_path_buf(),
        })?;
        if at.shape() != var.dims() {
            return Err(BmError::ShapeMismatch {
                path: at.file.to_path_buf(),
                tensor: name.clone(),
                expected: var.dims().to_vec(),
                got: at.shape().to_vec(),
            }
            .into());
        }
    }
    let device_map = match &opts.device_map {
        DeviceMapChoice::Map(m) => m.clone(),
        DeviceMapChoice::Auto(plan) => {
            let tree = model.tree(opts.dtype)?;
            infer_auto_device_map(&tree, plan)?.device_map
        }
    };
    let placements = part_placements(model, &device_map)?;
    let names = vars.iter().map(|(n, _)| n.as_str());
    let loader = Arc::new(OffloadedWeightsLoader::from_checkpoint(
        &source, names, None,
    )?);
    drop(source);
    // Every resident weight is read first, in parallel: each read lands in
    // fresh memory whose pages the kernel faults in and zero-fills, per core
    // (that, not the copy, is most of a load), so two threads halve it. A
    // weight that two parts share (a head tied to the embeddings) is read
    // once per device and dtype, and both parts hold the same tensor, as
    // both modules hold the same parameter in PyTorch.
    let mut reads = Vec::new();
    let mut slots = Vec::new();
    let mut first_read: HashMap<(String, String, DType), usize> = HashMap::new();
    for (part, (name, placement)) in model.blocks().into_iter().zip(&placements) {
        let device = match placement {
            Placement::Gpu(i) => cuda_device(name, *i)?,
            _ => Device::Cpu,
        };
        for (n, t) in part.weights().tensors() {
            let dtype = opts
                .dtype
                .filter(|_| t.dtype().is_float())
                .unwrap_or(t.dtype());
            let read = match placement {
                Placement::Disk => {
                    let empty = accel_bigmodel::placeholder(t.shape().clone(), dtype, &device)?;
                    reads.push((n.clone(), device.clone(), dtype, Some(empty)));
                    reads.len() - 1
                }
                _ => {
                    let key = (n.clone(), format!("{:?}", device.location()), dtype);
                    *first_read.entry(key).or_insert_with(|| {
                        reads.push((n.clone(), device.clone(), dtype, None));
                        reads.len() - 1
                    })
                }
            };
            slots.push((part.weights(), n, read));
        }
    }
    let values = reads
        .par_iter()
        .map(|(n, device, dtype, value)| match value {
            Some(placeholder) => Ok(placeholder.clone()),
            None => Ok(accel_bigmodel::checkpoint::convert(
                loader.load(n, device)?,
                *dtype,
            )?),
        })
        .collect::<Result<Vec<_>>>()?;
    for (weights, n, read) in slots {
        weights.set(&n, values[read].clone())?;
    }
    let dispatch = DispatchOptions {
        main_device: opts.main_device.clone(),
        offload_dir: opts.offload_folder.clone(),
        weights_map: Some(loader),
    };
    dispatch_model(model, &device_map, &dispatch)
}

#[cfg(test)]
#[path = "dispatch_tests.rs"]
mod tests;
