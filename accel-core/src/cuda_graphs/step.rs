//! [`Accelerator::compile_step`]: a training step (forward, `backward`,
//! optimizer step, `zero_grad`) handed over as a closure, so that it can be
//! captured once and replayed when its shapes are fixed.
//!
//! The user's loop keeps its shape:
//!
//! ```no_run
//! # use accel_core::prelude::*;
//! # use candle_core::Tensor;
//! # fn demo(mut acc: Accelerator, batches: Vec<Vec<Tensor>>) -> accel_core::Result<()> {
//! let mut step = acc.compile_step(|acc: &mut Accelerator, batch: &[Tensor]| {
//!     let loss = (&batch[0] * 2.0)?.sum_all()?; // the model's loss
//!     acc.backward(&loss)?;
//!     Ok(loss)
//! });
//! for batch in &batches {
//!     let loss = step.run(&mut acc, batch)?;
//! }
//! # Ok(())
//! # }
//! ```
//!
//! What runs today: every call runs the closure eagerly. Capture and replay
//! are not built (they wait for a GPU to be tested on, see the module
//! above); so on every device the step says once, when it is made, that it
//! runs eagerly and why, and [`CompiledStep::mode`] says the same. The
//! batch's shapes and dtypes are recorded on the first call, so a later
//! change is reported as the [`Fallback::ShapeChanged`] a replay would
//! fall back on.

use candle_core::Tensor;

use super::plan::{Fallback, Signature};
use crate::accelerator::Accelerator;
use crate::Result;

/// Eager calls before a capture would be tried: the first steps create
/// lazy state (optimizer moments, the loss scaler's buffers, the memory
/// pool's blocks) that a replay must find in place.
pub const WARMUP_STEPS: u64 = 3;

/// How a [`CompiledStep`] runs.
#[derive(Clone, Debug, PartialEq)]
pub enum StepMode {
    /// Each call runs the closure eagerly, for the reason given (said once,
    /// as a warning, when the step was made or when it fell back).
    Eager(String),
}

/// A training step made by [`Accelerator::compile_step`].
pub struct CompiledStep<F> {
    step: F,
    mode: StepMode,
    signature: Option<Signature>,
    calls: u64,
    /// The first change of batch shape, reported once.
    changed: bool,
}

/// Why a step on `device` runs eagerly instead of as a CUDA graph: what
/// `compile_step`, `TrainingArguments::cuda_graphs` and the examples'
/// `--cuda-graphs` say at start-up.
pub fn eager_reason(device: &candle_core::Device) -> String {
    if device.is_cuda() {
        "capturing a step as a CUDA graph is not built yet (it waits for a GPU to be tested on); \
         the step runs eagerly"
            .to_string()
    } else {
        format!(
            "CUDA graphs need a CUDA device and this run is on {}; the step runs eagerly",
            format!("{:?}", device.location()).to_lowercase()
        )
    }
}

/// The shapes and dtypes of a batch.
pub fn signature(batch: &[Tensor]) -> Signature {
    Signature(
        batch
            .iter()
            .map(|t| (t.dims().to_vec(), format!("{:?}", t.dtype()).to_lowercase()))
            .collect(),
    )
}

impl Accelerator {
    /// Wraps one training step, the closure `step(acc, batch) -> loss`,
    /// for capture as a CUDA graph: after [`WARMUP_STEPS`] eager calls one
    /// call would be captured and later calls replayed after copying the
    /// batch into the captured inputs (PyTorch users get this from
    /// `torch.compile(mode="reduce-overhead")`). Anything that cannot be
    /// captured keeps the step eager, named in one warning, never a wrong
    /// result.
    ///
    /// Capture is not built yet: every call runs eagerly, and making the
    /// step says so once (on the CPU: CUDA graphs need a CUDA device). The
    /// loop written against it keeps working unchanged when capture lands.
    pub fn compile_step<F>(&self, step: F) -> CompiledStep<F>
    where
        F: FnMut(&mut Accelerator, &[Tensor]) -> Result<Tensor>,
    {
        let reason = eager_reason(self.device());
        crate::notice::warn(&format!("compile_step: {reason}"));
        CompiledStep {
            step,
            mode: StepMode::Eager(reason),
            signature: None,
            calls: 0,
            changed: false,
        }
    }
}

