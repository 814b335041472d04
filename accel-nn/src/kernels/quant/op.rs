//! The quantized weight's tensors and the op `x W^T` over them, with the
//! input's gradient (the weight is frozen: it never gets one).

use std::sync::Arc;

use accel_kernels::cuda::{QuantMaxima, QuantWeight, QUANT_TILE_ELEMS};
use candle_core::backend::BackendStorage;
use candle_core::{
    bail, CpuStorage, CudaStorage, CustomOp1, DType, Layout, Result, Shape, Storage, Tensor,
};

use super::{QuantRef, Scales, Store};
use crate::kernels::{as_f32, from_f32, tensor_from_f32, with_f32};

/// A quantized weight `[out, inp]` as tensors (the parameters a checkpoint
/// holds), with what reading them takes.
#[derive(Debug, Clone)]
pub(crate) enum QuantTensors {
    /// bitsandbytes 4-bit.
    FourBit {
        /// u8 codes, two a byte.
        packed: Tensor,
        /// f32 block maxima, or u8 codes of them with `nested`.
        absmax: Tensor,
        /// Double quantization: f32 maxima of 256 blocks, and the offset.
        nested: Option<(Tensor, f32)>,
        /// The code values (NF4 or FP4).
        codes: &'static [f32; 16],
        blocksize: usize,
        store: Store,
        out: usize,
        inp: usize,
    },
    /// LLM.int8.
    EightBit {
        /// int8 codes as u8 bytes, `[out, inp]`.
        codes: Tensor,
        /// f32 row maxima `[out]`.
        row_max: Tensor,
        out: usize,
        inp: usize,
    },
}

/// The bytes of a contiguous CPU tensor of `dtype`, as `f` reads them.
macro_rules! cpu_slice {
    ($t:expr, $variant:ident, $what:expr, |$s:ident| $body:expr) => {{
        let (storage, layout) = $t.storage_and_layout();
        let Some((a, b)) = layout.contiguous_offsets() else {
            bail!("quantized weight: {} is not contiguous", $what)
        };
        match &*storage {
            Storage::Cpu(CpuStorage::$variant(v)) => {
                let $s = &v[a..b];
                $body
            }
            Storage::Cpu(other) => bail!(
                "quantized weight: {} is {:?}, expected {}",
                $what,
                other.dtype(),
                stringify!($variant)
            ),
            _ => bail!("quantized weight: {} is not on the CPU", $what),
        }
    }};
}

/// The CUDA storage of a tensor and its layout, as `f` reads them.
macro_rules! cuda_part {
    ($t:expr, $what:expr, |$s:ident| $body:expr) => {{
        let (storage, layout) = $t.storage_and_layout();
        match &*storage {
            Storage::Cuda(c) => {
                let $s = (c, layout);
                $body
            }
            _ => bail!("quantized weight: {} is not on the GPU", $what),
        }
    }};
}

impl QuantTensors {
    /// `(out, inp)`.
    pub(crate) fn dims(&self) -> (usize, usize) {
        match self {
            Self::FourBit { out, inp, .. } | Self::EightBit { out, inp, .. } => (*out, *inp),
        }
    }

    /// Runs `f` on a view of the host data, checked to hold the whole
    /// weight, its values rounded to `compute` (the products' dtype).
    pub(crate) fn with_ref<R>(
        &self,
        compute: Store,
        f: impl FnOnce(&QuantRef) -> Result<R>,
    ) -> Result<R> {
        let simd = super::quant_path().simd();
        let checked = |w: QuantRef| -> Result<R> {
            if let Err(e) = w.check() {
                bail!("quantized weight [{}, {}]: {e}", w.dims().0, w.dims().1)
            }
            f(&w)
        };
        match self {
            Self::FourBit {
                packed,
                absmax,
                nested,
                codes,
                blocksize,
                store,
                out,
                inp,
            } => cpu_slice!(packed, U8, "the packed codes", |p| match nested {
                None => cpu_slice!(absmax, F32, "absmax", |a| checked(QuantRef::FourBit {
                    packed: p,
                    scales: Scales::F32(a),
                    codes,
                    blocksize: *blocksize,
                    store: *store,
                    compute,
                    simd,
                    out: *out,
                    inp: *inp,
                })),
                Some((n, offset)) => cpu_slice!(absmax, U8, "absmax codes", |a| {
                    cpu_slice!(n, F32, "nested_absmax", |n| checked(QuantRef::FourBit {
                        packed: p,
                        scales: Scales::Nested {
                            codes: a,
                            nested: n,
                            offset: *offset,
                        },
                        codes,
                        blocksize: *blocksize,
                        store: *store,
                        compute,
                        simd,
                        out: *out,
                        inp: *inp,
                    }))
                }),
            }),
            Self::EightBit {
                codes,
                row_max,
                out,
                inp,
            } => cpu_slice!(codes, U8, "the int8 codes", |c| {
                cpu_slice!(row_max, F32, "SCB", |m| checked(QuantRef::EightBit {
                    codes: c,
                    row_max: m,
                    compute,
                    out: *out,
                    inp: *inp,
                }))
            }),
        }
    }

