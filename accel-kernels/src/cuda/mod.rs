//! The CUDA path: fused multi-tensor kernels, compiled with NVRTC on first use.
//!
//! The kernel sources (`*.cu` beside this file, plus `common.cuh`) are
//! embedded in the crate; nothing is compiled at build time, so building
//! with `--features cuda` needs no CUDA toolkit beyond what candle needs.
//! The first call on a device compiles each source for the device's
//! architecture (`sm_XY` from its compute capability) and loads the module
//! into the device's context; the modules are kept per device (candle
//! [`DeviceId`]) for the life of the process.
//!
//! A launch covers up to 64 tensors of a list: the host describes them
//! (operand addresses, lengths, chunks of `chunk_len` elements) in a table
//! passed by value as the kernel's first parameter (`Table` in
//! `operands.rs` and `common.cuh`), as PyTorch's `multi_tensor_apply`
//! does, so a call uploads nothing; the blocks of one grid walk the
//! chunks. Longer lists take one launch per 64 tensors, and lists of mixed
//! dtypes one per dtype.
//! Reductions (`sum_of_squares`, `max_abs`) write one partial per chunk,
//! combined on the host in chunk order; the overflow check of
//! `unscale_and_check` / `has_non_finite` raises one device flag. Both read
//! back a few bytes, so those calls synchronise with the device; every
//! other call only enqueues work on candle's stream.
//!
//! # cudarc and linking
//!
//! `cudarc` (the same 0.19 release candle uses, so cargo unifies the two)
//! is added with only the `driver`, `nvrtc` and `f16` modules and no
//! linking feature of its own: candle enables `dynamic-linking` and
//! `cuda-version-from-build-system`, and cudarc's build script refuses two
//! linking modes at once (`dynamic-loading` alongside would panic there).
//! So the binaries link `libnvrtc` like candle links `libcublas`.
//!
//! # Conversions
//!
//! f32 ↔ bf16/f16 use the PTX instructions of `__float2bfloat16`,
//! `__float2half`, `__bfloat162float` and `__half2float` (candle's CUDA
//! `to_dtype`), so the results are bitwise those of `to_dtype` on the same
//! device. NaN encodings can therefore differ from the CPU path (which
//! follows the `half` crate): on sm_80+ `cvt.rn.bf16.f32` returns the
//! canonical NaN.
//!
//! # Streams and locking
//!
//! candle 0.11 gives every host thread its own stream on a device
//! (`CudaDevice::new` wraps CUDA's per-thread default stream, so
//! `cuda_stream()` means "the calling thread's stream"). Launches here go
//! to that stream, so they are ordered with the candle ops of the calling
//! thread. Work of *other* streams (another thread's candle ops, NCCL's own
//! stream) is ordered by cudarc's per-allocation events, which cudarc only
//! tracks once its context runs more than one stream: [`crate::cuda_device`]
//! therefore opens a side stream on every device it makes (see
//! `devices.rs`), and tensors must come from that device.
//!
//! A call holds *read* locks on the storages of all its tensors while it
//! enqueues its kernels: taking an address through a read guard makes this
//! stream wait for the tensor's last write and records a read event after
//! the launch (ordering later writers and frees behind it). Tensors the
//! call writes are then write-locked one at a time and their write events
//! recorded after the launch (`operands::fence_writes`), so readers on
//! other streams wait for the kernel too. Written tensors must not share
//! storage with other tensors of the call ([`Error::AliasedStorage`]), as
//! on the CPU.

mod args;
mod attention;
mod launch;
mod loss;
mod operands;
mod ops;
mod pointwise;
mod pool;
mod quant;
mod rows;

use std::collections::HashMap;
use std::sync::{Arc, LazyLock, Mutex, RwLock};

use candle_core::cuda::{CudaDevice, DeviceId};
use candle_core::{DType, Device};
use cudarc::driver::{CudaFunction, CudaModule, DriverError};
use cudarc::nvrtc::{compile_ptx_with_opts, CompileError, CompileOptions, Ptx};

use crate::{Error, Result};

