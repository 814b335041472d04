//! Layer norm and RMS norm over the last dimension with backward passes.
//!
//! `candle_nn::ops::{layer_norm, rms_norm}` are fast but registered without
//! backward, and the composed versions are eight elementwise ops and their
//! gradients. These ops do one pass forward and one pass backward per row;
//! the row statistics are recomputed in backward rather than stored, since
//! that is a cheap pass over data that is read anyway.

use candle_core::backend::BackendStorage;
use candle_core::{
    bail, CpuStorage, CudaStorage, CustomOp2, CustomOp3, Layout, Result, Shape, Tensor,
};

use super::raw::par;
use super::{
    as_f32, from_f32, math, rows_per_reduction, rows_per_task, sum_in_order, tensor_from_f32,
    with_f32,
};

/// Which normalisation (`rms`: no centring, no bias) and its epsilon.
#[derive(Clone, Copy)]
struct Norm {
    eps: f32,
    rms: bool,
}

/// `(x - mean) / sqrt(var + eps) * w [+ b]` over the last dimension of `x`,
/// differentiable in every input.
pub(crate) fn layer_norm(x: &Tensor, w: &Tensor, b: Option<&Tensor>, eps: f64) -> Result<Tensor> {
    let op = Norm {
        eps: eps as f32,
        rms: false,
    };
    let (x, w) = (x.contiguous()?, w.contiguous()?);
    match b {
        Some(b) => x.apply_op3(&w, &b.contiguous()?, op),
        None => x.apply_op2(&w, op),
    }
}

/// `x / sqrt(mean(x^2) + eps) * w` over the last dimension, differentiable
/// in both inputs.
pub(crate) fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    let op = Norm {
        eps: eps as f32,
        rms: true,
    };
    x.contiguous()?.apply_op2(&w.contiguous()?, op)
}

/// (mean, 1/std) of one row; the mean is 0 for RMS norm.
#[inline(always)]
fn stats(row: &[f32], eps: f32, rms: bool) -> (f32, f32) {
    let n = row.len() as f32;
    let mean = if rms { 0.0 } else { math::sum(row) / n };
    let mut dev = [0f32; 16];
    let mut chunks = row.chunks_exact(16);
    for c in &mut chunks {
        for (a, &v) in dev.iter_mut().zip(c) {
            *a += (v - mean) * (v - mean);
        }
    }
    let tail: f32 = chunks
        .remainder()
        .iter()
        .map(|&v| (v - mean) * (v - mean))
        .sum();
    let var = (dev.iter().sum::<f32>() + tail) / n;
    (mean, 1.0 / (var + eps).sqrt())
}

multiversion! {
    /// Normalises every `w.len()`-wide row of `x` into `y`.
    fn forward_rows(x: &[f32], w: &[f32], b: Option<&[f32]>, y: &mut [f32], eps: f32, rms: bool) {
        let d = w.len();
        for (y, x) in y.chunks_exact_mut(d).zip(x.chunks_exact(d)) {
            let (mean, rstd) = stats(x, eps, rms);
            match b {
                Some(b) => {
                    for j in 0..d {
                        y[j] = (x[j] - mean) * rstd * w[j] + b[j];
                    }
                }
                None => {
                    for j in 0..d {
                        y[j] = (x[j] - mean) * rstd * w[j];
                    }
                }
            }
        }
    }
}

multiversion! {
    /// Writes the input gradient of every row into `dx` and adds the rows'
    /// contributions to the weight and bias gradients, which are the first
    /// two `d`-wide parts of `acc`; its third part is scratch.
    fn backward_rows(x: &[f32], w: &[f32], g: &[f32], dx: &mut [f32], acc: &mut [f32], eps: f32, rms: bool) {
        let d = w.len();
        let (dw, rest) = acc.split_at_mut(d);
        let (db, xhat) = rest.split_at_mut(d);
        for (dx, (x, g)) in dx.chunks_exact_mut(d).zip(x.chunks_exact(d).zip(g.chunks_exact(d))) {
            let (mean, rstd) = stats(x, eps, rms);
            for j in 0..d {
                xhat[j] = (x[j] - mean) * rstd;
                dx[j] = g[j] * w[j]; // dxhat, finished below
                dw[j] += g[j] * xhat[j];
                db[j] += g[j];
            }
            let m1 = if rms { 0.0 } else { math::sum(dx) / d as f32 };
            let m2 = math::dot(dx, xhat) / d as f32;
            for j in 0..d {
                dx[j] = rstd * (dx[j] - m1 - xhat[j] * m2);
            }
        }
    }
}

impl Norm {
    fn forward(
        &self,
        x: (&CpuStorage, &Layout),
        w: (&CpuStorage, &Layout),
        b: Option<(&CpuStorage, &Layout)>,
    ) -> Result<(CpuStorage, Shape)> {
        let xs = as_f32(x.0, x.1)?;
        let ws = as_f32(w.0, w.1)?;
        let bs = b.map(|(s, l)| as_f32(s, l)).transpose()?;
        let d = ws.len();
        if x.1.dims().last() != Some(&d) || bs.as_ref().is_some_and(|b| b.len() != d) || d == 0 {
            bail!(
                "norm: x {:?}, weight {:?}, bias {:?}",
                x.1.dims(),
                w.1.dims(),
                b.map(|b| b.1.dims().to_vec())
            )
        }
        let chunk = rows_per_task(xs.len() / d, d) * d;
        let bs = bs.as_deref();
        let y = par::new_vec(xs.len(), chunk, |i, y| {
            forward_rows(&xs[i * chunk..][..y.len()], &ws, bs, y, self.eps, self.rms)
        });
        Ok((from_f32(y, x.0.dtype())?, x.1.shape().clone()))
    }

