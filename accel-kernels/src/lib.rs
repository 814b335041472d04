//! Fused multi-tensor mixed-precision kernels for candle tensors.
#![warn(missing_docs)]

mod error;
pub use error::{Error, Result};
