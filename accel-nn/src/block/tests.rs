use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use candle_core::{DType, Device, Module, Tensor, Var};
use candle_nn::{VarBuilder, VarMap};

use super::*;
use crate::hooks::tests::{block, input, Dyn};

/// Three linear+GELU blocks on `map`, built through `Block::new`.
fn model_on(map: &VarMap) -> Sequential<Dyn> {
    let vb = VarBuilder::from_varmap(map, DType::F32, &Device::Cpu);
    let dims = [(8, 16), (16, 16), (16, 4)];
    let blocks = dims
        .iter()
        .enumerate()
        .map(|(i, &(a, b))| Block::new(&vb.pp("h"), &i.to_string(), "Layer", block(a, b)).unwrap());
    Sequential::new(blocks.collect())
}

fn grads(map: &VarMap, loss: &Tensor) -> HashMap<String, Vec<u32>> {
    let store = loss.backward().unwrap();
    let data = map.data().lock().unwrap();
    data.iter()
        .map(|(n, v)| {
            let g = store
                .get(v.as_tensor())
                .expect("every weight has a gradient");
            let g = g.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            (n.clone(), g.into_iter().map(f32::to_bits).collect())
        })
        .collect()
}

#[test]
fn a_block_takes_each_weight_once_from_its_source_with_the_init_hints_of_candle_nn() {
    let map = VarMap::new();
    let model = model_on(&map);
    assert_eq!(model.blocks[1].name(), "h.1");
    assert_eq!(model.blocks[1].class_name(), "Layer");
    assert_eq!(
        model.blocks[1].weights().names(),
        ["h.1.weight", "h.1.bias"]
    );
    // The block's tensors are the VarMap's Vars (no copy), so they train.
    let data = map.data().lock().unwrap();
    assert_eq!(data.len(), 6);
    let w = model.blocks[1].weights().tensor("h.1.weight").unwrap();
    assert_eq!(w.id(), data["h.1.weight"].as_tensor().id());
    // candle-nn's linear init: kaiming-uniform weights, not zeros.
    assert!(
        w.abs()
            .unwrap()
            .sum_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap()
            > 0.0
    );
}

#[test]
fn checkpointed_blocks_give_the_plain_outputs_and_gradients_bit_for_bit() {
    let map = VarMap::new();
    let model = model_on(&map);
    let x = Var::from_tensor(&input()).unwrap();
    let out = model.forward_hidden(x.as_tensor()).unwrap();
    let loss = out.sqr().unwrap().sum_all().unwrap();
    let plain = grads(&map, &loss);
    let gx = loss.backward().unwrap().get(x.as_tensor()).unwrap().clone();

    apply_activation_checkpointing(&model, &["Layer"]).unwrap();
    assert!(model.blocks.iter().all(|b| b.has_hook()));
    let out2 = model.forward_hidden(x.as_tensor()).unwrap();
    assert_eq!(bits(&out), bits(&out2));
    let loss2 = out2.sqr().unwrap().sum_all().unwrap();
    assert_eq!(plain, grads(&map, &loss2));
    let gx2 = loss2
        .backward()
        .unwrap()
        .get(x.as_tensor())
        .unwrap()
        .clone();
    assert_eq!(bits(&gx), bits(&gx2));
}

/// A linear layer times zero: -0 wherever the linear output is negative.
struct SignedZeros(candle_nn::Linear);

impl Module for SignedZeros {
    fn forward(&self, xs: &Tensor) -> candle_core::Result<Tensor> {
        let y = self.0.forward(xs)?;
        y.mul(&y.zeros_like()?)
    }
}