impl<F> CompiledStep<F>
where
    F: FnMut(&mut Accelerator, &[Tensor]) -> Result<Tensor>,
{
    /// Runs one step on `batch` and returns its loss.
    ///
    /// # Errors
    /// The step's own.
    pub fn run(&mut self, acc: &mut Accelerator, batch: &[Tensor]) -> Result<Tensor> {
        let now = signature(batch);
        match &self.signature {
            None => self.signature = Some(now),
            Some(first) if *first != now && !self.changed => {
                // Eager steps take any shape; a replay would fall back here.
                self.changed = true;
                let why = Fallback::ShapeChanged {
                    captured: first.clone(),
                    now,
                };
                tracing::debug!("compile_step: {why}");
            }
            Some(_) => {}
        }
        self.calls += 1;
        (self.step)(acc, batch)
    }

    /// How the step runs now.
    pub fn mode(&self) -> &StepMode {
        &self.mode
    }

    /// Calls so far.
    pub fn calls(&self) -> u64 {
        self.calls
    }

    /// The batch signature of the first call (what a capture is made for).
    pub fn signature(&self) -> Option<&Signature> {
        self.signature.as_ref()
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device, Var};

    use super::*;
    use crate::prelude::{AcceleratorConfig, AdamW, AdamWConfig};

    /// A compiled step on the CPU runs the closure eagerly and trains the
    /// same weights, bit for bit, as the plain loop; it says why it is
    /// eager; it records the first batch's signature.
    #[test]
    fn a_compiled_step_on_the_cpu_is_the_eager_step() -> Result<()> {
        let train = |compiled: bool| -> Result<Vec<f32>> {
            let mut acc = Accelerator::new(AcceleratorConfig::default().with_seed(3))?;
            let varmap = candle_nn::VarMap::new();
            let w = acc.var_builder(&varmap).get_with_hints(
                (4, 3),
                "w",
                candle_nn::Init::Const(0.5),
            )?;
            let params = acc.prepare_model(&varmap)?;
            let mut opt = acc.prepare_optimizer(&params, AdamW::new(AdamWConfig::default()));
            let batches: Vec<Vec<Tensor>> = (0..5)
                .map(|i| {
                    let x = Tensor::arange(0f32, 8.0, &Device::Cpu)?.affine(0.1, i as f64)?;
                    Ok(vec![x.reshape((2, 4))?])
                })
                .collect::<Result<_>>()?;
            let mut body = |acc: &mut Accelerator, batch: &[Tensor]| -> Result<Tensor> {
                let loss = batch[0].matmul(&w)?.sqr()?.mean_all()?;
                acc.backward(&loss)?;
                opt.step()?;
                opt.zero_grad();
                Ok(loss)
            };
            if compiled {
                let mut step = acc.compile_step(&mut body);
                assert!(
                    matches!(step.mode(), StepMode::Eager(why) if why.contains("CUDA device")),
                    "{:?}",
                    step.mode()
                );
                for b in &batches {
                    step.run(&mut acc, b)?;
                }
                assert_eq!(step.calls(), 5);
                assert_eq!(
                    step.signature(),
                    Some(&Signature(vec![(vec![2, 4], "f32".into())]))
                );
            } else {
                for b in &batches {
                    body(&mut acc, b)?;
                }
            }
            Ok(w.flatten_all()?.to_vec1()?)
        };
        let (eager, compiled) = (train(false)?, train(true)?);
        assert_ne!(eager, vec![0.5; 12], "the steps trained nothing");
        assert_eq!(eager, compiled);
        Ok(())
    }

    #[test]
    fn signatures_name_shapes_and_dtypes() -> Result<()> {
        let x = Tensor::zeros((2, 3), DType::BF16, &Device::Cpu)?;
        let y = Var::zeros(5, DType::U32, &Device::Cpu)?;
        let s = signature(&[x, y.as_tensor().clone()]);
        assert_eq!(
            s,
            Signature(vec![(vec![2, 3], "bf16".into()), (vec![5], "u32".into())])
        );
        Ok(())
    }
}
