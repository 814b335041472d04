//! CUDA graphs for a training step (issue "The GPU step without the host").
//!
//! The design: `Accelerator::compile_step` runs the user's step eagerly a
//! few times, then records one eager step's device work (allocations,
//! launches, stream joins, host reads, collectives) and plans its capture
//! with [`plan::plan`]. The plan says which buffers the batch is copied
//! into, which are updated in place and which belong to the graph, or the
//! [`plan::Fallback`] that keeps the step eager, named in one warning.
//!
//! Built so far: the plan, a pure function tested without a GPU, and the
//! API a loop is written against ([`step`]: `compile_step`, which runs the
//! step eagerly and says so once). Not built: the recorder (it hooks
//! accel-kernels' launches and candle's CUDA ops on accel's device), and
//! the capture and replay through cudarc; both need a GPU to test.

pub mod plan;
pub mod step;

pub use step::{eager_reason, CompiledStep, StepMode, WARMUP_STEPS};
