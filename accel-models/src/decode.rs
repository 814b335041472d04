//! Decoding with a KV cache, greedy or sampled, shared by the decoder
//! architectures.

use std::sync::{Arc, Mutex};

use accel_nn::block::{KvCache, KvCacheSlot};
use candle_core::{DType, Device, Tensor};

use crate::error::bail_input;
use crate::sampling::{Sampler, Sampling};
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
    generate(
        model,
        prompt,
        max_new_tokens,
        eos_token_ids,
        &Sampling::default(),
    )
}

/// [`greedy`] with each token chosen as `sampling` says (transformers'
/// repetition penalty, temperature, top-k, top-p and a seeded draw).
pub(crate) fn generate(
    model: &impl CausalLm,
    prompt: &[u32],
    max_new_tokens: usize,
    eos_token_ids: &[u32],
    sampling: &Sampling,
) -> Result<Vec<u32>> {
    let mut sampler = Sampler::new(sampling)?;
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
        let next = sampler.next(last.to_dtype(DType::F32)?.to_vec1()?, &tokens);
        tokens.push(next);
        if eos_token_ids.contains(&next) {
            break;
        }
        input = vec![next];
    }
    Ok(tokens)
}
