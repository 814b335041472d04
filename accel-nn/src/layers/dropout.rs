//! `Dropout`, as candle-nn's, with an optional seeded mask stream.

use std::sync::Mutex;

use candle_core::{Device, ModuleT, Result, Tensor};

use crate::ops;

/// Dropout with probability `p` in training, the identity in evaluation.
///
/// `new` draws masks from candle's device RNG (seedable with
/// `Device::set_seed` on CUDA only). `with_seed` draws them from its own
/// SplitMix64 stream on the host instead, so CPU runs are reproducible.
#[derive(Debug)]
pub struct Dropout {
    p: f32,
    rng: Option<Mutex<u64>>,
}

impl Clone for Dropout {
    fn clone(&self) -> Self {
        let rng = self.rng.as_ref().map(|r| Mutex::new(*r.lock().unwrap()));
        Self { p: self.p, rng }
    }
}

impl Dropout {
    /// As `candle_nn::Dropout::new`.
    pub fn new(p: f32) -> Self {
        Self { p, rng: None }
    }

    /// Masks from a host RNG seeded with `seed`: the same seed gives the
    /// same masks on every run and device.
    pub fn with_seed(p: f32, seed: u64) -> Self {
        Self {
            p,
            rng: Some(Mutex::new(seed)),
        }
    }

    /// Applies dropout when `train`.
    pub fn forward(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        let Some(rng) = &self.rng else {
            return ops::dropout(x, self.p, train);
        };
        if !train || self.p == 0.0 {
            return ops::dropout(x, self.p, false);
        }
        if !(0.0..1.0).contains(&self.p) {
            return ops::dropout(x, self.p, true);
        }
        let mut state = rng.lock().unwrap();
        let keep: Vec<u8> = (0..x.elem_count())
            .map(|_| {
                *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
                let mut z = *state;
                z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
                z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
                let u = ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64;
                u8::from(u >= self.p as f64)
            })
            .collect();
        let keep = Tensor::from_vec(keep, x.shape(), &Device::Cpu)?.to_device(x.device())?;
        ops::dropout::apply_mask(x, &keep, self.p)
    }
}

impl ModuleT for Dropout {
    fn forward_t(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        self.forward(x, train)
    }
}
