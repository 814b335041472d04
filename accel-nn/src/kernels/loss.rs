//! Mean cross entropy fused with its softmax, and optionally with the
//! linear layer that produces the logits (a GPT's tied `lm_head`).
//!
//! candle's `cross_entropy` is `log_softmax` (six ops over the whole
//! `[n, vocab]` logits) plus a gather, and its backward walks all of them
//! again. These ops make one pass forward, keeping each row's
//! log-sum-exp, and one pass backward that writes `softmax - onehot`
//! directly. The linear variant also keeps the logits out of the autograd
//! graph: backward turns its private copy into the logit gradient in place.
//!
//! Targets are u32 with `u32::MAX` marking ignored rows (`crate::ops`
//! maps HF's i64 `-100` to it); the mean is over the other rows, and is 0
//! with zero gradients when every row is ignored.

use std::sync::Mutex;

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor};

use super::gemm_bf16::{bf16_products, product};
use super::raw::{par, MatRef};
use super::{as_f32, math, rows_per_reduction, rows_per_task, tensor_from_f32, with_f32};

/// Marks a row whose target is ignored.
pub(crate) const IGNORED: u32 = u32::MAX;

/// The u32 targets of a CPU storage, checked against the class count.
fn targets_of<'a>(s: &'a CpuStorage, l: &Layout, n: usize, classes: usize) -> Result<&'a [u32]> {
    let (CpuStorage::U32(v), Some((start, end))) = (s, l.contiguous_offsets()) else {
        bail!("cross_entropy: targets must be contiguous u32")
    };
    let t = &v[start..end];
    if t.len() != n {
        bail!("cross_entropy: {n} rows of logits but {} targets", t.len())
    }
    if let Some(bad) = t.iter().find(|&&c| c != IGNORED && c as usize >= classes) {
        bail!("cross_entropy: target {bad} out of range for {classes} classes")
    }
    Ok(t)
}

/// Per-row log-sum-exp of `logits [n, c]` and the mean loss over rows
/// that are not ignored.
fn lse_and_loss(logits: &[f32], targets: &[u32], c: usize) -> (Vec<f32>, f32) {
    let n = targets.len();
    // Blocks of a fixed size, their sums added in order: the loss's bits do
    // not depend on the thread count (see `rows_per_reduction`).
    let rows = rows_per_reduction(c);
    let mut lse = vec![0f32; n];
    let mut partials = vec![0f64; n.div_ceil(rows.max(1))];
    par::chunks_mut2(&mut lse, rows, &mut partials, 1, |i, lse, sum| {
        let (x, t) = (&logits[i * rows * c..], &targets[i * rows..][..lse.len()]);
        for ((lse, row), &t) in lse.iter_mut().zip(x.chunks_exact(c)).zip(t) {
            if t == IGNORED {
                continue;
            }
            let max = math::max(row);
            *lse = max + math::sum_exp_shifted(row, max).ln();
            sum[0] += (*lse - row[t as usize]) as f64;
        }
    });
    let total: f64 = partials.iter().sum();
    let count = valid_count(targets);
    (
        lse,
        if count == 0 {
            0.0
        } else {
            (total / count as f64) as f32
        },
    )
}

/// Rows that count towards the mean.
fn valid_count(targets: &[u32]) -> usize {
    targets.iter().filter(|&&t| t != IGNORED).count()
}

/// Turns `logits [n, c]` into their gradient `(softmax - onehot) * scale`
/// in place (zero for ignored rows).
fn softmax_minus_onehot(logits: &mut [f32], lse: &[f32], targets: &[u32], c: usize, scale: f32) {
    let rows = rows_per_task(targets.len(), c);
    par::chunks_mut(logits, rows * c, |i, x| {
        let (lse, t) = (&lse[i * rows..], &targets[i * rows..]);
        for ((row, &lse), &t) in x.chunks_exact_mut(c).zip(lse).zip(t) {
            if t == IGNORED {
                row.fill(0.0);
            } else {
                math::softmax_grad_row(row, lse, t as usize, scale);
            }
        }
    });
}

/// The scalar upstream gradient divided by the number of counted rows.
fn mean_grad(grad: &Tensor, targets: &[u32]) -> Result<f32> {
    let count = valid_count(targets).max(1);
    Ok(grad.to_dtype(DType::F32)?.to_scalar::<f32>()? / count as f32)
}

/// Mean cross entropy of `logits [n, c]` against u32 `targets [n]`, an f32
/// scalar differentiable in the logits.
pub(crate) fn cross_entropy(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    logits
        .contiguous()?
        .apply_op2(&targets.contiguous()?, CrossEntropy)
}