    /// Runs `f` on the CUDA storages of the parts (for `quant.cu`'s
    /// products).
    pub(crate) fn with_cuda<R>(
        &self,
        f: impl FnOnce(&QuantWeight) -> accel_kernels::Result<R>,
    ) -> Result<R> {
        let run = |w: QuantWeight| f(&w).map_err(candle_core::Error::wrap);
        match self {
            Self::FourBit {
                packed,
                absmax,
                nested,
                codes,
                blocksize,
                store,
                out,
                inp,
            } => cuda_part!(packed, "the packed codes", |p| {
                let four_bit = |maxima| QuantWeight::FourBit {
                    packed: p,
                    maxima,
                    codes,
                    blocksize: *blocksize,
                    store: store.dtype(),
                    out: *out,
                    inp: *inp,
                };
                match nested {
                    None => cuda_part!(absmax, "absmax", |a| run(four_bit(QuantMaxima::F32(a)))),
                    Some((n, offset)) => cuda_part!(absmax, "absmax codes", |a| {
                        cuda_part!(n, "nested_absmax", |n| run(four_bit(QuantMaxima::Nested {
                            codes: a,
                            nested: n,
                            per: accel_bigmodel::quant::NESTED_BLOCKSIZE,
                            offset: *offset,
                            map: super::dynamic_map(),
                        })))
                    }),
                }
            }),
            Self::EightBit {
                codes,
                row_max,
                out,
                inp,
            } => cuda_part!(codes, "the int8 codes", |c| {
                cuda_part!(row_max, "SCB", |m| run(QuantWeight::EightBit {
                    codes: c,
                    row_max: m,
                    out: *out,
                    inp: *inp,
                }))
            }),
        }
    }

    /// The same weight with its parts on `device`.
    #[cfg(test)]
    pub(crate) fn to_device(&self, device: &candle_core::Device) -> Result<Self> {
        let mut w = self.clone();
        match &mut w {
            Self::FourBit {
                packed,
                absmax,
                nested,
                ..
            } => {
                *packed = packed.to_device(device)?;
                *absmax = absmax.to_device(device)?;
                if let Some((n, _)) = nested {
                    *n = n.to_device(device)?;
                }
            }
            Self::EightBit { codes, row_max, .. } => {
                *codes = codes.to_device(device)?;
                *row_max = row_max.to_device(device)?;
            }
        }
        Ok(w)
    }

    /// The weight dequantized on the CPU, `[out, inp]` f32.
    pub(crate) fn dequantize(&self) -> Result<Tensor> {
        let (out, inp) = self.dims();
        let v = self.with_ref(Store::F32, |w| Ok(super::dequantize(w)))?;
        Tensor::from_vec(v, (out, inp), &candle_core::Device::Cpu)
    }
}

/// `x [n, inp] @ W^T` (f32, bf16 or f16), differentiable in `x`: on the
/// CPU computed in f32 (or bf16 products), on CUDA by `quant.cu`'s tiles
/// and cuBLAS in `x`'s dtype.
pub(crate) fn quantized_linear(x: &Tensor, w: &Arc<QuantTensors>) -> Result<Tensor> {
    let x = x.contiguous()?;
    // The input's gradient reads only the frozen weight: the graph keeps
    // `x`'s node, not its values (docs/design/candle-core-patch.md).
    Ok(x.apply_op1(QuantLinearOp { w: w.clone() })?
        .release_input_values(&x))
}

