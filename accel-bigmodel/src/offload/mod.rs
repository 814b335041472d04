//! Where offloaded weights live between forwards (Accelerate's `utils/offload.py`
//! and the offload half of `big_modeling.py`): the [`WeightSource`] seam, a CPU
//! map, the disk folder format, and `cpu_offload` / `disk_offload`.

mod disk;

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use candle_core::{Device, Tensor};

pub use disk::{
    dtype_from_numpy, numpy_dtype_name, offload_state_dict, offload_weight, save_offload_index,
    OffloadEntry, OffloadedWeightsLoader, OFFLOAD_INDEX_NAME,
};

use crate::checkpoint::CheckpointSource;
use crate::error::{Error, Result};
use crate::hooks::{add_hook_to_module, AlignDevicesHook, HookedModel, ModelHook, ModuleWeights};

/// A map from tensor names to weights that hooks materialise from
/// (Accelerate's `weights_map`): CPU tensors, an offload folder, a checkpoint.
pub trait WeightSource: Send + Sync {
    /// Names the source in error messages (a folder path, "CPU weights").
    fn describe(&self) -> String;

    /// Whether the source holds `name`.
    fn contains(&self, name: &str) -> bool;

    /// Materialises `name` on `device`, in the dtype it is stored in.
    ///
    /// # Errors
    /// [`Error::MissingOffloadedWeight`] (or the source's own missing-tensor
    /// error) naming the tensor, I/O and device errors.
    fn load(&self, name: &str, device: &Device) -> Result<Tensor>;
}

/// Weights kept in host memory (the `weights_map` of Accelerate's `cpu_offload`).
#[derive(Clone, Debug, Default)]
pub struct CpuWeights {
    tensors: BTreeMap<String, Tensor>,
}

impl CpuWeights {
    /// A map over `tensors`, each moved to the CPU (a cheap clone when already there).
    ///
    /// # Errors
    /// [`Error::Candle`] when a device copy fails.
    pub fn new(tensors: impl IntoIterator<Item = (String, Tensor)>) -> Result<Self> {
        let tensors = tensors
            .into_iter()
            .map(|(n, t)| Ok((n, t.to_device(&Device::Cpu)?)))
            .collect::<Result<_>>()?;
        Ok(CpuWeights { tensors })
    }

    /// The tensors.
    pub fn tensors(&self) -> &BTreeMap<String, Tensor> {
        &self.tensors
    }
}

impl WeightSource for CpuWeights {
    fn describe(&self) -> String {
        "CPU weights map".to_string()
    }

    fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    fn load(&self, name: &str, device: &Device) -> Result<Tensor> {
        let t = self
            .tensors
            .get(name)
            .ok_or_else(|| Error::MissingOffloadedWeight {
                name: name.to_string(),
                source_desc: self.describe(),
            })?;
        Ok(t.to_device(device)?)
    }
}

/// A memory-mapped checkpoint as a weights map: each load copies the tensor
/// out of the mapping (whose pages then count as resident until the OS drops
/// them; [`OffloadedWeightsLoader::from_checkpoint`] reads without mapping).
impl WeightSource for CheckpointSource {
    fn describe(&self) -> String {
        self.checkpoint().display().to_string()
    }

    fn contains(&self, name: &str) -> bool {
        CheckpointSource::contains(self, name)
    }

    fn load(&self, name: &str, device: &Device) -> Result<Tensor> {
        self.tensor(name, device, None)
    }
}

fn model_state(model: &HookedModel) -> Vec<(String, Tensor)> {
    model.named_tensors()
}

fn attach_offload(
    model: &mut HookedModel,
    execution_device: &Device,
    map: Arc<dyn WeightSource>,
) -> Result<()> {
    for part in &mut model.parts {
        let hook = AlignDevicesHook::new(execution_device.clone())
            .with_offload(true)
            .with_weights_map(map.clone());
        add_hook_to_module(part, Box::new(hook), true)?;
    }
    Ok(())
}

/// Keeps every weight on the CPU and brings each part's weights to
/// `execution_device` only for its forward (Accelerate's `cpu_offload`).
///
/// `state_dict` replaces the model's own weights as the source when given.
///
/// # Errors
/// Those of attaching the hooks.
pub fn cpu_offload(
    model: &mut HookedModel,
    execution_device: &Device,
    state_dict: Option<BTreeMap<String, Tensor>>,
) -> Result<()> {
    let weights = match state_dict {
        Some(sd) => CpuWeights::new(sd)?,
        None => CpuWeights::new(model_state(model))?,
    };
    attach_offload(model, execution_device, Arc::new(weights))
}

