//! Seeds and random states: one seed for initialisation and data order that
//! every rank shares, the device generator candle's `rand`/`randn` draw from,
//! and [`Accelerator::synchronize_rng_states`].
//!
//! Why the seed is shared: a prepared loader shuffles with it and each rank
//! keeps its own share of that one global order. Ranks with different seeds
//! would shuffle differently, so their shares would overlap and skip samples.
//! Without `AcceleratorConfig::seed` each rank draws one from its clock, so
//! [`shared_seed`] hands rank 0's to all (Accelerate's seedable sampler and
//! `synchronize_rng_states` do the same for the sampler's generator).

use std::sync::Once;

use accel_dist::{Communicator, CommunicatorExt};
use candle_core::Device;

use super::Accelerator;
use crate::rng::SplitMix64;
use crate::Result;

/// The seed of a run: `explicit`, else a clock seed drawn by rank 0 and
/// broadcast to every rank (a collective when the world has more than one rank).
///
/// # Errors
/// When the broadcast fails.
pub(crate) fn shared_seed(explicit: Option<u64>, comm: &dyn Communicator) -> Result<u64> {
    if let Some(s) = explicit {
        return Ok(s);
    }
    let mut seed = vec![clock_seed()];
    if comm.world_size() > 1 {
        comm.broadcast_object_list(&mut seed, 0)?;
    }
    Ok(seed[0])
}

fn clock_seed() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}

/// Seeds candle's generator on `device` (what `Tensor::rand`/`randn` and
/// dropout draw from). Returns whether the device could be seeded: candle
/// 0.11 draws CPU random numbers from an unseedable thread generator, which
/// is said once per process; [`Accelerator::rng`] is the seeded alternative.
pub(crate) fn seed_device(device: &Device, seed: u64) -> bool {
    static CPU_WARNING: Once = Once::new();
    match device {
        Device::Cpu => {
            CPU_WARNING.call_once(|| {
                tracing::warn!(
                    "set_seed: candle's CPU Tensor::rand/randn cannot be seeded (candle 0.11 uses \
                     an unseedable thread generator); draw from Accelerator::rng() for \
                     reproducible CPU randomness"
                )
            });
            false
        }
        d => match d.set_seed(seed) {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!("set_seed: could not seed {d:?}: {e}");
                false
            }
        },
    }
}

impl Accelerator {
    /// Seeds parameter initialisation, data order, [`Accelerator::rng`] and
    /// the device generator (`Tensor::rand`/`randn` on CUDA and Metal), with
    /// the same seed on every rank, as Accelerate's `set_seed(seed)`.
    ///
    /// Data loaders prepared before this call keep the seed they were
    /// prepared with.
    pub fn set_seed(&mut self, seed: u64) {
        self.set_seed_with(seed, false);
    }

    /// [`Accelerator::set_seed`]; with `device_specific`, the device generator
    /// and [`Accelerator::rng`] get `seed + rank` (Accelerate's
    /// `set_seed(seed, device_specific=True)`), so dropout masks differ
    /// between ranks. Initialisation and data order keep `seed` on every rank:
    /// the ranks must agree on those.
    pub fn set_seed_with(&mut self, seed: u64, device_specific: bool) {
        let own = if device_specific {
            seed.wrapping_add(self.process_index() as u64)
        } else {
            seed
        };
        self.seed = seed;
        self.rng = SplitMix64::new(own);
        seed_device(self.device(), own);
    }

    /// The seed in use (the same on every rank).
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// A generator for user randomness (dropout masks, augmentation) whose
    /// state `save_state` stores, so a resumed run draws the same numbers.
    pub fn rng(&mut self) -> &mut SplitMix64 {
        &mut self.rng
    }

    /// Gives every rank rank 0's random state: the seed, [`Accelerator::rng`],
    /// each prepared data loader's shuffle seed and, where candle can read it,
    /// the device generator's seed (Accelerate's `synchronize_rng_states`).
    /// Every rank must call it. A no-op in a single process.
    ///
    /// # Errors
    /// When the broadcast fails.
    pub fn synchronize_rng_states(&mut self) -> Result<()> {
        if self.num_processes() == 1 {
            return Ok(());
        }
        let device_seed = match self.device() {
            Device::Cpu => None,
            d => d.get_current_seed().ok(),
        };
        let loader_seeds: Vec<u64> = self
            .loaders
            .iter()
            .map(|l| l.lock().unwrap_or_else(|e| e.into_inner()).seed)
            .collect();
        let mut state = vec![(self.seed, self.rng.state(), device_seed, loader_seeds)];
        self.comm().broadcast_object_list(&mut state, 0)?;
        let (seed, rng, device_seed, loader_seeds) = state.pop().unwrap_or_default();
        self.seed = seed;
        self.rng = SplitMix64::new(rng);
        if let Some(s) = device_seed {
            seed_device(self.device(), s);
        }
        for (l, s) in self.loaders.iter().zip(loader_seeds) {
            l.lock().unwrap_or_else(|e| e.into_inner()).seed = s;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::AcceleratorConfig;

    #[test]
    fn an_explicit_seed_is_kept_and_a_single_rank_draws_its_own() {
        let comm = accel_dist::LocalCommunicator;
        assert_eq!(shared_seed(Some(7), &comm).unwrap(), 7);
        shared_seed(None, &comm).unwrap();
    }

    #[test]
    fn set_seed_replays_the_rng_and_never_fails_on_the_cpu() -> Result<()> {
        let mut acc = Accelerator::new(AcceleratorConfig::default().with_device(Device::Cpu))?;
        acc.set_seed(42);
        let a: Vec<u64> = (0..4).map(|_| acc.rng().next_u64()).collect();
        acc.set_seed(42);
        let b: Vec<u64> = (0..4).map(|_| acc.rng().next_u64()).collect();
        assert_eq!(a, b);
        assert_eq!(acc.seed(), 42);
        // One rank: device_specific adds rank 0, so nothing changes.
        acc.set_seed_with(42, true);
        assert_eq!(acc.rng().next_u64(), a[0]);
        // The CPU generator cannot be seeded: reported, not an error.
        assert!(!seed_device(&Device::Cpu, 1));
        acc.synchronize_rng_states()?;
        Ok(())
    }

    /// candle's CUDA generator takes the seed: `randn` repeats after `set_seed`.
    #[test]
    #[ignore = "needs a CUDA GPU (run scripts/gpu_check.sh)"]
    fn set_seed_makes_cuda_randn_repeat() -> Result<()> {
        let dev = accel_kernels::cuda_device(0)?;
        let mut acc = Accelerator::new(AcceleratorConfig::default().with_device(dev.clone()))?;
        let draw = || -> Result<Vec<f32>> {
            Ok(candle_core::Tensor::randn(0f32, 1.0, 64, &dev)?.to_vec1::<f32>()?)
        };
        acc.set_seed(7);
        let a = draw()?;
        acc.set_seed(7);
        assert_eq!(a, draw()?);
        acc.set_seed(8);
        assert_ne!(a, draw()?);
        Ok(())
    }
}
