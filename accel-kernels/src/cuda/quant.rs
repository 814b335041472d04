//! Products through a frozen quantized weight on CUDA (`quant.cu`), the
//! twins of accel-nn's CPU kernels: `x W^T` for the forward and `dy W` for
//! the input's gradient, over bitsandbytes' 4-bit blocks (NF4/FP4, f32 or
//! double-quantized maxima) or LLM.int8 rows.
//!
//! Why tiles and cuBLAS: on a GPU the products belong on tensor cores, and
//! bitsandbytes itself dequantizes the whole weight for every call with more
//! than one row. Here a kernel writes one band of the weight at a time in
//! the compute dtype (rows for the forward, columns for the gradient, at most
//! [`QUANT_TILE_ELEMS`] elements, so a 4096 x 14336 projection takes four
//! bands of 32 MiB in bf16 rather than 112 MiB at once), candle's matmul
//! (cuBLAS) multiplies it, and the band is freed before the next: the
//! dequantized model never exists, and nothing of it is kept for the
//! backward. Up to [`GEMV_ROWS`] rows of a 4-bit weight (decoding) skip the
//! tiles: one kernel reads each code once and multiplies as it goes.

use candle_core::backend::BackendStorage;
use candle_core::cuda::{CudaDType, CudaDevice, CudaStorage};
use candle_core::{DType, Layout, WithDType};
use cudarc::driver::{CudaSlice, CudaView, DeviceRepr, ValidAsZeroBits};
use half::{bf16, f16};

use super::args::{QuantArgs, QuantCodes, QuantDims, QuantScales, GEMV_ROWS};
use super::compile::WrapDriver;
use super::launch::launch_quant;
use super::operands::view;
use super::registry::KernelId;
use crate::quant_weight::{Operand, QuantMaxima, QuantWeight};
use crate::{Error, Result};

/// `y [n, out] = x [n, inp] W^T` in `x`'s dtype (f32, bf16 or f16), bands
/// of at most `tile_elems` elements of `W` at a time.
///
/// # Errors
/// A dtype other than those, a non-contiguous or misshapen operand, parts
/// too short for the weight, driver and cuBLAS errors.
pub fn quantized_matmul(
    x: Operand<'_>,
    w: &QuantWeight<'_>,
    tile_elems: usize,
) -> Result<CudaStorage> {
    const OP: &str = "quantized_matmul";
    match x.0.dtype() {
        DType::F32 => forward::<f32>(OP, x, w, tile_elems),
        DType::BF16 => forward::<bf16>(OP, x, w, tile_elems),
        DType::F16 => forward::<f16>(OP, x, w, tile_elems),
        dtype => Err(Error::UnsupportedDType { op: OP, dtype }),
    }
}

/// `dx [n, inp] = dy [n, out] W` in `dy`'s dtype, bands of at most
/// `tile_elems` elements of `W` at a time: the input's gradient of
/// [`quantized_matmul`].
///
/// # Errors
/// As [`quantized_matmul`].
pub fn quantized_matmul_grad(
    dy: Operand<'_>,
    w: &QuantWeight<'_>,
    tile_elems: usize,
) -> Result<CudaStorage> {
    const OP: &str = "quantized_matmul_grad";
    match dy.0.dtype() {
        DType::F32 => backward::<f32>(OP, dy, w, tile_elems),
        DType::BF16 => backward::<bf16>(OP, dy, w, tile_elems),
        DType::F16 => backward::<f16>(OP, dy, w, tile_elems),
        dtype => Err(Error::UnsupportedDType { op: OP, dtype }),
    }
}

/// What the kernels need of an element type.
trait Elem: CudaDType + WithDType + DeviceRepr + ValidAsZeroBits {}
impl<T: CudaDType + WithDType + DeviceRepr + ValidAsZeroBits> Elem for T {}

fn invalid(op: &'static str, reason: String) -> Error {
    Error::InvalidArgument { op, reason }
}

/// `(rows, cols)` of a 2-D operand.
fn dims2(op: &'static str, l: &Layout, what: &str) -> Result<(usize, usize)> {
    match *l.dims() {
        [a, b] => Ok((a, b)),
        ref d => Err(invalid(
            op,
            format!("{what} is {d:?}, expected 2 dimensions"),
        )),
    }
}

