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
mod compile;
mod launch;
mod loss;
mod operands;
mod ops;
mod pointwise;
mod pool;
mod quant;
mod registry;
mod rows;

pub use crate::quant_weight::{Operand, QuantMaxima, QuantWeight, QUANT_TILE_ELEMS};
pub use attention::{
    flash_attention_backward, flash_attention_forward, flash_supported, FlashMask,
    FLASH_MAX_HEAD_DIM,
};
pub use compile::{compile_sources, precompile};
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
