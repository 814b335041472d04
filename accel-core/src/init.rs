//! Deterministic parameter initialisation: a candle `VarBuilder` backend that
//! creates variables from a seed and the parameter's name.
//!
//! candle's CPU device cannot be seeded, so `VarMap`'s own initialisation is
//! not reproducible. This backend honours the same `Init` hints with our
//! generator. In mixed precision it keeps the fp32 values it drew as master
//! weights, so the master copy is exact rather than a re-widened bf16 value.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use candle_core::{DType, Device, Shape, Tensor, Var};
use candle_nn::init::{Init, NormalOrUniform};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::VarMap;

use crate::rng::{fnv1a, SplitMix64};

/// fp32 master weights drawn by [`SeededBackend`] for parameters created in a lower precision.
pub(crate) type MasterMap = Arc<Mutex<HashMap<String, Var>>>;

pub(crate) struct SeededBackend {
    pub varmap: VarMap,
    pub masters: MasterMap,
    pub seed: u64,
}

/// Draws the fp32 values of `init` for a tensor of `shape`, seeded by `seed` and `name`.
pub fn init_values(seed: u64, name: &str, init: Init, shape: &Shape) -> Vec<f32> {
    let n = shape.elem_count();
    let mut rng = SplitMix64::new(seed ^ fnv1a(name.as_bytes()));
    let uniform = |rng: &mut SplitMix64, lo: f64, up: f64| (lo + (up - lo) * rng.next_f64()) as f32;
    match init {
        Init::Const(c) => vec![c as f32; n],
        Init::Uniform { lo, up } => (0..n).map(|_| uniform(&mut rng, lo, up)).collect(),
        Init::Randn { mean, stdev } => (0..n)
            .map(|_| (mean + stdev * rng.next_normal()) as f32)
            .collect(),
        Init::Kaiming {
            dist,
            fan,
            non_linearity,
        } => {
            let std = non_linearity.gain() / (fan.for_shape(shape) as f64).sqrt();
            match dist {
                NormalOrUniform::Uniform => {
                    let bound = 3f64.sqrt() * std;
                    (0..n).map(|_| uniform(&mut rng, -bound, bound)).collect()
                }
                NormalOrUniform::Normal => {
                    (0..n).map(|_| (std * rng.next_normal()) as f32).collect()
                }
            }
        }
    }
}

impl SimpleBackend for SeededBackend {
    fn get(
        &self,
        s: Shape,
        name: &str,
        h: Init,
        dtype: DType,
        dev: &Device,
    ) -> candle_core::Result<Tensor> {
        let mut data = self.varmap.data().lock().unwrap_or_else(|e| e.into_inner());
        if let Some(v) = data.get(name) {
            let t = v.as_tensor();
            if t.shape() != &s {
                candle_core::bail!(
                    "parameter `{name}` requested with shape {s:?} but it exists with shape {:?}",
                    t.shape()
                );
            }
            return t.to_dtype(dtype);
        }
        let values = init_values(self.seed, name, h, &s);
        let master = Tensor::from_vec(values, s, dev)?;
        let var = if dtype == DType::F32 {
            Var::from_tensor(&master)?
        } else {
            let var = Var::from_tensor(&master.to_dtype(dtype)?)?;
            self.masters
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(name.to_string(), Var::from_tensor(&master)?);
            var
        };
        let t = var.as_tensor().clone();
        data.insert(name.to_string(), var);
        Ok(t)
    }

    fn get_unchecked(
        &self,
        name: &str,
        _dtype: DType,
        _dev: &Device,
    ) -> candle_core::Result<Tensor> {
        candle_core::bail!("parameter `{name}`: a seeded var builder needs a shape and an init")
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.varmap
            .data()
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains_key(name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn init_depends_on_seed_and_name_only() {
        let s = Shape::from((4, 3));
        let a = init_values(1, "l.weight", candle_nn::init::DEFAULT_KAIMING_NORMAL, &s);
        assert_eq!(
            a,
            init_values(1, "l.weight", candle_nn::init::DEFAULT_KAIMING_NORMAL, &s)
        );
        assert_ne!(
            a,
            init_values(2, "l.weight", candle_nn::init::DEFAULT_KAIMING_NORMAL, &s)
        );
        assert_ne!(
            a,
            init_values(1, "l.bias", candle_nn::init::DEFAULT_KAIMING_NORMAL, &s)
        );
    }

    #[test]
    fn uniform_init_stays_in_bounds_and_const_is_exact() {
        let s = Shape::from(1000);
        let v = init_values(0, "x", Init::Uniform { lo: -0.5, up: 0.25 }, &s);
        assert!(v.iter().all(|x| (-0.5..0.25).contains(x)));
        assert_eq!(
            init_values(0, "x", Init::Const(1.5), &s),
            vec![1.5f32; 1000]
        );
    }
}
