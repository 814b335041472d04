//! Mixed precision: which dtype the model computes in, and the loss scaler for fp16.

mod scaler;
pub use scaler::{GradScaler, GradScalerConfig};

use candle_core::DType;
use serde::{Deserialize, Serialize};

use crate::{Error, Result};

/// The precision mode, named as Accelerate's `PrecisionType` (`mixed_precision` in its config).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum PrecisionType {
    /// Everything in fp32.
    #[default]
    No,
    /// Compute in f16 with fp32 master weights and a dynamic loss scale.
    Fp16,
    /// Compute in bf16 with fp32 master weights.
    Bf16,
}

impl PrecisionType {
    /// The dtype the model's forward and backward run in.
    pub fn compute_dtype(self) -> DType {
        match self {
            PrecisionType::No => DType::F32,
            PrecisionType::Fp16 => DType::F16,
            PrecisionType::Bf16 => DType::BF16,
        }
    }

    /// True when the model computes in a lower precision than its fp32 master weights.
    pub fn is_mixed(self) -> bool {
        self != PrecisionType::No
    }
}

impl std::fmt::Display for PrecisionType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            PrecisionType::No => "no",
            PrecisionType::Fp16 => "fp16",
            PrecisionType::Bf16 => "bf16",
        })
    }
}

impl std::str::FromStr for PrecisionType {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "no" | "fp32" | "none" => Ok(Self::No),
            "fp16" => Ok(Self::Fp16),
            "bf16" => Ok(Self::Bf16),
            other => Err(Error::Config {
                key: "mixed_precision".into(),
                reason: format!("unknown value {other:?} (expected no, fp16 or bf16)"),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn precision_names_round_trip_and_map_to_dtypes() {
        for p in [PrecisionType::No, PrecisionType::Fp16, PrecisionType::Bf16] {
            assert_eq!(p.to_string().parse::<PrecisionType>().unwrap(), p);
        }
        assert_eq!(PrecisionType::Bf16.compute_dtype(), DType::BF16);
        assert!("fp8"
            .parse::<PrecisionType>()
            .unwrap_err()
            .to_string()
            .contains("fp8"));
    }
}
