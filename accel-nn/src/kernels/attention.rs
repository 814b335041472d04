//! Scaled dot-product attention with causal and additive masks and
//! grouped-query heads, as one op with a fused backward.
//!
//! The composed version copies k and v `n_rep` times (`repeat_kv`),
//! materialises the mask, runs a five-op softmax, and in backward walks all
//! of it again. Here every (batch, head) is one task on the pool whose gemms read
//! q, k and v in place with their own strides (a head split of a fused qkv
//! projection costs no copy), and query heads index their shared kv head
//! directly. Backward runs one task per (batch, kv head), which owns that
//! head's dk/dv and its query group's dq, so tasks write disjoint chunks.

use std::sync::Mutex;

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp3, DType, Layout, Result, Shape, Tensor};

pub(crate) use super::attention_kernel::MaskSpec;
use super::attention_kernel::{Bias, Dims, Kernel, View};
use super::flash::Flash;
use super::raw::{gemm, gemm_new, par, MatRef};
use super::{from_f32, math, strided_f32, tensor_from_f32, with_f32, with_strided_f32};

/// The reference kernel: it keeps the probabilities `[b*h, t, s]` for
/// backward and runs its products over the whole square. The default is
/// the tiled [`Flash`]; this one stays as the reference the tests compare
/// it against ([`attention_reference`]).
pub(crate) struct Attention {
    pub(super) mask: MaskSpec,
    pub(super) scale: f32,
    pub(super) probs: Mutex<Option<Vec<f32>>>,
}

/// A [`Kernel`] as a candle op.
pub(crate) struct Op<K>(pub K);

/// `softmax(q k^T * scale + mask) v` per head for q `[b, h, t, d]` and k, v
/// `[b, kv_h, s, d]` (`kv_h` divides `h`; query head `i` reads kv head
/// `i / (h / kv_h)`, as HF's `repeat_kv`). Rows with no visible key give 0.
/// Runs the kernel [`attention_kernel`] picks for these shapes (see
/// [`AttentionKernel::Auto`]).
pub(crate) fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: MaskSpec,
    scale: f64,
) -> Result<Tensor> {
    let (b, h, t, _) = q.dims4()?;
    let s = k.dim(2)?;
    match attention_kernel()?.resolve(b * h, t, s) {
        AttentionKernel::Reference => apply::<Attention>(q, k, v, mask, scale),
        _ => apply::<Flash>(q, k, v, mask, scale),
    }
}

/// The most probabilities (elements, over all heads) for which
/// [`AttentionKernel::Auto`] runs the reference kernel: 64 MiB of f32.
const REFERENCE_PROBS: usize = 16 << 20;

/// The CPU attention kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttentionKernel {
    /// The reference kernel while its probabilities fit 64 MiB (short
    /// sequences: one product per head beats many tile products, 2.7 ms
    /// against 7.1 ms at 256 tokens and 8 heads), the tiled one past that,
    /// so memory stays bounded by a constant plus what grows linearly.
    Auto,
    /// Tiled with an online softmax (FlashAttention-2's algorithm): memory
    /// linear in the sequence length, causal tiles above the diagonal skipped.
    Tiled,
    /// The whole `[t, s]` probabilities per head, kept for backward.
    Reference,
}

impl AttentionKernel {
    /// `"auto"`, `"tiled"` or `"reference"`, as the setup lines of the
    /// examples report it.
    pub fn name(self) -> &'static str {
        match self {
            Self::Auto => "auto",
            Self::Tiled => "tiled",
            Self::Reference => "reference",
        }
    }

    /// The kernel that runs `heads` heads (batch times heads) of `t` queries
    /// over `s` keys: [`AttentionKernel::Auto`] resolved, the others as they are.
    pub fn resolve(self, heads: usize, t: usize, s: usize) -> Self {
        match self {
            Self::Auto if heads.saturating_mul(t).saturating_mul(s) <= REFERENCE_PROBS => {
                Self::Reference
            }
            Self::Auto => Self::Tiled,
            k => k,
        }
    }
}

/// The kernel choice of the fused CPU attention: `ACCEL_ATTENTION` (`auto`,
/// the default, `tiled` or `reference`), read once.
///
/// # Errors
/// Another value, naming the variable.
pub fn attention_kernel() -> Result<AttentionKernel> {
    static CHOICE: std::sync::OnceLock<std::result::Result<AttentionKernel, String>> =
        std::sync::OnceLock::new();
    CHOICE
        .get_or_init(|| match std::env::var("ACCEL_ATTENTION").as_deref() {
            Err(_) | Ok("auto") | Ok("") => Ok(AttentionKernel::Auto),
            Ok("tiled") => Ok(AttentionKernel::Tiled),
            Ok("reference") => Ok(AttentionKernel::Reference),
            Ok(other) => Err(format!(
                "ACCEL_ATTENTION={other:?}: the CPU attention kernel is `auto`, `tiled` or \
                 `reference`"
            )),
        })
        .clone()
        .map_err(candle_core::Error::msg)
}

