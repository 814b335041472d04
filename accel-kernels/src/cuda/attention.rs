//! Attention on CUDA (`attention.cu`): FlashAttention-2's algorithm, the
//! twin of accel-nn's tiled CPU kernel. The forward keeps the output and one
//! log-sum-exp per query row; the backward recomputes the probabilities
//! from them in two kernels (dq per query tile, dk and dv per key tile), so
//! nothing `[t, s]` is ever stored and no result depends on scheduling.
//!
//! bf16/f16 operands at head dims 64 and 128 take a tensor-core forward and
//! dq on sm_80+ (`attention_mma.cu`: `mma.sync`, f32 accumulation); dk and
//! dv are the scalar kernels' for every dtype so far.
//!
//! Operands: q `[b, h, t, d]`, k and v `[b, kvh, s, d]` (`kvh` divides `h`)
//! of one float dtype, strided views with a contiguous last dimension; an
//! optional f32 bias `[b, h, t, s]` with any strides (zero strides for
//! broadcast masks); head dims up to [`FLASH_MAX_HEAD_DIM`].

use candle_core::backend::BackendStorage;
use candle_core::cuda::{CudaDType, CudaDevice, CudaStorage};
use candle_core::{DType, Layout};
use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, CudaView, DeviceRepr, ValidAsZeroBits};
use half::{bf16, f16};

use super::args::{BackwardInputs, FlashArgs, FlashDims};
use super::compile::{device_cc, WrapDriver};
use super::launch::launch_flash;
use super::operands::slice_of;
use super::registry::KernelId;
use crate::{Error, Result};

/// The largest head dimension the kernels take (`FA_DMAX`): each tile row
/// is staged whole in shared memory.
pub const FLASH_MAX_HEAD_DIM: usize = 128;
/// Query rows per block of the forward (`FA_FWD_BR`), of dq (`FA_DQ_BR`),
/// and keys per block of dk/dv (`FA_KV_BC`).
const FWD_ROWS: usize = 32;
/// Query rows per block of the tensor-core forward (`FA_MMA_BR`).
const MMA_ROWS: usize = 64;
const DQ_ROWS: usize = 16;
const KV_KEYS: usize = 16;

/// The mask and scale of a call.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FlashMask {
    /// Multiplies `q k^T` before the bias is added.
    pub scale: f32,
    /// Causal masking with the first query at this absolute position (key
    /// `j` visible from query `i` when `j <= offset + i`).
    pub causal_offset: Option<usize>,
    /// With `causal_offset`, a sliding window: key `j` visible from query
    /// `i` only when `offset + i - j < window`.
    pub window: Option<usize>,
}

fn invalid(op: &'static str, reason: String) -> Error {
    Error::InvalidArgument { op, reason }
}

/// Whether the kernels take a head dimension `d` and operands of `dtype`
/// (other head dims and dtypes run accel-nn's composed attention).
pub fn flash_supported(dtype: DType, d: usize) -> bool {
    matches!(dtype, DType::F32 | DType::BF16 | DType::F16) && (1..=FLASH_MAX_HEAD_DIM).contains(&d)
}

/// The tensor-core forward and dq kernels where there are some for these
/// operands (bf16/f16, head dim 64 or 128) and the device has `mma.sync`
/// (sm_80+).
fn tensor_cores(dev: &CudaDevice, dtype: DType, dims: &FlashDims) -> Option<[KernelId; 2]> {
    KernelId::flash_mma(dtype, dims.d as usize).filter(|_| device_cc(dev).is_ok_and(|cc| cc >= 80))
}

