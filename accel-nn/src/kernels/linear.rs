//! `act(x @ w^T + b)` as one op with a fused backward.
//!
//! Compared with candle's `matmul(w.t()) + broadcast_add` this saves, per
//! call: the bias broadcast and its reduction in backward, the strided add
//! that turns the `[in, out]` gradient of `w.t()` back into `[out, in]`
//! (gemm writes `dW` in place in the right layout here), and the pointwise
//! activation ops and their backward chains.

use std::sync::Mutex;

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp2, CustomOp3, Device, Layout, Result, Shape, Tensor};

pub(crate) use super::act::Act;
use super::act::{copy_backward, forward_new};
use super::gemm_bf16::{self, bf16_products, keep_bf16, product_of};
use super::raw::amx::{HalfRef, Values};
use super::raw::{gemm, gemm_new, par, MatRef};
use super::{
    as_bf16, as_f32, from_f32, rows_per_reduction, sum_in_order, tensor_from_f32, to_bf16,
    with_bf16, with_f32, with_values, CHUNK,
};
use super::{linear_bf16, skinny};

/// `y [n, out]` with the bias, when given, added to every row.
fn plus_bias(mut y: Vec<f32>, b: Option<(&CpuStorage, &Layout)>, out: usize) -> Result<Vec<f32>> {
    if let Some(b) = b {
        let bs = as_f32(b.0, b.1)?;
        if bs.len() != out {
            bail!("linear: bias has {} entries, expected {out}", bs.len())
        }
        par::chunks_mut(&mut y, out, |_, row| {
            row.iter_mut().zip(bs.iter()).for_each(|(v, b)| *v += b)
        });
    }
    Ok(y)
}

/// A CPU storage and its layout, as ops receive them.
type Operand<'a> = (&'a CpuStorage, &'a Layout);

/// Up to this many rows, a bf16 forward takes the f32 skinny kernel rather
/// than bf16 products.
const BF16_SKINNY_MAX_ROWS: usize = 128;

/// The op; it keeps the pre-activation for the backward pass of smooth
/// activations (ReLU's derivative is read off the output instead).
struct LinearOp {
    act: Act,
    pre_activation: Mutex<Option<Vec<f32>>>,
}

/// `act(x [n, in] @ w [out, in]^T + b [out])` on 2-D CPU tensors of one
/// float dtype, differentiable in `x`, `w` and `b`.
pub(crate) fn linear(x: &Tensor, w: &Tensor, b: Option<&Tensor>, act: Act) -> Result<Tensor> {
    let op = LinearOp {
        act,
        pre_activation: Mutex::new(None),
    };
    let x = x.contiguous()?;
    let w = w.contiguous()?;
    let y = match b {
        Some(b) => x.apply_op3(&w, &b.contiguous()?, op)?,
        None => x.apply_op2(&w, op)?,
    };
    // Through a frozen weight (and bias) the backward reads only the weight:
    // the graph keeps `x`'s node, not its values, so a frozen layer's input
    // is freed once nothing else holds it (docs/design/candle-core-patch.md).
    let frozen = !w.track_op() && b.is_none_or(|b| !b.track_op());
    Ok(if frozen {
        y.release_input_values(&x)
    } else {
        y
    })
}

