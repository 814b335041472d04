//! [`AlignDevicesHook`]: weights and inputs on the execution device for the
//! forward, offloaded weights released again after it.

use std::collections::BTreeMap;
use std::sync::Arc;

use accel_bigmodel::{
    is_placeholder, CpuWeights, Error as BigModelError, StagingPool, WeightSource,
};
use candle_core::{Device, Tensor};
use rayon::prelude::*;

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
///
/// With a [staging pool](AlignDevicesHook::with_staging), weights that the
/// map reads from bytes (disk) are read into recycled buffers instead of
/// fresh allocations, and handed back to the pool after the forward when
/// nothing can still hold them: the forward's output does not track
/// gradients (else the autograd graph holds the weights), the output is no
/// view of a weight, and the weight slot still held the buffer (no later
/// hook swapped it for something it might keep). A buffer failing any of
/// these is left to be freed as before. References that live only during
/// the forward (the built layer, another hook's stash) are harmless: a
/// buffer is overwritten only by a later `pre_forward`.
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
    /// Where buffers for weights read from disk come from, and go back to.
    pub staging: Option<Arc<StagingPool>>,
    input_device: Option<Device>,
    // Pool buffers lent to the module's slots for the running forward.
    lent: Vec<(String, Tensor)>,
    // Whether the running forward's input tracks gradients.
    input_tracked: bool,
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
            staging: None,
            input_device: None,
            lent: Vec::new(),
            input_tracked: false,
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

    /// Sets `staging`: offloaded weights are read into buffers of `pool`,
    /// which the hooks of one model share so that consecutive blocks of one
    /// shape reuse the same memory.
    pub fn with_staging(mut self, pool: Arc<StagingPool>) -> Self {
        self.staging = Some(pool);
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

    /// Materialises every weight this hook manages for a forward: through
    /// pool buffers when there is a pool and the map reads bytes. On the CPU
    /// a buffer itself becomes the weight (and is lent until
    /// `post_forward`); on another device it only stages the copy and goes
    /// straight back.
    fn materialise_for_forward(&mut self, weights: &ModuleWeights) -> Result<()> {
        let todo: Vec<(String, Tensor)> = weights
            .tensors()
            .into_iter()
            .filter(|(name, _)| self.names_contains(weights, name))
            .collect();
        let (Some(pool), Some(map)) = (self.staging.clone(), self.weights_map.clone()) else {
            for (name, like) in &todo {
                weights.set(name, self.materialise(name, like)?)?;
            }
            return Ok(());
        };
        // The reads are copies out of the page cache (and, for the first
        // block, page faults): two threads do them about twice as fast.
        let staged = todo
            .par_iter()
            .map(|(name, like)| map.load_staged(name, like.dims(), like.dtype(), &pool))
            .collect::<accel_bigmodel::Result<Vec<_>>>()?;
        for ((name, like), staged) in todo.iter().zip(staged) {
            let placed = match staged {
                None => self.materialise(name, like)?,
                Some(buf) if self.execution_device.is_cpu() => {
                    self.lent.push((name.clone(), buf.clone()));
                    buf
                }
                Some(buf) => {
                    // The device copy is complete once `to_device` returns
                    // (pageable host memory is staged synchronously), so the
                    // buffer is free again.
                    let placed = buf.to_device(&self.execution_device)?;
                    pool.give_back(vec![buf]);
                    placed
                }
            };
            weights.set(name, placed)?;
        }
        Ok(())
    }

    /// The buffers lent for this forward that nothing can still hold once
    /// the weights are released (see the type's docs); the others are
    /// dropped here and freed when their last holder goes.
    fn reusable_lent(&mut self, weights: &ModuleWeights, output: &Tensor) -> Vec<Tensor> {
        let lent = std::mem::take(&mut self.lent);
        if self.input_tracked || output.track_op() {
            return Vec::new();
        }
        let out_key = accel_kernels::storage_key(output);
        let free = lent.into_iter().filter(|(name, buf)| {
            let in_slot = weights.tensor(name).is_some_and(|t| t.id() == buf.id());
            in_slot && accel_kernels::storage_key(buf) != out_key
        });
        free.map(|(_, buf)| buf).collect()
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
            // A forward that failed never reached `post_forward`: what it
            // was lent may still be held, so it is not given back.
            self.lent.clear();
            self.input_tracked = tracks_gradients(&args);
            self.materialise_for_forward(weights)?;
        }
        Ok(args.to_device(&self.execution_device)?)
    }

    fn post_forward(&mut self, weights: &ModuleWeights, output: Tensor) -> Result<Tensor> {
        if self.offload {
            let free = self.reusable_lent(weights, &output);
            for name in self.names(weights) {
                weights.release(&name, &self.execution_device)?;
            }
            if let Some(pool) = &self.staging {
                pool.give_back(free);
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

/// Whether any tensor of `args` is part of an autograd graph, so that ops
/// on the weights record them (and the graph keeps them alive).
fn tracks_gradients(args: &Activations) -> bool {
    let rope = args.rope.iter().flat_map(|(c, s)| [c, s]);
    let mut all = [Some(&args.hidden), args.attention_bias.as_ref()]
        .into_iter()
        .flatten()
        .chain(rope);
    all.any(Tensor::track_op)
}

impl AlignDevicesHook {
    fn names_contains(&self, weights: &ModuleWeights, name: &str) -> bool {
        self.place_submodules || self.names(weights).iter().any(|n| n == name)
    }
}

#[cfg(test)]
#[path = "staging_tests.rs"]
mod staging_tests;
