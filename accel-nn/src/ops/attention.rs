//! Scaled dot-product attention with causal/additive masks and grouped-
//! query heads, fused on CPU (forward and backward), composed elsewhere.

use candle_core::{bail, DType, Device, Result, Tensor, D};

use super::{fused, fused_cuda, upcast};
use crate::kernels::{self, MaskSpec};

/// Which keys each query may attend to.
///
/// Shapes: q is `[b, h, t, d]`, k/v are `[b, kv_h, s, d]`. A row whose keys
/// are all masked (`-inf`) outputs 0 and passes no gradient (PyTorch gives
/// NaN); finite "large negative" masks behave exactly as in PyTorch.
#[derive(Debug, Clone, Default)]
pub enum AttentionMask {
    /// Every query sees every key (encoders, cross-attention).
    #[default]
    None,
    /// Query `i` sits at absolute position `offset + i` and sees keys
    /// `0..=offset + i`. With a KV cache, `offset` is the number of cached
    /// positions before this call, so `s == offset + t`; without one, 0.
    Causal {
        /// Absolute position of the first query.
        offset: usize,
    },
    /// A bias added to the scores, broadcastable to `[b, h, t, s]`: BERT's
    /// padding mask `[b, 1, 1, s]` holding 0 or `-inf`/large negative, ALiBi
    /// or T5 position biases. It gets a gradient when it is a variable
    /// (that case runs the composed path).
    Additive(Tensor),
    /// Both: causal masking and an additive bias (a decoder with padding).
    CausalAndAdditive {
        /// As in [`AttentionMask::Causal`].
        offset: usize,
        /// As in [`AttentionMask::Additive`].
        bias: Tensor,
    },
    /// Causal within a sliding window (Mistral, Gemma's local layers): query
    /// `i` at position `offset + i` sees keys `j` with
    /// `offset + i - window < j <= offset + i`. The kernels skip the key
    /// tiles outside the window: work `O(t * window)`, not `O(t * s)`.
    SlidingWindow {
        /// As in [`AttentionMask::Causal`].
        offset: usize,
        /// Keys a query sees, itself included.
        window: usize,
        /// An additive bias as well, if any.
        bias: Option<Tensor>,
    },
}

impl AttentionMask {
    /// (causal offset, additive bias) of the mask.
    fn parts(&self) -> (Option<usize>, Option<&Tensor>) {
        match self {
            AttentionMask::None => (None, None),
            AttentionMask::Causal { offset } => (Some(*offset), None),
            AttentionMask::Additive(bias) => (None, Some(bias)),
            AttentionMask::CausalAndAdditive { offset, bias } => (Some(*offset), Some(bias)),
            AttentionMask::SlidingWindow { offset, bias, .. } => (Some(*offset), bias.as_ref()),
        }
    }

    /// The sliding window, if any.
    fn window(&self) -> Option<usize> {
        match self {
            AttentionMask::SlidingWindow { window, .. } => Some(*window),
            _ => None,
        }
    }

    /// The kernels' form of the mask for `[b, h, t, s]` scores: the causal
    /// offset, and the bias in f32 broadcast to the scores' shape.
    fn spec(&self, dims: (usize, usize, usize, usize)) -> Result<MaskSpec> {
        let (offset, bias) = self.parts();
        let bias = bias
            .map(|bias| bias.to_dtype(DType::F32)?.broadcast_as(dims))
            .transpose()?;
        Ok(MaskSpec {
            causal_offset: offset,
            window: self.window(),
            bias,
        })
    }
}

/// Whether CUDA tensors take the tiled kernels of `attention.cu` (forward,
/// and a backward that recomputes the probabilities; nothing `[t, s]` is
/// stored). Off until a GPU run of `scripts/gpu_check.sh` has passed
/// `cuda_attention_matches_...` (in `attention/tests.rs`): the kernels
/// compile in CI but have never run.
const CUDA_ATTENTION_CHECKED: bool = false;

/// Whether q, k, v (and the mask's bias) take the CUDA kernels.
fn takes_cuda(q: &Tensor, k: &Tensor, v: &Tensor, bias_is_constant: bool) -> bool {
    CUDA_ATTENTION_CHECKED
        && bias_is_constant
        && fused_cuda(q)
        && kernels::attention_cuda_supported(q, k, v)
}

