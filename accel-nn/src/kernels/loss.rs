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
use candle_core::{
    bail, CpuStorage, CudaStorage, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor,
};

use super::gemm_bf16::{bf16_products, keep_bf16, product_of};
use super::linear_bf16;
use super::raw::amx::{HalfRef, Values};
use super::raw::par;
use super::{
    as_bf16, as_f32, math, rows_per_reduction, rows_per_task, tensor_from_f32, values_of,
    with_bf16, with_f32, with_values,
};

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
    let (lse, partials) = lse_and_partials(logits, targets, c);
    (lse, mean_of(&partials, targets))
}

/// Per-row log-sum-exp of `logits [n, c]` and the loss summed over each
/// block of [`rows_per_reduction`] rows: blocks of a fixed size, added in
/// order by [`mean_of`], so the loss's bits depend neither on the thread
/// count nor on how the rows were split into chunks aligned to the blocks.
fn lse_and_partials(logits: &[f32], targets: &[u32], c: usize) -> (Vec<f32>, Vec<f64>) {
    let n = targets.len();
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
    (lse, partials)
}

/// The mean loss from the block sums of all rows, in order.
fn mean_of(partials: &[f64], targets: &[u32]) -> f32 {
    let total: f64 = partials.iter().sum();
    match valid_count(targets) {
        0 => 0.0,
        count => (total / count as f64) as f32,
    }
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
/// scalar differentiable in the logits: CPU tensors, or f32 logits and u32
/// targets on CUDA (`loss.cu`, no host read; see
/// `ops::loss::CUDA_CROSS_ENTROPY_CHECKED`).
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

    fn cuda_fwd(
        &self,
        s1: &CudaStorage,
        l1: &Layout,
        s2: &CudaStorage,
        l2: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let loss = accel_kernels::cuda::cross_entropy_forward((s1, l1), (s2, l2))
            .map_err(candle_core::Error::wrap)?;
        Ok((loss, Shape::from(())))
    }

    fn bwd(
        &self,
        logits: &Tensor,
        targets: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        if logits.device().is_cuda() {
            let dy = grad.to_dtype(DType::F32)?.contiguous()?;
            let dl = logits.apply_op3_no_bwd(targets, &dy, &CrossEntropyGrad)?;
            return Ok((Some(dl), None));
        }
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

/// The logits' gradient of [`CrossEntropy`] on CUDA, as one op over
/// `(logits, targets, dy)` with no backward of its own.
struct CrossEntropyGrad;

impl CustomOp3 for CrossEntropyGrad {
    fn name(&self) -> &'static str {
        "accel-cross-entropy-grad"
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
        bail!("accel-cross-entropy-grad runs on CUDA only (the CPU backward is CrossEntropy::bwd)")
    }

    fn cuda_fwd(
        &self,
        x: &CudaStorage,
        xl: &Layout,
        t: &CudaStorage,
        tl: &Layout,
        dy: &CudaStorage,
        dyl: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let dx = accel_kernels::cuda::cross_entropy_backward((x, xl), (t, tl), (dy, dyl))
            .map_err(candle_core::Error::wrap)?;
        Ok((dx, xl.shape().clone()))
    }
}

/// Mean cross entropy of the logits `x [n, d] @ w [classes, d]^T` against
/// u32 `targets [n]`, computed in f32; an f32 scalar, differentiable in `x`
/// and `w`.
pub(crate) fn linear_cross_entropy(x: &Tensor, w: &Tensor, targets: &Tensor) -> Result<Tensor> {
    linear_cross_entropy_within(x, w, targets, LOGITS_BUDGET)
}

/// [`linear_cross_entropy`] holding at most `budget` logits at once.
fn linear_cross_entropy_within(
    x: &Tensor,
    w: &Tensor,
    targets: &Tensor,
    budget: usize,
) -> Result<Tensor> {
    x.contiguous()?.apply_op3(
        &w.contiguous()?,
        &targets.contiguous()?,
        LinearCrossEntropy {
            budget,
            state: Mutex::default(),
        },
    )
}

/// Keeps the row log-sum-exps between forward and backward, and the f32
/// logits when they fit [`LOGITS_BUDGET`]. Backward consumes them; a second
/// backward recomputes them.
struct LinearCrossEntropy {
    budget: usize,
    state: Mutex<Option<Kept>>,
}

/// The logits when they were kept whole, and every row's log-sum-exp.
type Kept = (Option<Vec<f32>>, Vec<f32>);

/// The most logits (elements) `linear_cross_entropy` holds at once: 64 MiB
/// of f32. Past it, rows go in chunks and backward recomputes each chunk's
/// logits (one more `n x c x d` product) instead of keeping `[n, c]` whole,
/// which at 8192 tokens of a 32000-word vocabulary would be 1 GiB.
pub(crate) const LOGITS_BUDGET: usize = 16 << 20;

/// Rows per chunk for `n` rows of `c` logits: all of them within the
/// budget, else a multiple of [`rows_per_reduction`] (so the loss is the
/// same bits as unchunked) that fits it.
fn chunk_rows(n: usize, c: usize, budget: usize) -> usize {
    if n.saturating_mul(c) <= budget {
        return n.max(1);
    }
    let block = rows_per_reduction(c);
    ((budget / c.max(1)) / block).max(1) * block
}

/// `x [n, d] @ w [c, d]^T` in f32, with bf16 products when `bf16`.
fn logits(bf16: bool, x: &[f32], w: Values, n: usize, d: usize, c: usize) -> Vec<f32> {
    product_of(
        bf16,
        (n, c, d),
        HalfRef::new(Values::F32(x), 0, (d, 1)),
        HalfRef::new(w, 0, (1, d)),
    )
}

/// Whether a bf16 head's products take its values as they lie
/// ([`linear_bf16`]: AVX-512 BF16 without AMX).
fn direct_bf16(bf16: bool) -> bool {
    bf16 && linear_bf16::available()
}

/// The forward over chunks of `per` rows with the chunk's logits from
/// `logits(x_chunk, rows)`: row log-sum-exps and the loss.
fn chunked(
    x: &[f32],
    targets: &[u32],
    (d, c): (usize, usize),
    per: usize,
    logits: impl Fn(&[f32], usize) -> Vec<f32>,
) -> (Vec<f32>, f32) {
    let n = targets.len();
    let (mut lse, mut partials) = (Vec::with_capacity(n), vec![]);
    for r0 in (0..n).step_by(per.max(1)) {
        let m = per.min(n - r0);
        let l = logits(&x[r0 * d..(r0 + m) * d], m);
        let (cl, cp) = lse_and_partials(&l, &targets[r0..r0 + m], c);
        lse.extend(cl);
        partials.extend(cp);
    }
    let loss = mean_of(&partials, targets);
    (lse, loss)
}

/// The forward over chunks of `per` rows: row log-sum-exps and the loss.
fn chunked_forward(
    bf16: bool,
    (x, w): (&[f32], Values),
    targets: &[u32],
    (d, c): (usize, usize),
    per: usize,
) -> (Vec<f32>, f32) {
    chunked(x, targets, (d, c), per, |xc, m| {
        logits(bf16, xc, w, m, d, c)
    })
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
        let xs = as_f32(s1, l1)?;
        let per = chunk_rows(n, c, self.budget);
        if let Some(wb) = as_bf16(s2, l2).filter(|_| direct_bf16(bf16)) {
            // A bf16 head as it lies: a 128K x 3K vocabulary is 1.5 GB in f32.
            let (lse, loss) = chunked(&xs, targets, (d, c), per, |x, m| {
                linear_bf16::forward(linear_bf16::Rows::F32(x), m, wb, c, d)
            });
            *self.state.lock().unwrap() = Some((None, lse));
            return Ok((CpuStorage::F32(vec![loss]), Shape::from(())));
        }
        let ws = values_of(s2, l2, keep_bf16(bf16))?;
        let ws = ws.values();
        let loss = if per >= n {
            let logits = logits(bf16, &xs, ws, n, d, c);
            let (lse, loss) = lse_and_loss(&logits, targets, c);
            *self.state.lock().unwrap() = Some((Some(logits), lse));
            loss
        } else {
            let (lse, loss) = chunked_forward(bf16, (&xs, ws), targets, (d, c), per);
            *self.state.lock().unwrap() = Some((None, lse));
            loss
        };
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
        let per = chunk_rows(n, c, self.budget);
        let (kept, lse) = match state {
            Some(s) => s,
            None => {
                let (lse, _) = with_f32(x, |xs| {
                    with_values(w, keep_bf16(bf16), |ws| {
                        Ok(chunked_forward(bf16, (xs, ws), &targets, (d, c), per))
                    })
                })?;
                (None, lse)
            }
        };
        let (want_dx, want_dw) = (x.track_op(), w.track_op());
        if direct_bf16(bf16) && !want_dw && w.dtype() == DType::BF16 {
            // A frozen bf16 head (a LoRA or QLoRA base) as it lies.
            let dx = with_f32(x, |xs| {
                with_bf16(w, |wb| {
                    let mut dx = Vec::with_capacity(if want_dx { n * d } else { 0 });
                    for r0 in (0..n).step_by(per.max(1)) {
                        let m = per.min(n - r0);
                        let xc = &xs[r0 * d..(r0 + m) * d];
                        let mut dl = linear_bf16::forward(linear_bf16::Rows::F32(xc), m, wb, c, d);
                        let t = &targets[r0..r0 + m];
                        softmax_minus_onehot(&mut dl, &lse[r0..r0 + m], t, c, scale);
                        if want_dx {
                            dx.extend(linear_bf16::backward_input(
                                linear_bf16::Rows::F32(&dl),
                                m,
                                wb,
                                c,
                                d,
                            ));
                        }
                    }
                    Ok(dx)
                })
            })?;
            let dx = want_dx
                .then(|| tensor_from_f32(dx, (n, d), x.dtype()))
                .transpose()?;
            return Ok((dx, None, None));
        }
        let (dx, dw) = with_f32(x, |xs| {
            with_values(w, keep_bf16(bf16), |ws| {
                let mut dx = want_dx.then(|| Vec::with_capacity(n * d));
                let mut dw: Option<Vec<f32>> = None;
                let mut kept = kept;
                for r0 in (0..n).step_by(per.max(1)) {
                    let m = per.min(n - r0);
                    let xc = &xs[r0 * d..(r0 + m) * d];
                    // The kept logits (one chunk), else this chunk's again.
                    let mut dl = match kept.take() {
                        Some(l) => l,
                        None => logits(bf16, xc, ws, m, d, c),
                    };
                    let t = &targets[r0..r0 + m];
                    softmax_minus_onehot(&mut dl, &lse[r0..r0 + m], t, c, scale);
                    if let Some(dx) = dx.as_mut() {
                        let dl_rows = HalfRef::new(Values::F32(&dl), 0, (c, 1));
                        let w_rows = HalfRef::new(ws, 0, (d, 1));
                        dx.extend(product_of(bf16, (m, d, c), dl_rows, w_rows));
                    }
                    if want_dw {
                        let dl_t = HalfRef::new(Values::F32(&dl), 0, (1, c));
                        let x_rows = HalfRef::new(Values::F32(xc), 0, (d, 1));
                        let part = product_of(bf16, (c, d, m), dl_t, x_rows);
                        match dw.as_mut() {
                            None => dw = Some(part),
                            Some(acc) => acc.iter_mut().zip(&part).for_each(|(a, b)| *a += b),
                        }
                    }
                }
                if want_dw && dw.is_none() {
                    dw = Some(vec![0.0; c * d]);
                }
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

#[cfg(test)]
mod tests {
    use candle_core::{Device, Var};

    use super::*;
    use crate::ops::testing::randn;

    /// Chunked rows (a budget of a few rows, several chunks, a ragged last
    /// one, ignored rows) give the unchunked loss to the bit, and its
    /// gradients to rounding.
    #[test]
    fn chunks_give_the_whole_logits_result() -> Result<()> {
        // Wide rows: a reduction block is a few rows, so chunks can be small.
        let (n, d, c) = (37, 8, 4096);
        let x = Var::from_tensor(&randn(&[n, d], 1, 1.0)?)?;
        let w = Var::from_tensor(&randn(&[c, d], 2, 1.0)?)?;
        let t: Vec<u32> = (0..n as u32)
            .map(|i| {
                if i % 7 == 3 {
                    IGNORED
                } else {
                    (i * 13) % c as u32
                }
            })
            .collect();
        let t = Tensor::new(t, &Device::Cpu)?;
        let run = |budget| -> Result<(f32, Tensor, Tensor)> {
            let loss = linear_cross_entropy_within(&x, &w, &t, budget)?;
            let g = loss.backward()?;
            Ok((
                loss.to_scalar::<f32>()?,
                g.get(x.as_tensor()).unwrap().clone(),
                g.get(w.as_tensor()).unwrap().clone(),
            ))
        };
        let (whole, dx, dw) = run(usize::MAX)?;
        assert!(chunk_rows(n, c, 5 * c) < n);
        for budget in [c, 5 * c, 36 * c] {
            let (loss, cx, cw) = run(budget)?;
            assert_eq!(loss.to_bits(), whole.to_bits(), "budget {budget}");
            for (a, b) in [(&cx, &dx), (&cw, &dw)] {
                let e = (a - b)?.abs()?.max_all()?.to_scalar::<f32>()?;
                assert!(e < 1e-6, "budget {budget}: gradient differs by {e}");
            }
        }
        Ok(())
    }

    /// A frozen bf16 head (LoRA's, QLoRA's base): the loss and the input's
    /// gradient are those of f32 products on the same bf16 values, whole
    /// and in chunks, and the head gets no gradient.
    #[test]
    fn a_frozen_bf16_head_gives_the_f32_products_of_its_values() -> Result<()> {
        let (n, d, c) = (40, 32, 700);
        let x = Var::from_tensor(&randn(&[n, d], 3, 1.0)?.to_dtype(DType::BF16)?)?;
        let w = randn(&[c, d], 4, 0.5)?.to_dtype(DType::BF16)?;
        let t = Tensor::new(
            (0..n as u32)
                .map(|i| (i * 31) % c as u32)
                .collect::<Vec<_>>(),
            &Device::Cpu,
        )?;
        let x32 = Var::from_tensor(&x.to_dtype(DType::F32)?)?;
        let want = crate::ops::composed::linear_cross_entropy(&x32, &w.to_dtype(DType::F32)?, &t)?;
        let gw = want.backward()?;
        for budget in [usize::MAX, 9 * c] {
            let loss = linear_cross_entropy_within(&x, &w, &t, budget)?;
            let dl = (loss.to_dtype(DType::F32)? - &want)?
                .abs()?
                .to_scalar::<f32>()?;
            assert!(dl < 1e-4, "budget {budget}: loss off by {dl}");
            let g = loss.backward()?;
            assert!(g.get(&w).is_none());
            let dx = g.get(x.as_tensor()).unwrap().to_dtype(DType::F32)?;
            let e = (dx - g_x(&gw, &x32)?)?
                .abs()?
                .max_all()?
                .to_scalar::<f32>()?;
            assert!(e < 1e-3, "budget {budget}: dx off by {e}");
        }
        Ok(())
    }

    fn g_x(g: &candle_core::backprop::GradStore, x: &Var) -> Result<Tensor> {
        Ok(g.get(x.as_tensor()).unwrap().clone())
    }
}