struct QuantLinearOp {
    w: Arc<QuantTensors>,
}

impl CustomOp1 for QuantLinearOp {
    fn name(&self) -> &'static str {
        "accel-quantized-linear"
    }

    fn backward_reads_output(&self) -> bool {
        false
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let (n, inp) = l.shape().dims2()?;
        let (out, w_in) = self.w.dims();
        if inp != w_in {
            bail!("quantized linear: x is [{n}, {inp}] but the weight is [{out}, {w_in}]")
        }
        let xs = as_f32(s, l)?;
        let y = if bf16_products(s.dtype(), n) {
            // The packing rounds the weight to bf16, as the compute dtype would.
            let f = |w: &QuantRef| Ok(super::bf16_products::forward(&xs, n, w));
            self.w.with_ref(Store::F32, f)?
        } else {
            let f = |w: &QuantRef| Ok(super::forward(&xs, n, w));
            self.w.with_ref(Store::of(s.dtype()), f)?
        };
        Ok((from_f32(y, s.dtype())?, Shape::from((n, out))))
    }

    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
        let (n, _) = l.shape().dims2()?;
        let (out, _) = self.w.dims();
        let y = self
            .w
            .with_cuda(|w| accel_kernels::cuda::quantized_matmul((s, l), w, QUANT_TILE_ELEMS))?;
        Ok((y, Shape::from((n, out))))
    }

    fn bwd(&self, x: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        if !x.track_op() {
            return Ok(None);
        }
        if grad.device().is_cuda() {
            let w = self.w.clone();
            let dx = grad
                .contiguous()?
                .apply_op1_no_bwd(&QuantLinearGrad { w })?;
            return Ok(Some(dx));
        }
        let (n, inp) = x.dims2()?;
        let dx = with_f32(grad, |dy| {
            if bf16_products(x.dtype(), n) {
                let f = |w: &QuantRef| Ok(super::bf16_products::backward_input(dy, n, w));
                self.w.with_ref(Store::F32, f)
            } else {
                let f = |w: &QuantRef| Ok(super::backward_input(dy, n, w));
                self.w.with_ref(Store::of(x.dtype()), f)
            }
        })?;
        Ok(Some(tensor_from_f32(dx, (n, inp), x.dtype())?))
    }
}

/// `dy [n, out] @ W` on CUDA: the input's gradient of [`QuantLinearOp`]
/// (on the CPU its `bwd` computes it directly).
struct QuantLinearGrad {
    w: Arc<QuantTensors>,
}

impl CustomOp1 for QuantLinearGrad {
    fn name(&self) -> &'static str {
        "accel-quantized-linear-grad"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        bail!("internal: the quantized linear's CPU gradient is computed in its backward")
    }

    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
        let (n, _) = l.shape().dims2()?;
        let (_, inp) = self.w.dims();
        let dx = self.w.with_cuda(|w| {
            accel_kernels::cuda::quantized_matmul_grad((s, l), w, QUANT_TILE_ELEMS)
        })?;
        Ok((dx, Shape::from((n, inp))))
    }
}

/// Whether products over `n` rows of a `dtype` input take bf16 operands:
/// bf16 inputs past the skinny form (decoding reads the codes directly), on
/// a CPU with AVX-512 BF16 where the AVX-512 path is taken.
fn bf16_products(dtype: DType, n: usize) -> bool {
    dtype == DType::BF16
        && n > super::SKINNY_ROWS
        && super::quant_path() == super::QuantPath::Avx512
        && super::bf16_products::available()
}

impl Store {
    /// The dtype a weight was quantized from.
    fn dtype(self) -> DType {
        match self {
            Self::F32 => DType::F32,
            Self::Bf16 => DType::BF16,
            Self::F16 => DType::F16,
        }
    }

    /// The store of a weight quantized from `dtype`.
    pub(crate) fn of(dtype: DType) -> Self {
        match dtype {
            DType::BF16 => Self::Bf16,
            DType::F16 => Self::F16,
            _ => Self::F32,
        }
    }
}
