//! The multi-tensor operations on CUDA tensors: one launch per dtype group
//! of a list. Arguments arrive validated by `multi_tensor` / `optim`
//! (pairing, dtypes, contiguity of written tensors, one device, no
//! aliasing).

use candle_core::{DType, Tensor};

use super::compile::WrapDriver;
use super::launch::{launch, AdamWArgs, Args, SgdArgs};
use super::operands::{by_dtype, elem_sizes, launch_tables, with_device_ptrs, Column, Table};
use super::registry::KernelId;
use crate::hyperparams::{AdamWScalars, SgdScalars};
use crate::{fallback, Result};

/// Element counts of a list.
fn lens(ts: &[Tensor]) -> Vec<usize> {
    ts.iter().map(Tensor::elem_count).collect()
}

/// See [`crate::cast_into`]. Pairs of equal dtype are plain copies.
pub(crate) fn cast_into(src: &[Tensor], dst: &[Tensor]) -> Result<()> {
    const OP: &str = "cast_into";
    let (same, convert): (Vec<usize>, Vec<usize>) =
        (0..src.len()).partition(|&i| src[i].dtype() == dst[i].dtype());
    for i in same {
        fallback::assign(&dst[i], &src[i])?;
    }
    if convert.is_empty() {
        return Ok(());
    }
    let (s_elem, d_elem, n) = (elem_sizes(src), elem_sizes(dst), lens(src));
    with_device_ptrs(OP, &[src, dst], &[1], |dev, ptrs| {
        for (from, to) in pairs_of(src, dst, &convert) {
            let idx: Vec<usize> = convert
                .iter()
                .copied()
                .filter(|&i| src[i].dtype() == from && dst[i].dtype() == to)
                .collect();
            let Some(id) = KernelId::cast(from, to) else {
                continue;
            };
            let cols = [
                Column {
                    ptrs: &ptrs[0],
                    elem: &s_elem,
                },
                Column {
                    ptrs: &ptrs[1],
                    elem: &d_elem,
                },
            ];
            launch(OP, dev, id, &launch_tables(&idx, &n, &cols)?, Args::None)?;
        }
        Ok(())
    })
}

/// The distinct (source, destination) dtype pairs among positions `idx`.
fn pairs_of(src: &[Tensor], dst: &[Tensor], idx: &[usize]) -> Vec<(DType, DType)> {
    let mut pairs: Vec<(DType, DType)> = Vec::new();
    for &i in idx {
        let p = (src[i].dtype(), dst[i].dtype());
        if !pairs.contains(&p) {
            pairs.push(p);
        }
    }
    pairs
}

/// See [`crate::cast_tensors`]: contiguous tensors of another dtype are
/// converted together into new tensors.
pub(crate) fn cast_tensors(src: &[Tensor], dtype: DType) -> Result<Vec<Tensor>> {
    let fused: Vec<usize> = (0..src.len())
        .filter(|&i| src[i].dtype() != dtype && src[i].is_contiguous())
        .collect();
    let ins: Vec<Tensor> = fused.iter().map(|&i| src[i].clone()).collect();
    let outs = ins
        .iter()
        .map(|t| Ok(Tensor::zeros(t.shape(), dtype, t.device())?))
        .collect::<Result<Vec<_>>>()?;
    if !ins.is_empty() {
        cast_into(&ins, &outs)?;
    }
    let mut outs = outs.into_iter();
    src.iter()
        .map(|t| {
            if t.dtype() == dtype {
                Ok(t.clone())
            } else if t.is_contiguous() {
                Ok(outs.next().expect("one output per fused tensor"))
            } else {
                Ok(t.to_dtype(dtype)?)
            }
        })
        .collect()
}

/// Runs `kernel(dtype)` over each dtype group of `ts` with `args()`, one
/// launch per group.
fn per_dtype(
    op: &'static str,
    ts: &[Tensor],
    kernel: fn(DType) -> KernelId,
    mut args: impl FnMut() -> Args<'static>,
) -> Result<()> {
    let (elem, n) = (elem_sizes(ts), lens(ts));
    with_device_ptrs(op, &[ts], &[0], |dev, ptrs| {
        for (dtype, idx) in by_dtype(ts) {
            let cols = [Column {
                ptrs: &ptrs[0],
                elem: &elem,
            }];
            launch(
                op,
                dev,
                kernel(dtype),
                &launch_tables(&idx, &n, &cols)?,
                args(),
            )?;
        }
        Ok(())
    })
}

