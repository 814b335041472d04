//! Sharded initialisation: a `VarBuilder` backend that draws each parameter
//! as the seeded backend would, keeps only this rank's piece, and hands the
//! model a zero-memory placeholder of the full shape.

use std::sync::{Arc, Mutex};

use candle_core::{DType, Device, Shape, Tensor};
use candle_nn::init::Init;
use candle_nn::var_builder::SimpleBackend;

use crate::init::init_values;

/// A parameter drawn by [`ShardedInit`]: name, full shape and this rank's fp32 piece.
pub(crate) type DrawnPiece = (String, Shape, Tensor);

pub(crate) struct ShardedInit {
    pub seed: u64,
    /// Ranks the parameters are split between (1 for NO_SHARD).
    pub world: usize,
    pub rank: usize,
    pub master_device: Device,
    pub drawn: Arc<Mutex<Vec<DrawnPiece>>>,
}

/// A tensor of `shape` that owns one element: what a model built for FSDP
/// holds instead of its parameters (they live in the sharded model).
pub(crate) fn placeholder(
    shape: &Shape,
    dtype: DType,
    dev: &Device,
) -> candle_core::Result<Tensor> {
    Tensor::zeros((), dtype, dev)?.broadcast_as(shape)
}

impl SimpleBackend for ShardedInit {
    fn get(
        &self,
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
            return placeholder(&s, dtype, dev);
        }
        // Every rank draws the same full values (seed and name only), so the
        // pieces are exactly those a replicated run would start from.
        let values = init_values(self.seed, name, h, &s);
        let r = accel_dist::fsdp::piece_range(values.len(), self.world, self.rank);
        let piece = Tensor::from_vec(values[r.clone()].to_vec(), r.len(), &self.master_device)?;
        drawn.push((name.to_string(), s.clone(), piece));
        placeholder(&s, dtype, dev)
    }

    fn get_unchecked(
        &self,
        name: &str,
        _dtype: DType,
        _dev: &Device,
    ) -> candle_core::Result<Tensor> {
        candle_core::bail!("parameter `{name}`: a sharded var builder needs a shape and an init")
    }

    fn contains_tensor(&self, name: &str) -> bool {
        let drawn = self.drawn.lock().unwrap_or_else(|e| e.into_inner());
        drawn.iter().any(|(n, _, _)| n == name)
    }
}
