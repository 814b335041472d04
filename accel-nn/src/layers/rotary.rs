//! Rotary position tables and their application to q and k.

use candle_core::{Device, Result, Tensor};
use serde::Deserialize;

use crate::ops;

/// Llama 3's `rope_scaling` (`"rope_type": "llama3"` in `config.json`):
/// long wavelengths are slowed by `factor`, short ones kept, and the band
/// between is interpolated.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
pub struct Llama3RopeScaling {
    /// How much longer the new context is than the original.
    pub factor: f64,
    /// Wavelengths longer than `original / low_freq_factor` are scaled.
    pub low_freq_factor: f64,
    /// Wavelengths shorter than `original / high_freq_factor` are kept.
    pub high_freq_factor: f64,
    /// The context length the model was pre-trained with.
    pub original_max_position_embeddings: usize,
}

/// cos/sin tables `[max_positions, head_dim / 2]` in f32 for HF-style
/// rotary embeddings; kept in f32 whatever the model dtype so positions far
/// into the context keep their precision.
#[derive(Debug, Clone)]
pub struct RotaryEmbedding {
    cos: Tensor,
    sin: Tensor,
}

impl RotaryEmbedding {
    /// Tables for `head_dim`, positions `0..max_position_embeddings` and
    /// base `rope_theta`, with optional Llama 3 scaling. The inverse
    /// frequencies follow transformers' `_compute_default_rope_parameters`
    /// and `_compute_llama3_parameters` (rounded to f32 as there).
    pub fn new(
        head_dim: usize,
        max_position_embeddings: usize,
        rope_theta: f64,
        rope_scaling: Option<&Llama3RopeScaling>,
        device: &Device,
    ) -> Result<Self> {
        let inv_freq = Self::inv_freq(head_dim, rope_theta, rope_scaling);
        let half = inv_freq.len();
        let angles: Vec<f32> = (0..max_position_embeddings)
            .flat_map(|p| inv_freq.iter().map(move |&f| p as f32 * f))
            .collect();
        let angles = Tensor::from_vec(angles, (max_position_embeddings, half), device)?;
        Ok(Self {
            cos: angles.cos()?,
            sin: angles.sin()?,
        })
    }

    /// The `head_dim / 2` inverse frequencies, f32 as in transformers.
    pub fn inv_freq(head_dim: usize, theta: f64, scaling: Option<&Llama3RopeScaling>) -> Vec<f32> {
        let base: Vec<f32> = (0..head_dim / 2)
            .map(|i| (1.0 / theta.powf((2 * i) as f64 / head_dim as f64)) as f32)
            .collect();
        let Some(s) = scaling else { return base };
        let old = s.original_max_position_embeddings as f64;
        let low_freq_wavelen = old / s.low_freq_factor;
        let high_freq_wavelen = old / s.high_freq_factor;
        base.into_iter()
            .map(|f| {
                let f = f as f64;
                let wavelen = 2.0 * std::f64::consts::PI / f;
                let scaled = if wavelen > low_freq_wavelen {
                    f / s.factor
                } else {
                    f
                };
                // transformers: ~(wavelen < high) * ~(wavelen > low); no NaNs here.
                let medium = wavelen >= high_freq_wavelen && wavelen <= low_freq_wavelen;
                let out = if medium {
                    let smooth = (old / wavelen - s.low_freq_factor)
                        / (s.high_freq_factor - s.low_freq_factor);
                    (1.0 - smooth) * scaled / s.factor + smooth * scaled
                } else {
                    scaled
                };
                out as f32
            })
            .collect()
    }

    /// The `[max_positions, head_dim / 2]` cos table.
    pub fn cos(&self) -> &Tensor {
        &self.cos
    }

    /// The `[max_positions, head_dim / 2]` sin table.
    pub fn sin(&self) -> &Tensor {
        &self.sin
    }

    /// Rotates q `[b, h, t, d]` and k `[b, kv_h, t, d]` for positions
    /// `offset..offset + t` (`offset`: tokens already in the KV cache).
    pub fn apply(&self, q: &Tensor, k: &Tensor, offset: usize) -> Result<(Tensor, Tensor)> {
        let t = q.dim(2)?;
        let cos = self.cos.narrow(0, offset, t)?;
        let sin = self.sin.narrow(0, offset, t)?;
        Ok((ops::rope(q, &cos, &sin)?, ops::rope(k, &cos, &sin)?))
    }
}