/// Runs the overflow check (scaling by `factor` unless it is `None`) over
/// every dtype group of `ts` into one device flag, and reads it back once.
fn check(op: &'static str, ts: &[Tensor], factor: Option<f32>) -> Result<bool> {
    let (elem, n) = (elem_sizes(ts), lens(ts));
    let written: &[usize] = if factor.is_some() { &[0] } else { &[] };
    with_device_ptrs(op, &[ts], written, |dev, ptrs| {
        let stream = dev.cuda_stream();
        let mut flag = stream.alloc_zeros::<u32>(1).w(op, "alloc")?;
        for (dtype, idx) in by_dtype(ts) {
            let cols = [Column {
                ptrs: &ptrs[0],
                elem: &elem,
            }];
            let tables = launch_tables(&idx, &n, &cols)?;
            match factor {
                Some(f) => launch(
                    op,
                    dev,
                    KernelId::unscale(dtype),
                    &tables,
                    Args::FactorFlag(f, &mut flag),
                )?,
                None => launch(
                    op,
                    dev,
                    KernelId::non_finite(dtype),
                    &tables,
                    Args::Flag(&mut flag),
                )?,
            }
        }
        let found = stream.clone_dtoh(&flag).w(op, "memcpy_dtoh")?;
        Ok(found[0] != 0)
    })
}

/// See [`crate::unscale_and_check`]. A factor of 1 only checks, as the
/// other paths do.
pub(crate) fn unscale_and_check(tensors: &[Tensor], inv_scale: f32) -> Result<bool> {
    let factor = (inv_scale != 1.0).then_some(inv_scale);
    check("unscale_and_check", tensors, factor)
}

/// See [`crate::has_non_finite`].
pub(crate) fn has_non_finite(tensors: &[Tensor]) -> Result<bool> {
    check("has_non_finite", tensors, None)
}

/// See [`crate::scale_in_place`].
pub(crate) fn scale(tensors: &[Tensor], factor: f32) -> Result<()> {
    per_dtype("scale_in_place", tensors, KernelId::scale, || {
        Args::Factor(factor)
    })
}

/// See [`crate::clamp_in_place`].
pub(crate) fn clamp(tensors: &[Tensor], lo: f32, hi: f32) -> Result<()> {
    per_dtype("clamp_in_place", tensors, KernelId::clamp, || {
        Args::Range(lo, hi)
    })
}

/// Launches `kernel(dtype)` per dtype group of `grads` with operand columns
/// `f32_lists` (f32 tensors, each paired with `grads`) followed by `grads`.
fn with_grads(
    op: &'static str,
    f32_lists: &[&[Tensor]],
    grads: &[Tensor],
    kernel: fn(DType) -> KernelId,
    args: impl Fn() -> Args<'static>,
) -> Result<()> {
    let n = lens(grads);
    let f32_elem = vec![4usize; grads.len()];
    let g_elem = elem_sizes(grads);
    let mut lists: Vec<&[Tensor]> = f32_lists.to_vec();
    lists.push(grads);
    let written: Vec<usize> = (0..f32_lists.len()).collect();
    with_device_ptrs(op, &lists, &written, |dev, ptrs| {
        for (dtype, idx) in by_dtype(grads) {
            let mut cols: Vec<Column<'_>> = ptrs[..f32_lists.len()]
                .iter()
                .map(|p| Column {
                    ptrs: p,
                    elem: &f32_elem,
                })
                .collect();
            cols.push(Column {
                ptrs: &ptrs[f32_lists.len()],
                elem: &g_elem,
            });
            launch(
                op,
                dev,
                kernel(dtype),
                &launch_tables(&idx, &n, &cols)?,
                args(),
            )?;
        }
        Ok(())
    })
}

/// See [`crate::add_in_place`].
pub(crate) fn add(dst: &[Tensor], src: &[Tensor]) -> Result<()> {
    with_grads("add_in_place", &[dst], src, KernelId::add, || Args::None)
}