/// Checks the shapes and builds the kernels' `FlashDims`.
fn flash_dims(
    op: &'static str,
    (ql, kl, vl): (&Layout, &Layout, &Layout),
    bias: Option<&Layout>,
    mask: FlashMask,
) -> Result<FlashDims> {
    let ([b, h, t, d], [kb, kvh, s, kd]) = (ql.dims(), kl.dims()) else {
        return Err(invalid(
            op,
            format!("q {:?} and k {:?} must be 4-D", ql.dims(), kl.dims()),
        ));
    };
    let (b, h, t, d, kvh, s) = (*b, *h, *t, *d, *kvh, *s);
    if (*kb, *kd) != (b, d) || vl.dims() != [b, kvh, s, d] || kvh == 0 || h % kvh != 0 {
        return Err(invalid(
            op,
            format!(
                "q {:?} needs k and v [{b}, kv_heads dividing {h}, s, {d}], got {:?} and {:?}",
                ql.dims(),
                kl.dims(),
                vl.dims()
            ),
        ));
    }
    if !(1..=FLASH_MAX_HEAD_DIM).contains(&d) {
        return Err(invalid(
            op,
            format!("head dim {d} is not 1..={FLASH_MAX_HEAD_DIM}"),
        ));
    }
    if let Some(bl) = bias {
        if bl.dims() != [b, h, t, s] {
            return Err(invalid(
                op,
                format!("bias {:?} is not [{b}, {h}, {t}, {s}]", bl.dims()),
            ));
        }
    }
    let small = |v: usize| u32::try_from(v).ok();
    let offset = mask.causal_offset.unwrap_or(0);
    // Grids: (b * h, tiles), at most 65535 tiles.
    let tiles_fit = t.div_ceil(DQ_ROWS) <= 65_535 && s.div_ceil(KV_KEYS) <= 65_535;
    let window = mask
        .window
        .filter(|_| mask.causal_offset.is_some())
        .unwrap_or(0);
    let fits = [b * h, b * kvh, t, s, offset, window]
        .iter()
        .all(|&v| small(v).is_some());
    if !(fits && tiles_fit) {
        return Err(invalid(
            op,
            format!("q {:?} and k {:?} are too large", ql.dims(), kl.dims()),
        ));
    }
    let strides = |l: &Layout, index: usize| -> Result<[u64; 3]> {
        let st = l.stride();
        if st[3] != 1 && d > 1 {
            return Err(Error::RequiresContiguous { op, index });
        }
        Ok([st[0] as u64, st[1] as u64, st[2] as u64])
    };
    let bs = bias.map_or([0; 4], |bl| {
        let st = bl.stride();
        [st[0] as u64, st[1] as u64, st[2] as u64, st[3] as u64]
    });
    Ok(FlashDims {
        b: b as u32,
        h: h as u32,
        kvh: kvh as u32,
        t: t as u32,
        s: s as u32,
        d: d as u32,
        causal: mask.causal_offset.is_some() as u32,
        offset: offset as u32,
        scale: mask.scale,
        has_bias: bias.is_some() as u32,
        window: window as u32,
        pad0: 0,
        qs: strides(ql, 0)?,
        ks: strides(kl, 1)?,
        vs: strides(vl, 2)?,
        bs,
    })
}

/// The elements of `(s, l)` from its start offset as a view, checked to
/// hold every element its strides reach; `index` names the operand.
fn strided_view<'a, T: CudaDType>(
    op: &'static str,
    index: usize,
    s: &'a CudaStorage,
    l: &Layout,
) -> Result<CudaView<'a, T>> {
    let slice = slice_of::<T>(op, s)?;
    let extent = if l.dims().contains(&0) {
        0
    } else {
        1 + l
            .dims()
            .iter()
            .zip(l.stride())
            .map(|(&n, &st)| (n - 1) * st)
            .sum::<usize>()
    };
    let start = l.start_offset();
    if start + extent > slice.len() {
        return Err(invalid(
            op,
            format!("operand {index} reaches past its storage"),
        ));
    }
    Ok(slice.slice(start..))
}

/// The bias as a view, or without one a one-element placeholder kept in
/// `none` (the kernels read no bias when `has_bias` is 0, but take a pointer).
fn bias_view<'a>(
    op: &'static str,
    index: usize,
    bias: Option<Operand<'a>>,
    stream: &Arc<CudaStream>,
    none: &'a mut Option<CudaSlice<f32>>,
) -> Result<CudaView<'a, f32>> {
    match bias {
        Some((s, l)) => strided_view::<f32>(op, index, s, l),
        None => Ok(none.insert(stream.alloc_zeros(1).w(op, "alloc")?).slice(..)),
    }
}

/// The contiguous elements of `(s, l)` as a view.
fn contiguous_view<'a, T: CudaDType>(
    op: &'static str,
    index: usize,
    s: &'a CudaStorage,
    l: &Layout,
) -> Result<CudaView<'a, T>> {
    let (start, end) = l
        .contiguous_offsets()
        .ok_or(Error::RequiresContiguous { op, index })?;
    let slice = s
        .as_cuda_slice::<T>()
        .map_err(|_| Error::UnsupportedDType {
            op,
            dtype: s.dtype(),
        })?;
    Ok(slice.slice(start..end))
}

