//! Backward passes for candle-nn's fused ops: the accel-rs patch.
//!
//! Upstream candle-nn 0.11.1 builds `ops::softmax_last_dim`, `ops::rms_norm`,
//! `ops::layer_norm` and `rotary_emb::{rope, rope_i, rope_thd}` with
//! `apply_op*_no_bwd`, so a backward stops at them and every parameter below
//! silently gets no gradient (huggingface/candle #2168, #3011, #3569, #3752).
//! These are the analytic gradients, as the open upstream PRs #3526, #3568,
//! #3591, #3613 and #3823 add them. `attention::flash_attn`'s CPU kernels
//! build their output from a `Vec`, which cuts the graph too; a forward a
//! backward can reach takes [`attention`] (composed ops) instead.
//!
//! They are composed of candle ops, so they run on every device (on CUDA as
//! candle's own kernels, a handful of launches per op; the rotary ones reuse
//! the fused forward kernel, since a rotation's gradient is the rotation by
//! the opposite angle). Half-precision inputs are widened to f32 for the
//! reductions and the result is rounded back once, as the forward kernels
//! accumulate in f32. A gradient is only computed for an argument that a
//! backward can reach (`Tensor::track_op`), so constant `cos`/`sin` tables
//! or frozen weights cost nothing.

use candle::{DType, Result, Tensor, D};

/// `t` in the dtype the gradient is computed in (f32 for half precision).
fn widened(t: &Tensor) -> Result<Tensor> {
    match t.dtype() {
        DType::F16 | DType::BF16 => t.to_dtype(DType::F32),
        _ => Ok(t.clone()),
    }
}

/// Sums `t` over every dimension but the last: the gradient of a weight that
/// was broadcast along the rows.
fn sum_rows(t: &Tensor) -> Result<Tensor> {
    let n = t.dim(D::Minus1)?;
    t.reshape(((), n))?.sum(0)
}

/// The gradient of `softmax_last_dim`, from its output `y`:
/// `dx = y * (g - sum(g * y))` along the last dimension.
pub(crate) fn softmax_last_dim(y: &Tensor, grad: &Tensor) -> Result<Tensor> {
    let (yf, gf) = (widened(y)?, widened(grad)?);
    let dot = (&yf * &gf)?.sum_keepdim(D::Minus1)?;
    gf.broadcast_sub(&dot)?.mul(&yf)?.to_dtype(y.dtype())
}

/// `x` normalised over its last dimension and `1 / sqrt(mean + eps)`, in the
/// working dtype; `centre` subtracts the mean first (layer norm).
fn normalised(x: &Tensor, eps: f32, centre: bool) -> Result<(Tensor, Tensor)> {
    let x = widened(x)?;
    let x = if centre {
        x.broadcast_sub(&x.mean_keepdim(D::Minus1)?)?
    } else {
        x
    };
    let r = (x.sqr()?.mean_keepdim(D::Minus1)? + eps as f64)?
        .sqrt()?
        .recip()?;
    Ok((x.broadcast_mul(&r)?, r))
}

/// The gradients of `rms_norm(x, alpha, eps)` for `x` and `alpha`.
///
/// With `xhat = x * r`, `r = 1 / sqrt(mean(x^2) + eps)` and `h = g * alpha`:
/// `dx = r * (h - xhat * mean(h * xhat))`, `dalpha = sum over rows of g * xhat`.
pub(crate) fn rms_norm(
    x: &Tensor,
    alpha: &Tensor,
    grad: &Tensor,
    eps: f32,
) -> Result<(Option<Tensor>, Option<Tensor>)> {
    let (xhat, r) = normalised(x, eps, false)?;
    let g = widened(grad)?;
    let dx = if x.track_op() {
        let h = g.broadcast_mul(&widened(alpha)?)?;
        let proj = (&h * &xhat)?.mean_keepdim(D::Minus1)?;
        let dx = (h - xhat.broadcast_mul(&proj)?)?.broadcast_mul(&r)?;
        Some(dx.to_dtype(x.dtype())?)
    } else {
        None
    };
    let dalpha = if alpha.track_op() {
        Some(sum_rows(&(&g * &xhat)?)?.to_dtype(alpha.dtype())?)
    } else {
        None
    };
    Ok((dx, dalpha))
}