fn forward<T: Elem>(
    op: &'static str,
    x: Operand<'_>,
    w: &QuantWeight<'_>,
    tile_elems: usize,
) -> Result<CudaStorage> {
    let (n, k) = dims2(op, x.1, "x")?;
    let (out, inp) = w.dims();
    if k != inp {
        return Err(invalid(
            op,
            format!("x is [{n}, {k}], the weight [{out}, {inp}]"),
        ));
    }
    let dev = x.0.device.clone();
    let parts = Parts::new(op, w)?;
    if n == 0 || out == 0 || inp == 0 {
        return zeros::<T>(op, &dev, n * out);
    }
    if n <= GEMV_ROWS && matches!(parts, Parts::Four { .. }) {
        let xv = view::<T>(op, 0, x.0, x.1)?;
        let y = parts.gemv::<T>(op, &dev, &xv, n)?;
        return Ok(CudaStorage::wrap_cuda_slice(y, dev));
    }
    let band = (tile_elems / inp).clamp(1, out);
    in_bands::<T>(op, &dev, (n, out), band, |o0, rows| {
        let t = parts.tile::<T>(op, &dev, (o0, rows), (0, inp))?;
        let t = CudaStorage::wrap_cuda_slice(t, dev.clone());
        let tl = Layout::contiguous((rows, inp)).transpose(0, 1)?;
        Ok(x.0.matmul(&t, (1, n, rows, inp), x.1, &tl)?)
    })
}

fn backward<T: Elem>(
    op: &'static str,
    dy: Operand<'_>,
    w: &QuantWeight<'_>,
    tile_elems: usize,
) -> Result<CudaStorage> {
    let (n, o) = dims2(op, dy.1, "dy")?;
    let (out, inp) = w.dims();
    if o != out {
        return Err(invalid(
            op,
            format!("dy is [{n}, {o}], the weight [{out}, {inp}]"),
        ));
    }
    let dev = dy.0.device.clone();
    let parts = Parts::new(op, w)?;
    if n == 0 || out == 0 || inp == 0 {
        return zeros::<T>(op, &dev, n * inp);
    }
    let band = (tile_elems / out).clamp(1, inp);
    in_bands::<T>(op, &dev, (n, inp), band, |k0, cols| {
        let t = parts.tile::<T>(op, &dev, (0, out), (k0, cols))?;
        let t = CudaStorage::wrap_cuda_slice(t, dev.clone());
        let tl = Layout::contiguous((out, cols));
        Ok(dy.0.matmul(&t, (1, n, cols, out), dy.1, &tl)?)
    })
}

/// The `[n, width]` result whose columns `c0..c0 + len` are `product(c0, len)`
/// (`[n, len]`), in bands of `band` columns: one product when a band is the
/// whole width, else each copied into place.
fn in_bands<T: Elem>(
    op: &'static str,
    dev: &CudaDevice,
    (n, width): (usize, usize),
    band: usize,
    product: impl Fn(usize, usize) -> Result<CudaStorage>,
) -> Result<CudaStorage> {
    if band >= width {
        return product(0, width);
    }
    let mut out = zeros::<T>(op, dev, n * width)?;
    for c0 in (0..width).step_by(band) {
        let len = band.min(width - c0);
        product(c0, len)?.copy2d(&mut out, n, len, len, width, 0, c0)?;
    }
    Ok(out)
}

fn zeros<T: Elem>(op: &'static str, dev: &CudaDevice, n: usize) -> Result<CudaStorage> {
    let z: CudaSlice<T> = dev.cuda_stream().alloc_zeros(n.max(1)).w(op, "alloc")?;
    Ok(CudaStorage::wrap_cuda_slice(z, dev.clone()))
}

/// A weight's parts as the kernels take them.
enum Parts<'a> {
    Four {
        packed: CudaView<'a, u8>,
        maxima: Maxima<'a>,
        codes: Box<QuantCodes>,
        dims: QuantDims,
    },
    Eight {
        codes: CudaView<'a, u8>,
        row_max: CudaView<'a, f32>,
        dims: QuantDims,
    },
}

enum Maxima<'a> {
    F32(CudaView<'a, f32>),
    Nested {
        codes: CudaView<'a, u8>,
        nested: CudaView<'a, f32>,
    },
}

