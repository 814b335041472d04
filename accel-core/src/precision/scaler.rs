//! Dynamic loss scaling for fp16, with PyTorch `GradScaler` semantics.

use serde::{Deserialize, Serialize};

/// Settings of the dynamic loss scale (PyTorch's defaults).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct GradScalerConfig {
    /// The scale the first step uses.
    pub init_scale: f64,
    /// Factor applied after `growth_interval` steps without overflow.
    pub growth_factor: f64,
    /// Factor applied on a step whose gradients overflowed.
    pub backoff_factor: f64,
    /// Clean steps between two growths.
    pub growth_interval: u64,
}

impl Default for GradScalerConfig {
    fn default() -> Self {
        Self {
            init_scale: 65536.0,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 2000,
        }
    }
}

/// The dynamic loss scale: the loss is multiplied by `scale()` before backward so
/// small f16 gradients do not flush to zero, gradients are divided by it before
/// the optimizer step, and a step whose gradients hold inf/NaN is skipped.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GradScaler {
    config: GradScalerConfig,
    scale: f64,
    growth_tracker: u64,
}

impl GradScaler {
    /// A scaler at `config.init_scale`.
    pub fn new(config: GradScalerConfig) -> Self {
        Self {
            scale: config.init_scale,
            config,
            growth_tracker: 0,
        }
    }

    /// The current scale.
    pub fn scale(&self) -> f64 {
        self.scale
    }

    /// Clean steps since the last growth or backoff.
    pub fn growth_tracker(&self) -> u64 {
        self.growth_tracker
    }

    /// Updates the scale after a step: back off on overflow, grow after
    /// `growth_interval` clean steps in a row (PyTorch `_amp_update_scale_`).
    pub fn update(&mut self, found_inf: bool) {
        if found_inf {
            // f32 arithmetic as PyTorch keeps the scale in an f32 tensor.
            self.scale = (self.scale as f32 * self.config.backoff_factor as f32) as f64;
            self.growth_tracker = 0;
        } else {
            self.growth_tracker += 1;
            if self.growth_tracker == self.config.growth_interval {
                let grown = self.scale as f32 * self.config.growth_factor as f32;
                // PyTorch only grows while the result stays finite.
                if grown.is_finite() {
                    self.scale = grown as f64;
                }
                self.growth_tracker = 0;
            }
        }
    }

    /// The state saved in `scaler.json`.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "scale": self.scale,
            "growth_factor": self.config.growth_factor,
            "backoff_factor": self.config.backoff_factor,
            "growth_interval": self.config.growth_interval,
            "_growth_tracker": self.growth_tracker,
        })
    }

    /// Restores the state written by [`GradScaler::to_json`].
    pub fn load_json(&mut self, v: &serde_json::Value) -> Option<()> {
        self.scale = v.get("scale")?.as_f64()?;
        self.config.growth_factor = v.get("growth_factor")?.as_f64()?;
        self.config.backoff_factor = v.get("backoff_factor")?.as_f64()?;
        self.config.growth_interval = v.get("growth_interval")?.as_u64()?;
        self.growth_tracker = v.get("_growth_tracker")?.as_u64()?;
        Some(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overflow_halves_the_scale_and_resets_growth() {
        let mut s = GradScaler::new(GradScalerConfig::default());
        s.update(false);
        s.update(true);
        assert_eq!(s.scale(), 32768.0);
        assert_eq!(s.growth_tracker(), 0);
    }

    #[test]
    fn scale_doubles_after_growth_interval_clean_steps() {
        let mut s = GradScaler::new(GradScalerConfig {
            growth_interval: 3,
            ..Default::default()
        });
        s.update(false);
        s.update(false);
        assert_eq!(s.scale(), 65536.0);
        s.update(false);
        assert_eq!(s.scale(), 131072.0);
        assert_eq!(s.growth_tracker(), 0);
    }

    #[test]
    fn state_round_trips_through_json() {
        let mut s = GradScaler::new(GradScalerConfig::default());
        s.update(true);
        s.update(false);
        let mut t = GradScaler::new(GradScalerConfig::default());
        t.load_json(&s.to_json()).unwrap();
        assert_eq!(s, t);
    }
}