struct CrossEntropy;

impl CustomOp2 for CrossEntropy {
    fn name(&self) -> &'static str {
        "accel-cross-entropy"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (n, c) = l1.shape().dims2()?;
        let targets = targets_of(s2, l2, n, c)?;
        let (_, loss) = lse_and_loss(&as_f32(s1, l1)?, targets, c);
        Ok((CpuStorage::F32(vec![loss]), Shape::from(())))
    }

    fn bwd(
        &self,
        logits: &Tensor,
        targets: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let c = logits.dim(1)?;
        let targets = targets.to_vec1::<u32>()?;
        let scale = mean_grad(grad, &targets)?;
        let mut dl = with_f32(logits, |l| Ok(l.to_vec()))?;
        let (lse, _) = lse_and_loss(&dl, &targets, c);
        softmax_minus_onehot(&mut dl, &lse, &targets, c, scale);
        Ok((
            Some(tensor_from_f32(dl, logits.shape(), logits.dtype())?),
            None,
        ))
    }
}

/// Mean cross entropy of the logits `x [n, d] @ w [classes, d]^T` against
/// u32 `targets [n]`, computed in f32; an f32 scalar, differentiable in `x`
/// and `w`.
pub(crate) fn linear_cross_entropy(x: &Tensor, w: &Tensor, targets: &Tensor) -> Result<Tensor> {
    x.contiguous()?.apply_op3(
        &w.contiguous()?,
        &targets.contiguous()?,
        LinearCrossEntropy::default(),
    )
}

/// Keeps the f32 logits and their row log-sum-exps between forward and
/// backward. Backward consumes them; a second backward recomputes them.
#[derive(Default)]
struct LinearCrossEntropy {
    state: Mutex<Option<(Vec<f32>, Vec<f32>)>>,
}

/// `x [n, d] @ w [c, d]^T` in f32, with bf16 products when `bf16`.
fn logits(bf16: bool, x: &[f32], w: &[f32], n: usize, d: usize, c: usize) -> Vec<f32> {
    product(
        bf16,
        (n, c, d),
        MatRef::rows(x, 0, d),
        MatRef::rows_t(w, 0, d),
    )
}

impl CustomOp3 for LinearCrossEntropy {
    fn name(&self) -> &'static str {
        "accel-linear-cross-entropy"
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
        let (n, d) = l1.shape().dims2()?;
        let (c, wd) = l2.shape().dims2()?;
        if wd != d {
            bail!("linear_cross_entropy: x is [{n}, {d}] but w is [{c}, {wd}]")
        }
        let targets = targets_of(s3, l3, n, c)?;
        let bf16 = bf16_products(s1.dtype(), s2.dtype());
        let logits = logits(bf16, &as_f32(s1, l1)?, &as_f32(s2, l2)?, n, d, c);
        let (lse, loss) = lse_and_loss(&logits, targets, c);
        *self.state.lock().unwrap() = Some((logits, lse));
        Ok((CpuStorage::F32(vec![loss]), Shape::from(())))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        targets: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (n, d) = x.dims2()?;
        let c = w.dim(0)?;
        let targets = targets.to_vec1::<u32>()?;
        let scale = mean_grad(grad, &targets)?;
        let state = self.state.lock().unwrap().take();
        let bf16 = bf16_products(x.dtype(), w.dtype());
        let (mut dl, lse) = match state {
            Some(s) => s,
            None => {
                let l = with_f32(x, |xs| with_f32(w, |ws| Ok(logits(bf16, xs, ws, n, d, c))))?;
                let (lse, _) = lse_and_loss(&l, &targets, c);
                (l, lse)
            }
        };
        softmax_minus_onehot(&mut dl, &lse, &targets, c, scale);
        let (dx, dw) = with_f32(x, |xs| {
            with_f32(w, |ws| {
                let dx = if x.track_op() {
                    let dl_rows = MatRef::rows(&dl, 0, c);
                    Some(product(bf16, (n, d, c), dl_rows, MatRef::rows(ws, 0, d)))
                } else {
                    None
                };
                let dw = if w.track_op() {
                    let dl_t = MatRef::rows_t(&dl, 0, c);
                    Some(product(bf16, (c, d, n), dl_t, MatRef::rows(xs, 0, d)))
                } else {
                    None
                };
                Ok((dx, dw))
            })
        })?;
        let dx = dx
            .map(|v| tensor_from_f32(v, (n, d), x.dtype()))
            .transpose()?;
        let dw = dw
            .map(|v| tensor_from_f32(v, (c, d), w.dtype()))
            .transpose()?;
        Ok((dx, dw, None))
    }
}
