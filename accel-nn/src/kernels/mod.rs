//! Fused CPU kernels with hand-written backward passes.
//!
//! Why they exist (bench GPT, batch 8, 2 cores, composed candle ops): a
//! training step spent ~1.9 s in backward and ~0.5 s in forward, mostly not
//! in gemm but in chains of small elementwise ops (GELU's backward alone is
//! ~12 of them, with `powf`), strided adds of transposed weight gradients,
//! zero-padded `cat`s from `narrow` backward and the thread hand-offs each
//! op pays. Each kernel here does one pass over its data, calls `gemm`
//! directly with the strides the data already has, and runs on candle's
//! CPU thread pool, the one candle's own element-wise ops use (see
//! [`raw::par`] for why not rayon).
//!
//! All kernels compute in f32; f16/bf16 tensors are converted on the way in
//! and out, which also sidesteps candle's missing bf16 CPU gemm. They are
//! CPU-only: `crate::ops` picks the composed candle path on other devices.
//! The only `unsafe` of the crate is in [`raw`].

use std::borrow::Cow;

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, DType, Device, Layout, Result, Shape, Storage, Tensor};
use half::{bf16, f16};

#[macro_use]
#[allow(unsafe_code)]
mod raw;

mod act;
mod attention;
mod attention_cuda;
mod attention_kernel;
mod attention_packed;
mod bf16_path;
mod flash;
mod forced;
mod gemm_bf16;
mod gemm_bf16_t;
mod linear;
mod linear_bf16;
mod loss;
mod loss_chunked;
mod math;
mod norm;
mod quant;
mod rope;
mod skinny;
mod softmax;

pub(crate) use act::{pointwise, swiglu};
pub(crate) use attention::attention;
pub use attention::{attention_kernel, AttentionKernel};
#[cfg(test)]
pub(crate) use attention::{attention_reference, attention_tiled};
pub(crate) use attention_cuda::{attention_cuda, cuda_supported as attention_cuda_supported};
pub(crate) use attention_kernel::MaskSpec;
pub(crate) use attention_packed::attention_packed;
pub use bf16_path::{bf16_path, with_bf16_path, Bf16Path};
pub(crate) use linear::{linear, Act};
pub(crate) use loss::{cross_entropy, linear_cross_entropy, LOGITS_BUDGET};
pub(crate) use loss_chunked::chunked_linear_cross_entropy;
pub(crate) use norm::{layer_norm, rms_norm};
pub use quant::{quant_path, with_quant_path, QuantPath};
pub(crate) use quant::{quantized_linear, QuantTensors, Store};
pub(crate) use rope::rope;
pub(crate) use softmax::{log_softmax_last_dim, softmax_last_dim};

/// The contiguous contents of a CPU storage as f32: borrowed when already
/// f32, converted for f16 and bf16.
fn as_f32<'a>(s: &'a CpuStorage, l: &Layout) -> Result<Cow<'a, [f32]>> {
    let Some((start, end)) = l.contiguous_offsets() else {
        bail!("fused kernel input must be contiguous")
    };
    Ok(match s {
        CpuStorage::F32(v) => Cow::Borrowed(&v[start..end]),
        CpuStorage::F16(v) => Cow::Owned(convert(&v[start..end], f16::to_f32)),
        CpuStorage::BF16(v) => Cow::Owned(convert(&v[start..end], bf16_to_f32)),
        other => bail!(
            "fused kernels support f32, f16 and bf16, got {:?}",
            other.dtype()
        ),
    })
}

/// `v` converted value by value, in parallel chunks, each output written
/// once (no serial zero fill first): halves to f32 and back around the
/// fused kernels (a 1 GB bf16 weight took a serial second here).
fn convert<S: Copy + Sync, T: Copy + Send>(v: &[S], f: impl Fn(S) -> T + Sync) -> Vec<T> {
    raw::par::map_values(v, CHUNK, f)
}

/// `x` widened as `bf16::to_f32` does (a NaN is quieted), branch-free so
/// the conversion loops vectorise.
#[inline(always)]
fn bf16_to_f32(x: bf16) -> f32 {
    let b = x.to_bits() as u32;
    let nan = (b & 0x7fff) > 0x7f80;
    f32::from_bits((if nan { b | 0x40 } else { b }) << 16)
}

/// `x` rounded to bf16 as `bf16::from_f32` does, branch-free so the
/// conversion loops vectorise (half's version did not: 6% of a bf16 LoRA
/// step).
#[inline(always)]
fn to_bf16(x: f32) -> bf16 {
    bf16::from_bits(raw::amx::bf16_bits(x))
}

/// The contiguous contents of a bf16 CPU storage, borrowed (`None` for
/// other dtypes or a strided layout).
fn as_bf16<'a>(s: &'a CpuStorage, l: &Layout) -> Option<&'a [bf16]> {
    match (s, l.contiguous_offsets()) {
        (CpuStorage::BF16(v), Some((start, end))) => Some(&v[start..end]),
        _ => None,
    }
}

