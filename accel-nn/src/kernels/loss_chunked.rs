//! `linear_cross_entropy` from candle's tensor ops, chunked over rows: the
//! lm head and loss for devices without the fused CPU kernel (CUDA).
//!
//! The composed path materialises the logits whole, in f32, and autograd
//! keeps them and their gradient: at GPT-2 small's 8 x 1024 tokens and
//! 50257 classes that is 1.6 GB each. Here at most `budget` logits exist at
//! once. The forward runs on detached tensors and keeps one log-sum-exp per
//! row; a custom op hands its loss to autograd, and its backward recomputes
//! each chunk's logits and turns them into their gradient, `(softmax -
//! onehot) * dy / count`, before the two products (`dx = dl w`, `dw += dl^T
//! x`, summed over chunks in f32). The products run in the operands'
//! dtype (cuBLAS on the tensor cores for bf16), the softmax in f32. Nothing
//! is read back to the host.

use candle_core::backend::BackendStorage;
use candle_core::{
    bail, CpuStorage, CudaStorage, CustomOp3, DType, Layout, Result, Shape, Storage, Tensor,
};

/// The class id that marks an ignored row.
const IGNORED: u32 = u32::MAX;

/// Mean cross entropy of `x [n, d] @ w [c, d]^T` against u32 `targets
/// [n]` (`u32::MAX` ignored), an f32 scalar differentiable in `x` and `w`,
/// holding at most `budget` logits at a time.
pub(crate) fn chunked_linear_cross_entropy(
    x: &Tensor,
    w: &Tensor,
    targets: &Tensor,
    budget: usize,
) -> Result<Tensor> {
    let (n, d) = x.dims2()?;
    let (c, wd) = w.dims2()?;
    if wd != d || targets.dims() != [n] || targets.dtype() != DType::U32 {
        bail!(
            "linear_cross_entropy: x {:?}, w {:?} and u32 targets {:?} are not [n, d], [c, d], [n]",
            x.dims(),
            w.dims(),
            targets.dims()
        )
    }
    let per = (budget / c.max(1)).clamp(1, n.max(1));
    let rows = Rows::new(targets)?;
    let (xd, wt) = (x.detach(), w.detach().t()?);
    let mut total = Tensor::zeros((), DType::F32, x.device())?;
    let mut lses = Vec::with_capacity(n.div_ceil(per));
    for r0 in (0..n).step_by(per) {
        let m = per.min(n - r0);
        let logits = xd.narrow(0, r0, m)?.matmul(&wt)?.to_dtype(DType::F32)?;
        let max = logits.max_keepdim(1)?;
        let lse = (logits.broadcast_sub(&max)?.exp()?.sum_keepdim(1)?.log()? + max)?;
        let picked = logits.gather(&rows.safe.narrow(0, r0, m)?, 1)?;
        let valid = rows.valid.narrow(0, r0, m)?;
        total = (total + ((&lse - picked)? * valid)?.sum_all()?)?;
        lses.push(lse);
    }
    let count = rows.valid.sum_all()?.clamp(1f32, f32::MAX)?;
    let loss = (total / &count)?;
    let lse = if lses.is_empty() {
        Tensor::zeros((0, 1), DType::F32, x.device())?
    } else {
        Tensor::cat(&lses, 0)?
    };
    let op = ChunkedLinearCrossEntropy {
        loss,
        lse,
        rows,
        count,
        per,
    };
    x.apply_op3(w, targets, op)
}

/// Per-row views of the targets: `safe` `[n, 1]` u32 (ignored rows read
/// class 0) and `valid` `[n, 1]` f32 (0 for ignored rows).
struct Rows {
    safe: Tensor,
    valid: Tensor,
}

impl Rows {
    fn new(targets: &Tensor) -> Result<Self> {
        let ignored = targets.eq(IGNORED)?;
        let safe = ignored.where_cond(&targets.zeros_like()?, targets)?;
        let valid = ignored.eq(0u8)?.to_dtype(DType::F32)?;
        Ok(Self {
            safe: safe.unsqueeze(1)?,
            valid: valid.unsqueeze(1)?,
        })
    }
}

/// Hands the loss computed on detached tensors to autograd, keeping what
/// its backward needs.
struct ChunkedLinearCrossEntropy {
    /// The f32 scalar loss.
    loss: Tensor,
    /// `[n, 1]` f32 log-sum-exps.
    lse: Tensor,
    rows: Rows,
    /// The counted rows (at least 1), an f32 scalar.
    count: Tensor,
    /// Rows per chunk.
    per: usize,
}

