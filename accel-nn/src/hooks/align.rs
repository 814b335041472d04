//! [`AlignDevicesHook`]: weights and inputs on the execution device for the
//! forward, offloaded weights released again after it.

use std::collections::BTreeMap;
use std::sync::Arc;

use accel_bigmodel::{is_placeholder, CpuWeights, Error as BigModelError, WeightSource};
use candle_core::{Device, Tensor};

use super::{ModelHook, ModuleWeights};
use crate::block::Activations;
use crate::Result;

/// Accelerate's `AlignDevicesHook`.
///
/// Without `offload`, attaching moves the module's weights to
/// `execution_device` once (placeholders are filled from `weights_map`).
/// With `offload`, the weights are placeholders between forwards:
/// `pre_forward` materialises each one from `weights_map` on the execution
/// device (converted to the dtype the module holds), `post_forward` replaces it
/// by a one-element placeholder again, so its memory is freed. Without a
/// `weights_map`, attaching keeps the module's current weights on the CPU as
/// the map (what `cpu_offload` does).
pub struct AlignDevicesHook {
    /// Where the forward runs.
    pub execution_device: Device,
    /// Keep weights off the execution device between forwards.
    pub offload: bool,
    /// Move the output back to the device the input came from.
    pub io_same_device: bool,
    /// Where offloaded weights are read from.
    pub weights_map: Option<Arc<dyn WeightSource>>,
    /// Accelerate's flag for offloading buffers with parameters. Modules built
    /// from a `VarBuilder` have no separate buffers (every weight is a `Var`),
    /// so all weights follow `offload` whatever this says; it is kept so
    /// ported calls read the same.
    pub offload_buffers: bool,
    /// Handle the weights of submodules too (`true`), or only the module's
    /// direct weights (`false`: names with no further dot after the prefix).
    pub place_submodules: bool,
    input_device: Option<Device>,
    // Devices the weights were on before `init_hook`, restored by `detach_hook`.
    original_devices: BTreeMap<String, Device>,
}

impl AlignDevicesHook {
    /// A hook executing on `execution_device`, without offload.
    pub fn new(execution_device: Device) -> Self {
        AlignDevicesHook {
            execution_device,
            offload: false,
            io_same_device: false,
            weights_map: None,
            offload_buffers: false,
            place_submodules: true,
            input_device: None,
            original_devices: BTreeMap::new(),
        }
    }

    /// Sets `offload`.
    pub fn with_offload(mut self, offload: bool) -> Self {
        self.offload = offload;
        self
    }

    /// Sets `io_same_device`.
    pub fn with_io_same_device(mut self, io_same_device: bool) -> Self {
        self.io_same_device = io_same_device;
        self
    }

    /// Sets `weights_map`.
    pub fn with_weights_map(mut self, weights_map: Arc<dyn WeightSource>) -> Self {
        self.weights_map = Some(weights_map);
        self
    }

    /// Sets `offload_buffers`.
    pub fn with_offload_buffers(mut self, offload_buffers: bool) -> Self {
        self.offload_buffers = offload_buffers;
        self
    }

    /// Sets `place_submodules`.
    pub fn with_place_submodules(mut self, place_submodules: bool) -> Self {
        self.place_submodules = place_submodules;
        self
    }

    /// The names this hook manages.
    fn names(&self, weights: &ModuleWeights) -> Vec<String> {
        let prefix = weights.prefix();
        let skip = if prefix.is_empty() {
            0
        } else {
            prefix.len() + 1
        };
        let names = weights.names().into_iter();
        names
            .filter(|n| self.place_submodules || !n[skip.min(n.len())..].contains('.'))
            .collect()
    }

    /// Reads `name` from the weights map onto the execution device, in the dtype of `like`.
    fn materialise(&self, name: &str, like: &Tensor) -> Result<Tensor> {
        let Some(map) = &self.weights_map else {
            return Err(BigModelError::MissingOffloadedWeight {
                name: name.to_string(),
                source_desc: "AlignDevicesHook without weights_map".to_string(),
            }
            .into());
        };
        let t = map.load(name, &self.execution_device)?;
        Ok(accel_bigmodel::checkpoint::convert(t, like.dtype())?)
    }
}

impl ModelHook for AlignDevicesHook {
    fn init_hook(&mut self, weights: &ModuleWeights) -> Result<()> {
        let names = self.names(weights);
        let current: BTreeMap<String, Tensor> = weights.tensors().into_iter().collect();
        for name in &names {
            let t = &current[name];
            if !is_placeholder(t) {
                self.original_devices
                    .insert(name.clone(), t.device().clone());
            }
        }
        if !self.offload {
            for name in &names {
                let t = &current[name];
                let placed = if is_placeholder(t) {
                    self.materialise(name, t)?
                } else {
                    t.to_device(&self.execution_device)?
                };
                weights.set(name, placed)?;
            }
            return Ok(());
        }
        if self.weights_map.is_none() {
            let own = names.iter().map(|n| (n.clone(), current[n].clone()));
            self.weights_map = Some(Arc::new(CpuWeights::new(own)?));
        }
        let map = self.weights_map.as_ref().expect("set above");
        for name in &names {
            if !map.contains(name) {
                return Err(BigModelError::MissingOffloadedWeight {
                    name: name.clone(),
                    source_desc: map.describe(),
                }
                .into());
            }
        }
        for name in &names {
            weights.release(name, &self.execution_device)?;
        }
        Ok(())
    }

    fn pre_forward(&mut self, weights: &ModuleWeights, args: Activations) -> Result<Activations> {
        if self.io_same_device {
            self.input_device = Some(args.device().clone());
        }
        if self.offload {
            for (name, t) in weights.tensors() {
                if self.names_contains(weights, &name) {
                    weights.set(&name, self.materialise(&name, &t)?)?;
                }
            }
        }
        Ok(args.to_device(&self.execution_device)?)
    }

    fn post_forward(&mut self, weights: &ModuleWeights, output: Tensor) -> Result<Tensor> {
        if self.offload {
            for name in self.names(weights) {
                weights.release(&name, &self.execution_device)?;
            }
        }
        match self.input_device.take() {
            Some(device) => Ok(output.to_device(&device)?),
            None => Ok(output),
        }
    }

    fn detach_hook(&mut self, weights: &ModuleWeights) -> Result<()> {
        if !self.offload {
            return Ok(());
        }
        // Bring back the weights that were real before the hook, where they were.
        for (name, device) in std::mem::take(&mut self.original_devices) {
            let like = weights.tensor(&name).expect("names come from the handle");
            let t = self.materialise(&name, &like)?;
            weights.set(&name, t.to_device(&device)?)?;
        }
        Ok(())
    }

    fn offloads(&self) -> bool {
        self.offload
    }

    fn name(&self) -> &'static str {
        "AlignDevicesHook"
    }
}

impl AlignDevicesHook {
    fn names_contains(&self, weights: &ModuleWeights, name: &str) -> bool {
        self.place_submodules || self.names(weights).iter().any(|n| n == name)
    }
}
