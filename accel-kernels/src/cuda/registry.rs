//! Every kernel the crate compiles, in one table: the embedded CUDA C++
//! sources ([`ModuleId`]) and their entry points ([`KernelId`]), with the
//! dtype-to-kernel choices the callers make. A leaf: it names kernels and
//! imports no sibling, so every launcher can name them.

use candle_core::DType;

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
pub(super) const MODULES: [(&str, &str); 12] = [
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
