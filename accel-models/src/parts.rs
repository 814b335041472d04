//! Block bodies and helpers the architectures share: token embedding, the
//! output projection with its fused loss, label shifting, masks.

use accel_nn::block::{Activations, BlockForward};
use accel_nn::layers::Embedding;
use accel_nn::ops::{self, AttentionMask};
use candle_core::{DType, Device, Tensor};

use crate::error::bail_input;
use crate::Result;

/// Token ids `[b, t]` to embeddings `[b, t, d]` (class `Embedding`).
pub(crate) struct TokenEmbedding(pub Embedding);

impl BlockForward for TokenEmbedding {
    fn forward(&self, x: &Activations) -> candle_core::Result<Tensor> {
        candle_core::Module::forward(&self.0, &x.hidden)
    }
}

/// The output projection `lm_head` (class `Linear`), tied or not: logits, or
/// with labels the mean cross-entropy with the logits never materialised in
/// the autograd graph (the fused linear + loss op).
pub(crate) struct LmHead {
    /// `[vocab, d]`: `lm_head.weight` or the tied embedding table.
    pub weight: Tensor,
}

impl BlockForward for LmHead {
    fn forward(&self, x: &Activations) -> candle_core::Result<Tensor> {
        match &x.labels {
            Some(labels) => ops::linear_cross_entropy(&x.hidden, &self.weight, labels),
            None => ops::linear(&x.hidden, &self.weight, None, None),
        }
    }
}

/// transformers' causal-LM label shift: position `i` predicts `labels[i + 1]`
/// and the last position predicts nothing, so the loss is the mean over the
/// `t - 1` real targets of each row (and over non-ignored ones: `-100` for
/// i64 labels, `u32::MAX` for u32).
pub(crate) fn shift_labels(labels: &Tensor) -> Result<Tensor> {
    let (b, t) = labels.dims2()?;
    if t == 0 {
        bail_input!("loss", "labels have no positions");
    }
    let ignore = match labels.dtype() {
        DType::I64 => Tensor::full(-100i64, (b, 1), labels.device())?,
        DType::U32 => Tensor::full(u32::MAX, (b, 1), labels.device())?,
        other => bail_input!("loss", "labels must be u32 or i64, got {other:?}"),
    };
    Ok(Tensor::cat(&[&labels.narrow(1, 1, t - 1)?, &ignore], 1)?)
}

/// The causal mask of a decoder layer for `t` new queries over `s` keys
/// (`s - t` of them cached), with the activations' additive bias and a
/// sliding window when they apply (the attention kernels skip the keys
/// before the window).
pub(crate) fn causal_mask(
    x: &Activations,
    t: usize,
    s: usize,
    window: Option<usize>,
) -> candle_core::Result<AttentionMask> {
    let offset = s - t;
    Ok(match (window.filter(|&w| s > w), &x.attention_bias) {
        (Some(window), bias) => AttentionMask::SlidingWindow {
            offset,
            window,
            bias: bias.clone(),
        },
        (None, Some(bias)) => AttentionMask::CausalAndAdditive {
            offset,
            bias: bias.clone(),
        },
        (None, None) => AttentionMask::Causal { offset },
    })
}

/// A decoder layer's causal attention on its rotated heads `q [b, h, t, hd]`
/// and `k`, `v [b, kv_h, t, hd]`: the keys and values appended to the
/// activations' cache when there is one (a sliding layer's cache first cut
/// to the `window - 1` positions its queries can still see, so it stops
/// growing at the window), the causal mask (with the window and the
/// activations' bias), and the heads merged back to `[b, t, h * hd]`.
pub(crate) fn causal_attention(
    x: &Activations,
    (q, k, v): (Tensor, Tensor, Tensor),
    window: Option<usize>,
    scale: f64,
) -> candle_core::Result<Tensor> {
    let t = q.dim(2)?;
    let (k, v) = cached(x, (k, v), window)?;
    let mask = causal_mask(x, t, k.dim(2)?, window)?;
    merge_heads(&ops::scaled_dot_product_attention(
        &q, &k, &v, &mask, scale,
    )?)
}