/// `softmax(q k^T * scale + bias) v` per head (rows that see no key give
/// 0) and the log-sum-exp of each query row, `[b, h, t]` f32 (`-inf` for
/// such rows), which [`flash_attention_backward`] takes back.
///
/// # Errors
/// Shapes that do not fit, a head dim past [`FLASH_MAX_HEAD_DIM`], mixed or
/// unsupported dtypes, a last dimension that is not contiguous, driver errors.
pub fn flash_attention_forward(
    q: (&CudaStorage, &Layout),
    k: (&CudaStorage, &Layout),
    v: (&CudaStorage, &Layout),
    bias: Option<(&CudaStorage, &Layout)>,
    mask: FlashMask,
) -> Result<(CudaStorage, CudaStorage)> {
    const OP: &str = "flash_attention_forward";
    let dims = flash_dims(OP, (q.1, k.1, v.1), bias.map(|b| b.1), mask)?;
    match q.0.dtype() {
        DType::F32 => forward::<f32>(OP, (q, k, v), bias, &dims),
        DType::BF16 => forward::<bf16>(OP, (q, k, v), bias, &dims),
        DType::F16 => forward::<f16>(OP, (q, k, v), bias, &dims),
        dtype => Err(Error::UnsupportedDType { op: OP, dtype }),
    }
}

type Operand<'a> = (&'a CudaStorage, &'a Layout);

