//! A growing key/value cache for incremental decoding.

use candle_core::{Result, Tensor};

/// Keys and values `[b, kv_h, s, d]` of the positions decoded so far.
///
/// Use: per layer and step, `let (k, v) = cache.append(&k_new, &v_new)?`,
/// then attend with `AttentionMask::Causal { offset: cache.len() - t }`
/// (query `i` of this step sits at absolute position `offset + i`).
/// Appending concatenates (a copy of the whole cache per step), which is
/// simple and keeps gradients flowing; preallocation is not needed at the
/// sizes this crate trains and evaluates.
#[derive(Debug, Clone, Default)]
pub struct KvCache {
    kv: Option<(Tensor, Tensor)>,
}

impl KvCache {
    /// An empty cache.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds `k`, `v` `[b, kv_h, t, d]` along the sequence dimension 2 and
    /// returns the whole cache.
    pub fn append(&mut self, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
        let kv = match &self.kv {
            None => (k.clone(), v.clone()),
            Some((ck, cv)) => (Tensor::cat(&[ck, k], 2)?, Tensor::cat(&[cv, v], 2)?),
        };
        self.kv = Some(kv.clone());
        Ok(kv)
    }

    /// Number of cached positions.
    pub fn len(&self) -> usize {
        self.kv
            .as_ref()
            .map_or(0, |(k, _)| k.dims().get(2).copied().unwrap_or(0))
    }

    /// Whether nothing is cached yet.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Forgets every position (a new sequence).
    pub fn reset(&mut self) {
        self.kv = None;
    }

    /// The cached keys and values, if any.
    pub fn current(&self) -> Option<&(Tensor, Tensor)> {
        self.kv.as_ref()
    }
}
