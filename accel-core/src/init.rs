//! Deterministic parameter initialisation: one candle `VarBuilder` backend
//! that draws each parameter from a seed and the parameter's name.
//!
//! candle's CPU device cannot be seeded, so `VarMap`'s own initialisation is
//! not reproducible. [`SeededBackend`] honours the same `Init` hints with our
//! generator, and what it keeps of a drawn value depends on how the model
//! will run ([`Keep`]): the whole variable for a replicated model, or only this
//! rank's piece for a sharded one. Both draw the very same values, so a
//! sharded run starts from exactly the pieces of the replicated run.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use candle_core::{DType, Device, Shape, Tensor, Var};
use candle_nn::init::{Init, NormalOrUniform};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::VarMap;

use accel_bigmodel::placeholder;

use crate::rng::{fnv1a, SplitMix64};

/// fp32 master weights drawn by [`SeededBackend`] for parameters created in a lower precision.
pub(crate) type MasterMap = Arc<Mutex<HashMap<String, Var>>>;

/// A parameter drawn for a sharded model: name, full shape and this rank's fp32 piece.
pub(crate) type DrawnPiece = (String, Shape, Tensor);

/// What [`SeededBackend`] keeps of each value it draws.
pub(crate) enum Keep {
    /// Replicated models: see [`FullVars`].
    Full(FullVars),
    /// Sharded models: see [`Pieces`].
    Piece(Pieces),
}

/// Keeps the whole variable in `varmap` (in the requested dtype), plus its
/// exact fp32 values in `masters` when that dtype is narrower, so the master
/// copy is not a re-widened bf16 value.
pub(crate) struct FullVars {
    pub varmap: VarMap,
    pub masters: MasterMap,
}

/// Keeps only this rank's fp32 piece of each parameter (split between
/// `world` ranks); the model gets a [`placeholder`] of the full shape.
pub(crate) struct Pieces {
    pub world: usize,
    pub rank: usize,
    pub master_device: Device,
    pub drawn: Arc<Mutex<Vec<DrawnPiece>>>,
}

/// The seeded `VarBuilder` backend of the Accelerator (plain, DDP and FSDP models).
pub(crate) struct SeededBackend {
    pub seed: u64,
    pub keep: Keep,
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

impl FullVars {
    fn get(
        &self,
        seed: u64,
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
        let values = init_values(seed, name, h, &s);
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
}

impl Pieces {
    fn get(
        &self,
        seed: u64,
        s: Shape,
        name: &str,
        h: Init,
        dtype: DType,
        dev: &Device,
    ) -> candle_core::Result<Tensor> {
        let mut drawn = self.drawn.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, shape, _)) = drawn.iter().find(|(n, _, _)| n == name) {
            if shape != &s {
                candle_core::bail!("parameter `{name}` requested with shape {s:?} but it exists with shape {shape:?}");
            }
            return placeholder(s, dtype, dev);
        }
        // Every rank draws the same full values (seed and name only), so the
        // pieces are exactly those a replicated run would start from.
        let values = init_values(seed, name, h, &s);
        let r = accel_dist::fsdp::piece_range(values.len(), self.world, self.rank);
        let piece = Tensor::from_vec(values[r.clone()].to_vec(), r.len(), &self.master_device)?;
        drawn.push((name.to_string(), s.clone(), piece));
        placeholder(s, dtype, dev)
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
        match &self.keep {
            Keep::Full(full) => full.get(self.seed, s, name, h, dtype, dev),
            Keep::Piece(pieces) => pieces.get(self.seed, s, name, h, dtype, dev),
        }
    }

    fn get_unchecked(
        &self,
        name: &str,
        _dtype: DType,
        _dev: &Device,
    ) -> candle_core::Result<Tensor> {
        match self.keep {
            Keep::Full(_) => candle_core::bail!(
                "parameter `{name}`: a seeded var builder needs a shape and an init"
            ),
            Keep::Piece(_) => candle_core::bail!(
                "parameter `{name}`: a sharded var builder needs a shape and an init"
            ),
        }
    }

    fn contains_tensor(&self, name: &str) -> bool {
        match &self.keep {
            Keep::Full(full) => full
                .varmap
                .data()
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .contains_key(name),
            Keep::Piece(pieces) => pieces
                .drawn
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .iter()
                .any(|(n, _, _)| n == name),
        }
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