/// The gradients of `layer_norm(x, alpha, beta, eps)` for `x`, `alpha` and `beta`.
///
/// With `xhat = (x - mean(x)) * r`, `r = 1 / sqrt(var(x) + eps)` and
/// `h = g * alpha`: `dx = r * (h - mean(h) - xhat * mean(h * xhat))`,
/// `dalpha = sum over rows of g * xhat`, `dbeta = sum over rows of g`.
pub(crate) fn layer_norm(
    x: &Tensor,
    alpha: &Tensor,
    beta: &Tensor,
    grad: &Tensor,
    eps: f32,
) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
    let (xhat, r) = normalised(x, eps, true)?;
    let g = widened(grad)?;
    let dx = if x.track_op() {
        let h = g.broadcast_mul(&widened(alpha)?)?;
        let mean_h = h.mean_keepdim(D::Minus1)?;
        let proj = (&h * &xhat)?.mean_keepdim(D::Minus1)?;
        let dx = h
            .broadcast_sub(&mean_h)?
            .sub(&xhat.broadcast_mul(&proj)?)?
            .broadcast_mul(&r)?;
        Some(dx.to_dtype(x.dtype())?)
    } else {
        None
    };
    let dalpha = if alpha.track_op() {
        Some(sum_rows(&(&g * &xhat)?)?.to_dtype(alpha.dtype())?)
    } else {
        None
    };
    let dbeta = if beta.track_op() {
        Some(sum_rows(&g)?.to_dtype(beta.dtype())?)
    } else {
        None
    };
    Ok((dx, dalpha, dbeta))
}

/// How a rotary embedding pairs the elements of a head and where its heads lie.
#[derive(Debug, Clone, Copy)]
pub(crate) enum RopeLayout {
    /// `rope`: `(b, h, t, d)`, element `i` pairs with `i + d/2`.
    Halves,
    /// `rope_i`: `(b, h, t, d)`, element `2i` pairs with `2i + 1`.
    Interleaved,
    /// `rope_thd`: `(b, t, h, d)`, element `i` pairs with `i + d/2`.
    HalvesThd,
}

impl RopeLayout {
    /// The two members of each rotated pair, each `(b, h, t, d/2)` or `(b, t, h, d/2)`.
    fn pairs(self, t: &Tensor) -> Result<(Tensor, Tensor)> {
        let d = t.dim(D::Minus1)?;
        match self {
            Self::Halves | Self::HalvesThd => Ok((
                t.narrow(D::Minus1, 0, d / 2)?,
                t.narrow(D::Minus1, d / 2, d / 2)?,
            )),
            Self::Interleaved => {
                let mut dims = t.dims().to_vec();
                dims.pop();
                dims.extend([d / 2, 2]);
                let t = t.reshape(dims)?;
                Ok((
                    t.narrow(D::Minus1, 0, 1)?.squeeze(D::Minus1)?,
                    t.narrow(D::Minus1, 1, 1)?.squeeze(D::Minus1)?,
                ))
            }
        }
    }

    /// The dimension of the heads, summed over for the `cos`/`sin` gradients.
    fn head_dim(self) -> usize {
        match self {
            Self::Halves | Self::Interleaved => 1,
            Self::HalvesThd => 2,
        }
    }
}

/// The gradient of a `cos`/`sin` table from per-element products `p` of
/// shape `(b, h, t, d/2)` (or `(b, t, h, d/2)`): summed over the heads, and
/// over the batch for a 2D table; rows past the sequence get zeros.
fn table_grad(p: &Tensor, layout: RopeLayout, table: &Tensor) -> Result<Tensor> {
    let mut p = p.sum(layout.head_dim())?;
    if table.rank() == 2 {
        p = p.sum(0)?;
    }
    let t_dim = table.rank() - 2;
    let (rows, seq) = (table.dim(t_dim)?, p.dim(t_dim)?);
    if rows > seq {
        let mut dims = p.dims().to_vec();
        dims[t_dim] = rows - seq;
        let pad = Tensor::zeros(dims, p.dtype(), p.device())?;
        p = Tensor::cat(&[&p, &pad], t_dim)?;
    }
    p.to_dtype(table.dtype())
}