/// `softmax(q k^T * scale + mask) v`, per head, for q `[b, h, t, d]` and
/// k, v `[b, kv_h, s, d]` where `kv_h` divides `h` (query head `i` uses kv
/// head `i / (h / kv_h)`, HF's `repeat_kv` order; the fused kernel reads the
/// shared head in place instead of copying it). Returns `[b, h, t, d]`.
///
/// q, k and v may be strided views (e.g. heads split out of a fused qkv
/// projection by `reshape` + `transpose`): the CPU kernel reads them in
/// place when their last dimension is contiguous.
pub fn scaled_dot_product_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: &AttentionMask,
    scale: f64,
) -> Result<Tensor> {
    let (b, h, t, d) = q.dims4()?;
    let (kb, kvh, s, kd) = k.dims4()?;
    if (kb, kd) != (b, d) || v.dims() != [b, kvh, s, d] || kvh == 0 || h % kvh != 0 {
        bail!(
            "attention: q {:?} needs k and v [{b}, kv_heads dividing {h}, s, {d}], got {:?} and {:?}",
            q.dims(),
            k.dims(),
            v.dims()
        )
    }
    let (_, bias) = mask.parts();
    let same_dtype = k.dtype() == q.dtype() && v.dtype() == q.dtype();
    let bias_is_constant = bias.is_none_or(|b| !b.track_op());
    let cuda = takes_cuda(q, k, v, bias_is_constant);
    if !(cuda || fused(q) && same_dtype && bias_is_constant) {
        return composed_attention(q, k, v, mask, scale);
    }
    let spec = mask.spec((b, h, t, s))?;
    if cuda {
        return kernels::attention_cuda(q, k, v, spec, scale);
    }
    kernels::attention(q, k, v, spec, scale)
}

/// [`scaled_dot_product_attention`] on the CUDA kernels of `attention.cu`
/// whatever the default path is (as `torch.nn.attention.sdpa_kernel`
/// forces a backend): what `scripts/gpu_check.sh` checks and
/// `bench_attention --device cuda` times before the kernels become the
/// default on CUDA.
///
/// # Errors
/// Tensors that are not on a CUDA device, mixed dtypes, a head dim past
/// 128, a bias that is a variable; those of the kernels.
pub fn cuda_flash_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: &AttentionMask,
    scale: f64,
) -> Result<Tensor> {
    let (b, h, t, _) = q.dims4()?;
    let s = k.dim(2)?;
    let (_, bias) = mask.parts();
    if !(fused_cuda(q) && kernels::attention_cuda_supported(q, k, v)) {
        bail!(
            "cuda_flash_attention: q {:?} {:?} on {:?} needs CUDA tensors of one float dtype with \
             a head dim up to 128",
            q.dims(),
            q.dtype(),
            q.device().location()
        )
    }
    if bias.is_some_and(|b| b.track_op()) {
        bail!("cuda_flash_attention: the bias is a variable; its gradient needs the composed path")
    }
    kernels::attention_cuda(q, k, v, mask.spec((b, h, t, s))?, scale)
}

/// Self-attention straight from a fused qkv projection: `qkv [b, t, 3 *
/// n_head * hd]` holds the q, k and v blocks (heads concatenated inside
/// each, GPT-2's `c_attn` layout); returns the merged heads `[b, t, n_head
/// * hd]`. Same maths as [`scaled_dot_product_attention`] with `s == t`;
/// on CPU it also skips the three zero-padded gradient `cat`s that
/// splitting heads with `narrow` costs in backward.
pub fn attention_qkv(
    qkv: &Tensor,
    n_head: usize,
    mask: &AttentionMask,
    scale: f64,
) -> Result<Tensor> {
    let (b, t, three_d) = qkv.dims3()?;
    if n_head == 0 || three_d % (3 * n_head) != 0 {
        bail!(
            "attention_qkv: qkv {:?} is not [b, t, 3 * {n_head} * head_dim]",
            qkv.dims()
        )
    }
    let (_, bias) = mask.parts();
    let bias_is_constant = bias.is_none_or(|b| !b.track_op());
    if CUDA_ATTENTION_CHECKED && bias_is_constant && fused_cuda(qkv) {
        // Heads split with views; the kernels read them in place.
        let d = three_d / 3;
        let x = qkv.reshape((b, t, 3, n_head, d / n_head))?;
        let part = |i| x.narrow(2, i, 1)?.squeeze(2)?.transpose(1, 2);
        let (q, k, v) = (part(0)?, part(1)?, part(2)?);
        let y = scaled_dot_product_attention(&q, &k, &v, mask, scale)?;
        return y.transpose(1, 2)?.reshape((b, t, d));
    }
    if !(fused(qkv) && bias_is_constant) {
        return composed_attention_qkv(qkv, n_head, mask, scale);
    }
    kernels::attention_packed(qkv, n_head, mask.spec((b, n_head, t, t))?, scale)
}

