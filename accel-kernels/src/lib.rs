//! Fused multi-tensor mixed-precision kernels for candle tensors.
//!
//! Mixed-precision training touches every parameter several times per step:
//! unscaling gradients, checking them for overflow, clipping, the optimizer
//! update, and refreshing the low-precision weights from f32 master
//! weights. Done with one candle op per tensor, each pass allocates and
//! walks memory separately. The functions here take whole lists of tensors
//! and, for host tensors, do each job in a single fused, multi-threaded pass
//! over all of them, updating storage in place.
//!
//! With the `cuda` feature, tensors on a CUDA device run fused kernels
//! compiled with NVRTC on first use (see [`cuda`]); without it, and for
//! other devices, an equivalent built from candle tensor ops.
//!
//! The only `unsafe` is the kernel launch in `cuda/launch.rs`: host-side
//! mutable access to tensor storage goes through candle's in-place custom
//! ops (see [`with_slice_mut`]).
//!
//! In-place results are visible through every tensor sharing the storage
//! (clones, the tensor of a `Var`). A call holds the storage locks of the
//! tensors it touches while it runs, so it refuses lists in which a written
//! tensor shares storage with another tensor of the same call (that would
//! deadlock) with [`Error::AliasedStorage`].
//!
//! Main items: [`cast_tensors`] / [`cast_into`] (fp32 <-> bf16/f16, bitwise
//! candle's `to_dtype`), [`unscale_and_check`] (a loss-scaled gradient list
//! unscaled with an overflow flag), [`adamw_step`] / [`sgd_step`] with
//! [`AdamWParams`] / [`SgdParams`], [`cuda_device`] (the one `Device` per
//! CUDA ordinal the rest of accel-rs shares), and [`par`], the CPU pool the
//! passes run on.
//!
//! ```
//! use accel_kernels::{cast_into, cast_tensors, unscale_and_check};
//! use candle_core::{DType, Device, Tensor};
//!
//! let dev = Device::Cpu;
//! // fp32 master weights and their bf16 compute copies, converted in one pass
//! let masters = vec![Tensor::ones((4, 4), DType::F32, &dev)?, Tensor::ones(8, DType::F32, &dev)?];
//! let copies = cast_tensors(&masters, DType::BF16)?;
//! assert_eq!(copies[1].dtype(), DType::BF16);
//!
//! // gradients of a loss scaled by 1024: unscaled in place, with an overflow flag
//! let grads = vec![
//!     (Tensor::ones((4, 4), DType::F32, &dev)? * 2048.0)?,
//!     (Tensor::ones(8, DType::F32, &dev)? * 1024.0)?,
//! ];
//! let overflow = unscale_and_check(&grads, 1.0 / 1024.0)?;
//! assert!(!overflow);
//! assert_eq!(grads[0].flatten_all()?.to_vec1::<f32>()?[0], 2.0);
//!
//! // after the optimizer step: refresh the copies in place, without allocating
//! cast_into(&masters, &copies)?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
#![warn(missing_docs)]
#![deny(unsafe_code)]

mod activation;
mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
#[cfg(not(feature = "cuda"))]
#[path = "cuda_off.rs"]
pub mod cuda;
mod devices;
mod error;
mod fallback;
mod hyperparams;
mod multi_tensor;
mod optim;
pub mod par;
mod quant_weight;
mod slices;
mod validate;

pub use devices::cuda_device;
pub use error::{Error, Result};
pub use hyperparams::{AdamWParams, SgdParams};
pub use multi_tensor::{
    add_in_place, cast_into, cast_tensors, clamp_in_place, has_non_finite, max_abs, scale_in_place,
    sum_of_squares, unscale_and_check,
};
pub use optim::{adamw_step, sgd_step};
pub use slices::{storage_key, with_slice, with_slice_mut};

#[cfg(test)]
mod tests;