/// A storage's values for the products: bf16 as they lie (read by the AMX
/// kernel), or f32, borrowed or converted.
enum ValuesOf<'a> {
    Bf16(&'a [bf16]),
    F32(Cow<'a, [f32]>),
}

impl ValuesOf<'_> {
    fn values(&self) -> raw::amx::Values<'_> {
        match self {
            Self::Bf16(v) => raw::amx::Values::Bf16(v),
            Self::F32(v) => raw::amx::Values::F32(v),
        }
    }
}

/// The contiguous contents of a CPU storage for the products: bf16 as they
/// lie when `keep_bf16` (callers pass it where AMX takes the products),
/// else as f32 ([`as_f32`]).
fn values_of<'a>(s: &'a CpuStorage, l: &Layout, keep_bf16: bool) -> Result<ValuesOf<'a>> {
    match as_bf16(s, l) {
        Some(v) if keep_bf16 => Ok(ValuesOf::Bf16(v)),
        _ => Ok(ValuesOf::F32(as_f32(s, l)?)),
    }
}

/// Runs `f` on a CPU tensor's values as [`values_of`] gives them.
fn with_values<R>(
    t: &Tensor,
    keep_bf16: bool,
    f: impl FnOnce(raw::amx::Values) -> Result<R>,
) -> Result<R> {
    let t = t.contiguous()?;
    let (storage, layout) = t.storage_and_layout();
    match &*storage {
        Storage::Cpu(s) => f(values_of(s, layout, keep_bf16)?.values()),
        _ => bail!("fused kernels run on CPU only"),
    }
}

/// A possibly strided f32 view of a CPU storage: (data, start offset,
/// strides). f32 storages are borrowed whole so strided views (a head
/// split of a fused qkv projection) cost no copy; half storages must be
/// contiguous and are converted.
fn strided_f32<'a>(s: &'a CpuStorage, l: &Layout) -> Result<(Cow<'a, [f32]>, usize, Vec<usize>)> {
    match s {
        CpuStorage::F32(v) => Ok((Cow::Borrowed(&v[..]), l.start_offset(), l.stride().to_vec())),
        _ => Ok((
            as_f32(s, l)?,
            0,
            Layout::contiguous(l.shape()).stride().to_vec(),
        )),
    }
}

/// f32 results as a CPU storage of `dtype`.
fn from_f32(v: Vec<f32>, dtype: DType) -> Result<CpuStorage> {
    Ok(match dtype {
        DType::F32 => CpuStorage::F32(v),
        DType::F16 => CpuStorage::F16(convert(&v, f16::from_f32)),
        DType::BF16 => CpuStorage::BF16(convert(&v, to_bf16)),
        other => bail!("fused kernels support f32, f16 and bf16, got {other:?}"),
    })
}

/// Runs `f` on the f32 contents of a CPU tensor (used by backward passes,
/// which receive tensors rather than storages).
fn with_f32<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> Result<R>) -> Result<R> {
    let t = t.contiguous()?;
    let (storage, layout) = t.storage_and_layout();
    match &*storage {
        Storage::Cpu(s) => f(&as_f32(s, layout)?),
        _ => bail!("fused kernels run on CPU only"),
    }
}

/// Runs `f` on the contents of a contiguous bf16 CPU tensor, borrowed.
fn with_bf16<R>(t: &Tensor, f: impl FnOnce(&[bf16]) -> Result<R>) -> Result<R> {
    let t = t.contiguous()?;
    let (storage, layout) = t.storage_and_layout();
    match &*storage {
        Storage::Cpu(s) => match as_bf16(s, layout) {
            Some(v) => f(v),
            None => bail!("expected a contiguous bf16 tensor, got {:?}", s.dtype()),
        },
        _ => bail!("fused kernels run on CPU only"),
    }
}

/// Like [`with_f32`] but keeps the tensor's strides (see [`strided_f32`]).
fn with_strided_f32<R>(
    t: &Tensor,
    f: impl FnOnce(&[f32], usize, &[usize]) -> Result<R>,
) -> Result<R> {
    let (storage, layout) = t.storage_and_layout();
    match &*storage {
        Storage::Cpu(s) => {
            let (data, off, strides) = strided_f32(s, layout)?;
            f(&data, off, &strides)
        }
        _ => bail!("fused kernels run on CPU only"),
    }
}

/// f32 results as a CPU tensor of `dtype`.
fn tensor_from_f32(v: Vec<f32>, shape: impl Into<Shape>, dtype: DType) -> Result<Tensor> {
    match dtype {
        DType::BF16 => Tensor::from_vec(convert(&v, to_bf16), shape, &Device::Cpu),
        DType::F16 => Tensor::from_vec(convert(&v, f16::from_f32), shape, &Device::Cpu),
        _ => Tensor::from_vec(v, shape, &Device::Cpu)?.to_dtype(dtype),
    }
}

