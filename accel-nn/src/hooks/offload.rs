//! Offloading a whole model with hooks (the offload half of Accelerate's
//! `big_modeling.py`): `cpu_offload`, `disk_offload`, `cpu_offload_with_hook`.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use accel_bigmodel::offload::OFFLOAD_INDEX_NAME;
use accel_bigmodel::{
    offload_state_dict, CpuWeights, Error as BigModelError, OffloadedWeightsLoader, StagingPool,
    WeightSource,
};
use candle_core::{Device, Tensor};

use super::{add_hook_to_module, AlignDevicesHook, ModelHook, ModuleWeights};
use crate::block::{Activations, Model};
use crate::Result;

fn model_state(model: &dyn Model) -> Vec<(String, Tensor)> {
    model.named_tensors()
}

fn attach_offload(
    model: &dyn Model,
    execution_device: &Device,
    map: Arc<dyn WeightSource>,
) -> Result<()> {
    // One pool for the model: consecutive blocks of one shape read into
    // the same buffers.
    let staging = Arc::new(StagingPool::new());
    for part in model.blocks() {
        let hook = AlignDevicesHook::new(execution_device.clone())
            .with_offload(true)
            .with_weights_map(map.clone())
            .with_staging(staging.clone());
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
    model: &dyn Model,
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
    model: &dyn Model,
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
            return Err(BigModelError::MissingOffloadedWeight {
                name,
                source_desc: offload_dir.display().to_string(),
            }
            .into());
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
    /// [`crate::Error::Candle`] when a copy fails.
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

    fn pre_forward(&mut self, weights: &ModuleWeights, args: Activations) -> Result<Activations> {
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
    model: &dyn Model,
    execution_device: &Device,
    prev: Option<&UserCpuOffloadHook>,
) -> Result<UserCpuOffloadHook> {
    for (i, part) in model.blocks().into_iter().enumerate() {
        let hook = CpuOffloadHook {
            execution_device: execution_device.clone(),
            // Only the first part needs to evict the previous model.
            prev: if i == 0 { prev.cloned() } else { None },
        };
        add_hook_to_module(part, Box::new(hook), true)?;
    }
    Ok(UserCpuOffloadHook {
        weights: model.blocks().iter().map(|p| p.weights().clone()).collect(),
    })
}
