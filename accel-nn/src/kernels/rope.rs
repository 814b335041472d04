//! Rotary position embeddings as one elementwise op.
//!
//! The composed `rotate_half` form is two `narrow`s, a `cat` and four
//! products, and its backward zero-pads each narrow; the rotation is
//! linear, so its backward is the same rotation with `sin` negated and one
//! pass each way suffices. The cos/sin tables are constants (no gradient).

use candle_core::backend::BackendStorage;
use candle_core::{
    bail, CpuStorage, CudaStorage, CustomOp1, CustomOp3, Layout, Result, Shape, Tensor,
};

use super::raw::par;
use super::{as_f32, from_f32, rows_per_task, tensor_from_f32, with_f32};

/// The op: tables `[t, d/2]` in f32 and the pairing convention.
struct Rope {
    cos: Vec<f32>,
    sin: Vec<f32>,
    interleaved: bool,
}

/// Rotates `x [b, h, t, d]` by the angles whose cos/sin are `[t, d/2]`:
/// pairs `(i, i + d/2)` (HF `rotate_half`) or, when `interleaved`,
/// `(2i, 2i + 1)` (GPT-J, original RoFormer). CPU tensors of the fused
/// dtypes, or f32 CUDA tensors (`rope.cu`, bitwise this CPU kernel; see
/// `ops::rope::CUDA_ROPE_CHECKED`).
pub(crate) fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor, interleaved: bool) -> Result<Tensor> {
    let (_, _, t, d) = x.dims4()?;
    if d % 2 != 0 || cos.dims() != [t, d / 2] || sin.dims() != [t, d / 2] {
        bail!(
            "rope: x {:?} needs cos/sin [{t}, {}], got {:?} and {:?}",
            x.dims(),
            d / 2,
            cos.dims(),
            sin.dims()
        )
    }
    if x.device().is_cuda() {
        let op = RopeCuda {
            interleaved,
            inverse: false,
        };
        return x
            .contiguous()?
            .apply_op3(&cos.contiguous()?, &sin.contiguous()?, op);
    }
    let cos = with_f32(cos, |c| Ok(c.to_vec()))?;
    let sin = with_f32(sin, |s| Ok(s.to_vec()))?;
    x.contiguous()?.apply_op1(Rope {
        cos,
        sin,
        interleaved,
    })
}

impl Rope {
    /// Rotates every `d`-wide row of `x` (rows cycle through the `t`
    /// positions) into `y`; `sign = -1` gives the inverse rotation.
    fn rotate(&self, x: &[f32], d: usize, sign: f32) -> Vec<f32> {
        let half = d / 2;
        let t = self.cos.len() / half.max(1);
        let rows = rows_per_task(x.len() / d, d);
        par::new_vec(x.len(), rows * d, |task, y| {
            let x = &x[task * rows * d..][..y.len()];
            for (r, (y, x)) in y.chunks_exact_mut(d).zip(x.chunks_exact(d)).enumerate() {
                let pos = (task * rows + r) % t;
                let cos = &self.cos[pos * half..(pos + 1) * half];
                let sin = &self.sin[pos * half..(pos + 1) * half];
                if self.interleaved {
                    for i in 0..half {
                        let (a, b, c, s) = (x[2 * i], x[2 * i + 1], cos[i], sign * sin[i]);
                        y[2 * i] = a * c - b * s;
                        y[2 * i + 1] = a * s + b * c;
                    }
                } else {
                    let (x1, x2) = x.split_at(half);
                    let (y1, y2) = y.split_at_mut(half);
                    for i in 0..half {
                        let (a, b, c, s) = (x1[i], x2[i], cos[i], sign * sin[i]);
                        y1[i] = a * c - b * s;
                        y2[i] = b * c + a * s;
                    }
                }
            }
        })
    }
}

impl CustomOp1 for Rope {
    fn name(&self) -> &'static str {
        "accel-rope"
    }

    fn backward_reads_output(&self) -> bool {
        false
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let x = as_f32(s, l)?;
        let d = l.dims()[3];
        Ok((
            from_f32(self.rotate(&x, d, 1.0), s.dtype())?,
            l.shape().clone(),
        ))
    }

    fn bwd(&self, x: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let d = x.dim(3)?;
        let dx = with_f32(grad, |g| Ok(self.rotate(g, d, -1.0)))?;
        Ok(Some(tensor_from_f32(dx, x.shape(), x.dtype())?))
    }
}

/// The rotation on CUDA as an op over `(x, cos, sin)`, differentiable in
/// `x` only (the tables are constants): its backward is the inverse
/// rotation, the same op with `inverse` set.
#[derive(Clone, Copy)]
struct RopeCuda {
    interleaved: bool,
    inverse: bool,
}

impl CustomOp3 for RopeCuda {
    fn name(&self) -> &'static str {
        "accel-rope-cuda"
    }

    fn backward_reads_output(&self) -> bool {
        false
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        bail!("accel-rope-cuda runs on CUDA only (the CPU op is Rope)")
    }

    fn cuda_fwd(
        &self,
        x: &CudaStorage,
        xl: &Layout,
        cos: &CudaStorage,
        cl: &Layout,
        sin: &CudaStorage,
        sl: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let y = accel_kernels::cuda::rope_rotate(
            (x, xl),
            (cos, cl),
            (sin, sl),
            self.interleaved,
            self.inverse,
        )
        .map_err(candle_core::Error::wrap)?;
        Ok((y, xl.shape().clone()))
    }

    fn bwd(
        &self,
        _x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let back = RopeCuda {
            inverse: !self.inverse,
            ..*self
        };
        let dx = grad.contiguous()?.apply_op3_no_bwd(cos, sin, &back)?;
        Ok((Some(dx), None, None))
    }
}
