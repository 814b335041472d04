//! Stand-in for the CUDA path when the `cuda` feature is off: the same
//! names, each failing with [`Error::NotCompiled`]. Without the feature
//! candle has no CUDA devices, so the crate-internal entry points are never
//! reached; they exist so that every call site type-checks in CPU builds.

use candle_core::{CudaStorage, DType, Device, Layout, Storage, Tensor};

use crate::hyperparams::{AdamWScalars, SgdScalars};
pub use crate::quant_weight::{Operand, QuantMaxima, QuantWeight, QUANT_TILE_ELEMS};
use crate::{Error, Result};

fn off<T>() -> Result<T> {
    Err(Error::NotCompiled { feature: "cuda" })
}

/// Compiles and loads every kernel for a CUDA device; this build has no
/// CUDA support.
///
/// # Errors
/// Always [`Error::NotCompiled`].
pub fn precompile(_device: &Device) -> Result<()> {
    off()
}

/// Keeps freed device memory reserved for the process; this build has no
/// CUDA support.
///
/// # Errors
/// Always [`Error::NotCompiled`].
pub fn retain_freed_memory(_device: &Device, _retain: bool) -> Result<()> {
    off()
}

/// Gives reserved device memory back to the driver; this build has no CUDA
/// support.
///
/// # Errors
/// Always [`Error::NotCompiled`].
pub fn empty_cache(_device: &Device) -> Result<()> {
    off()
}

/// Free and total device memory; this build has no CUDA support.
///
/// # Errors
/// Always [`Error::NotCompiled`].
pub fn mem_get_info(_device: &Device) -> Result<(usize, usize)> {
    off()
}

/// The device's name; this build has no CUDA support.
///
/// # Errors
/// Always [`Error::NotCompiled`].
pub fn device_name(_device: &Device) -> Result<String> {
    off()
}

/// Peak device memory held by tensors; this build has no CUDA support.
///
/// # Errors
/// Always [`Error::NotCompiled`].
pub fn max_memory_allocated(_device: &Device) -> Result<Option<u64>> {
    off()
}

/// Resets the peak of [`max_memory_allocated`]; this build has no CUDA
/// support.
///
/// # Errors
/// Always [`Error::NotCompiled`].
pub fn reset_peak_memory_stats(_device: &Device) -> Result<()> {
    off()
}

/// Layer norm / RMS norm of an f32 matrix on a CUDA device; this build has
/// no CUDA support.
///
/// # Errors
/// Always [`Error::NotCompiled`].
pub fn row_norm_forward(
    _x: (&CudaStorage, &Layout),
    _w: (&CudaStorage, &Layout),
    _b: Option<(&CudaStorage, &Layout)>,
    _eps: f32,
    _rms: bool,
) -> Result<CudaStorage> {
    off()
}

/// The gradients of [`row_norm_forward`]; this build has no CUDA support.
///
/// # Errors
/// Always [`Error::NotCompiled`].
pub fn row_norm_backward(
    _x: (&CudaStorage, &Layout),
    _w: (&CudaStorage, &Layout),
    _g: (&CudaStorage, &Layout),
    _eps: f32,
    _rms: bool,
) -> Result<CudaStorage> {
    off()
}

/// SwiGLU of two f32 storages on a CUDA device; this build has no CUDA support.
///
/// # Errors
/// Always [`Error::NotCompiled`].
pub fn swiglu_forward(
    _g: (&CudaStorage, &Layout),
    _u: (&CudaStorage, &Layout),
) -> Result<CudaStorage> {
    off()
}

/// The gradients of [`swiglu_forward`]; this build has no CUDA support.
///
/// # Errors
/// Always [`Error::NotCompiled`].
pub fn swiglu_backward(
    _g: (&CudaStorage, &Layout),
    _u: (&CudaStorage, &Layout),
    _dy: (&CudaStorage, &Layout),
) -> Result<CudaStorage> {
    off()
}

pub use crate::activation::Activation;

/// A pointwise activation on a CUDA device; this build has no CUDA support.
///
/// # Errors
/// Always [`Error::NotCompiled`].
pub fn activation_forward(_x: (&CudaStorage, &Layout), _act: Activation) -> Result<CudaStorage> {
    off()
}

/// The gradient of [`activation_forward`]; this build has no CUDA support.
///
/// # Errors
/// Always [`Error::NotCompiled`].
pub fn activation_backward(
    _x: (&CudaStorage, &Layout),
    _dy: (&CudaStorage, &Layout),
    _act: Activation,
) -> Result<CudaStorage> {
    off()
}

/// Rotary position embeddings on a CUDA device; this build has no CUDA support.
///
/// # Errors
/// Always [`Error::NotCompiled`].
pub fn rope_rotate(
    _x: (&CudaStorage, &Layout),
    _cos: (&CudaStorage, &Layout),
    _sin: (&CudaStorage, &Layout),
    _interleaved: bool,
    _inverse: bool,
) -> Result<CudaStorage> {
    off()
}

/// Softmax over rows on a CUDA device; this build has no CUDA support.
///
/// # Errors
/// Always [`Error::NotCompiled`].
pub fn softmax_rows(_x: (&CudaStorage, &Layout), _log: bool) -> Result<CudaStorage> {
    off()
}

