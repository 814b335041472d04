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

    /// Keeps only the last `n` cached positions (a sliding-window layer
    /// keeps `window - 1` before appending a step: every key the step's
    /// queries can still see), so its cache stops growing at the window.
    ///
    /// # Errors
    /// Those of narrowing the tensors.
    pub fn keep_last(&mut self, n: usize) -> Result<()> {
        if let Some((k, v)) = &self.kv {
            let len = k.dim(2)?;
            if len > n {
                let (k, v) = (k.narrow(2, len - n, n)?, v.narrow(2, len - n, n)?);
                self.kv = Some((k.contiguous()?, v.contiguous()?));
            }
        }
        Ok(())
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

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// `keep_last` drops the oldest positions only, and only past `n`.
    #[test]
    fn keep_last_drops_the_oldest_positions() {
        let pos = |a: u32, b: u32| {
            Tensor::arange(a, b, &Device::Cpu)
                .unwrap()
                .to_dtype(candle_core::DType::F32)
                .unwrap()
                .reshape((1, 1, (b - a) as usize, 1))
                .unwrap()
        };
        let mut c = KvCache::new();
        c.append(&pos(0, 5), &pos(10, 15)).unwrap();
        c.keep_last(8).unwrap();
        assert_eq!(c.len(), 5);
        c.keep_last(3).unwrap();
        let (k, v) = c.append(&pos(5, 6), &pos(15, 16)).unwrap();
        let flat = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(flat(&k), [2.0, 3.0, 4.0, 5.0]);
        assert_eq!(flat(&v), [12.0, 13.0, 14.0, 15.0]);
    }
}
