//! Rotary position embeddings as transformers' `modeling_rope_utils` computes
//! them: the inverse frequencies of each `rope_type` this crate reads
//! (`default`, `linear`, `llama3`, `longrope`), over the rotated part of a
//! head (`partial_rotary_factor`), and the cos/sin tables of a forward.

use std::path::Path;

use accel_nn::layers::{Llama3RopeScaling, RotaryEmbedding};
use candle_core::{DType, Device, Tensor};
use serde::Deserialize;

use crate::{Error, Result};

/// Rotary settings as transformers 5 writes them (`rope_parameters`), also
/// accepted as the older `rope_scaling` dict.
#[derive(Debug, Clone, Default, Deserialize)]
pub(crate) struct RopeParameters {
    #[serde(alias = "type")]
    pub rope_type: Option<String>,
    pub rope_theta: Option<f64>,
    pub factor: Option<f64>,
    pub low_freq_factor: Option<f64>,
    pub high_freq_factor: Option<f64>,
    pub original_max_position_embeddings: Option<usize>,
    pub short_factor: Option<Vec<f64>>,
    pub long_factor: Option<Vec<f64>>,
    pub attention_factor: Option<f64>,
    pub partial_rotary_factor: Option<f64>,
}

/// How the inverse frequencies are scaled (`rope_type`).
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    /// Llama 3's banded scaling.
    Llama3(Llama3RopeScaling),
    /// Every frequency divided by `factor` (Gemma 3's global layers).
    Linear {
        /// The divisor.
        factor: f64,
    },
    /// Phi-3's LongRoPE: per-frequency factors, the long set once positions
    /// pass the pre-training length, and cos/sin scaled by `attention_factor`.
    LongRope {
        /// Factors within `original_max_position_embeddings`.
        short_factor: Vec<f64>,
        /// Factors past it.
        long_factor: Vec<f64>,
        /// The pre-training context.
        original_max_position_embeddings: usize,
        /// The scale of cos and sin.
        attention_factor: f64,
    },
}

/// The rotary embedding of one attention layer.
#[derive(Debug, Clone, PartialEq)]
pub struct RopeSpec {
    /// The base wavelength.
    pub theta: f64,
    /// Leading dims of a head that rotate (`head_dim * partial_rotary_factor`).
    pub rotary_dim: usize,
    /// `None` for `default`.
    pub scaling: Option<RopeScaling>,
}

impl RopeSpec {
    /// The spec `params` (under `key` of the file at `path`) describes for
    /// heads of `head_dim` in a model of `max_position_embeddings`;
    /// `theta` and `partial` are the top-level fallbacks of older configs.
    pub(crate) fn parse(
        path: &Path,
        key: &str,
        params: Option<&RopeParameters>,
        (head_dim, max_position_embeddings): (usize, usize),
        (theta, partial, top_original_max): (Option<f64>, Option<f64>, Option<usize>),
    ) -> Result<Self> {
        let empty = RopeParameters::default();
        let r = params.unwrap_or(&empty);
        let theta = r.rope_theta.or(theta).unwrap_or(10_000.0);
        let partial = r.partial_rotary_factor.or(partial).unwrap_or(1.0);
        let rotary_dim = (head_dim as f64 * partial) as usize;
        let need = |v: Option<f64>, k: &str| {
            v.ok_or_else(|| Error::MissingKey {
                path: path.to_path_buf(),
                key: format!("{key}.{k}"),
            })
        };
        let original = || {
            r.original_max_position_embeddings
                .or(top_original_max)
                .ok_or_else(|| Error::MissingKey {
                    path: path.to_path_buf(),
                    key: format!("{key}.original_max_position_embeddings"),
                })
        };
        let scaling = match r.rope_type.as_deref() {
            None | Some("default") => None,
            Some("linear") => Some(RopeScaling::Linear {
                factor: need(r.factor, "factor")?,
            }),
            Some("llama3") => Some(RopeScaling::Llama3(Llama3RopeScaling {
                factor: need(r.factor, "factor")?,
                low_freq_factor: need(r.low_freq_factor, "low_freq_factor")?,
                high_freq_factor: need(r.high_freq_factor, "high_freq_factor")?,
                original_max_position_embeddings: original()?,
            })),
            Some("longrope") => {
                let original = original()?;
                let factors = |v: &Option<Vec<f64>>, k: &str| -> Result<Vec<f64>> {
                    match v {
                        Some(f) if f.len() == rotary_dim / 2 => Ok(f.clone()),
                        Some(f) => Err(Error::Unsupported {
                            path: path.to_path_buf(),
                            key: format!("{key}.{k}"),
                            reason: format!(
                                "{} factors for {} rotary frequencies",
                                f.len(),
                                rotary_dim / 2
                            ),
                        }),
                        None => Err(Error::MissingKey {
                            path: path.to_path_buf(),
                            key: format!("{key}.{k}"),
                        }),
                    }
                };
                // transformers: the ratio of the context lengths when
                // `factor` is absent, and LongRoPE's suggested scale.
                let factor = r
                    .factor
                    .unwrap_or(max_position_embeddings as f64 / original as f64);
                let attention_factor = r.attention_factor.unwrap_or(if factor <= 1.0 {
                    1.0
                } else {
                    (1.0 + factor.ln() / (original as f64).ln()).sqrt()
                });
                Some(RopeScaling::LongRope {
                    short_factor: factors(&r.short_factor, "short_factor")?,
                    long_factor: factors(&r.long_factor, "long_factor")?,
                    original_max_position_embeddings: original,
                    attention_factor,
                })
            }
            Some(other) => {
                return Err(Error::Unsupported {
                    path: path.to_path_buf(),
                    key: format!("{key}.rope_type"),
                    reason: format!("{other:?}; supported: default, linear, llama3, longrope"),
                })
            }
        };
        Ok(Self {
            theta,
            rotary_dim,
            scaling,
        })
    }

