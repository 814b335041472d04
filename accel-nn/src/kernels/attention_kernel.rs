//! What an attention kernel takes: the mask, the shapes of a call, the f32
//! views of its operands, and the [`Kernel`] trait the reference kernel
//! (`attention.rs`) and the tiled one (`flash.rs`) implement. `attention.rs`
//! picks between the kernels, so the tiled kernel takes these from here, not
//! from it (the two files imported each other).

use candle_core::{bail, Result, Tensor};

use super::with_strided_f32;

/// What the fused kernel masks: keys after `offset + i` for query `i`
/// (causal) and/or an additive f32 bias already broadcast to `[b, h, t, s]`.
#[derive(Clone, Default)]
pub(crate) struct MaskSpec {
    /// Causal masking with the query block starting at this absolute position.
    pub causal_offset: Option<usize>,
    /// With `causal_offset`: query `i` sees only keys `j > offset + i - window`.
    pub window: Option<usize>,
    /// Additive bias, f32, broadcast to `[b, h, t, s]` (zero strides allowed).
    pub bias: Option<Tensor>,
}

impl MaskSpec {
    /// The first key query row `i` sees (0 without a window).
    pub(super) fn window_start(&self, i: usize) -> usize {
        match (self.causal_offset, self.window) {
            (Some(o), Some(w)) => (o + i + 1).saturating_sub(w),
            _ => 0,
        }
    }

    /// `f` with the bias as a strided f32 view (read in place), or `None`.
    ///
    /// # Errors
    /// A bias that is not `[b, h, t, s]`; those of `f`.
    pub(super) fn with_bias<R>(
        &self,
        dims: Dims,
        f: impl FnOnce(Bias<'_>) -> Result<R>,
    ) -> Result<R> {
        let Some(bias) = &self.bias else {
            return f(None);
        };
        if bias.dims() != [dims.b, dims.h, dims.t, dims.s] {
            bail!("attention: bias {:?} is not [b, h, t, s]", bias.dims())
        }
        with_strided_f32(bias, |data, off, st| f(Some((data, off, st))))
    }
}

/// What an attention kernel does on f32 views; `attention::Op` makes either
/// one a candle op with backward, and `attention_packed` runs either on a
/// fused qkv projection.
pub(crate) trait Kernel: Send + Sync {
    /// The kernel for `mask` and `scale`.
    fn new(mask: MaskSpec, scale: f32) -> Self;

    /// The output `[b, h, t, d]`, keeping what backward needs.
    fn run(&self, q: View<'_>, k: View<'_>, v: View<'_>, dims: Dims) -> Result<Vec<f32>>;

    /// (dq, dk, dv), contiguous, from the output `y` and its gradient `g`
    /// (both `[b, h, t, d]`, contiguous: the op's result is read back rather
    /// than kept a second time from the forward).
    fn backward(
        &self,
        q: View<'_>,
        k: View<'_>,
        v: View<'_>,
        yg: (&[f32], &[f32]),
        dims: Dims,
    ) -> Result<(Vec<f32>, Vec<f32>, Vec<f32>)>;
}

/// The additive bias as a strided f32 view `[b, h, t, s]`, if any.
pub(super) type Bias<'a> = Option<(&'a [f32], usize, &'a [usize])>;

/// A strided f32 view: (data, start offset, strides).
pub(super) type View<'a> = (&'a [f32], usize, &'a [usize]);

/// The shapes of one call.
#[derive(Clone, Copy)]
pub(super) struct Dims {
    pub(super) b: usize,
    pub(super) h: usize,
    pub(super) kvh: usize,
    pub(super) t: usize,
    pub(super) s: usize,
    pub(super) d: usize,
}

impl Dims {
    /// The shapes of q `[b, h, t, d]` and k, v `[b, kv_h, s, d]`.
    pub(super) fn of(q: &[usize], k: &[usize], v: &[usize]) -> Result<Self> {
        let ([b, h, t, d], [kb, kvh, s, kd], [vb, vh, vs, vd]) = (q, k, v) else {
            bail!("attention: q {q:?}, k {k:?} and v {v:?} must be 4-D")
        };
        if (kb, kd) != (b, d) || (vb, vh, vs, vd) != (b, kvh, s, d) || *kvh == 0 || h % kvh != 0 {
            bail!("attention: q {q:?} needs k and v [{b}, kv_heads dividing {h}, s, {d}], got {k:?} and {v:?}")
        }
        Ok(Self {
            b: *b,
            h: *h,
            kvh: *kvh,
            t: *t,
            s: *s,
            d: *d,
        })
    }
}