/// See [`crate::adamw_step`].
pub(crate) fn adamw(
    params: &[Tensor],
    grads: &[Tensor],
    exp_avg: &[Tensor],
    exp_avg_sq: &[Tensor],
    s: &AdamWScalars,
) -> Result<()> {
    let a = AdamWArgs {
        decay: s.decay.unwrap_or(1.0),
        apply_decay: s.decay.is_some() as i32,
        w1: s.w1,
        beta2: s.beta2,
        c2: s.c2,
        step_size: s.step_size,
        bc2_sqrt: s.bc2_sqrt,
        eps: s.eps,
    };
    with_grads(
        "adamw_step",
        &[params, exp_avg, exp_avg_sq],
        grads,
        KernelId::adamw,
        || Args::AdamW(a),
    )
}

/// See [`crate::sgd_step`]. Without momentum the buffer column is empty
/// (address 0), which the kernel never dereferences.
pub(crate) fn sgd(
    params: &[Tensor],
    grads: &[Tensor],
    bufs: Option<&[Tensor]>,
    s: &SgdScalars,
) -> Result<()> {
    let a = SgdArgs {
        lr: s.lr,
        momentum: s.momentum.unwrap_or(0.0),
        weight_decay: s.weight_decay.unwrap_or(0.0),
        one_minus_dampening: s.one_minus_dampening,
        has_momentum: (s.momentum.is_some() && bufs.is_some()) as i32,
        has_weight_decay: s.weight_decay.is_some() as i32,
        nesterov: s.nesterov as i32,
        first: s.first as i32,
    };
    match bufs.filter(|_| s.momentum.is_some()) {
        Some(b) => with_grads("sgd_step", &[params, b], grads, KernelId::sgd, || {
            Args::Sgd(a)
        }),
        None => with_grads_no_buf(params, grads, a),
    }
}

/// SGD without momentum buffers: columns param, (none), grad.
fn with_grads_no_buf(params: &[Tensor], grads: &[Tensor], a: SgdArgs) -> Result<()> {
    const OP: &str = "sgd_step";
    let n = lens(grads);
    let f32_elem = vec![4usize; grads.len()];
    let g_elem = elem_sizes(grads);
    let none = vec![0u64; grads.len()];
    with_device_ptrs(OP, &[params, grads], &[0], |dev, ptrs| {
        for (dtype, idx) in by_dtype(grads) {
            let cols = [
                Column {
                    ptrs: &ptrs[0],
                    elem: &f32_elem,
                },
                Column {
                    ptrs: &none,
                    elem: &f32_elem,
                },
                Column {
                    ptrs: &ptrs[1],
                    elem: &g_elem,
                },
            ];
            let tables = launch_tables(&idx, &n, &cols)?;
            launch(OP, dev, KernelId::sgd(dtype), &tables, Args::Sgd(a))?;
        }
        Ok(())
    })
}

/// Runs a per-chunk reduction over every dtype group of `ts` and returns
/// the partial results in chunk order (group by group).
fn partials(op: &'static str, ts: &[Tensor], kernel: fn(DType) -> KernelId) -> Result<Vec<f64>> {
    let (elem, n) = (elem_sizes(ts), lens(ts));
    with_device_ptrs(op, &[ts], &[], |dev, ptrs| {
        let stream = dev.cuda_stream();
        let mut all = Vec::new();
        for (dtype, idx) in by_dtype(ts) {
            let cols = [Column {
                ptrs: &ptrs[0],
                elem: &elem,
            }];
            let tables = launch_tables(&idx, &n, &cols)?;
            let chunks: usize = tables.iter().map(Table::chunks).sum();
            if chunks == 0 {
                continue;
            }
            let mut out = stream.alloc_zeros::<f64>(chunks).w(op, "alloc")?;
            launch(op, dev, kernel(dtype), &tables, Args::Partials(&mut out))?;
            all.extend(stream.clone_dtoh(&out).w(op, "memcpy_dtoh")?);
        }
        Ok(all)
    })
}

/// See [`crate::sum_of_squares`]. Chunk sums are added on the host in
/// chunk order, so the result is reproducible (though not the CPU path's
/// bits: the summation order differs).
pub(crate) fn sum_of_squares(tensors: &[Tensor]) -> Result<f64> {
    Ok(partials("sum_of_squares", tensors, KernelId::sum_sq)?
        .into_iter()
        .sum())
}

/// See [`crate::max_abs`].
pub(crate) fn max_abs(tensors: &[Tensor]) -> Result<f64> {
    let parts = partials("max_abs", tensors, KernelId::max_abs)?;
    Ok(parts.into_iter().fold(0f64, |acc, m| {
        if m.is_nan() || acc.is_nan() {
            f64::NAN
        } else {
            acc.max(m)
        }
    }))
}