/// Composed [`attention_qkv`]: split heads with views, composed attention,
/// merge heads.
pub fn composed_attention_qkv(
    qkv: &Tensor,
    n_head: usize,
    mask: &AttentionMask,
    scale: f64,
) -> Result<Tensor> {
    let (b, t, three_d) = qkv.dims3()?;
    let d = three_d / 3;
    let x = qkv.reshape((b, t, 3, n_head, d / n_head))?;
    let part = |i| x.narrow(2, i, 1)?.squeeze(2)?.transpose(1, 2);
    let y = composed_attention(&part(0)?, &part(1)?, &part(2)?, mask, scale)?;
    y.transpose(1, 2)?.reshape((b, t, d))
}

/// The additive causal mask `[t, s]`: 0 where query `i` may see key `j`
/// (`j <= offset + i`, and `offset + i - j < window` with a window),
/// `-inf` elsewhere.
fn causal_bias(
    t: usize,
    s: usize,
    (offset, window): (usize, Option<usize>),
    dtype: DType,
    device: &Device,
) -> Result<Tensor> {
    let window = window.unwrap_or(usize::MAX);
    let mask: Vec<f32> = (0..t)
        .flat_map(|i| {
            (0..s).map(move |j| {
                if j <= offset + i && offset + i - j < window {
                    0.0
                } else {
                    f32::NEG_INFINITY
                }
            })
        })
        .collect();
    Tensor::from_vec(mask, (t, s), device)?.to_dtype(dtype)
}

/// Composed attention, in f32 for half inputs: `repeat_kv`, masked scores,
/// a softmax whose fully masked rows give 0, and the weighted sum.
pub fn composed_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: &AttentionMask,
    scale: f64,
) -> Result<Tensor> {
    let dtype = q.dtype();
    // candle's matmul refuses views strided in the batch dimensions (heads
    // split out of a fused projection), hence the contiguous copies.
    let (q, k, v) = (
        upcast(q)?.contiguous()?,
        upcast(k)?.contiguous()?,
        upcast(v)?.contiguous()?,
    );
    let compute = q.dtype();
    let (b, h, t, d) = q.dims4()?;
    let (_, kvh, s, _) = k.dims4()?;
    let n_rep = h / kvh;
    let repeat = |x: Tensor| -> Result<Tensor> {
        if n_rep == 1 {
            return Ok(x);
        }
        x.unsqueeze(2)?
            .broadcast_as((b, kvh, n_rep, s, d))?
            .reshape((b, h, s, d))
    };
    let (k, v) = (repeat(k.to_dtype(compute)?)?, repeat(v.to_dtype(compute)?)?);
    let mut scores = (q.matmul(&k.t()?)? * scale)?;
    let (offset, bias) = mask.parts();
    if let Some(offset) = offset {
        let causal = causal_bias(t, s, (offset, mask.window()), compute, q.device())?;
        scores = scores.broadcast_add(&causal)?;
    }
    if let Some(bias) = bias {
        scores = scores.broadcast_add(&bias.to_dtype(compute)?)?;
    }
    // Softmax with the max detached (it cancels mathematically) and made 0
    // for rows with no finite score, whose exps are then all 0; their
    // denominator becomes 1 so the row is 0 rather than 0/0.
    let max = scores.max_keepdim(D::Minus1)?.detach();
    let finite = max.ne(f64::NEG_INFINITY)?;
    let max = finite.where_cond(&max, &max.zeros_like()?)?;
    let e = scores.broadcast_sub(&max)?.exp()?;
    let sum = e.sum_keepdim(D::Minus1)?;
    let empty = sum.eq(0.0)?.to_dtype(compute)?;
    let p = e.broadcast_div(&(sum + empty)?)?;
    p.matmul(&v)?.to_dtype(dtype)
}

#[cfg(test)]
mod tests;
