//! Fused CPU kernels with hand-written backward passes for the GPT and MLP
//! training hot spots.
//!
//! Why they exist (bench GPT, batch 8, 2 cores, composed candle ops): a
//! training step spent ~1.9 s in backward and ~0.5 s in forward, mostly not
//! in gemm but in chains of small elementwise ops (GELU's backward alone is
//! ~12 of them, with `powf`), strided adds of transposed weight gradients,
//! zero-padded `cat`s from `narrow` backward and the thread hand-offs each
//! op pays. Each kernel here does one pass over its data, calls `gemm`
//! directly with the strides the data already has (so head splitting and
//! weight transposes cost no copies), and runs on rayon, the pool gemm uses.
//!
//! All kernels compute in f32; f16/bf16 tensors are converted on the way in
//! and out, which also sidesteps candle's missing bf16 CPU gemm. They are
//! CPU-only: callers pick the composed candle path on other devices.

use std::borrow::Cow;

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, DType, Device, Layout, Result, Shape, Storage, Tensor};
use half::{bf16, f16};

/// Defines `pub(super) fn $name($args) -> $ret` that runs `$body`
/// compiled for AVX-512, AVX2 or baseline, whichever the CPU supports.
macro_rules! multiversion {
    ($(#[$doc:meta])* fn $name:ident($($arg:ident: $ty:ty),*) $(-> $ret:ty)? $body:block) => {
        $(#[$doc])*
        pub(super) fn $name($($arg: $ty),*) $(-> $ret)? {
            #[inline(always)]
            fn imp($($arg: $ty),*) $(-> $ret)? $body
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f")]
                unsafe fn avx512($($arg: $ty),*) $(-> $ret)? { imp($($arg),*) }
                #[target_feature(enable = "avx2")]
                unsafe fn avx2($($arg: $ty),*) $(-> $ret)? { imp($($arg),*) }
                if std::arch::is_x86_feature_detected!("avx512f") {
                    // SAFETY: the CPU supports the enabled features.
                    return unsafe { avx512($($arg),*) };
                }
                if std::arch::is_x86_feature_detected!("avx2") {
                    // SAFETY: as above.
                    return unsafe { avx2($($arg),*) };
                }
            }
            imp($($arg),*)
        }
    };
}

mod attention;
mod linear;
mod loss;
mod math;
mod norm;

pub(crate) use attention::causal_attention;
pub(crate) use linear::{linear, Activation};
pub(crate) use loss::linear_cross_entropy;
pub(crate) use norm::layer_norm;

/// The contiguous contents of a CPU storage as f32: borrowed when already
/// f32, converted for f16 and bf16.
fn as_f32<'a>(s: &'a CpuStorage, l: &Layout) -> Result<Cow<'a, [f32]>> {
    let Some((start, end)) = l.contiguous_offsets() else {
        bail!("fused kernel input must be contiguous")
    };
    Ok(match s {
        CpuStorage::F32(v) => Cow::Borrowed(&v[start..end]),
        CpuStorage::F16(v) => Cow::Owned(v[start..end].iter().map(|x| x.to_f32()).collect()),
        CpuStorage::BF16(v) => Cow::Owned(v[start..end].iter().map(|x| x.to_f32()).collect()),
        other => bail!(
            "fused kernels support f32, f16 and bf16, got {:?}",
            other.dtype()
        ),
    })
}

/// f32 results as a CPU storage of `dtype`.
fn from_f32(v: Vec<f32>, dtype: DType) -> Result<CpuStorage> {
    Ok(match dtype {
        DType::F32 => CpuStorage::F32(v),
        DType::F16 => CpuStorage::F16(v.into_iter().map(f16::from_f32).collect()),
        DType::BF16 => CpuStorage::BF16(v.into_iter().map(bf16::from_f32).collect()),
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

/// f32 results as a CPU tensor of `dtype`.
fn tensor_from_f32(v: Vec<f32>, shape: impl Into<Shape>, dtype: DType) -> Result<Tensor> {
    Tensor::from_vec(v, shape, &Device::Cpu)?.to_dtype(dtype)
}

/// A raw pointer that may cross threads. Parallel tasks use it to write
/// disjoint, strided regions of one output buffer, which slices cannot
/// express; each use documents why the regions do not overlap.
#[derive(Clone, Copy)]
struct SendPtr(*mut f32);
// SAFETY: only used to write regions that no other task touches, while the
// owning buffer outlives the parallel section.
unsafe impl Send for SendPtr {}
unsafe impl Sync for SendPtr {}

impl SendPtr {
    /// The pointer. A method rather than field access so closures capture
    /// the whole (Send) wrapper, not the bare pointer field.
    fn ptr(self) -> *mut f32 {
        self.0
    }
}

/// A read-only strided matrix: element (i, j) lives at `ptr + i*rs + j*cs`.
#[derive(Clone, Copy)]
struct Mat {
    ptr: *const f32,
    rs: isize,
    cs: isize,
}

impl Mat {
    /// A row-major matrix with row stride `rs`.
    fn rows(ptr: *const f32, rs: usize) -> Self {
        Self {
            ptr,
            rs: rs as isize,
            cs: 1,
        }
    }

    /// The transpose of the row-major matrix at `ptr` with row stride `rs`.
    fn rows_t(ptr: *const f32, rs: usize) -> Self {
        Self {
            ptr,
            rs: 1,
            cs: rs as isize,
        }
    }
}

/// `dst[m, n] (row stride dst_rs) = [dst +] a[m, k] @ b[k, n]`.
///
/// # Safety
/// All pointers must be valid for the given shapes and strides, and `dst`
/// must not alias `a` or `b`.
#[allow(clippy::too_many_arguments)]
unsafe fn gemm(
    m: usize,
    n: usize,
    k: usize,
    dst: *mut f32,
    dst_rs: usize,
    accumulate: bool,
    a: Mat,
    b: Mat,
    parallel: bool,
) {
    let threads = rayon::current_num_threads();
    let par = if parallel && threads > 1 {
        gemm::Parallelism::Rayon(threads)
    } else {
        gemm::Parallelism::None
    };
    gemm::gemm(
        m,
        n,
        k,
        dst,
        1,
        dst_rs as isize,
        accumulate,
        a.ptr,
        a.cs,
        a.rs,
        b.ptr,
        b.cs,
        b.rs,
        1.0,
        1.0,
        false,
        false,
        false,
        par,
    )
}

/// A new `m x n` row-major buffer holding `a @ b`. gemm overwrites every
/// element when it does not read `dst`, so the buffer is never
/// zero-filled first (that memset showed up at ~3% of a training step).
///
/// # Safety
/// `a` and `b` must be valid for the given shapes and strides.
unsafe fn gemm_new(m: usize, n: usize, k: usize, a: Mat, b: Mat, parallel: bool) -> Vec<f32> {
    let mut out = Vec::with_capacity(m * n);
    gemm(m, n, k, out.as_mut_ptr(), n, false, a, b, parallel);
    // SAFETY: the gemm above wrote all m * n elements (with k == 0 and
    // read_dst == false it writes zeros).
    out.set_len(m * n);
    out
}

/// Rows per parallel task for row-wise kernels: big enough that a task
/// amortises its scheduling, small enough to balance over the threads.
fn rows_per_task(rows: usize, row_len: usize) -> usize {
    let target = (16 * 1024 / row_len.max(1)).max(1);
    let even = rows.div_ceil(4 * rayon::current_num_threads()).max(1);
    target.min(even)
}

#[cfg(test)]
mod tests;
