//! Mean cross entropy fused with its softmax and with the linear layer
//! that produces the logits (the GPT's tied `lm_head`).
//!
//! candle's `cross_entropy` is `log_softmax` (six ops over the whole
//! `[B*T, vocab]` logits, 4M values at the bench shape) plus a gather, and
//! its backward walks all of them again. This op makes one pass forward,
//! keeping each row's log-sum-exp, and one pass backward that writes
//! `softmax - onehot` directly. It also keeps the logits out of the
//! autograd graph: backward turns its private copy into
//! the logit gradient in place, instead of candle allocating a zeroed
//! 16 MiB accumulator and adding that gradient into it.

use std::sync::Mutex;

use candle_core::{bail, CpuStorage, CustomOp3, DType, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use super::{as_f32, gemm_new, math, rows_per_task, tensor_from_f32, with_f32, Mat};

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

/// The u32 targets of a CPU storage, checked against the class count.
fn targets_of<'a>(s: &'a CpuStorage, l: &Layout, n: usize, classes: usize) -> Result<&'a [u32]> {
    let (CpuStorage::U32(v), Some((start, end))) = (s, l.contiguous_offsets()) else {
        bail!("cross_entropy: targets must be contiguous u32")
    };
    let t = &v[start..end];
    if t.len() != n {
        bail!("cross_entropy: {n} rows of logits but {} targets", t.len())
    }
    if let Some(bad) = t.iter().find(|&&c| c as usize >= classes) {
        bail!("cross_entropy: target {bad} out of range for {classes} classes")
    }
    Ok(t)
}

/// Per-row log-sum-exp of `logits [n, c]` and the mean loss.
fn lse_and_loss(logits: &[f32], targets: &[u32], c: usize) -> (Vec<f32>, f32) {
    let n = targets.len();
    let rows = rows_per_task(n, c);
    let mut lse = vec![0f32; n];
    let total: f64 = lse
        .par_chunks_mut(rows)
        .zip(logits.par_chunks(rows * c).zip(targets.par_chunks(rows)))
        .map(|(lse, (x, t))| {
            let mut sum = 0f64;
            for ((lse, row), &t) in lse.iter_mut().zip(x.chunks_exact(c)).zip(t) {
                let max = math::max(row);
                *lse = max + math::sum_exp_shifted(row, max).ln();
                sum += (*lse - row[t as usize]) as f64;
            }
            sum
        })
        .sum();
    (lse, (total / n as f64) as f32)
}

/// Turns `logits [n, c]` into their gradient `(softmax - onehot) * scale`
/// in place.
fn softmax_minus_onehot(logits: &mut [f32], lse: &[f32], targets: &[u32], c: usize, scale: f32) {
    let rows = rows_per_task(targets.len(), c);
    logits
        .par_chunks_mut(rows * c)
        .zip(lse.par_chunks(rows).zip(targets.par_chunks(rows)))
        .for_each(|(x, (lse, t))| {
            for ((row, &lse), &t) in x.chunks_exact_mut(c).zip(lse).zip(t) {
                math::softmax_grad_row(row, lse, t as usize, scale);
            }
        });
}

/// The scalar upstream gradient divided by the number of rows.
fn mean_grad(grad: &Tensor, n: usize) -> Result<f32> {
    Ok(grad.to_dtype(DType::F32)?.to_scalar::<f32>()? / n as f32)
}

/// Keeps the f32 logits and their row log-sum-exps between forward and
/// backward. Backward consumes them; a second backward recomputes them.
#[derive(Default)]
struct LinearCrossEntropy {
    state: Mutex<Option<(Vec<f32>, Vec<f32>)>>,
}

/// `x [n, d] @ w [c, d]^T` in f32.
fn logits(x: &[f32], w: &[f32], n: usize, d: usize, c: usize) -> Vec<f32> {
    // SAFETY: x is [n, d] and w is [c, d], checked by callers.
    unsafe {
        gemm_new(
            n,
            c,
            d,
            Mat::rows(x.as_ptr(), d),
            Mat::rows_t(w.as_ptr(), d),
            true,
        )
    }
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
        let logits = logits(&as_f32(s1, l1)?, &as_f32(s2, l2)?, n, d, c);
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
        let scale = mean_grad(grad, n)?;
        let targets = targets.to_vec1::<u32>()?;
        let state = self.state.lock().unwrap().take();
        let (mut dl, lse) = match state {
            Some(s) => s,
            None => {
                let l = with_f32(x, |xs| with_f32(w, |ws| Ok(logits(xs, ws, n, d, c))))?;
                let (lse, _) = lse_and_loss(&l, &targets, c);
                (l, lse)
            }
        };
        softmax_minus_onehot(&mut dl, &lse, &targets, c, scale);
        let (dx, dw) = with_f32(x, |xs| {
            with_f32(w, |ws| {
                // SAFETY: dl is [n, c], w is [c, d] and x is [n, d].
                unsafe {
                    let dl_rows = Mat::rows(dl.as_ptr(), c);
                    let dx = gemm_new(n, d, c, dl_rows, Mat::rows(ws.as_ptr(), d), true);
                    let dl_t = Mat::rows_t(dl.as_ptr(), c);
                    let dw = gemm_new(c, d, n, dl_t, Mat::rows(xs.as_ptr(), d), true);
                    Ok((dx, dw))
                }
            })
        })?;
        let dx = tensor_from_f32(dx, (n, d), x.dtype())?;
        let dw = tensor_from_f32(dw, (c, d), w.dtype())?;
        Ok((Some(dx), Some(dw), None))
    }
}
