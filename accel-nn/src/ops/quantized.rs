//! `act(x W^T + b)` through a frozen quantized weight.

use candle_core::{bail, DType, Result, Tensor};

use super::activation::composed_activation;
use super::{fused, fused_cuda, linear::composed_linear, Activation};
use crate::kernels::{self, QuantTensors};
use crate::layers::QuantizedWeight;

/// Whether `quant.cu`'s products have passed on a GPU
/// (`cuda_quantized_linear_matches_the_cpu_kernel`, in scripts/gpu_check.sh's
/// `nn-cuda-quant` step); until then CUDA tensors take the composed path.
const CUDA_QUANT_CHECKED: bool = false;

/// A linear layer over a quantized weight (bitsandbytes' `Linear4bit` /
/// `Linear8bitLt`): `x` is cast to the weight's compute dtype, multiplied,
/// biased, activated and cast back. Differentiable in `x` (and the bias);
/// the weight is frozen.
///
/// On CPU the products dequantize tiles of the weight as they go (never the
/// whole matrix). On CUDA, once `quant.cu` has passed its GPU check
/// (`CUDA_QUANT_CHECKED`), bands of the weight are dequantized and
/// multiplied by cuBLAS one at a time and a few rows read the codes
/// directly; until then, and on other devices, the weight is dequantized
/// with candle ops for each call (correct everywhere, but the graph keeps
/// each dense copy for the backward).
pub fn quantized_linear(
    x: &Tensor,
    w: &QuantizedWeight,
    b: Option<&Tensor>,
    act: Option<Activation>,
) -> Result<Tensor> {
    let (out, inp) = w.dims();
    let Some((&last, lead)) = x.dims().split_last() else {
        bail!("quantized linear: x must have at least one dimension")
    };
    if last != inp || b.is_some_and(|b| b.dims() != [out]) {
        bail!(
            "quantized linear: x {:?}, weight [{out}, {inp}], bias {:?} do not fit",
            x.dims(),
            b.map(|b| b.dims().to_vec())
        )
    }
    let dtype = x.dtype();
    let xc = match w.compute_dtype {
        Some(c) if c != dtype => x.to_dtype(c)?,
        _ => x.clone(),
    };
    let n: usize = lead.iter().product();
    let x2 = xc.reshape((n, inp))?;
    let y = if fused(&x2) || (CUDA_QUANT_CHECKED && fused_cuda(&x2)) {
        kernels::quantized_linear(&x2, &w.tensors)?
    } else {
        let dense = composed_dequantize(&w.tensors, x2.device())?.to_dtype(x2.dtype())?;
        composed_linear(&x2, &dense, None, None)?
    };
    let y = match b {
        Some(b) => y.broadcast_add(&b.to_dtype(y.dtype())?)?,
        None => y,
    };
    let mut dims = lead.to_vec();
    dims.push(out);
    let y = y.reshape(dims)?;
    let y = match act {
        Some(a) => composed_activation(&y, Some(a))?,
        None => y,
    };
    y.to_dtype(dtype)
}

/// The weight dequantized with candle ops on `device` (f32 `[out, inp]`),
/// as bitsandbytes' reference `dequantize_4bit` / `int8_vectorwise_dequant`.
pub(crate) fn composed_dequantize(
    w: &QuantTensors,
    device: &candle_core::Device,
) -> Result<Tensor> {
    let (out, inp) = w.dims();
    let n = out * inp;
    match w {
        QuantTensors::FourBit {
            packed,
            absmax,
            nested,
            codes,
            blocksize,
            store,
            ..
        } => {
            let bytes = packed
                .to_device(device)?
                .flatten_all()?
                .to_dtype(DType::F32)?;
            let hi = (&bytes / 16.0)?.floor()?;
            let lo = (&bytes - (&hi * 16.0)?)?;
            let idx = Tensor::stack(&[&hi, &lo], 1)?
                .flatten_all()?
                .narrow(0, 0, n)?
                .to_dtype(DType::U32)?;
            let table = Tensor::new(codes.as_slice(), device)?;
            let values = table.index_select(&idx, 0)?;
            let blocks = n.div_ceil(*blocksize);
            let scales = match nested {
                None => absmax.to_device(device)?,
                Some((nested, offset)) => {
                    let map = Tensor::new(accel_bigmodel::quant::dynamic_map().as_slice(), device)?;
                    let codes = absmax.to_device(device)?.to_dtype(DType::U32)?;
                    let per = Tensor::arange(0u32, blocks as u32, device)?
                        .affine(1.0 / accel_bigmodel::quant::NESTED_BLOCKSIZE as f64, 0.0)?;
                    // arange / 256 floored: the nested block of each block.
                    let which = per.to_dtype(DType::F32)?.floor()?.to_dtype(DType::U32)?;
                    let nested = nested.to_device(device)?.index_select(&which, 0)?;
                    ((map.index_select(&codes, 0)? * nested)? + f64::from(*offset))?
                }
            };
            let block_of = (Tensor::arange(0u32, n as u32, device)?.to_dtype(DType::F32)?
                / *blocksize as f64)?
                .floor()?
                .to_dtype(DType::U32)?;
            let v = (values * scales.index_select(&block_of, 0)?)?;
            let v = match store {
                kernels::Store::F32 => v,
                kernels::Store::Bf16 => v.to_dtype(DType::BF16)?.to_dtype(DType::F32)?,
                kernels::Store::F16 => v.to_dtype(DType::F16)?.to_dtype(DType::F32)?,
            };
            v.reshape((out, inp))
        }
        QuantTensors::EightBit { codes, row_max, .. } => {
            let c = codes.to_device(device)?.to_dtype(DType::F32)?;
            // The bytes are int8 two's complement: values of 128 and up are negative.
            let neg = c.ge(128.0)?.to_dtype(DType::F32)?;
            let c = (c - (neg * 256.0)?)?;
            let m = row_max.to_device(device)?.reshape((out, 1))?;
            c.broadcast_mul(&m)? * f64::from(7.874_016e-3f32)
        }
    }
}

#[cfg(test)]
#[path = "quantized_tests.rs"]
mod tests;
