//! The staging pool under `AlignDevicesHook`: buffers go from one offloaded
//! block to the next, and never while something can still read them.

use std::sync::{Arc, Mutex};

use accel_bigmodel::{offload_state_dict, CpuWeights, OffloadedWeightsLoader, StagingPool};
use candle_core::{DType, Device, Module, Tensor, Var};
use candle_nn::{VarBuilder, VarMap};

use super::super::tests::{bits, block, input, Dyn, Layer};
use super::super::{add_hook_to_module, ModelHook, ModuleWeights};
use super::AlignDevicesHook;
use crate::block::{Activations, Block, Model, Sequential};

/// Three 8 -> 8 blocks with different weights on one VarMap, and the plain model.
fn same_shapes() -> (Sequential<Dyn>, Vec<Layer>) {
    let map = VarMap::new();
    let dev = Device::Cpu;
    let parts = (0..3)
        .map(|i| Block::from_varmap(&format!("h.{i}"), "", &map, DType::F32, &dev, block(8, 8)))
        .collect::<crate::Result<Vec<_>>>()
        .unwrap();
    let vb = VarBuilder::from_varmap(&map, DType::F32, &dev);
    let plain = (0..3)
        .map(|i| Layer(candle_nn::linear(8, 8, vb.pp(format!("h.{i}"))).unwrap()))
        .collect();
    (Sequential::new(parts), plain)
}

/// Writes `model`'s weights to a folder and offloads every block from it,
/// all hooks sharing one pool; weights are read, not mapped.
fn offload_with_pool(model: &dyn Model, dir: &std::path::Path) -> Arc<StagingPool> {
    offload_from_folder(model, dir, false)
}

fn offload_from_folder(model: &dyn Model, dir: &std::path::Path, map: bool) -> Arc<StagingPool> {
    let state = model.named_tensors();
    offload_state_dict(dir, state.iter().map(|(n, t)| (n.as_str(), t))).unwrap();
    let loader = OffloadedWeightsLoader::open(dir).unwrap().with_mapping(map);
    let loader = Arc::new(loader);
    let pool = Arc::new(StagingPool::new());
    for part in model.blocks() {
        let hook = AlignDevicesHook::new(Device::Cpu)
            .with_offload(true)
            .with_weights_map(loader.clone())
            .with_staging(pool.clone());
        add_hook_to_module(part, Box::new(hook), false).unwrap();
    }
    pool
}

/// Records where each block's weights live during its forward.
struct Probe {
    seen: Arc<Mutex<Vec<(String, usize)>>>,
}

impl ModelHook for Probe {
    fn pre_forward(&mut self, w: &ModuleWeights, args: Activations) -> crate::Result<Activations> {
        for (name, t) in w.tensors() {
            let key = accel_kernels::storage_key(&t).unwrap();
            let short = name.rsplit('.').next().unwrap().to_string();
            self.seen.lock().unwrap().push((short, key));
        }
        Ok(args)
    }
    fn name(&self) -> &'static str {
        "Probe"
    }
}

fn x8() -> Tensor {
    input().narrow(1, 0, 8).unwrap().contiguous().unwrap()
}

#[test]
fn consecutive_blocks_of_one_shape_read_into_the_same_buffers_with_their_own_values() {
    let (model, plain) = same_shapes();
    let x = x8();
    let expected = plain.iter().fold(x.clone(), |h, l| l.forward(&h).unwrap());
    let dir = tempfile::tempdir().unwrap();
    let pool = offload_with_pool(&model, dir.path());
    let seen = Arc::new(Mutex::new(Vec::new()));
    for part in &model.blocks {
        let probe = Probe { seen: seen.clone() };
        add_hook_to_module(part, Box::new(probe), true).unwrap();
    }
    for _ in 0..2 {
        assert_eq!(bits(&model.forward_hidden(&x).unwrap()), bits(&expected));
    }
    // Each block read its own weights into the buffers the block before used.
    let seen = seen.lock().unwrap();
    assert_eq!(seen.len(), 12, "2 forwards x 3 blocks x (weight, bias)");
    let weights: Vec<usize> = seen
        .iter()
        .filter(|(n, _)| n == "weight")
        .map(|s| s.1)
        .collect();
    assert!(weights.iter().all(|&k| k == weights[0]), "{weights:?}");
    let stats = pool.stats();
    assert_eq!((stats.allocated, stats.reused), (2, 10));
    // Between forwards the pool holds one block's weights and biases.
    assert_eq!(stats.free_bytes, (8 * 8 + 8) * 4);
    assert!(model
        .blocks
        .iter()
        .all(|b| b.weights().resident_bytes() == 0));
}

/// Records whether each block's weights are mapped file pages during its forward.
struct MappedProbe {
    seen: Arc<Mutex<Vec<bool>>>,
}

impl ModelHook for MappedProbe {
    fn pre_forward(&mut self, w: &ModuleWeights, args: Activations) -> crate::Result<Activations> {
        let mut seen = self.seen.lock().unwrap();
        seen.extend(
            w.tensors()
                .iter()
                .map(|(_, t)| accel_bigmodel::mapped::is_mapped(t)),
        );
        Ok(args)
    }
    fn name(&self) -> &'static str {
        "MappedProbe"
    }
}