    /// The `rotary_dim / 2` inverse frequencies for a forward whose last
    /// position is `positions - 1`, and the scale of cos and sin.
    pub fn inv_freq(&self, positions: usize) -> (Vec<f32>, f64) {
        let dim = self.rotary_dim;
        match &self.scaling {
            None => (RotaryEmbedding::inv_freq(dim, self.theta, None), 1.0),
            Some(RopeScaling::Llama3(s)) => {
                (RotaryEmbedding::inv_freq(dim, self.theta, Some(s)), 1.0)
            }
            Some(RopeScaling::Linear { factor }) => {
                let base = RotaryEmbedding::inv_freq(dim, self.theta, None);
                (base.into_iter().map(|f| f / *factor as f32).collect(), 1.0)
            }
            Some(RopeScaling::LongRope {
                short_factor,
                long_factor,
                original_max_position_embeddings,
                attention_factor,
            }) => {
                // transformers picks the set by the largest position id + 1.
                let ext = if positions > *original_max_position_embeddings {
                    long_factor
                } else {
                    short_factor
                };
                let freq = ext
                    .iter()
                    .enumerate()
                    .map(|(i, e)| {
                        let shape = (2 * i) as f32 / dim as f32;
                        1.0 / (*e as f32 * (self.theta as f32).powf(shape))
                    })
                    .collect();
                (freq, *attention_factor)
            }
        }
    }

    /// `(cos, sin)` `[t, rotary_dim / 2]` for positions `offset..offset + t`,
    /// computed in f32 as transformers does, scaled, then cast to `dtype`.
    pub fn tables(
        &self,
        offset: usize,
        t: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<(Tensor, Tensor)> {
        let (inv_freq, scale) = self.inv_freq(offset + t);
        let angles: Vec<f32> = (offset..offset + t)
            .flat_map(|p| inv_freq.iter().map(move |&f| p as f32 * f))
            .collect();
        let angles = Tensor::from_vec(angles, (t, inv_freq.len()), device)?;
        let (cos, sin) = (angles.cos()?, angles.sin()?);
        let (cos, sin) = if scale != 1.0 {
            ((cos * scale)?, (sin * scale)?)
        } else {
            (cos, sin)
        };
        Ok((cos.to_dtype(dtype)?, sin.to_dtype(dtype)?))
    }
}

/// `x [b, h, t, hd]` with its first `rotary_dim` dims rotated by `(cos, sin)`
/// (transformers' `rotate_half` form) and the rest passed through.
pub(crate) fn apply(
    x: &Tensor,
    (cos, sin): &(Tensor, Tensor),
    rotary_dim: usize,
) -> candle_core::Result<Tensor> {
    let hd = x.dim(3)?;
    if rotary_dim == hd {
        return accel_nn::ops::rope(x, cos, sin);
    }
    let rot = accel_nn::ops::rope(&x.narrow(3, 0, rotary_dim)?.contiguous()?, cos, sin)?;
    Tensor::cat(&[&rot, &x.narrow(3, rotary_dim, hd - rotary_dim)?], 3)?.contiguous()
}