    /// (dx, dw, db) of the normalisation.
    fn backward(&self, x: &Tensor, w: &Tensor, grad: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
        if x.device().is_cuda() {
            return self.cuda_backward(x, w, grad);
        }
        let d = w.dim(0)?;
        let mut dx = vec![0f32; x.elem_count()];
        let (dw, db) = with_f32(x, |xs| {
            with_f32(w, |ws| {
                with_f32(grad, |g| {
                    let chunk = rows_per_reduction(d) * d;
                    // Each task writes its rows of dx and returns partial sums
                    // [dw | db | scratch]; the partials are then added up in order.
                    let mut partials = vec![Vec::new(); dx.len().div_ceil(chunk)];
                    par::chunks_mut2(&mut dx, chunk, &mut partials, 1, |i, dx, acc| {
                        let at = i * chunk..i * chunk + dx.len();
                        acc[0] = vec![0f32; 3 * d];
                        let (x, g) = (&xs[at.clone()], &g[at]);
                        backward_rows(x, ws, g, dx, &mut acc[0], self.eps, self.rms);
                    });
                    let acc = sum_in_order(partials, 3 * d);
                    Ok((acc[..d].to_vec(), acc[d..2 * d].to_vec()))
                })
            })
        })?;
        Ok((
            tensor_from_f32(dx, x.shape(), x.dtype())?,
            tensor_from_f32(dw, d, w.dtype())?,
            tensor_from_f32(db, d, w.dtype())?,
        ))
    }
}

// ------------------------------------------------------------------ CUDA

impl Norm {
    /// The forward on CUDA: accel-kernels' row kernel over f32 operands (the
    /// op layer converts half inputs, see `ops::norm`).
    fn cuda_forward(
        &self,
        x: (&CudaStorage, &Layout),
        w: (&CudaStorage, &Layout),
        b: Option<(&CudaStorage, &Layout)>,
    ) -> Result<(CudaStorage, Shape)> {
        let y = accel_kernels::cuda::row_norm_forward(x, w, b, self.eps, self.rms)
            .map_err(candle_core::Error::wrap)?;
        Ok((y, x.1.shape().clone()))
    }

    /// (dx, dw, db) on CUDA: one op computing all three into one buffer
    /// (`[dx | dw | db]`), then views of it.
    fn cuda_backward(
        &self,
        x: &Tensor,
        w: &Tensor,
        grad: &Tensor,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let (n, d) = (x.elem_count(), w.dim(0)?);
        let packed = grad
            .contiguous()?
            .apply_op3_no_bwd(x, w, &NormGrad(*self))?;
        Ok((
            packed.narrow(0, 0, n)?.reshape(x.shape())?,
            packed.narrow(0, n, d)?,
            packed.narrow(0, n + d, d)?,
        ))
    }
}

/// The gradients of [`Norm`] on CUDA, as one op over `(grad, x, w)` with no
/// backward of its own.
struct NormGrad(Norm);

impl CustomOp3 for NormGrad {
    fn name(&self) -> &'static str {
        "accel-norm-grad"
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
        bail!("accel-norm-grad runs on CUDA only (the CPU backward is Norm::backward)")
    }

    fn cuda_fwd(
        &self,
        g: &CudaStorage,
        gl: &Layout,
        x: &CudaStorage,
        xl: &Layout,
        w: &CudaStorage,
        wl: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let out = accel_kernels::cuda::row_norm_backward(
            (x, xl),
            (w, wl),
            (g, gl),
            self.0.eps,
            self.0.rms,
        )
        .map_err(candle_core::Error::wrap)?;
        let d = wl.shape().elem_count();
        Ok((out, Shape::from(xl.shape().elem_count() + 2 * d)))
    }
}

impl CustomOp3 for Norm {
    fn name(&self) -> &'static str {
        "accel-layer-norm"
    }

    fn backward_reads_output(&self) -> bool {
        false
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

    fn cuda_fwd(
        &self,
        s1: &CudaStorage,
        l1: &Layout,
        s2: &CudaStorage,
        l2: &Layout,
        s3: &CudaStorage,
        l3: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        self.cuda_forward((s1, l1), (s2, l2), Some((s3, l3)))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _b: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (dx, dw, db) = self.backward(x, w, grad)?;
        Ok((Some(dx), Some(dw), Some(db)))
    }
}

impl CustomOp2 for Norm {
    fn name(&self) -> &'static str {
        if self.rms {
            "accel-rms-norm"
        } else {
            "accel-layer-norm-nobias"
        }
    }

    fn backward_reads_output(&self) -> bool {
        false
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

    fn cuda_fwd(
        &self,
        s1: &CudaStorage,
        l1: &Layout,
        s2: &CudaStorage,
        l2: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        self.cuda_forward((s1, l1), (s2, l2), None)
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (dx, dw, _) = self.backward(x, w, grad)?;
        Ok((Some(dx), Some(dw)))
    }
}
