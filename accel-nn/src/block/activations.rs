//! [`Activations`]: what flows from one block of a model to the next.

use std::sync::{Arc, Mutex};

use candle_core::{Device, Tensor};

use crate::layers::KvCache;

/// A shared handle on one block's [`KvCache`].
pub type KvCacheSlot = Arc<Mutex<KvCache>>;

/// The input of a block: the hidden states and what the model computed once
/// for all blocks (masks, rotary tables, positions, a cache slot, labels,
/// token types).
///
/// Hooks see all of it: a device-placement hook moves every tensor here to
/// the block's execution device. Only [`Activations::hidden`] carries
/// gradients through a block that is recomputed in backward (activation
/// checkpointing, FSDP units); the other tensors are treated as constants
/// there, which they are for every model in this workspace.
#[derive(Debug, Clone)]
pub struct Activations {
    /// The residual stream `[b, t, d]` (token ids `[b, t]` for an embedding block).
    pub hidden: Tensor,
    /// Additive attention bias broadcastable to `[b, heads, t, s]` (e.g. a
    /// padding mask of 0 and -inf), on top of any causal mask a block applies.
    pub attention_bias: Option<Tensor>,
    /// Rotary tables `(cos, sin)` for the positions of `hidden`.
    pub rope: Option<(Tensor, Tensor)>,
    /// Absolute position of `hidden`'s first token (the KV cache length).
    pub position_offset: usize,
    /// This block's KV cache, when decoding with one.
    pub cache: Option<KvCacheSlot>,
    /// Targets for a head block that computes the loss itself (fused output
    /// projection and cross-entropy), `[b, t]`.
    pub labels: Option<Tensor>,
    /// Segment ids `[b, t]` for an embedding block that adds token-type
    /// embeddings (BERT's `token_type_ids`); `None` means all zeros.
    pub token_type_ids: Option<Tensor>,
    /// Training mode (dropout active).
    pub train: bool,
}

impl Activations {
    /// Activations holding only `hidden`.
    pub fn new(hidden: Tensor) -> Self {
        Self {
            hidden,
            attention_bias: None,
            rope: None,
            position_offset: 0,
            cache: None,
            labels: None,
            token_type_ids: None,
            train: false,
        }
    }

    /// The same context with other hidden states (a block's output going on).
    pub fn with_hidden(&self, hidden: Tensor) -> Self {
        Self {
            hidden,
            ..self.clone()
        }
    }

    /// The same with `cache` as the cache slot (a model sets block `i`'s slot).
    pub fn with_cache(&self, cache: Option<KvCacheSlot>) -> Self {
        Self {
            cache,
            ..self.clone()
        }
    }

    /// The device of the hidden states.
    pub fn device(&self) -> &Device {
        self.hidden.device()
    }

    /// Every tensor moved to `device` (those already there are kept as they are).
    ///
    /// # Errors
    /// A failed copy.
    pub fn to_device(&self, device: &Device) -> candle_core::Result<Self> {
        let mv = |t: &Tensor| t.to_device(device);
        Ok(Self {
            hidden: mv(&self.hidden)?,
            attention_bias: self.attention_bias.as_ref().map(mv).transpose()?,
            rope: match &self.rope {
                Some((c, s)) => Some((mv(c)?, mv(s)?)),
                None => None,
            },
            position_offset: self.position_offset,
            cache: self.cache.clone(),
            labels: self.labels.as_ref().map(mv).transpose()?,
            token_type_ids: self.token_type_ids.as_ref().map(mv).transpose()?,
            train: self.train,
        })
    }

    /// The same with every tensor detached from the graph.
    pub fn detach(&self) -> Self {
        Self {
            hidden: self.hidden.detach(),
            attention_bias: self.attention_bias.as_ref().map(Tensor::detach),
            rope: self.rope.as_ref().map(|(c, s)| (c.detach(), s.detach())),
            labels: self.labels.as_ref().map(Tensor::detach),
            token_type_ids: self.token_type_ids.as_ref().map(Tensor::detach),
            ..self.clone()
        }
    }
}

impl From<Tensor> for Activations {
    fn from(hidden: Tensor) -> Self {
        Self::new(hidden)
    }
}

impl From<&Tensor> for Activations {
    fn from(hidden: &Tensor) -> Self {
        Self::new(hidden.clone())
    }
}