/// The gradient of [`softmax_rows`]; this build has no CUDA support.
///
/// # Errors
/// Always [`Error::NotCompiled`].
pub fn softmax_rows_backward(
    _y: (&CudaStorage, &Layout),
    _g: (&CudaStorage, &Layout),
    _log: bool,
) -> Result<CudaStorage> {
    off()
}

/// Mean cross entropy on a CUDA device; this build has no CUDA support.
///
/// # Errors
/// Always [`Error::NotCompiled`].
pub fn cross_entropy_forward(
    _logits: (&CudaStorage, &Layout),
    _targets: (&CudaStorage, &Layout),
) -> Result<CudaStorage> {
    off()
}

/// The gradient of [`cross_entropy_forward`]; this build has no CUDA support.
///
/// # Errors
/// Always [`Error::NotCompiled`].
pub fn cross_entropy_backward(
    _logits: (&CudaStorage, &Layout),
    _targets: (&CudaStorage, &Layout),
    _dy: (&CudaStorage, &Layout),
) -> Result<CudaStorage> {
    off()
}

pub(crate) fn storage_key(_storage: &Storage) -> Option<usize> {
    None
}

pub(crate) fn cast_into(_src: &[Tensor], _dst: &[Tensor]) -> Result<()> {
    off()
}

pub(crate) fn cast_tensors(_src: &[Tensor], _dtype: DType) -> Result<Vec<Tensor>> {
    off()
}

pub(crate) fn unscale_and_check(_tensors: &[Tensor], _inv_scale: f32) -> Result<bool> {
    off()
}

pub(crate) fn has_non_finite(_tensors: &[Tensor]) -> Result<bool> {
    off()
}

pub(crate) fn sum_of_squares(_tensors: &[Tensor]) -> Result<f64> {
    off()
}

pub(crate) fn max_abs(_tensors: &[Tensor]) -> Result<f64> {
    off()
}

pub(crate) fn scale(_tensors: &[Tensor], _factor: f32) -> Result<()> {
    off()
}

pub(crate) fn clamp(_tensors: &[Tensor], _lo: f32, _hi: f32) -> Result<()> {
    off()
}

pub(crate) fn add(_dst: &[Tensor], _src: &[Tensor]) -> Result<()> {
    off()
}

pub(crate) fn adamw(
    _params: &[Tensor],
    _grads: &[Tensor],
    _exp_avg: &[Tensor],
    _exp_avg_sq: &[Tensor],
    _s: &AdamWScalars,
) -> Result<()> {
    off()
}

pub(crate) fn sgd(
    _params: &[Tensor],
    _grads: &[Tensor],
    _bufs: Option<&[Tensor]>,
    _s: &SgdScalars,
) -> Result<()> {
    off()
}

/// Compiles every embedded kernel source with NVRTC; this build has no CUDA
/// support.
///
/// # Errors
/// Always [`Error::NotCompiled`].
pub fn compile_sources(_arch: &str) -> Result<Vec<(&'static str, String)>> {
    off()
}

/// The largest head dimension of the CUDA attention kernels.
pub const FLASH_MAX_HEAD_DIM: usize = 128;

/// The mask and scale of a CUDA attention call.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FlashMask {
    /// Multiplies `q k^T` before the bias is added.
    pub scale: f32,
    /// Causal masking with the first query at this absolute position.
    pub causal_offset: Option<usize>,
    /// With `causal_offset`, a sliding window of this many keys.
    pub window: Option<usize>,
}

/// Whether the CUDA attention kernels take these operands; never in this
/// build.
pub fn flash_supported(_dtype: DType, _d: usize) -> bool {
    false
}

/// Tiled attention on a CUDA device; this build has no CUDA support.
///
/// # Errors
/// Always [`Error::NotCompiled`].
pub fn flash_attention_forward(
    _q: (&CudaStorage, &Layout),
    _k: (&CudaStorage, &Layout),
    _v: (&CudaStorage, &Layout),
    _bias: Option<(&CudaStorage, &Layout)>,
    _mask: FlashMask,
) -> Result<(CudaStorage, CudaStorage)> {
    off()
}

/// The gradients of [`flash_attention_forward`]; this build has no CUDA
/// support.
///
/// # Errors
/// Always [`Error::NotCompiled`].
#[allow(clippy::too_many_arguments)]
pub fn flash_attention_backward(
    _q: (&CudaStorage, &Layout),
    _k: (&CudaStorage, &Layout),
    _v: (&CudaStorage, &Layout),
    _o: (&CudaStorage, &Layout),
    _g: (&CudaStorage, &Layout),
    _lse: (&CudaStorage, &Layout),
    _bias: Option<(&CudaStorage, &Layout)>,
    _mask: FlashMask,
) -> Result<(CudaStorage, CudaStorage, CudaStorage)> {
    off()
}

/// `x W^T` through a quantized weight on a CUDA device; this build has no
/// CUDA support.
///
/// # Errors
/// Always [`Error::NotCompiled`].
pub fn quantized_matmul(
    _x: Operand<'_>,
    _w: &QuantWeight<'_>,
    _tile_elems: usize,
) -> Result<CudaStorage> {
    off()
}

/// `dy W` through a quantized weight on a CUDA device; this build has no
/// CUDA support.
///
/// # Errors
/// Always [`Error::NotCompiled`].
pub fn quantized_matmul_grad(
    _dy: Operand<'_>,
    _w: &QuantWeight<'_>,
    _tile_elems: usize,
) -> Result<CudaStorage> {
    off()
}