/// Writes the model's weights to `offload_dir` (unless it already holds an
/// `index.json`, as in Accelerate) and serves each part's weights from there
/// for its forward only (Accelerate's `disk_offload`).
///
/// # Errors
/// Those of [`offload_state_dict`], [`OffloadedWeightsLoader::open`] and of
/// attaching the hooks (a weight missing from an existing folder is named).
pub fn disk_offload(
    model: &mut HookedModel,
    offload_dir: &Path,
    execution_device: &Device,
) -> Result<()> {
    if !offload_dir.join(OFFLOAD_INDEX_NAME).is_file() {
        let state = model_state(model);
        offload_state_dict(offload_dir, state.iter().map(|(n, t)| (n.as_str(), t)))?;
    }
    let loader = OffloadedWeightsLoader::open(offload_dir)?;
    for (name, _) in model.named_tensors() {
        if !loader.contains(&name) {
            return Err(Error::MissingOffloadedWeight {
                name,
                source_desc: offload_dir.display().to_string(),
            });
        }
    }
    attach_offload(model, execution_device, Arc::new(loader))
}

/// The handle [`cpu_offload_with_hook`] returns (Accelerate's
/// `UserCpuOffloadHook`): `offload()` sends the model back to the CPU, which
/// the next model of a pipeline does automatically before its own forward.
#[derive(Clone, Debug)]
pub struct UserCpuOffloadHook {
    weights: Vec<ModuleWeights>,
}

impl UserCpuOffloadHook {
    /// Moves every weight of the model back to the CPU.
    ///
    /// # Errors
    /// [`Error::Candle`] when a copy fails.
    pub fn offload(&self) -> Result<()> {
        move_all(&self.weights, &Device::Cpu)
    }

    /// Whether every weight of the model is on the CPU now.
    pub fn is_offloaded(&self) -> bool {
        let mut tensors = self.weights.iter().flat_map(|w| w.tensors());
        tensors.all(|(_, t)| t.device().is_cpu())
    }
}

fn move_all(weights: &[ModuleWeights], device: &Device) -> Result<()> {
    for w in weights {
        for (name, t) in w.tensors() {
            if !t.device().same_device(device) {
                w.set(&name, t.to_device(device)?)?;
            }
        }
    }
    Ok(())
}

/// Accelerate's `CpuOffload` hook: weights on the CPU until the forward, then
/// on the execution device until someone calls `offload()`.
struct CpuOffloadHook {
    execution_device: Device,
    prev: Option<UserCpuOffloadHook>,
}

impl ModelHook for CpuOffloadHook {
    fn init_hook(&mut self, weights: &ModuleWeights) -> Result<()> {
        move_all(std::slice::from_ref(weights), &Device::Cpu)
    }

    fn pre_forward(&mut self, weights: &ModuleWeights, args: Tensor) -> Result<Tensor> {
        if let Some(prev) = &self.prev {
            prev.offload()?;
        }
        move_all(std::slice::from_ref(weights), &self.execution_device)?;
        Ok(args.to_device(&self.execution_device)?)
    }

    fn name(&self) -> &'static str {
        "CpuOffload"
    }
}

/// Offloads `model` to the CPU as a whole and returns a handle to send it back
/// after use (Accelerate's `cpu_offload_with_hook`); unlike [`cpu_offload`],
/// weights stay on the execution device between forwards, which suits a
/// pipeline running one model many times before the next. `prev` is offloaded
/// automatically when this model's first forward starts.
///
/// # Errors
/// Those of attaching the hooks.
pub fn cpu_offload_with_hook(
    model: &mut HookedModel,
    execution_device: &Device,
    prev: Option<&UserCpuOffloadHook>,
) -> Result<UserCpuOffloadHook> {
    for (i, part) in model.parts.iter_mut().enumerate() {
        let hook = CpuOffloadHook {
            execution_device: execution_device.clone(),
            // Only the first part needs to evict the previous model.
            prev: if i == 0 { prev.cloned() } else { None },
        };
        add_hook_to_module(part, Box::new(hook), true)?;
    }
    Ok(UserCpuOffloadHook {
        weights: model.parts.iter().map(|p| p.weights().clone()).collect(),
    })
}
