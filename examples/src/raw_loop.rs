//! What `bench_train`'s rows share: the raw loop's optimizer (the fused
//! `adamw_step` over transformers' two decay groups, with fp32 masters when
//! the model computes in a half type) and the timing of a row's rounds.

use std::time::Instant;

use accel_core::kernels::{adamw_step, cast_into, cast_tensors, AdamWParams};
use accel_core::optim::transformers_no_decay;
use anyhow::{bail, Result};
use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};
use candle_nn::VarMap;

/// A row: runs `n` steps after one untimed step, returns steps per second.
pub type Row = Box<dyn FnMut(usize) -> Result<f64>>;

/// Times `step(i)` (`i` counts every call) in rounds: one untimed step
/// first, since the row before may have evicted this one's weights and
/// buffers from the caches; GPU work is waited for at both ends.
pub fn timed(device: Device, mut step: impl FnMut(usize) -> Result<()> + 'static) -> Row {
    let mut i = 0;
    Box::new(move |n| {
        step(i)?;
        i += 1;
        device.synchronize()?;
        let t = Instant::now();
        for _ in 0..n {
            step(i)?;
            i += 1;
        }
        device.synchronize()?;
        Ok(n as f64 / t.elapsed().as_secs_f64())
    })
}

/// The median of `v` (the upper one of an even count).
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// One decay group: the model's weights, their fp32 masters (the weights
/// themselves when they are fp32) and the moments.
struct Group {
    /// Whether the weights are a half type (gradients and masters are cast).
    half: bool,
    params: Vec<Tensor>,
    masters: Vec<Tensor>,
    m: Vec<Tensor>,
    v: Vec<Tensor>,
    hp: AdamWParams,
}

/// AdamW (betas 0.9/0.999, eps 1e-8) over a `VarMap`'s weights in
/// transformers' grouping (no decay on biases and norm weights), as the
/// Accelerator's prepared AdamW applies it, without the Accelerator.
pub struct RawAdamW {
    groups: [Group; 2],
    step: u64,
}

impl RawAdamW {
    /// The optimizer of `varmap`'s weights.
    ///
    /// # Errors
    /// Allocating the masters and moments.
    pub fn new(varmap: &VarMap, lr: f64, weight_decay: f64) -> Result<Self> {
        let mut named: Vec<(String, Var)> =
            varmap.data().lock().unwrap().clone().into_iter().collect();
        named.sort_by(|a, b| a.0.cmp(&b.0));
        let group = |no_decay: bool| -> Result<Group> {
            let params: Vec<Tensor> = named
                .iter()
                .filter(|(n, _)| transformers_no_decay(n) == no_decay)
                .map(|(_, v)| v.as_tensor().clone())
                .collect();
            let half = params.iter().any(|p| p.dtype() != DType::F32);
            let masters = if half {
                cast_tensors(&params, DType::F32)?
            } else {
                params.clone()
            };
            let zeros = |p: &Tensor| p.zeros_like();
            Ok(Group {
                m: masters
                    .iter()
                    .map(zeros)
                    .collect::<candle_core::Result<_>>()?,
                v: masters
                    .iter()
                    .map(zeros)
                    .collect::<candle_core::Result<_>>()?,
                half,
                params,
                masters,
                hp: AdamWParams {
                    lr,
                    beta1: 0.9,
                    beta2: 0.999,
                    eps: 1e-8,
                    weight_decay: if no_decay { 0.0 } else { weight_decay },
                },
            })
        };
        Ok(Self {
            groups: [group(false)?, group(true)?],
            step: 0,
        })
    }

    /// One step from a backward's gradients: half gradients are cast to
    /// fp32, the masters stepped, and cast back into the weights.
    ///
    /// # Errors
    /// A weight without a gradient; kernel errors.
    pub fn step(&mut self, grads: &GradStore) -> Result<()> {
        self.step += 1;
        for g in &self.groups {
            let mut gs = Vec::with_capacity(g.params.len());
            for (i, p) in g.params.iter().enumerate() {
                match grads.get(p) {
                    Some(grad) => gs.push(grad.clone()),
                    None => bail!("weight {i} of a decay group got no gradient"),
                }
            }
            if g.half {
                gs = cast_tensors(&gs, DType::F32)?;
            }
            adamw_step(&g.masters, &gs, &g.m, &g.v, self.step, &g.hp)?;
            if g.half {
                cast_into(&g.masters, &g.params)?;
            }
        }
        Ok(())
    }
}
