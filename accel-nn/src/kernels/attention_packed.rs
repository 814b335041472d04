//! Attention straight from a fused qkv projection `[b, t, 3 * h * hd]` to
//! merged heads `[b, t, h * hd]` (GPT-2's `c_attn` layout).
//!
//! Splitting heads with `narrow`/`transpose` views costs nothing forward,
//! but candle's `narrow` backward zero-pads each of the three gradients to
//! the full qkv width and adds them up: three `[b, t, 3d]` allocations,
//! `cat`s and adds per layer. This op reads q, k and v in place and writes
//! `dqkv` once; merging and splitting heads are single parallel copies.

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp1, Layout, Result, Shape, Tensor};

use super::attention::{attention_kernel, Attention, AttentionKernel};
use super::attention_kernel::{Dims, Kernel, MaskSpec};
use super::flash::Flash;
use super::raw::par;
use super::{as_f32, from_f32, tensor_from_f32, with_f32};

/// The op: an attention kernel plus the head count.
struct Packed<K> {
    inner: K,
    n_head: usize,
}

/// Attention of the q, k and v column blocks of `qkv [b, t, 3 * h * hd]`
/// (heads concatenated inside each block), returning `[b, t, h * hd]`.
pub(crate) fn attention_packed(
    qkv: &Tensor,
    n_head: usize,
    mask: MaskSpec,
    scale: f64,
) -> Result<Tensor> {
    let qkv = qkv.contiguous()?;
    let scale = scale as f32;
    let (b, t, _) = qkv.dims3()?;
    match attention_kernel()?.resolve(b * n_head, t, t) {
        AttentionKernel::Reference => qkv.apply_op1(Packed {
            inner: Attention::new(mask, scale),
            n_head,
        }),
        _ => qkv.apply_op1(Packed {
            inner: Flash::new(mask, scale),
            n_head,
        }),
    }
}

impl<K> Packed<K> {
    /// The per-head shapes of a `qkv` of shape `dims`.
    fn dims(&self, dims: &[usize]) -> Result<Dims> {
        let [b, t, three_d] = *dims else {
            bail!("attention_qkv: qkv {dims:?} must be [b, t, 3 * heads * head_dim]")
        };
        let h = self.n_head;
        if h == 0 || three_d % (3 * h) != 0 {
            bail!("attention_qkv: qkv {dims:?} is not [b, t, 3 * {h} * head_dim]")
        }
        Ok(Dims {
            b,
            h,
            kvh: h,
            t,
            s: t,
            d: three_d / (3 * h),
        })
    }
}

/// Strides `[b, h, t, hd]` of the q (or k, v) block inside `qkv`.
fn head_strides(dims: Dims) -> [usize; 4] {
    let three_d = 3 * dims.h * dims.d;
    [dims.t * three_d, dims.d, three_d, 1]
}

impl<K: Kernel + 'static> CustomOp1 for Packed<K> {
    fn name(&self) -> &'static str {
        "accel-attention-qkv"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let dims = self.dims(l.dims())?;
        let Dims { b, h, t, d: hd, .. } = dims;
        let qkv = as_f32(s, l)?;
        let st = head_strides(dims);
        let d = h * hd;
        let y = self
            .inner
            .run((&qkv, 0, &st), (&qkv, d, &st), (&qkv, 2 * d, &st), dims)?;
        // [b, h, t, hd] -> [b, t, h * hd]
        let merged = if d == 0 {
            Vec::new()
        } else {
            par::new_vec(b * t * d, d, |row, out| {
                let (bi, ti) = (row / t, row % t);
                for (hi, o) in out.chunks_exact_mut(hd).enumerate() {
                    let src = ((bi * h + hi) * t + ti) * hd;
                    o.copy_from_slice(&y[src..src + hd]);
                }
            })
        };
        Ok((from_f32(merged, s.dtype())?, Shape::from((b, t, d))))
    }

    fn bwd(&self, qkv: &Tensor, res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let dims = self.dims(qkv.dims())?;
        let Dims { b, h, t, d: hd, .. } = dims;
        let d = h * hd;
        if d == 0 || b * t == 0 {
            return Ok(Some(qkv.zeros_like()?));
        }
        // The output and its gradient, [b, t, h * hd] -> [b, h, t, hd].
        let heads = |x: &Tensor| {
            with_f32(x, |merged| {
                Ok(par::new_vec(b * t * d, t * hd, |bh, out| {
                    let (bi, hi) = (bh / h, bh % h);
                    for (ti, o) in out.chunks_exact_mut(hd).enumerate() {
                        let src = (bi * t + ti) * d + hi * hd;
                        o.copy_from_slice(&merged[src..src + hd]);
                    }
                }))
            })
        };
        let (y, g) = (heads(res)?, heads(grad)?);
        let st = head_strides(dims);
        let (dq, dk, dv) = with_f32(qkv, |x| {
            self.inner
                .backward((x, 0, &st), (x, d, &st), (x, 2 * d, &st), (&y, &g), dims)
        })?;
        // Scatter the three [b, h, t, hd] gradients into dqkv rows.
        let dqkv = par::new_vec(b * t * 3 * d, 3 * d, |row, out| {
            let (bi, ti) = (row / t, row % t);
            for (part, src) in [&dq, &dk, &dv].into_iter().enumerate() {
                for hi in 0..h {
                    let from = ((bi * h + hi) * t + ti) * hd;
                    let to = part * d + hi * hd;
                    out[to..to + hd].copy_from_slice(&src[from..from + hd]);
                }
            }
        });
        Ok(Some(tensor_from_f32(dqkv, qkv.shape(), qkv.dtype())?))
    }
}