fn forward<T: CudaDType + DeviceRepr + ValidAsZeroBits>(
    op: &'static str,
    (q, k, v): (Operand<'_>, Operand<'_>, Operand<'_>),
    bias: Option<Operand<'_>>,
    dims: &FlashDims,
) -> Result<(CudaStorage, CudaStorage)> {
    let dev = q.0.device.clone();
    let stream = dev.cuda_stream();
    let (qv, kv, vv) = (
        strided_view::<T>(op, 0, q.0, q.1)?,
        strided_view::<T>(op, 1, k.0, k.1)?,
        strided_view::<T>(op, 2, v.0, v.1)?,
    );
    let mut none = None;
    let bv = bias_view(op, 3, bias, &stream, &mut none)?;
    let mut o: CudaSlice<T> = stream.alloc_zeros(dims.q_elems().max(1)).w(op, "alloc")?;
    let mut lse: CudaSlice<f32> = stream.alloc_zeros(dims.q_rows().max(1)).w(op, "alloc")?;
    if dims.q_rows() > 0 {
        let (kernel, rows) = match tensor_cores(&dev, q.0.dtype(), dims) {
            Some([fwd, _]) => (fwd, MMA_ROWS),
            None => (KernelId::flash(q.0.dtype())[0], FWD_ROWS),
        };
        let args = FlashArgs::Forward {
            q: &qv,
            k: &kv,
            v: &vv,
            bias: &bv,
            o: &mut o,
            lse: &mut lse,
            dims,
            tiles: (dims.t as usize).div_ceil(rows) as u32,
        };
        launch_flash(op, &dev, kernel, args)?;
    }
    Ok((
        CudaStorage::wrap_cuda_slice(o, dev.clone()),
        CudaStorage::wrap_cuda_slice(lse, dev),
    ))
}

/// The gradients `(dq, dk, dv)` of [`flash_attention_forward`], contiguous
/// `[b, h, t, d]` and `[b, kvh, s, d]` in the operands' dtype, from the
/// forward's output `o` and log-sum-exps `lse` and the output gradient `g`
/// (`o` and `g` contiguous `[b, h, t, d]`, `lse` contiguous f32).
///
/// # Errors
/// As [`flash_attention_forward`]; `o`, `g` or `lse` of another shape.
#[allow(clippy::too_many_arguments)]
pub fn flash_attention_backward(
    q: (&CudaStorage, &Layout),
    k: (&CudaStorage, &Layout),
    v: (&CudaStorage, &Layout),
    o: (&CudaStorage, &Layout),
    g: (&CudaStorage, &Layout),
    lse: (&CudaStorage, &Layout),
    bias: Option<(&CudaStorage, &Layout)>,
    mask: FlashMask,
) -> Result<(CudaStorage, CudaStorage, CudaStorage)> {
    const OP: &str = "flash_attention_backward";
    let dims = flash_dims(OP, (q.1, k.1, v.1), bias.map(|b| b.1), mask)?;
    let (b, h, t) = (dims.b as usize, dims.h as usize, dims.t as usize);
    if o.1.dims() != q.1.dims() || g.1.dims() != q.1.dims() || lse.1.dims() != [b, h, t] {
        return Err(invalid(
            OP,
            format!(
                "output {:?}, its gradient {:?} and log-sum-exps {:?} do not match q {:?}",
                o.1.dims(),
                g.1.dims(),
                lse.1.dims(),
                q.1.dims()
            ),
        ));
    }
    let saved = (o, g, lse);
    match q.0.dtype() {
        DType::F32 => backward::<f32>(OP, (q, k, v), saved, bias, &dims),
        DType::BF16 => backward::<bf16>(OP, (q, k, v), saved, bias, &dims),
        DType::F16 => backward::<f16>(OP, (q, k, v), saved, bias, &dims),
        dtype => Err(Error::UnsupportedDType { op: OP, dtype }),
    }
}

fn backward<T: CudaDType + DeviceRepr + ValidAsZeroBits>(
    op: &'static str,
    (q, k, v): (Operand<'_>, Operand<'_>, Operand<'_>),
    (o, g, lse): (Operand<'_>, Operand<'_>, Operand<'_>),
    bias: Option<Operand<'_>>,
    dims: &FlashDims,
) -> Result<(CudaStorage, CudaStorage, CudaStorage)> {
    let dev = q.0.device.clone();
    let stream = dev.cuda_stream();
    let (qv, kv, vv) = (
        strided_view::<T>(op, 0, q.0, q.1)?,
        strided_view::<T>(op, 1, k.0, k.1)?,
        strided_view::<T>(op, 2, v.0, v.1)?,
    );
    let ov = contiguous_view::<T>(op, 3, o.0, o.1)?;
    let gv = contiguous_view::<T>(op, 4, g.0, g.1)?;
    let lv = contiguous_view::<f32>(op, 5, lse.0, lse.1)?;
    let mut none = None;
    let bv = bias_view(op, 6, bias, &stream, &mut none)?;
    let mut dq: CudaSlice<T> = stream.alloc_zeros(dims.q_elems().max(1)).w(op, "alloc")?;
    let mut dk: CudaSlice<T> = stream.alloc_zeros(dims.kv_elems().max(1)).w(op, "alloc")?;
    let mut dv: CudaSlice<T> = stream.alloc_zeros(dims.kv_elems().max(1)).w(op, "alloc")?;
    if dims.q_rows() > 0 && dims.s > 0 {
        let [_, delta_kernel, dq_kernel, dkdv_kernel] = KernelId::flash(q.0.dtype());
        let mut delta: CudaSlice<f32> = stream.alloc_zeros(dims.q_rows()).w(op, "alloc")?;
        let args = FlashArgs::Delta {
            o: &ov,
            g: &gv,
            delta: &mut delta,
            dims,
        };
        launch_flash(op, &dev, delta_kernel, args)?;
        let (dq_kernel, dq_rows) = match tensor_cores(&dev, q.0.dtype(), dims) {
            Some([_, dq]) => (dq, MMA_ROWS),
            None => (dq_kernel, DQ_ROWS),
        };
        let ins = BackwardInputs {
            q: qv,
            k: kv,
            v: vv,
            bias: bv,
            g: gv,
            lse: lv,
            delta,
        };
        let args = FlashArgs::Dq {
            ins: &ins,
            dq: &mut dq,
            dims,
            tiles: (dims.t as usize).div_ceil(dq_rows) as u32,
        };
        launch_flash(op, &dev, dq_kernel, args)?;
        let args = FlashArgs::Dkdv {
            ins: &ins,
            dk: &mut dk,
            dv: &mut dv,
            dims,
            tiles: (dims.s as usize).div_ceil(KV_KEYS) as u32,
        };
        launch_flash(op, &dev, dkdv_kernel, args)?;
    }
    let wrap = |s: CudaSlice<T>| CudaStorage::wrap_cuda_slice(s, dev.clone());
    Ok((wrap(dq), wrap(dk), wrap(dv)))
}