impl CustomOp3 for ChunkedLinearCrossEntropy {
    fn name(&self) -> &'static str {
        "accel-linear-cross-entropy-chunked"
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
        let (storage, layout) = self.loss.storage_and_layout();
        match &*storage {
            Storage::Cpu(s) => Ok((s.try_clone(layout)?, Shape::from(()))),
            _ => bail!("linear_cross_entropy: the loss is not on the operands' device"),
        }
    }

    fn cuda_fwd(
        &self,
        _: &CudaStorage,
        _: &Layout,
        _: &CudaStorage,
        _: &Layout,
        _: &CudaStorage,
        _: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let (storage, layout) = self.loss.storage_and_layout();
        match &*storage {
            Storage::Cuda(s) => Ok((s.try_clone(layout)?, Shape::from(()))),
            _ => bail!("linear_cross_entropy: the loss is not on the operands' device"),
        }
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _targets: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let n = x.dim(0)?;
        let (want_dx, want_dw) = (x.track_op(), w.track_op());
        let scale = (grad.to_dtype(DType::F32)? / &self.count)?;
        let (xd, wd) = (x.detach(), w.detach());
        let wt = wd.t()?;
        let mut dxs = Vec::with_capacity(n.div_ceil(self.per));
        let mut dw: Option<Tensor> = None;
        for r0 in (0..n).step_by(self.per) {
            let m = self.per.min(n - r0);
            let xc = xd.narrow(0, r0, m)?;
            let logits = xc.matmul(&wt)?.to_dtype(DType::F32)?;
            let p = logits.broadcast_sub(&self.lse.narrow(0, r0, m)?)?.exp()?;
            let valid = self.rows.valid.narrow(0, r0, m)?;
            let p = p.scatter_add(&self.rows.safe.narrow(0, r0, m)?, &valid.neg()?, 1)?;
            let dl = p
                .broadcast_mul(&valid)?
                .broadcast_mul(&scale)?
                .to_dtype(x.dtype())?;
            if want_dx {
                dxs.push(dl.matmul(&wd)?);
            }
            if want_dw {
                let part = dl.t()?.matmul(&xc)?.to_dtype(DType::F32)?;
                dw = Some(match dw {
                    None => part,
                    Some(acc) => (acc + part)?,
                });
            }
        }
        let dx = match (want_dx, dxs.is_empty()) {
            (false, _) => None,
            (true, true) => Some(x.zeros_like()?),
            (true, false) => Some(Tensor::cat(&dxs, 0)?),
        };
        let dw = match (want_dw, dw) {
            (false, _) => None,
            (true, None) => Some(w.zeros_like()?),
            (true, Some(acc)) => Some(acc.to_dtype(w.dtype())?),
        };
        Ok((dx, dw, None))
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Var};

    use super::*;
    use crate::ops::testing::{assert_close, randn};

    /// (loss, dx, dw) of `f` at f32 `x`, `w` cast to `dtype`.
    fn run(
        x: &Tensor,
        w: &Tensor,
        dtype: DType,
        f: &dyn Fn(&Tensor, &Tensor) -> Result<Tensor>,
    ) -> Result<(f32, Tensor, Tensor)> {
        let (x, w) = (
            Var::from_tensor(&x.to_dtype(dtype)?)?,
            Var::from_tensor(&w.to_dtype(dtype)?)?,
        );
        let loss = f(x.as_tensor(), w.as_tensor())?;
        let g = (&loss * 3.0)?.backward()?;
        let grad = |v: &Var| g.get(v.as_tensor()).unwrap().to_dtype(DType::F32);
        Ok((loss.to_scalar::<f32>()?, grad(&x)?, grad(&w)?))
    }

    /// Several chunks, a ragged last one and ignored rows give the fused
    /// CPU kernel's loss and gradients (f32 and bf16); a batch with every
    /// row ignored gives 0 and zero gradients; one chunk is the whole.
    #[test]
    fn chunks_give_the_fused_kernels_loss_and_gradients() -> Result<()> {
        let (n, d, c) = (37, 16, 300);
        let x = randn(&[n, d], 11, 1.0)?;
        let w = randn(&[c, d], 12, 0.5)?;
        let ids: Vec<u32> = (0..n as u32)
            .map(|i| {
                if i % 6 == 2 {
                    IGNORED
                } else {
                    (i * 41) % c as u32
                }
            })
            .collect();
        let t = Tensor::new(ids.as_slice(), &Device::Cpu)?;
        let none = Tensor::new(vec![IGNORED; n].as_slice(), &Device::Cpu)?;
        for (dtype, tol) in [(DType::F32, 1e-5), (DType::BF16, 2e-2)] {
            let fused = |x: &Tensor, w: &Tensor| super::super::linear_cross_entropy(x, w, &t);
            let want = run(&x, &w, dtype, &fused)?;
            for budget in [c, 5 * c, 36 * c, usize::MAX] {
                let chunked =
                    |x: &Tensor, w: &Tensor| chunked_linear_cross_entropy(x, w, &t, budget);
                let got = run(&x, &w, dtype, &chunked)?;
                let what = format!("{dtype:?} budget {budget}");
                let rel = (got.0 - want.0).abs() / want.0.abs();
                assert!(
                    rel <= tol as f32,
                    "{what}: loss {} against {}",
                    got.0,
                    want.0
                );
                assert_close(&got.1, &want.1, tol, &format!("{what}: dx"))?;
                assert_close(&got.2, &want.2, tol, &format!("{what}: dw"))?;
            }
            let chunked = |x: &Tensor, w: &Tensor| chunked_linear_cross_entropy(x, w, &none, c);
            let (loss, dx, dw) = run(&x, &w, dtype, &chunked)?;
            assert_eq!(loss, 0.0);
            for g in [dx, dw] {
                assert_eq!(g.abs()?.sum_all()?.to_scalar::<f32>()?, 0.0);
            }
        }
        Ok(())
    }

    #[test]
    fn mismatched_shapes_are_named() {
        let x = Tensor::zeros((4, 8), DType::F32, &Device::Cpu).unwrap();
        let w = Tensor::zeros((10, 7), DType::F32, &Device::Cpu).unwrap();
        let t = Tensor::zeros(4, DType::U32, &Device::Cpu).unwrap();
        let e = chunked_linear_cross_entropy(&x, &w, &t, 100).unwrap_err();
        assert!(e.to_string().contains("[4, 8]"), "{e}");
    }
}