impl LinearOp {
    fn forward(
        &self,
        x: (&CpuStorage, &Layout),
        w: (&CpuStorage, &Layout),
        b: Option<(&CpuStorage, &Layout)>,
    ) -> Result<(CpuStorage, Shape)> {
        let (n, inp) = x.1.shape().dims2()?;
        let (out, w_in) = w.1.shape().dims2()?;
        if w_in != inp {
            bail!("linear: x is [{n}, {inp}] but w is [{out}, {w_in}]")
        }
        let bf16 = bf16_products(x.0.dtype(), w.0.dtype());
        let amx = match (as_bf16(x.0, x.1), as_bf16(w.0, w.1)) {
            (Some(xs), Some(ws)) if keep_bf16(bf16) => Some((xs, ws)),
            _ => None,
        };
        let y = match amx {
            // bf16 tensors as they lie, on AMX tiles, at any row count (a
            // single row wastes most of a tile but still beats converting
            // the weight for the skinny kernel).
            Some((xs, ws)) => gemm_bf16::amx_new(
                (n, out, inp),
                HalfRef::new(Values::Bf16(xs), 0, (inp, 1)),
                HalfRef::new(Values::Bf16(ws), 0, (1, inp)),
            ),
            None => match as_bf16(w.0, w.1) {
                // bf16 weights on AVX-512 BF16 without AMX: packed as they lie.
                Some(ws) if bf16 && n >= linear_bf16::MIN_ROWS && linear_bf16::available() => {
                    let Some(xs) = as_bf16(x.0, x.1) else {
                        bail!("linear: bf16 products need a contiguous bf16 x")
                    };
                    let xs = linear_bf16::Rows::Bf16(xs);
                    if b.is_none() && matches!(self.act, Act::None) {
                        // Rounded to the bf16 output as the product is
                        // transposed, with no f32 copy of it.
                        let y = linear_bf16::forward_as(xs, n, ws, (out, inp), to_bf16);
                        return Ok((CpuStorage::BF16(y), Shape::from((n, out))));
                    }
                    plus_bias(linear_bf16::forward(xs, n, ws, out, inp), b, out)?
                }
                _ => Self::product_f32((x, w, b), (n, inp, out), bf16)?,
            },
        };
        let mut y = match (amx, b) {
            (Some(_), Some(b)) => plus_bias(y, Some(b), out)?,
            _ => y,
        };
        let y = match self.act {
            Act::None => y,
            Act::Relu => {
                par::chunks_mut(&mut y, CHUNK, |_, y| {
                    y.iter_mut().for_each(|v| *v = v.max(0.0))
                });
                y
            }
            act => {
                let a = forward_new(act, &y);
                *self.pre_activation.lock().unwrap() = Some(y);
                a
            }
        };
        Ok((from_f32(y, x.0.dtype())?, Shape::from((n, out))))
    }

    /// `x w^T (+ b)` through f32 values: the f32 kernels, or the AVX-512
    /// BF16 one for bf16 operands (converted to f32 first).
    fn product_f32(
        (x, w, b): (Operand, Operand, Option<Operand>),
        (n, inp, out): (usize, usize, usize),
        bf16: bool,
    ) -> Result<Vec<f32>> {
        let xs = as_f32(x.0, x.1)?;
        let ws = as_f32(w.0, w.1)?;
        let (x_rows, w_t) = (MatRef::rows(&xs, 0, inp), MatRef::rows_t(&ws, 0, inp));
        let skinny_rows = if bf16 {
            BF16_SKINNY_MAX_ROWS
        } else {
            skinny::MAX_ROWS
        };
        Ok(match b {
            // Few rows (inference): dot products on `w` as it lies, see
            // `skinny`. bf16 products pack `w` on each call, which pays for
            // itself from about 128 rows (256 rows: 213-263 GFLOP/s against
            // the f32 skinny kernel's 162-202 on Llama shapes; 128: even).
            b if n <= skinny_rows => plus_bias(skinny::x_wt(&xs, &ws, n, inp, out), b, out)?,
            b if bf16 => plus_bias(gemm_bf16::gemm_new_bf16((n, out, inp), x_rows, w_t), b, out)?,
            Some(b) => {
                // Start every row from the bias and let gemm accumulate onto
                // it, which fuses the bias add into the product.
                let bs = as_f32(b.0, b.1)?;
                if bs.len() != out {
                    bail!("linear: bias has {} entries, expected {out}", bs.len())
                }
                let rows = (CHUNK / out.max(1)).max(1);
                let mut y = par::new_vec(n * out, rows * out, |_, y| {
                    y.chunks_mut(out).for_each(|row| row.copy_from_slice(&bs))
                });
                gemm((n, out, inp), &mut y, 0, out, true, x_rows, w_t, 1.0, true);
                y
            }
            None => gemm_new((n, out, inp), x_rows, w_t, true),
        })
    }