#[test]
fn with_the_allocator_installed_offloaded_weights_are_the_files_pages_only_during_the_forward() {
    let (model, plain) = same_shapes();
    let x = x8();
    let expected = plain.iter().fold(x.clone(), |h, l| l.forward(&h).unwrap());
    let dir = tempfile::tempdir().unwrap();
    let pool = offload_from_folder(&model, dir.path(), true);
    let seen = Arc::new(Mutex::new(Vec::new()));
    for part in &model.blocks {
        let probe = MappedProbe { seen: seen.clone() };
        add_hook_to_module(part, Box::new(probe), true).unwrap();
    }
    for _ in 0..2 {
        assert_eq!(bits(&model.forward_hidden(&x).unwrap()), bits(&expected));
    }
    let seen = seen.lock().unwrap();
    assert_eq!(seen.len(), 12, "2 forwards x 3 blocks x (weight, bias)");
    assert!(seen.iter().all(|m| *m), "every weight mapped: {seen:?}");
    // Nothing was staged, and nothing stays resident between forwards.
    assert_eq!(pool.stats().allocated + pool.stats().reused, 0);
    assert!(model
        .blocks
        .iter()
        .all(|b| b.weights().resident_bytes() == 0));
}

#[test]
fn a_weight_the_autograd_graph_holds_is_not_handed_to_the_next_block() {
    let (model, plain) = same_shapes();
    let dir = tempfile::tempdir().unwrap();
    let pool = offload_with_pool(&model, dir.path());
    let x = Var::from_tensor(&x8()).unwrap();
    // Block 0's output tracks gradients, so its graph holds block 0's weight.
    let out = model.blocks[0].forward_hidden(x.as_tensor()).unwrap();
    assert_eq!(pool.stats().kept, 0);
    // Block 1 (same shapes, other weights) runs before the backward.
    model.blocks[1].forward_hidden(&x8()).unwrap();
    let grad = out.sum_all().unwrap().backward().unwrap();
    let got = grad.get(x.as_tensor()).unwrap();

    let y = Var::from_tensor(&x8()).unwrap();
    let plain_out = plain[0].forward(y.as_tensor()).unwrap();
    let want_grads = plain_out.sum_all().unwrap().backward().unwrap();
    let want = want_grads.get(y.as_tensor()).unwrap();
    assert_eq!(bits(got), bits(want));
}

const RANDN: candle_nn::Init = candle_nn::Init::Randn {
    mean: 0.0,
    stdev: 1.0,
};

/// A block whose output is its weight itself.
struct WeightOut(Tensor);

impl Module for WeightOut {
    fn forward(&self, _: &Tensor) -> candle_core::Result<Tensor> {
        Ok(self.0.clone())
    }
}

#[test]
fn an_output_that_is_a_view_of_a_weight_keeps_its_values_after_the_next_block() {
    let map = VarMap::new();
    let dev = Device::Cpu;
    let first = Block::from_varmap("h.0", "", &map, DType::F32, &dev, |vb| {
        Ok(Box::new(WeightOut(vb.get_with_hints((8, 8), "weight", RANDN)?)) as Dyn)
    })
    .unwrap();
    let second = Block::from_varmap("h.1", "", &map, DType::F32, &dev, |vb| {
        Ok(Box::new(WeightOut(vb.get_with_hints((8, 8), "weight", RANDN)?)) as Dyn)
    })
    .unwrap();
    let w0 = map.data().lock().unwrap()["h.0.weight"]
        .as_tensor()
        .copy()
        .unwrap();
    let model = Sequential::new(vec![first, second]);
    let dir = tempfile::tempdir().unwrap();
    let pool = offload_with_pool(&model, dir.path());
    let out0 = model.blocks[0].forward_hidden(&x8()).unwrap();
    let out1 = model.blocks[1].forward_hidden(&out0).unwrap();
    assert_eq!(bits(&out0), bits(&w0), "block 1's read went elsewhere");
    assert_ne!(bits(&out0), bits(&out1));
    assert_eq!(pool.stats().reused, 0);
}

#[test]
fn weights_served_from_memory_are_lent_as_they_are_and_never_pooled() {
    let (model, plain) = same_shapes();
    let x = x8();
    let expected = plain.iter().fold(x.clone(), |h, l| l.forward(&h).unwrap());
    // A map holding the model's own tensors (what cpu_offload builds).
    let map = Arc::new(CpuWeights::new(model.named_tensors()).unwrap());
    let keys: Vec<usize> = map
        .tensors()
        .values()
        .map(|t| accel_kernels::storage_key(t).unwrap())
        .collect();
    let pool = Arc::new(StagingPool::new());
    let seen = Arc::new(Mutex::new(Vec::new()));
    for part in &model.blocks {
        let hook = AlignDevicesHook::new(Device::Cpu)
            .with_offload(true)
            .with_weights_map(map.clone())
            .with_staging(pool.clone());
        add_hook_to_module(part, Box::new(hook), false).unwrap();
        let probe = Probe { seen: seen.clone() };
        add_hook_to_module(part, Box::new(probe), true).unwrap();
    }
    for _ in 0..2 {
        assert_eq!(bits(&model.forward_hidden(&x).unwrap()), bits(&expected));
    }
    // The forward ran on the map's own storage, and the pool was never asked.
    assert!(seen.lock().unwrap().iter().all(|(_, k)| keys.contains(k)));
    assert_eq!(pool.stats(), Default::default());
    let again = plain.iter().fold(x.clone(), |h, l| l.forward(&h).unwrap());
    assert_eq!(
        bits(&again),
        bits(&expected),
        "the map's tensors are unchanged"
    );
}