/// The keys and values appended to the activations' cache when there is
/// one (a sliding layer's cache first cut to the `window - 1` positions its
/// queries can still see, so it stops growing at the window).
fn cached(
    x: &Activations,
    (k, v): (Tensor, Tensor),
    window: Option<usize>,
) -> candle_core::Result<(Tensor, Tensor)> {
    match &x.cache {
        Some(slot) => {
            let mut cache = slot.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(w) = window {
                cache.keep_last(w.saturating_sub(1))?;
            }
            cache.append(&k, &v)
        }
        None => Ok((k, v)),
    }
}

/// [`causal_attention`] with Gemma 2's soft-capped scores: `tanh(s / cap) *
/// cap` on the scaled scores before the mask and the softmax (transformers'
/// `eager_attention_forward`, which Gemma 2 requires: SDPA and the flash
/// kernels have no softcap). Composed from ops with a backward, the scores
/// materialised `[b, h, t, s]` as transformers does.
pub(crate) fn softcapped_attention(
    x: &Activations,
    (q, k, v): (Tensor, Tensor, Tensor),
    window: Option<usize>,
    scale: f64,
    cap: f64,
) -> candle_core::Result<Tensor> {
    let (b, h, t, hd) = q.dims4()?;
    let (k, v) = cached(x, (k, v), window)?;
    let (kvh, s) = (k.dim(1)?, k.dim(2)?);
    // transformers' `repeat_kv`: query head i reads key/value head i / (h / kvh).
    let repeat = |x: &Tensor| -> candle_core::Result<Tensor> {
        if kvh == h {
            return Ok(x.clone());
        }
        x.unsqueeze(2)?
            .broadcast_as((b, kvh, h / kvh, s, hd))?
            .reshape((b, h, s, hd))
    };
    let (k, v) = (repeat(&k)?, repeat(&v)?);
    let scores = (q.contiguous()?.matmul(&k.t()?.contiguous()?)? * scale)?;
    let capped = ((scores / cap)?.tanh()? * cap)?;
    // The causal (and sliding) mask as -inf, plus the activations' bias.
    let offset = s - t;
    let mask: Vec<f32> = (0..t)
        .flat_map(|i| {
            (0..s).map(move |j| {
                let seen = j <= offset + i && window.is_none_or(|w| offset + i < j + w);
                if seen {
                    0.0
                } else {
                    f32::NEG_INFINITY
                }
            })
        })
        .collect();
    let mask = Tensor::from_vec(mask, (1, 1, t, s), q.device())?;
    let mut logits = capped.to_dtype(DType::F32)?.broadcast_add(&mask)?;
    if let Some(bias) = &x.attention_bias {
        logits = logits.broadcast_add(&bias.to_dtype(DType::F32)?)?;
    }
    let probs = ops::softmax_last_dim(&logits)?.to_dtype(q.dtype())?;
    merge_heads(&probs.matmul(&v.contiguous()?)?)
}

/// `[b, t, heads * hd]` to `[b, heads, t, hd]`.
pub(crate) fn split_heads(x: &Tensor, heads: usize, hd: usize) -> candle_core::Result<Tensor> {
    let (b, t, _) = x.dims3()?;
    x.reshape((b, t, heads, hd))?.transpose(1, 2)?.contiguous()
}

/// `[b, heads, t, hd]` to `[b, t, heads * hd]`.
pub(crate) fn merge_heads(x: &Tensor) -> candle_core::Result<Tensor> {
    let (b, h, t, hd) = x.dims4()?;
    x.transpose(1, 2)?.reshape((b, t, h * hd))
}

/// The device a block's weights live on (where its inputs are created).
pub(crate) fn weights_device(block: &dyn accel_nn::AnyBlock) -> Device {
    block
        .weights()
        .tensors()
        .first()
        .map_or(Device::Cpu, |(_, t)| t.device().clone())
}