pub use crate::quant_weight::{Operand, QuantMaxima, QuantWeight, QUANT_TILE_ELEMS};
pub use attention::{
    flash_attention_backward, flash_attention_forward, flash_supported, FlashMask,
    FLASH_MAX_HEAD_DIM,
};
pub use loss::{cross_entropy_backward, cross_entropy_forward};
pub(crate) use operands::storage_key;
pub(crate) use ops::*;
pub use pointwise::{
    activation_backward, activation_forward, rope_rotate, swiglu_backward, swiglu_forward,
    Activation,
};
pub use pool::{
    device_name, empty_cache, max_memory_allocated, mem_get_info, reset_peak_memory_stats,
    retain_freed_memory,
};
pub use quant::{quantized_matmul, quantized_matmul_grad};
pub use rows::{row_norm_backward, row_norm_forward, softmax_rows, softmax_rows_backward};

/// Smallest and largest chunk of a launch table, in elements. Chunk
/// lengths are powers of two (multiples of the vector width, so every chunk
/// of an aligned tensor is aligned too).
pub(crate) const MIN_CHUNK: usize = 4 * 1024;
/// See [`MIN_CHUNK`].
pub(crate) const MAX_CHUNK: usize = 64 * 1024;

/// The chunk length for a list of `total` elements: about 2048 chunks,
/// enough blocks to fill a large GPU several times over, and each a block's
/// worth of work (up to 64K elements) so that per-chunk costs stay small.
pub(crate) fn chunk_len(total: usize) -> usize {
    (total / 2048)
        .next_power_of_two()
        .clamp(MIN_CHUNK, MAX_CHUNK)
}

/// The helpers prepended to every source.
const COMMON: &str = include_str!("common.cuh");

/// One embedded kernel source.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ModuleId {
    /// `cast.cu`: dtype conversions.
    Cast,
    /// `unscale.cu`: unscale, overflow check, scale, clamp.
    Unscale,
    /// `optim.cu`: gradient accumulation, AdamW, SGD.
    Optim,
    /// `norm.cu`: sum of squares, largest magnitude.
    Norm,
    /// `rownorm.cu`: layer norm and RMS norm over rows, forward and backward.
    RowNorm,
    /// `act.cu`: SwiGLU and the pointwise activations, forward and backward.
    Act,
    /// `rope.cu`: rotary position embeddings (the backward is the inverse rotation).
    Rope,
    /// `softmax.cu`: softmax and log-softmax over rows, forward and backward.
    Softmax,
    /// `loss.cu`: mean cross entropy, forward and backward, without host reads.
    Loss,
    /// `attention.cu`: tiled attention with an online softmax, forward and backward.
    Attention,
    /// `attention_mma.cu`: the attention forward and dq on tensor cores (sm_80+).
    AttentionMma,
    /// `quant.cu`: tiles of 4-bit and 8-bit weights, the few-row 4-bit product.
    Quant,
}

/// Name and source of every module, indexed by `ModuleId as usize`.
const MODULES: [(&str, &str); 12] = [
    ("cast", include_str!("cast.cu")),
    ("unscale", include_str!("unscale.cu")),
    ("optim", include_str!("optim.cu")),
    ("norm", include_str!("norm.cu")),
    ("rownorm", include_str!("rownorm.cu")),
    ("act", include_str!("act.cu")),
    ("rope", include_str!("rope.cu")),
    ("softmax", include_str!("softmax.cu")),
    ("loss", include_str!("loss.cu")),
    ("attention", include_str!("attention.cu")),
    ("attention_mma", include_str!("attention_mma.cu")),
    ("quant", include_str!("quant.cu")),
];

/// The part the attention sources share, prepended to both (NVRTC has no
/// file system for their `#include "attention.cuh"`).
const ATTENTION_SHARED: &str = include_str!("attention.cuh");