impl<'a> Maxima<'a> {
    fn scales(&'a self) -> QuantScales<'a> {
        match self {
            Self::F32(a) => QuantScales::F32(a),
            Self::Nested { codes, nested } => QuantScales::Nested { codes, nested },
        }
    }
}

impl<'a> Parts<'a> {
    fn new(op: &'static str, w: &QuantWeight<'a>) -> Result<Self> {
        let (out, inp) = w.dims();
        let base = QuantDims {
            out: out as u64,
            inp: inp as u64,
            ..QuantDims::default()
        };
        Ok(match *w {
            QuantWeight::FourBit {
                packed,
                ref maxima,
                codes,
                blocksize,
                store,
                ..
            } => {
                let store = match store {
                    DType::F32 => 0,
                    DType::BF16 => 1,
                    DType::F16 => 2,
                    d => return Err(invalid(op, format!("a 4-bit weight stored as {d:?}"))),
                };
                let blocksize = u32::try_from(blocksize)
                    .ok()
                    .filter(|&b| b > 0)
                    .ok_or_else(|| invalid(op, format!("blocksize {blocksize}")))?;
                let mut table = Box::new(QuantCodes {
                    codes: *codes,
                    map: [0.0; 256],
                });
                let (maxima, nested_per, offset) = match *maxima {
                    QuantMaxima::F32(a) => (Maxima::F32(view(op, 2, a.0, a.1)?), 0, 0.0),
                    QuantMaxima::Nested {
                        codes,
                        nested,
                        per,
                        offset,
                        map,
                    } => {
                        table.map = *map;
                        let per = u32::try_from(per)
                            .ok()
                            .filter(|&p| p > 0)
                            .ok_or_else(|| invalid(op, format!("{per} maxima per nested one")))?;
                        let m = Maxima::Nested {
                            codes: view(op, 2, codes.0, codes.1)?,
                            nested: view(op, 3, nested.0, nested.1)?,
                        };
                        (m, per, offset)
                    }
                };
                Parts::Four {
                    packed: view(op, 1, packed.0, packed.1)?,
                    maxima,
                    codes: table,
                    dims: QuantDims {
                        blocksize,
                        nested_per,
                        offset,
                        store,
                        ..base
                    },
                }
            }
            QuantWeight::EightBit { codes, row_max, .. } => Parts::Eight {
                codes: view(op, 1, codes.0, codes.1)?,
                row_max: view(op, 2, row_max.0, row_max.1)?,
                dims: base,
            },
        })
    }

    /// Rows `r0..r0 + rows`, columns `k0..k0 + cols` of the weight, row-major.
    fn tile<T: Elem>(
        &self,
        op: &'static str,
        dev: &CudaDevice,
        (r0, rows): (usize, usize),
        (k0, cols): (usize, usize),
    ) -> Result<CudaSlice<T>> {
        let size = |v: usize| u32::try_from(v).map_err(|_| invalid(op, format!("a tile of {v}")));
        let mut dst: CudaSlice<T> = dev.cuda_stream().alloc_zeros(rows * cols).w(op, "alloc")?;
        let [four, eight, _] = KernelId::quant(T::DTYPE);
        let at = |d: &QuantDims| -> Result<QuantDims> {
            Ok(QuantDims {
                r0: r0 as u64,
                k0: k0 as u64,
                rows: size(rows)?,
                cols: size(cols)?,
                ..*d
            })
        };
        match self {
            Parts::Four {
                packed,
                maxima,
                codes,
                dims,
            } => {
                let dims = at(dims)?;
                let args = QuantArgs::Dequant4 {
                    packed,
                    scales: maxima.scales(),
                    dims: &dims,
                    codes,
                    dst: &mut dst,
                };
                launch_quant(op, dev, four, args)?;
            }
            Parts::Eight {
                codes,
                row_max,
                dims,
            } => {
                let dims = at(dims)?;
                let args = QuantArgs::Dequant8 {
                    codes,
                    row_max,
                    dims: &dims,
                    dst: &mut dst,
                };
                launch_quant(op, dev, eight, args)?;
            }
        }
        Ok(dst)
    }

    /// `x [n, inp] W^T` straight off a 4-bit weight's codes.
    fn gemv<T: Elem>(
        &self,
        op: &'static str,
        dev: &CudaDevice,
        x: &CudaView<'_, T>,
        n: usize,
    ) -> Result<CudaSlice<T>> {
        let Parts::Four {
            packed,
            maxima,
            codes,
            dims,
        } = self
        else {
            return Err(invalid(
                op,
                "the few-row product takes 4-bit weights".into(),
            ));
        };
        let mut y: CudaSlice<T> = dev
            .cuda_stream()
            .alloc_zeros(n * dims.out as usize)
            .w(op, "alloc")?;
        let [_, _, gemv] = KernelId::quant(T::DTYPE);
        let dims = QuantDims {
            n: n as u32,
            ..*dims
        };
        let args = QuantArgs::Gemv4 {
            x,
            packed,
            scales: maxima.scales(),
            dims: &dims,
            codes,
            y: &mut y,
        };
        launch_quant(op, dev, gemv, args)?;
        Ok(y)
    }
}