/// The gradients of a rotary embedding `fwd(x, cos, sin)` for `x`, `cos` and `sin`.
///
/// A rotation's gradient is the rotation by the opposite angle, so
/// `dx = fwd(g, cos, -sin)` runs the fused forward again. For a pair
/// `(x1, x2)` rotated to `(x1 cos - x2 sin, x1 sin + x2 cos)`:
/// `dcos = g1 x1 + g2 x2` and `dsin = g2 x1 - g1 x2`, summed over the heads.
pub(crate) fn rotary(
    fwd: fn(&Tensor, &Tensor, &Tensor) -> Result<Tensor>,
    layout: RopeLayout,
    x: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    grad: &Tensor,
) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
    let dx = if x.track_op() {
        Some(fwd(&grad.contiguous()?, &cos.detach(), &sin.detach().neg()?)?)
    } else {
        None
    };
    if !cos.track_op() && !sin.track_op() {
        return Ok((dx, None, None));
    }
    let (x1, x2) = layout.pairs(&widened(x)?)?;
    let (g1, g2) = layout.pairs(&widened(grad)?)?;
    let dcos = if cos.track_op() {
        let p = ((&g1 * &x1)? + (&g2 * &x2)?)?;
        Some(table_grad(&p, layout, cos)?)
    } else {
        None
    };
    let dsin = if sin.track_op() {
        let p = ((&g2 * &x1)? - (&g1 * &x2)?)?;
        Some(table_grad(&p, layout, sin)?)
    } else {
        None
    };
    Ok((dx, dcos, dsin))
}

/// `attention::flash_attn` when a backward can reach `q`, `k` or `v`: the
/// CPU flash kernels write their output through `Tensor::from_vec`, which
/// would cut the graph there, so a training forward takes these composed
/// (differentiable) ops instead, with the same inputs and result:
/// `q (B, S, H, D)`, `k`/`v (B, KV_S, KV_H, D)` (grouped-query heads
/// repeated), output `(B, H, S, D)`. Scores are computed in f32.
///
/// ALiBi (`max_bias`) has no composed form here: an error, not a cut graph.
pub(crate) fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    softmax_scale: f32,
    attn_mask: &crate::attention::AttnMask,
    max_bias: Option<f32>,
    softcap: Option<f32>,
) -> Result<Tensor> {
    use crate::attention::AttnMask;
    if max_bias.is_some_and(|b| b > 0.0) {
        candle::bail!(
            "attention::flash_attn: ALiBi (max_bias) has no backward; \
             train with a composed attention instead"
        )
    }
    let dtype = q.dtype();
    let (b, s_q, h_q, d) = q.dims4()?;
    let (_, s_kv, h_kv, _) = k.dims4()?;
    if h_kv == 0 || h_q % h_kv != 0 {
        candle::bail!("attention::flash_attn: {h_q} query heads over {h_kv} key/value heads")
    }
    let heads = |t: &Tensor| -> Result<Tensor> {
        // (B, KV_S, KV_H, D) -> (B, H, KV_S, D), each key/value head repeated.
        let t = widened(t)?.transpose(1, 2)?;
        let t = t.unsqueeze(2)?.broadcast_as((b, h_kv, h_q / h_kv, s_kv, d))?;
        t.reshape((b, h_q, s_kv, d))
    };
    let (k, v) = (heads(k)?, heads(v)?);
    let q = widened(q)?.transpose(1, 2)?.contiguous()?;
    let mut scores = (q.matmul(&k.t()?)? * softmax_scale as f64)?;
    if let Some(cap) = softcap.filter(|&c| c != 0.0) {
        scores = ((scores / cap as f64)?.tanh()? * cap as f64)?;
    }
    let additive = match attn_mask {
        AttnMask::None => None,
        AttnMask::Causal { kv_offset } => {
            let rows: Vec<f32> = (0..s_q)
                .flat_map(|i| {
                    (0..s_kv).map(move |j| if j <= i + kv_offset { 0.0 } else { f32::NEG_INFINITY })
                })
                .collect();
            Some(Tensor::from_vec(rows, (s_q, s_kv), q.device())?)
        }
        AttnMask::Mask(m) => Some(m.clone()),
    };
    if let Some(mask) = additive {
        scores = scores.broadcast_add(&mask.to_dtype(scores.dtype())?)?;
    }
    let probs = crate::ops::softmax_last_dim(&scores)?;
    probs.matmul(&v.contiguous()?)?.to_dtype(dtype)
}