#[test]
fn a_checkpointed_block_keeps_the_sign_of_zero_outputs() {
    let map = VarMap::new();
    let vb = VarBuilder::from_varmap(&map, DType::F32, &Device::Cpu);
    let make = |vb: VarBuilder| -> candle_core::Result<Dyn> {
        Ok(Box::new(SignedZeros(candle_nn::linear(8, 4, vb)?)))
    };
    let model = Sequential::new(vec![Block::new(&vb, "z", "Layer", make).unwrap()]);
    // Fixed weights of both signs (candle's init takes no seed).
    let w = Tensor::arange(0f32, 32., &Device::Cpu)
        .unwrap()
        .affine(0.1, -1.6)
        .unwrap();
    let data = map.data().lock().unwrap();
    data["z.weight"].set(&w.reshape((4, 8)).unwrap()).unwrap();
    data["z.bias"]
        .set(&Tensor::zeros(4, DType::F32, &Device::Cpu).unwrap())
        .unwrap();
    drop(data);
    let x = Var::from_tensor(&input()).unwrap();
    let plain = bits(&model.forward_hidden(x.as_tensor()).unwrap());
    let negative = plain.iter().filter(|b| **b == (-0f32).to_bits()).count();
    let positive = plain.iter().filter(|b| **b == 0).count();
    assert!(
        negative > 0 && positive > 0 && negative + positive == plain.len(),
        "{plain:?}"
    );
    apply_activation_checkpointing(&model, &["Layer"]).unwrap();
    let checkpointed = bits(&model.forward_hidden(x.as_tensor()).unwrap());
    assert_eq!(plain, checkpointed, "{negative} of the plain zeros are -0");
}

/// Counts its forwards, so a test sees the recomputation happen.
struct Counting(candle_nn::Linear, Arc<AtomicUsize>);

impl BlockForward for Counting {
    fn forward(&self, x: &Activations) -> candle_core::Result<Tensor> {
        self.1.fetch_add(1, Ordering::SeqCst);
        self.0.forward(&x.hidden)?.gelu()
    }
}

#[test]
fn a_checkpointed_block_runs_again_in_backward_and_only_then() {
    let map = VarMap::new();
    let vb = VarBuilder::from_varmap(&map, DType::F32, &Device::Cpu);
    let calls = Arc::new(AtomicUsize::new(0));
    let c = calls.clone();
    let b = Block::new(&vb, "lin", "Layer", move |vb| {
        Ok(Counting(candle_nn::linear(8, 4, vb)?, c.clone()))
    })
    .unwrap();
    let model = Sequential::new(vec![b]);
    apply_activation_checkpointing(&model, &[]).unwrap();
    let x = Var::from_tensor(&input()).unwrap();
    let loss = model
        .forward_hidden(x.as_tensor())
        .unwrap()
        .sum_all()
        .unwrap();
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    let store = loss.backward().unwrap();
    assert_eq!(calls.load(Ordering::SeqCst), 2);
    assert!(store.get(x.as_tensor()).is_some());
    assert_eq!(
        map.all_vars()
            .iter()
            .filter(|v| store.get(v.as_tensor()).is_some())
            .count(),
        2
    );
}

#[test]
fn two_hooks_that_wrap_the_forward_are_refused_naming_the_block() {
    let map = VarMap::new();
    let model = model_on(&map);
    apply_activation_checkpointing(&model, &[]).unwrap();
    let err = apply_activation_checkpointing(&model, &[]).unwrap_err();
    assert!(err.to_string().contains("\"h.0\""), "{err}");
    // The first hook is still in place.
    assert!(model.blocks[0].has_hook());
}

#[test]
fn a_module_block_runs_like_the_candle_module() {
    let map = VarMap::new();
    let vb = VarBuilder::from_varmap(&map, DType::F32, &Device::Cpu);
    let b: Block<Dyn> = Block::new(&vb, "lin", "", block(8, 4)).unwrap();
    let lin = candle_nn::linear(8, 4, vb.pp("lin")).unwrap();
    let x = input();
    let want = lin.forward(&x).unwrap().gelu().unwrap();
    assert_eq!(bits(&b.forward_hidden(&x).unwrap()), bits(&want));
}

fn bits(t: &Tensor) -> Vec<u32> {
    crate::hooks::tests::bits(t)
}
