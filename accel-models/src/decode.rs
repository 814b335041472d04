//! Greedy decoding with a KV cache, shared by the decoder architectures.

use std::sync::{Arc, Mutex};

use accel_nn::block::{KvCache, KvCacheSlot};
use candle_core::{DType, Device, Tensor};

use crate::error::bail_input;
use crate::Result;

/// A decoder-only model that can run new tokens on top of per-layer KV
/// caches: what [`greedy`] needs.
pub(crate) trait CausalLm {
    /// Number of attention layers (one cache slot each).
    fn num_layers(&self) -> usize;
    /// Longest sequence the position tables cover.
    fn max_positions(&self) -> usize;
    /// Where token ids are created.
    fn input_device(&self) -> Device;
    /// Logits `[b, t, vocab]` for `ids [b, t]` placed at `offset..offset + t`,
    /// appending their keys and values to `caches`.
    fn forward_cached(&self, ids: &Tensor, offset: usize, caches: &[KvCacheSlot])
        -> Result<Tensor>;
}

/// One empty cache slot per layer.
pub(crate) fn new_caches(n: usize) -> Vec<KvCacheSlot> {
    (0..n)
        .map(|_| Arc::new(Mutex::new(KvCache::new())))
        .collect()
}

/// transformers' `generate(do_sample=False)`: the prompt once, then one token
/// per step on the cache, each the argmax of the last position's logits
/// (first index on ties, as `torch.argmax`). Returns prompt and continuation;
/// stops after a token of `eos_token_ids`.
pub(crate) fn greedy(
    model: &impl CausalLm,
    prompt: &[u32],
    max_new_tokens: usize,
    eos_token_ids: &[u32],
) -> Result<Vec<u32>> {
    if prompt.is_empty() {
        bail_input!("generate", "the prompt is empty");
    }
    let total = prompt.len() + max_new_tokens;
    if total > model.max_positions() {
        bail_input!(
            "generate",
            "prompt {} + {max_new_tokens} new tokens exceed the model's {} positions",
            prompt.len(),
            model.max_positions()
        );
    }
    let device = model.input_device();
    let caches = new_caches(model.num_layers());
    let mut tokens = prompt.to_vec();
    let mut input = prompt.to_vec();
    for _ in 0..max_new_tokens {
        let offset = tokens.len() - input.len();
        let ids = Tensor::new(input.as_slice(), &device)?.unsqueeze(0)?;
        let logits = model.forward_cached(&ids, offset, &caches)?;
        let last = logits.get(0)?.get(input.len() - 1)?;
        let next = argmax(&last)?;
        tokens.push(next);
        if eos_token_ids.contains(&next) {
            break;
        }
        input = vec![next];
    }
    Ok(tokens)
}

/// Index of the first maximum of a 1-D tensor.
fn argmax(logits: &Tensor) -> Result<u32> {
    let v: Vec<f32> = logits.to_dtype(DType::F32)?.to_vec1()?;
    let mut best = 0;
    for (i, x) in v.iter().enumerate() {
        if *x > v[best] {
            best = i;
        }
    }
    Ok(best as u32)
}