/// Every module, in table order.
pub(crate) const ALL_MODULES: [ModuleId; 12] = [
    ModuleId::Cast,
    ModuleId::Unscale,
    ModuleId::Optim,
    ModuleId::Norm,
    ModuleId::RowNorm,
    ModuleId::Act,
    ModuleId::Rope,
    ModuleId::Softmax,
    ModuleId::Loss,
    ModuleId::Attention,
    ModuleId::AttentionMma,
    ModuleId::Quant,
];

impl ModuleId {
    /// The source's file stem.
    pub(crate) const fn name(self) -> &'static str {
        MODULES[self as usize].0
    }

    /// The full text NVRTC compiles: `common.cuh`, `attention.cuh` for the
    /// attention sources, then the `.cu` file.
    pub(crate) fn source(self) -> String {
        let shared = match self {
            ModuleId::Attention | ModuleId::AttentionMma => ATTENTION_SHARED,
            _ => "",
        };
        format!("{COMMON}\n{shared}\n{}", MODULES[self as usize].1)
    }
}

/// Declares the kernels: the enum, its module and its `extern "C"` name.
macro_rules! kernels {
    ($($id:ident => $module:ident, $name:literal;)*) => {
        /// One `extern "C"` kernel of the embedded sources.
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        pub(crate) enum KernelId { $(#[doc = $name] $id,)* }

        impl KernelId {
            /// Every kernel.
            pub(crate) const ALL: &'static [KernelId] = &[$(KernelId::$id,)*];

            /// The source that defines it.
            pub(crate) const fn module(self) -> ModuleId {
                match self { $(KernelId::$id => ModuleId::$module,)* }
            }

            /// Its symbol in the PTX.
            pub(crate) const fn name(self) -> &'static str {
                match self { $(KernelId::$id => $name,)* }
            }
        }
    };
}

kernels! {
    CastF32Bf16 => Cast, "cast_f32_bf16";
    CastF32F16 => Cast, "cast_f32_f16";
    CastBf16F32 => Cast, "cast_bf16_f32";
    CastF16F32 => Cast, "cast_f16_f32";
    CastBf16F16 => Cast, "cast_bf16_f16";
    CastF16Bf16 => Cast, "cast_f16_bf16";
    UnscaleF32 => Unscale, "unscale_f32";
    UnscaleBf16 => Unscale, "unscale_bf16";
    UnscaleF16 => Unscale, "unscale_f16";
    NonFiniteF32 => Unscale, "nonfinite_f32";
    NonFiniteBf16 => Unscale, "nonfinite_bf16";
    NonFiniteF16 => Unscale, "nonfinite_f16";
    ScaleF32 => Unscale, "scale_f32";
    ScaleBf16 => Unscale, "scale_bf16";
    ScaleF16 => Unscale, "scale_f16";
    ClampF32 => Unscale, "clamp_f32";
    ClampBf16 => Unscale, "clamp_bf16";
    ClampF16 => Unscale, "clamp_f16";
    AddF32 => Optim, "add_f32";
    AddBf16 => Optim, "add_bf16";
    AddF16 => Optim, "add_f16";
    AdamWF32 => Optim, "adamw_f32";
    AdamWBf16 => Optim, "adamw_bf16";
    AdamWF16 => Optim, "adamw_f16";
    SgdF32 => Optim, "sgd_f32";
    SgdBf16 => Optim, "sgd_bf16";
    SgdF16 => Optim, "sgd_f16";
    SumSqF32 => Norm, "sumsq_f32";
    SumSqBf16 => Norm, "sumsq_bf16";
    SumSqF16 => Norm, "sumsq_f16";
    MaxAbsF32 => Norm, "maxabs_f32";
    MaxAbsBf16 => Norm, "maxabs_bf16";
    MaxAbsF16 => Norm, "maxabs_f16";
    RowNormFwd => RowNorm, "rownorm_fwd";
    RowNormBwdDx => RowNorm, "rownorm_bwd_dx";
    RowNormBwdPartials => RowNorm, "rownorm_bwd_partials";
    RowNormBwdSum => RowNorm, "rownorm_bwd_sum";
    SwigluFwd => Act, "swiglu_fwd";
    SwigluBwd => Act, "swiglu_bwd";
    ActFwd => Act, "act_fwd";
    ActBwd => Act, "act_bwd";
    RopeF32 => Rope, "rope_f32";
    SoftmaxFwd => Softmax, "softmax_fwd";
    SoftmaxBwd => Softmax, "softmax_bwd";
    XentRows => Loss, "xent_rows";
    XentMean => Loss, "xent_mean";
    XentGrad => Loss, "xent_grad";
    FlashFwdF32 => Attention, "flash_fwd_f32";
    FlashFwdBf16 => Attention, "flash_fwd_bf16";
    FlashFwdF16 => Attention, "flash_fwd_f16";
    FlashDeltaF32 => Attention, "flash_delta_f32";
    FlashDeltaBf16 => Attention, "flash_delta_bf16";
    FlashDeltaF16 => Attention, "flash_delta_f16";
    FlashDqF32 => Attention, "flash_dq_f32";
    FlashDqBf16 => Attention, "flash_dq_bf16";
    FlashDqF16 => Attention, "flash_dq_f16";
    FlashDkdvF32 => Attention, "flash_dkdv_f32";
    FlashDkdvBf16 => Attention, "flash_dkdv_bf16";
    FlashDkdvF16 => Attention, "flash_dkdv_f16";
    FlashFwdMmaBf16D64 => AttentionMma, "flash_fwd_mma_bf16_d64";
    FlashFwdMmaBf16D128 => AttentionMma, "flash_fwd_mma_bf16_d128";
    FlashFwdMmaF16D64 => AttentionMma, "flash_fwd_mma_f16_d64";
    FlashFwdMmaF16D128 => AttentionMma, "flash_fwd_mma_f16_d128";
    FlashDqMmaBf16D64 => AttentionMma, "flash_dq_mma_bf16_d64";
    FlashDqMmaBf16D128 => AttentionMma, "flash_dq_mma_bf16_d128";
    FlashDqMmaF16D64 => AttentionMma, "flash_dq_mma_f16_d64";
    FlashDqMmaF16D128 => AttentionMma, "flash_dq_mma_f16_d128";
    Dequant4F32 => Quant, "dequant4_f32";
    Dequant4Bf16 => Quant, "dequant4_bf16";
    Dequant4F16 => Quant, "dequant4_f16";
    Dequant8F32 => Quant, "dequant8_f32";
    Dequant8Bf16 => Quant, "dequant8_bf16";
    Dequant8F16 => Quant, "dequant8_f16";
    Gemv4F32 => Quant, "gemv4_f32";
    Gemv4Bf16 => Quant, "gemv4_bf16";
    Gemv4F16 => Quant, "gemv4_f16";
}

/// Picks the kernel of a family for a dtype (the three float types).
fn by_dtype(dtype: DType, f32: KernelId, bf16: KernelId, f16: KernelId) -> KernelId {
    match dtype {
        DType::BF16 => bf16,
        DType::F16 => f16,
        _ => f32,
    }
}

impl KernelId {
    /// The conversion kernel from `src` to `dst` (`None` for equal dtypes).
    pub(crate) fn cast(src: DType, dst: DType) -> Option<KernelId> {
        use DType::*;
        Some(match (src, dst) {
            (F32, BF16) => KernelId::CastF32Bf16,
            (F32, F16) => KernelId::CastF32F16,
            (BF16, F32) => KernelId::CastBf16F32,
            (F16, F32) => KernelId::CastF16F32,
            (BF16, F16) => KernelId::CastBf16F16,
            (F16, BF16) => KernelId::CastF16Bf16,
            _ => return None,
        })
    }

    /// Unscale with overflow check, for tensors of `dtype`.
    pub(crate) fn unscale(dtype: DType) -> KernelId {
        use KernelId::*;
        by_dtype(dtype, UnscaleF32, UnscaleBf16, UnscaleF16)
    }

    /// Overflow check alone.
    pub(crate) fn non_finite(dtype: DType) -> KernelId {
        use KernelId::*;
        by_dtype(dtype, NonFiniteF32, NonFiniteBf16, NonFiniteF16)
    }

    /// In-place scaling.
    pub(crate) fn scale(dtype: DType) -> KernelId {
        use KernelId::*;
        by_dtype(dtype, ScaleF32, ScaleBf16, ScaleF16)
    }

    /// In-place clamping.
    pub(crate) fn clamp(dtype: DType) -> KernelId {
        use KernelId::*;
        by_dtype(dtype, ClampF32, ClampBf16, ClampF16)
    }

    /// f32 `+=` a source of `dtype`.
    pub(crate) fn add(dtype: DType) -> KernelId {
        use KernelId::*;
        by_dtype(dtype, AddF32, AddBf16, AddF16)
    }

    /// AdamW with gradients of `dtype`.
    pub(crate) fn adamw(dtype: DType) -> KernelId {
        use KernelId::*;
        by_dtype(dtype, AdamWF32, AdamWBf16, AdamWF16)
    }

    /// SGD with gradients of `dtype`.
    pub(crate) fn sgd(dtype: DType) -> KernelId {
        use KernelId::*;
        by_dtype(dtype, SgdF32, SgdBf16, SgdF16)
    }

    /// Per-chunk sums of squares.
    pub(crate) fn sum_sq(dtype: DType) -> KernelId {
        use KernelId::*;
        by_dtype(dtype, SumSqF32, SumSqBf16, SumSqF16)
    }

    /// Per-chunk largest magnitudes.
    pub(crate) fn max_abs(dtype: DType) -> KernelId {
        use KernelId::*;
        by_dtype(dtype, MaxAbsF32, MaxAbsBf16, MaxAbsF16)
    }

    /// The tensor-core kernels for operands of `dtype` and head dim `d`, where
    /// there are some (bf16/f16, d 64 or 128; they need sm_80).
    /// Its forward and dq kernels.
    pub(crate) fn flash_mma(dtype: DType, d: usize) -> Option<[KernelId; 2]> {
        use KernelId::*;
        Some(match (dtype, d) {
            (DType::BF16, 64) => [FlashFwdMmaBf16D64, FlashDqMmaBf16D64],
            (DType::BF16, 128) => [FlashFwdMmaBf16D128, FlashDqMmaBf16D128],
            (DType::F16, 64) => [FlashFwdMmaF16D64, FlashDqMmaF16D64],
            (DType::F16, 128) => [FlashFwdMmaF16D128, FlashDqMmaF16D128],
            _ => return None,
        })
    }

    /// The quantized-weight kernels with outputs of `dtype`: 4-bit tiles,
    /// 8-bit tiles, and the few-row 4-bit product.
    pub(crate) fn quant(dtype: DType) -> [KernelId; 3] {
        use KernelId::*;
        [
            by_dtype(dtype, Dequant4F32, Dequant4Bf16, Dequant4F16),
            by_dtype(dtype, Dequant8F32, Dequant8Bf16, Dequant8F16),
            by_dtype(dtype, Gemv4F32, Gemv4Bf16, Gemv4F16),
        ]
    }

    /// The attention kernels for operands of `dtype`: forward, the row
    /// dot products of the backward, dq, and dk with dv.
    pub(crate) fn flash(dtype: DType) -> [KernelId; 4] {
        use KernelId::*;
        [
            by_dtype(dtype, FlashFwdF32, FlashFwdBf16, FlashFwdF16),
            by_dtype(dtype, FlashDeltaF32, FlashDeltaBf16, FlashDeltaF16),
            by_dtype(dtype, FlashDqF32, FlashDqBf16, FlashDqF16),
            by_dtype(dtype, FlashDkdvF32, FlashDkdvBf16, FlashDkdvF16),
        ]
    }
}

// ============================================================ compile and cache

/// The modules loaded on one device, compiled on first use.
struct DeviceKernels {
    /// Compute capability, `10 * major + minor`.
    cc: u32,
    modules: RwLock<[Option<Arc<CudaModule>>; MODULES.len()]>,
}

/// Per-device kernel modules. Keyed by candle's `DeviceId` (one per
/// `Device::new_cuda`), like candle's own per-device module store, so a
/// module is always loaded into the context of the device that runs it.
static CACHE: LazyLock<Mutex<HashMap<DeviceId, Arc<DeviceKernels>>>> =
    LazyLock::new(|| Mutex::new(HashMap::new()));

/// Formats a driver error with its name and description (its `Debug` is a
/// bare number).
pub(crate) fn driver_message(e: &DriverError) -> String {
    let name = e.error_name().map(|s| s.to_string_lossy().into_owned());
    let text = e.error_string().map(|s| s.to_string_lossy().into_owned());
    match (name, text) {
        (Ok(n), Ok(t)) => format!("{n}: {t}"),
        _ => format!("{e:?}"),
    }
}

/// Wraps driver errors as [`Error::Cuda`] naming the operation and step.
pub(crate) trait WrapDriver<T> {
    /// Converts the error, for `?`.
    fn w(self, op: &'static str, call: &'static str) -> Result<T>;
}

impl<T> WrapDriver<T> for std::result::Result<T, DriverError> {
    fn w(self, op: &'static str, call: &'static str) -> Result<T> {
        self.map_err(|e| Error::Cuda {
            op,
            call,
            message: driver_message(&e),
        })
    }
}

/// The compute capability of a device, as `10 * major + minor`.
fn compute_capability(dev: &CudaDevice) -> Result<u32> {
    let (major, minor) = dev
        .cuda_stream()
        .context()
        .compute_capability()
        .w("nvrtc", "compute_capability")?;
    Ok(10 * major as u32 + minor as u32)
}

/// Architectures to fall back to, newest first, when the installed NVRTC
/// does not know the device's own (a GPU newer than the toolkit): PTX for
/// an older architecture is JIT-compiled by the driver for the device.
const FALLBACK_ARCHS: [u32; 7] = [120, 100, 90, 89, 86, 80, 75];

/// Compiles `module` for the device's architecture, or the newest older one
/// NVRTC accepts; returns the PTX and the architecture used.
fn compile_for(module: ModuleId, cc: u32) -> Result<(Ptx, String)> {
    let own = format!("sm_{cc}");
    let first = match compile(module, &own) {
        Ok(ptx) => return Ok((ptx, own)),
        Err(e) => e,
    };
    let unknown_arch =
        matches!(&first, Error::Nvrtc { log, .. } if log.contains("gpu-architecture"));
    if unknown_arch {
        for arch in FALLBACK_ARCHS.iter().filter(|&&a| a < cc) {
            let arch = format!("sm_{arch}");
            if let Ok(ptx) = compile(module, &arch) {
                return Ok((ptx, arch));
            }
        }
    }
    Err(first)
}

/// Compiles one module for `arch` with the options the kernels rely on:
/// no FMA contraction and IEEE division and square root (bitwise agreement
/// with the CPU path), no flush-to-zero (subnormals survive casts).
pub(crate) fn compile(module: ModuleId, arch: &str) -> Result<Ptx> {
    let opts = CompileOptions {
        ftz: Some(false),
        prec_sqrt: Some(true),
        prec_div: Some(true),
        fmad: Some(false),
        options: vec![format!("--gpu-architecture={arch}")],
        name: Some(format!("{}.cu", module.name())),
        ..Default::default()
    };
    compile_ptx_with_opts(module.source(), opts).map_err(|e| Error::Nvrtc {
        module: module.name(),
        arch: arch.to_string(),
        log: match e {
            CompileError::CompileError { nvrtc, log, .. } => {
                format!("{nvrtc:?}: {}", log.to_string_lossy())
            }
            other => format!("{other:?}"),
        },
    })
}

/// The per-device entry of [`CACHE`], made on first use.
fn device_kernels(dev: &CudaDevice) -> Result<Arc<DeviceKernels>> {
    let mut cache = CACHE.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(k) = cache.get(&dev.id()) {
        return Ok(k.clone());
    }
    let k = Arc::new(DeviceKernels {
        cc: compute_capability(dev)?,
        modules: RwLock::new(Default::default()),
    });
    cache.insert(dev.id(), k.clone());
    Ok(k)
}

/// The compute capability of `dev` (`10 * major + minor`), queried once per
/// device and kept with its modules.
pub(crate) fn device_cc(dev: &CudaDevice) -> Result<u32> {
    Ok(device_kernels(dev)?.cc)
}

/// The kernel `id` on `dev`, compiling and loading its module on first use.
pub(crate) fn function(dev: &CudaDevice, id: KernelId) -> Result<CudaFunction> {
    let kernels = device_kernels(dev)?;
    let m = id.module() as usize;
    let loaded = kernels.modules.read().unwrap_or_else(|p| p.into_inner())[m].clone();
    let module = match loaded {
        Some(module) => module,
        None => {
            // Compiling under the write lock keeps two threads from both
            // compiling the same module; it happens once per device.
            let mut modules = kernels.modules.write().unwrap_or_else(|p| p.into_inner());
            match &modules[m] {
                Some(module) => module.clone(),
                None => {
                    let (ptx, _arch) = compile_for(id.module(), kernels.cc)?;
                    let module = dev
                        .cuda_stream()
                        .context()
                        .load_module(ptx)
                        .w(id.name(), "load_module")?;
                    modules[m] = Some(module.clone());
                    module
                }
            }
        }
    };
    module
        .load_function(id.name())
        .w(id.name(), "load_function")
}

/// The CUDA device behind `device`, or [`Error::InvalidArgument`] naming
/// `op` (the public entry points that take a `Device`).
pub(crate) fn cuda_of<'a>(op: &'static str, device: &'a Device) -> Result<&'a CudaDevice> {
    match device {
        Device::Cuda(dev) => Ok(dev),
        other => Err(Error::InvalidArgument {
            op,
            reason: format!("needs a CUDA device, got {:?}", other.location()),
        }),
    }
}

/// Compiles and loads every kernel for `device` now, instead of on the first
/// call that needs it (NVRTC takes a moment per module). Also a quick check
/// that the installed NVRTC and driver accept the sources.
///
/// # Errors
/// [`Error::Nvrtc`] with the compile log, [`Error::Cuda`] when the driver
/// rejects the PTX, [`Error::InvalidArgument`] for a non-CUDA device.
pub fn precompile(device: &Device) -> Result<()> {
    let dev = cuda_of("precompile", device)?;
    for &id in KernelId::ALL {
        function(dev, id)?;
    }
    Ok(())
}

/// Compiles every embedded kernel source with NVRTC for `arch` (such as
/// `"sm_90"`), with no device involved, and returns each module's name and
/// PTX: a check that the installed NVRTC accepts the sources (it runs where
/// `libnvrtc` exists, GPU or not).
///
/// # Errors
/// [`Error::Nvrtc`] with the compile log.
pub fn compile_sources(arch: &str) -> Result<Vec<(&'static str, String)>> {
    ALL_MODULES
        .iter()
        .map(|&m| Ok((m.name(), compile(m, arch)?.to_src())))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Needs `libnvrtc` (no GPU): every `KernelId` names a kernel of its
    /// module's PTX, so `load_function` cannot miss at run time.
    #[test]
    #[ignore = "needs libnvrtc; run with --ignored where it is installed"]
    fn every_kernel_id_is_an_entry_of_its_module() -> Result<()> {
        for &m in &ALL_MODULES {
            let ptx = compile(m, "sm_80")?.to_src();
            for id in KernelId::ALL.iter().filter(|id| id.module() == m) {
                let entry = format!(".entry {}(", id.name());
                assert!(ptx.contains(&entry), "{} not in {}.cu", id.name(), m.name());
            }
            let entries = ptx.matches(".entry ").count();
            let ids = KernelId::ALL.iter().filter(|id| id.module() == m).count();
            assert_eq!(
                entries,
                ids,
                "{}.cu has kernels without a KernelId",
                m.name()
            );
        }
        Ok(())
    }
}