/// [`attention`] with the tiled kernel ([`Flash`]), for tests.
#[cfg(test)]
pub(crate) fn attention_tiled(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: MaskSpec,
    scale: f64,
) -> Result<Tensor> {
    apply::<Flash>(q, k, v, mask, scale)
}

/// [`attention`] with the reference kernel ([`Attention`]), for tests.
#[cfg(test)]
pub(crate) fn attention_reference(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: MaskSpec,
    scale: f64,
) -> Result<Tensor> {
    apply::<Attention>(q, k, v, mask, scale)
}

fn apply<K: Kernel + 'static>(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: MaskSpec,
    scale: f64,
) -> Result<Tensor> {
    // gemm needs unit stride along the head dimension; half inputs are
    // converted, which needs them contiguous.
    let prep = |t: &Tensor| -> Result<Tensor> {
        if t.dtype() != DType::F32 || t.stride().last() != Some(&1) {
            t.contiguous()
        } else {
            Ok(t.clone())
        }
    };
    let (q, k, v) = (prep(q)?, prep(k)?, prep(v)?);
    q.apply_op3(&k, &v, Op(K::new(mask, scale as f32)))
}

multiversion! {
    /// Softmax of the first `live` entries of a row, zeros after them; a
    /// row with no finite score becomes all zeros (nothing to attend to).
    fn masked_softmax_row(row: &mut [f32], live: usize) {
        let (l, dead) = row.split_at_mut(live);
        dead.fill(0.0);
        let max = math::max(l);
        if max == f32::NEG_INFINITY {
            l.fill(0.0);
            return;
        }
        for v in l.iter_mut() {
            *v = if *v == f32::NEG_INFINITY { 0.0 } else { math::exp(*v - max) };
        }
        let inv = 1.0 / math::sum(l);
        l.iter_mut().for_each(|v| *v *= inv);
    }
}

multiversion! {
    /// Softmax backward in place: `ds = p * (ds - rowsum(ds * p)) * scale`
    /// for rows of length `s`, where `ds` holds dP on entry.
    fn softmax_backward_rows(ds: &mut [f32], p: &[f32], s: usize, scale: f32) {
        for (dp, pr) in ds.chunks_exact_mut(s).zip(p.chunks_exact(s)) {
            let dot = math::dot(dp, pr);
            dp.iter_mut().zip(pr).for_each(|(a, &b)| *a = b * (*a - dot) * scale);
        }
    }
}

impl Attention {
    /// Adds the bias and applies the masked softmax to the scores `p [t, s]`
    /// of batch `bi`, head `hi`.
    fn probabilities(&self, p: &mut [f32], bi: usize, hi: usize, dims: Dims, bias: Bias<'_>) {
        let (t, s) = (dims.t, dims.s);
        for (i, row) in p.chunks_exact_mut(s.max(1)).take(t).enumerate() {
            if let Some((data, off, st)) = bias {
                let base = off + bi * st[0] + hi * st[1] + i * st[2];
                for (j, v) in row.iter_mut().enumerate() {
                    *v += data[base + j * st[3]];
                }
            }
            let live = match self.mask.causal_offset {
                Some(o) => (o + i + 1).min(s),
                None => s,
            };
            let dead = self.mask.window_start(i).min(live);
            row[..dead].fill(f32::NEG_INFINITY);
            masked_softmax_row(row, live);
        }
    }

    fn forward(
        &self,
        q: (&[f32], usize, &[usize]),
        k: (&[f32], usize, &[usize]),
        v: (&[f32], usize, &[usize]),
        dims: Dims,
        bias: Bias<'_>,
    ) -> (Vec<f32>, Vec<f32>) {
        let Dims { b, h, kvh, t, s, d } = dims;
        let n_rep = h / kvh;
        let mut y = vec![0f32; b * h * t * d];
        let mut probs = vec![0f32; b * h * t * s];
        let par = b * h < par::threads();
        if t == 0 || d == 0 {
            return (y, probs);
        }
        par::chunks_mut2(&mut y, t * d, &mut probs, (t * s).max(1), |bh, y, p| {
            let (bi, hi) = (bh / h, bh % h);
            let kv = hi / n_rep;
            let qo = q.1 + bi * q.2[0] + hi * q.2[1];
            let ko = k.1 + bi * k.2[0] + kv * k.2[1];
            let vo = v.1 + bi * v.2[0] + kv * v.2[1];
            gemm(
                (t, s, d),
                p,
                0,
                s,
                false,
                MatRef::rows(q.0, qo, q.2[2]),
                MatRef::rows_t(k.0, ko, k.2[2]),
                self.scale,
                par,
            );
            self.probabilities(p, bi, hi, dims, bias);
            gemm(
                (t, d, s),
                y,
                0,
                d,
                false,
                MatRef::rows(p, 0, s),
                MatRef::rows(v.0, vo, v.2[2]),
                1.0,
                par,
            );
        });
        (y, probs)
    }
}

impl Kernel for Attention {
    fn new(mask: MaskSpec, scale: f32) -> Self {
        Self {
            mask,
            scale,
            probs: Mutex::new(None),
        }
    }

