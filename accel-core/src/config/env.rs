//! What this machine and build can do (CUDA, NCCL, bf16), and the
//! `ACCELERATE_*` variables `accel launch` hands to each rank.

use candle_core::{DType, Tensor};

use crate::{AcceleratorConfig, Error, PrecisionType, Result};

/// The variable `accel launch` sets to the run's precision (`no`, `fp16`, `bf16`).
pub const ENV_MIXED_PRECISION: &str = "ACCELERATE_MIXED_PRECISION";

/// The candle release accel-rs is built on (pinned in the workspace manifest).
pub const CANDLE_VERSION: &str = "0.11.1";

/// True when this build has CUDA (`cuda` feature, checked with candle's
/// `cuda_is_available`) and a CUDA device can be opened.
pub fn is_cuda_available() -> bool {
    candle_core::utils::cuda_is_available() && accel_kernels::cuda_device(0).is_ok()
}

/// True when this build has NCCL (`nccl` feature) and CUDA is available.
pub fn is_nccl_available() -> bool {
    cfg!(feature = "nccl") && is_cuda_available()
}

/// True when bf16 compute works: always on the CPU; on CUDA, when a small
/// bf16 matmul succeeds on device 0 (it needs compute capability 8.0+), as
/// Accelerate's `is_bf16_available` asks `torch.cuda.is_bf16_supported()`.
pub fn is_bf16_available() -> bool {
    if !is_cuda_available() {
        return true;
    }
    let probe = || -> candle_core::Result<()> {
        let dev = accel_kernels::cuda_device(0)?;
        let a = Tensor::ones((2, 2), DType::BF16, &dev)?;
        a.matmul(&a)?.to_dtype(DType::F32)?.to_vec2::<f32>()?;
        Ok(())
    };
    probe().is_ok()
}

/// How many CUDA devices can be opened (0 without the `cuda` feature).
pub fn cuda_device_count() -> usize {
    if !candle_core::utils::cuda_is_available() {
        return 0;
    }
    // candle has no count query; open devices until one fails (64 is far above any node).
    (0..64)
        .take_while(|&i| accel_kernels::cuda_device(i).is_ok())
        .count()
}

/// Total memory of this machine in bytes, from `/proc/meminfo` (`None` elsewhere).
pub fn total_ram_bytes() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// The precision `accel launch` exported (`ACCELERATE_MIXED_PRECISION`), if any.
///
/// # Errors
/// [`Error::Config`] naming the variable when its value is not `no`, `fp16` or `bf16`.
pub fn precision_from_env() -> Result<Option<PrecisionType>> {
    match std::env::var(ENV_MIXED_PRECISION) {
        Ok(v) if !v.trim().is_empty() => resolve_precision(None, Some(&v)).map(Some),
        _ => Ok(None),
    }
}

/// Accelerate's precedence for the precision: an explicit choice, then the
/// launcher's `ACCELERATE_MIXED_PRECISION` (`env`), then `no`.
///
/// # Errors
/// [`Error::Config`] naming the variable when `env` is used and is not `no`,
/// `fp16` or `bf16`.
pub fn resolve_precision(
    explicit: Option<PrecisionType>,
    env: Option<&str>,
) -> Result<PrecisionType> {
    if let Some(p) = explicit {
        return Ok(p);
    }
    match env.map(str::trim).filter(|v| !v.is_empty()) {
        None => Ok(PrecisionType::No),
        Some(v) => v.parse().map_err(|e| match e {
            Error::Config { reason, .. } => Error::Config {
                key: ENV_MIXED_PRECISION.into(),
                reason,
            },
            other => other,
        }),
    }
}

impl AcceleratorConfig {
    /// The default configuration with the precision `accel launch` exported
    /// (`ACCELERATE_MIXED_PRECISION`), as Accelerate's `Accelerator()` picks it
    /// up when no `mixed_precision` argument is given.
    ///
    /// # Errors
    /// As [`precision_from_env`].
    pub fn from_env() -> Result<Self> {
        Self::default().with_env_precision()
    }