    /// Gradients of `x`, `w` and (when `with_bias`) `b`, each only when that
    /// input is part of the graph, since candle asks for all of them.
    fn backward(
        &self,
        x: &Tensor,
        w: &Tensor,
        with_bias: bool,
        res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (n, inp) = x.dims2()?;
        let out = w.dim(0)?;
        let direct = bf16_products(x.dtype(), w.dtype())
            && n >= linear_bf16::MIN_ROWS
            && linear_bf16::available();
        if direct
            && matches!(self.act, Act::None)
            && grad.dtype() == candle_core::DType::BF16
            && x.track_op()
            && !w.track_op()
            && !with_bias
        {
            // A frozen bf16 weight (LoRA's base): the input's gradient alone,
            // the upstream bf16 gradient read as the microkernel's pairs.
            let dx = with_bf16(grad, |g| {
                with_bf16(w, |ws| {
                    let g = linear_bf16::Rows::Bf16(g);
                    Ok(linear_bf16::backward_input_as(
                        g,
                        n,
                        ws,
                        (out, inp),
                        to_bf16,
                    ))
                })
            })?;
            return Ok((
                Some(Tensor::from_vec(dx, (n, inp), &Device::Cpu)?),
                None,
                None,
            ));
        }
        with_f32(grad, |g| {
            // dh: the gradient before the activation; the upstream gradient
            // itself (borrowed, not copied) when there is no activation.
            let owned: Vec<f32>;
            let dh: &[f32] = match self.act {
                Act::None => g,
                Act::Relu => {
                    owned = with_f32(res, |y| {
                        Ok(par::new_vec(g.len(), CHUNK, |i, d| {
                            let (g, y) = (&g[i * CHUNK..], &y[i * CHUNK..]);
                            for ((d, &g), &y) in d.iter_mut().zip(g).zip(y) {
                                *d = if y > 0.0 { g } else { 0.0 }
                            }
                        }))
                    })?;
                    &owned
                }
                act => {
                    let pre = self.pre_activation.lock().unwrap();
                    let Some(h) = pre.as_ref() else {
                        bail!("linear backward without its forward state")
                    };
                    owned = copy_backward(act, h, g);
                    &owned
                }
            };
            let bf16 = bf16_products(x.dtype(), w.dtype());
            // Where AMX takes the products it reads bf16 `w` and `x` as they
            // lie (no f32 copy of the weight), and `dh` rounded to bf16 as
            // it packs it.
            let keep = keep_bf16(bf16);
            let dx = if x.track_op() && direct {
                // A bf16 weight on AVX-512 BF16 without AMX, as it lies.
                let dx = with_bf16(w, |ws| {
                    let dh = linear_bf16::Rows::F32(dh);
                    Ok(linear_bf16::backward_input(dh, n, ws, out, inp))
                })?;
                Some(tensor_from_f32(dx, (n, inp), x.dtype())?)
            } else if x.track_op() {
                // dx [n, in] = dh [n, out] @ w [out, in]
                let dx = with_values(w, keep, |ws| {
                    let dh_rows = HalfRef::new(Values::F32(dh), 0, (out, 1));
                    Ok(product_of(
                        bf16,
                        (n, inp, out),
                        dh_rows,
                        HalfRef::new(ws, 0, (inp, 1)),
                    ))
                })?;
                Some(tensor_from_f32(dx, (n, inp), x.dtype())?)
            } else {
                None
            };
            let dw = if w.track_op() {
                // dw [out, in] = dh^T [out, n] @ x [n, in]
                let dw = with_values(x, keep, |xs| {
                    let dh_t = HalfRef::new(Values::F32(dh), 0, (1, out));
                    Ok(product_of(
                        bf16,
                        (out, inp, n),
                        dh_t,
                        HalfRef::new(xs, 0, (inp, 1)),
                    ))
                })?;
                Some(tensor_from_f32(dw, (out, inp), w.dtype())?)
            } else {
                None
            };
            let db = if with_bias {
                Some(tensor_from_f32(column_sums(dh, out), out, w.dtype())?)
            } else {
                None
            };
            Ok((dx, dw, db))
        })
    }
}

/// Sums the rows of the row-major `m` (row length `cols`): partial sums over
/// fixed row blocks in parallel, then added in order, so the result does not
/// depend on the thread count.
pub(super) fn column_sums(m: &[f32], cols: usize) -> Vec<f32> {
    if cols == 0 {
        return Vec::new();
    }
    let block = rows_per_reduction(cols) * cols;
    let partials = par::map(m.len().div_ceil(block), |i| {
        let mut acc = vec![0f32; cols];
        for row in m[i * block..].chunks_exact(cols).take(block / cols) {
            acc.iter_mut().zip(row).for_each(|(a, &v)| *a += v);
        }
        acc
    });
    sum_in_order(partials, cols)
}

impl CustomOp3 for LinearOp {
    fn name(&self) -> &'static str {
        "accel-linear"
    }

    /// ReLU's backward reads its output; no other activation's does.
    fn backward_reads_output(&self) -> bool {
        matches!(self.act, Act::Relu)
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
        self.forward((s1, l1), (s2, l2), Some((s3, l3)))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _b: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        self.backward(x, w, true, res, grad)
    }
}

impl CustomOp2 for LinearOp {
    fn name(&self) -> &'static str {
        "accel-linear-nobias"
    }

    /// ReLU's backward reads its output; no other activation's does.
    fn backward_reads_output(&self) -> bool {
        matches!(self.act, Act::Relu)
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        self.forward((s1, l1), (s2, l2), None)
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (dx, dw, _) = self.backward(x, w, false, res, grad)?;
        Ok((dx, dw))
    }
}