/// Rows per task for kernels that reduce over rows (bias and norm-weight
/// gradients, the loss): about [`CHUNK`] elements, a function of the row
/// length alone, never of the thread count, so that with [`sum_in_order`] a
/// result's bits are the same on every machine and every run (rayon's
/// `reduce` combines partials in a tree whose shape follows work stealing).
fn rows_per_reduction(row_len: usize) -> usize {
    (CHUNK / row_len.max(1)).max(1)
}

/// Adds equally long partial sums one after the other, in their order.
fn sum_in_order(partials: Vec<Vec<f32>>, len: usize) -> Vec<f32> {
    let mut it = partials.into_iter();
    let mut acc = it.next().unwrap_or_else(|| vec![0f32; len]);
    for p in it {
        acc.iter_mut().zip(&p).for_each(|(a, b)| *a += b);
    }
    acc
}

/// Rows per parallel task for row-wise kernels: big enough that a task
/// amortises its scheduling, small enough to balance over the threads.
/// Only for kernels whose rows are independent (see [`rows_per_reduction`]).
fn rows_per_task(rows: usize, row_len: usize) -> usize {
    let even = rows.div_ceil(4 * raw::par::threads()).max(1);
    rows_per_reduction(row_len).min(even)
}

/// Elements per parallel task for elementwise kernels.
const CHUNK: usize = 16 * 1024;

#[cfg(test)]
mod conversion_tests {
    use half::bf16;

    use super::{bf16_to_f32, convert, to_bf16};

    #[test]
    fn conversions_match_half_bit_for_bit_on_every_bf16_and_every_rounding_case() {
        let halves: Vec<bf16> = (0..=u16::MAX).map(bf16::from_bits).collect();
        let wide = convert(&halves, bf16_to_f32);
        for (h, w) in halves.iter().zip(&wide) {
            assert_eq!(w.to_bits(), h.to_f32().to_bits(), "{:#06x}", h.to_bits());
        }
        // Every high half with the low halves around the rounding tie.
        let floats: Vec<f32> = (0..=u16::MAX as u32)
            .flat_map(|hi| [0, 1, 0x7fff, 0x8000, 0x8001, 0xffff].map(|lo| (hi << 16) | lo))
            .map(f32::from_bits)
            .collect();
        let narrow = convert(&floats, to_bf16);
        for (f, n) in floats.iter().zip(&narrow) {
            let want = bf16::from_f32(*f).to_bits();
            assert_eq!(n.to_bits(), want, "{:#010x}", f.to_bits());
        }
    }
}

#[cfg(test)]
mod determinism_tests {
    use candle_core::{DType, Device, Tensor, Var};

    use crate::ops::{self, Activation};

    /// Loss and every gradient of linear -> layer norm -> linear -> cross
    /// entropy, as raw bits.
    fn run() -> candle_core::Result<Vec<Vec<u32>>> {
        let dev = Device::Cpu;
        // Fixed pseudo-random values (candle's CPU generator takes no seed).
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut t = |dims: &[usize], mean: f32, scale: f32| {
            let n: usize = dims.iter().product();
            let v: Vec<f32> = (0..n)
                .map(|_| {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    mean + scale * ((state >> 40) as f32 / (1u64 << 24) as f32 - 0.5)
                })
                .collect();
            Tensor::from_vec(v, dims, &dev)
        };
        let n = 300; // several reduction blocks for every kernel below
        let x = t(&[n, 96], 0.0, 2.0)?;
        let vars = [
            Var::from_tensor(&t(&[80, 96], 0.0, 0.2)?)?,
            Var::from_tensor(&t(&[80], 0.0, 0.2)?)?,
            Var::from_tensor(&t(&[80], 1.0, 0.2)?)?,
            Var::from_tensor(&t(&[80], 0.0, 0.2)?)?,
            Var::from_tensor(&t(&[600, 80], 0.0, 0.2)?)?,
        ];
        let labels = Tensor::arange(0u32, n as u32, &dev)?;
        let h = ops::linear(&x, &vars[0], Some(&vars[1]), Some(Activation::Gelu))?;
        let h = ops::layer_norm(&h, &vars[2], Some(&vars[3]), 1e-5)?;
        let loss = ops::linear_cross_entropy(&h, &vars[4], &labels)?;
        let grads = loss.backward()?;
        let bits = |t: &Tensor| -> candle_core::Result<Vec<u32>> {
            let v = t.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
            Ok(v.into_iter().map(f32::to_bits).collect())
        };
        let mut out = vec![bits(&loss)?];
        for v in &vars {
            out.push(bits(grads.get(v).expect("a gradient for every weight"))?);
        }
        Ok(out)
    }

    #[test]
    fn losses_and_gradients_have_the_same_bits_for_any_thread_count() {
        let in_pool = |threads: usize| super::raw::par::with_threads(threads, run).unwrap();
        let one = in_pool(1);
        for threads in [2, 3] {
            let many = in_pool(threads);
            for (k, (a, b)) in one.iter().zip(&many).enumerate() {
                assert!(a == b, "output {k} differs between 1 and {threads} threads");
            }
        }
    }
}