    /// Resolves the precision: the one set with
    /// [`AcceleratorConfig::with_mixed_precision`] (even `no`) wins, else
    /// `ACCELERATE_MIXED_PRECISION`, else `no` (see [`resolve_precision`]).
    ///
    /// # Errors
    /// As [`precision_from_env`].
    pub fn with_env_precision(mut self) -> Result<Self> {
        let env = std::env::var(ENV_MIXED_PRECISION).ok();
        self.mixed_precision = Some(resolve_precision(self.mixed_precision, env.as_deref())?);
        Ok(self)
    }

    /// The precision mode, `no` while unresolved.
    pub fn precision(&self) -> PrecisionType {
        self.mixed_precision.unwrap_or_default()
    }
}

/// A start-up warning when `OMP_NUM_THREADS` asks for a thread count that
/// accel-rs does not compute with. torchrun (and Accelerate's launcher) size
/// each rank's CPU threads through it, but accel-rs computes on candle's CPU
/// pool (accel-nn's and accel-kernels' kernels, candle's element-wise ops)
/// and rayon's (candle's own matmul), both sized by `RAYON_NUM_THREADS` (which
/// `accel launch` sets; `CANDLE_NUM_THREADS` overrides it for candle's);
/// without this a torchrun job of N ranks silently ran N pools of all cores.
/// `None` when `RAYON_NUM_THREADS` is set (an explicit choice) or the counts agree.
pub fn omp_threads_notice(
    omp_env: Option<&str>,
    rayon_env: Option<&str>,
    pool_threads: usize,
) -> Option<String> {
    if rayon_env.is_some() {
        return None;
    }
    let omp = omp_env?.trim();
    match omp.parse::<usize>() {
        Ok(n) if n > 0 && n == pool_threads => None,
        Ok(n) if n > 0 => Some(format!(
            "OMP_NUM_THREADS={n} has no effect on accel-rs, which computes on pools of \
             {pool_threads} threads sized by RAYON_NUM_THREADS; set RAYON_NUM_THREADS={n} as well \
             (accel launch sets both)"
        )),
        _ => Some(format!(
            "OMP_NUM_THREADS={omp:?} is not a positive number of threads and has no effect; \
             accel-rs computes on pools of {pool_threads} threads (RAYON_NUM_THREADS)"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn omp_num_threads_that_does_not_act_is_reported() {
        let msg = omp_threads_notice(Some("1"), None, 2).expect("a notice");
        assert!(msg.contains("OMP_NUM_THREADS=1") && msg.contains("RAYON_NUM_THREADS=1"));
        assert!(omp_threads_notice(Some("x"), None, 2).is_some_and(|m| m.contains("\"x\"")));
        assert_eq!(omp_threads_notice(Some("2"), None, 2), None);
        assert_eq!(omp_threads_notice(Some("1"), Some("4"), 4), None);
        assert_eq!(omp_threads_notice(None, None, 2), None);
    }

    #[test]
    fn the_candle_version_matches_the_workspace_pin() {
        let manifest = include_str!("../../../Cargo.toml");
        let want = format!("candle-core = \"{CANDLE_VERSION}\"");
        assert!(manifest.contains(&want), "update CANDLE_VERSION");
    }

    #[test]
    fn a_cpu_build_reports_no_cuda_and_bf16() {
        if !cfg!(feature = "cuda") {
            assert!(!is_cuda_available());
            assert!(!is_nccl_available());
            assert_eq!(cuda_device_count(), 0);
        }
        // Either the CPU (always) or a working CUDA probe.
        let _ = is_bf16_available();
        assert!(total_ram_bytes().is_none_or(|b| b > 0));
    }

    #[test]
    fn an_explicit_precision_wins_then_the_launchers_then_no() {
        use PrecisionType::*;
        assert_eq!(resolve_precision(Some(No), Some("bf16")).unwrap(), No);
        assert_eq!(resolve_precision(Some(Fp16), Some("bf16")).unwrap(), Fp16);
        assert_eq!(resolve_precision(None, Some("bf16")).unwrap(), Bf16);
        assert_eq!(resolve_precision(None, Some(" ")).unwrap(), No);
        assert_eq!(resolve_precision(None, None).unwrap(), No);
        // A bad launcher value is named, but only when it is used.
        let e = resolve_precision(None, Some("fp64"))
            .unwrap_err()
            .to_string();
        assert!(e.contains(ENV_MIXED_PRECISION) && e.contains("fp64"), "{e}");
        assert_eq!(resolve_precision(Some(Bf16), Some("fp64")).unwrap(), Bf16);
    }
}