    /// The forward pass with the mask's bias read in place: returns the
    /// output `[b, h, t, d]` and keeps the probabilities for backward.
    fn run(&self, q: View<'_>, k: View<'_>, v: View<'_>, dims: Dims) -> Result<Vec<f32>> {
        let (y, probs) = self
            .mask
            .with_bias(dims, |bias| Ok(self.forward(q, k, v, dims, bias)))?;
        *self.probs.lock().unwrap() = Some(probs);
        Ok(y)
    }

    /// (dq, dk, dv), contiguous `[b, h, t, d]` / `[b, kv_h, s, d]`, from the
    /// stored probabilities and the output gradient `g [b, h, t, d]`.
    fn backward(
        &self,
        q: View<'_>,
        k: View<'_>,
        v: View<'_>,
        (_, g): (&[f32], &[f32]),
        dims: Dims,
    ) -> Result<(Vec<f32>, Vec<f32>, Vec<f32>)> {
        let Dims { b, h, kvh, t, s, d } = dims;
        let n_rep = h / kvh;
        let guard = self.probs.lock().unwrap();
        let Some(probs) = guard.as_ref() else {
            bail!("attention backward without its forward state")
        };
        let mut dq = vec![0f32; b * h * t * d];
        let mut dk = vec![0f32; b * kvh * s * d];
        let mut dv = vec![0f32; b * kvh * s * d];
        if t == 0 || s == 0 || d == 0 {
            return Ok((dq, dk, dv));
        }
        let par = b * kvh < par::threads();
        let ((qd, qo, qs), (kd, ko, ks), (vd, vo, vs)) = (q, k, v);
        par::chunks_mut3(
            (&mut dq, n_rep * t * d),
            (&mut dk, s * d),
            (&mut dv, s * d),
            |group, dq, dk, dv| {
                let (bi, kv) = (group / kvh, group % kvh);
                let ko = ko + bi * ks[0] + kv * ks[1];
                let vo = vo + bi * vs[0] + kv * vs[1];
                for r in 0..n_rep {
                    let hi = kv * n_rep + r;
                    let bh = bi * h + hi;
                    let qo = qo + bi * qs[0] + hi * qs[1];
                    let p = &probs[bh * t * s..(bh + 1) * t * s];
                    let dy = MatRef::rows(g, bh * t * d, d);
                    // dP = dY V^T
                    let mut ds = gemm_new((t, s, d), dy, MatRef::rows_t(vd, vo, vs[2]), par);
                    // dV += P^T dY
                    let p_t = MatRef::rows_t(p, 0, s);
                    gemm((s, d, t), dv, 0, d, r > 0, p_t, dy, 1.0, par);
                    // dS = P * (dP - rowsum(dP * P)) * scale; 0 where P is.
                    softmax_backward_rows(&mut ds, p, s, self.scale);
                    // dQ = dS K, dK += dS^T Q
                    let (ds_rows, ds_t) = (MatRef::rows(&ds, 0, s), MatRef::rows_t(&ds, 0, s));
                    let k_rows = MatRef::rows(kd, ko, ks[2]);
                    gemm(
                        (t, d, s),
                        dq,
                        r * t * d,
                        d,
                        false,
                        ds_rows,
                        k_rows,
                        1.0,
                        par,
                    );
                    let q_rows = MatRef::rows(qd, qo, qs[2]);
                    gemm((s, d, t), dk, 0, d, r > 0, ds_t, q_rows, 1.0, par);
                }
            },
        );
        Ok((dq, dk, dv))
    }
}

impl<K: Kernel> CustomOp3 for Op<K> {
    fn name(&self) -> &'static str {
        "accel-attention"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let dims = Dims::of(l1.dims(), l2.dims(), l3.dims())?;
        let (q, qo, qs) = strided_f32(s1, l1)?;
        let (k, ko, ks) = strided_f32(s2, l2)?;
        let (v, vo, vs) = strided_f32(s3, l3)?;
        let y = self
            .0
            .run((&q, qo, &qs), (&k, ko, &ks), (&v, vo, &vs), dims)?;
        Ok((from_f32(y, s1.dtype())?, l1.shape().clone()))
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let dims = Dims::of(q.dims(), k.dims(), v.dims())?;
        let (dq, dk, dv) = with_strided_f32(q, |qd, qo, qs| {
            with_strided_f32(k, |kd, ko, ks| {
                with_strided_f32(v, |vd, vo, vs| {
                    with_f32(res, |y| {
                        with_f32(grad, |g| {
                            let (q, k, v) = ((qd, qo, qs), (kd, ko, ks), (vd, vo, vs));
                            self.0.backward(q, k, v, (y, g), dims)
                        })
                    })
                })
            })
        })?;
        let grad_of = |t: &Tensor, data: Vec<f32>| -> Result<Option<Tensor>> {
            if t.track_op() {
                Ok(Some(tensor_from_f32(data, t.shape(), t.dtype())?))
            } else {
                Ok(None)
            }
        };
        Ok((grad_of(q, dq)?, grad_of(k, dk)?, grad_of(v, dv)?))
    }
}
