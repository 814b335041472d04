//! Who this process is: rank, world size, device and the kind of distributed run.

use candle_core::Device;
use serde::{Deserialize, Serialize};

use crate::{Error, Result};

/// The kind of run, named as Accelerate's `DistributedType`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum DistributedType {
    /// One process, one device.
    #[default]
    No,
    /// Several CPU processes talking over TCP.
    MultiCpu,
    /// Several GPU processes talking over NCCL.
    MultiGpu,
    /// Fully sharded data parallel (parameters, gradients and optimizer state sharded).
    Fsdp,
}

impl std::fmt::Display for DistributedType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = match self {
            DistributedType::No => "NO",
            DistributedType::MultiCpu => "MULTI_CPU",
            DistributedType::MultiGpu => "MULTI_GPU",
            DistributedType::Fsdp => "FSDP",
        };
        f.write_str(s)
    }
}

impl std::str::FromStr for DistributedType {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.to_ascii_uppercase().as_str() {
            "NO" => Ok(Self::No),
            "MULTI_CPU" => Ok(Self::MultiCpu),
            "MULTI_GPU" => Ok(Self::MultiGpu),
            "FSDP" => Ok(Self::Fsdp),
            other => Err(Error::Config {
                key: "distributed_type".into(),
                reason: format!(
                    "unknown value {other:?} (expected NO, MULTI_CPU, MULTI_GPU or FSDP)"
                ),
            }),
        }
    }
}

/// The identity of this process in the job, read once from the launcher's
/// environment (`RANK`, `LOCAL_RANK`, `WORLD_SIZE`), and the device it computes on.
#[derive(Debug, Clone)]
pub struct ProcessState {
    /// Global rank of this process.
    pub rank: usize,
    /// Rank of this process on its machine.
    pub local_rank: usize,
    /// Number of processes in the job.
    pub world_size: usize,
    /// The device tensors live on.
    pub device: Device,
    /// The kind of run.
    pub distributed_type: DistributedType,
}

impl ProcessState {
    /// A single process on `device`.
    pub fn single(device: Device) -> Self {
        Self {
            rank: 0,
            local_rank: 0,
            world_size: 1,
            device,
            distributed_type: DistributedType::No,
        }
    }

    /// Reads `RANK`, `LOCAL_RANK` and `WORLD_SIZE` (torchrun's names); a process
    /// started without them is a single process.
    pub fn from_env(device: Device) -> Result<Self> {
        let rank = env_usize("RANK")?.unwrap_or(0);
        let world_size = env_usize("WORLD_SIZE")?.unwrap_or(1);
        let local_rank = env_usize("LOCAL_RANK")?.unwrap_or(rank);
        if rank >= world_size {
            return Err(Error::Config {
                key: "RANK".into(),
                reason: format!("rank {rank} is not below WORLD_SIZE {world_size}"),
            });
        }
        let distributed_type = match (world_size, device.is_cpu()) {
            (1, _) => DistributedType::No,
            (_, true) => DistributedType::MultiCpu,
            (_, false) => DistributedType::MultiGpu,
        };
        Ok(Self {
            rank,
            local_rank,
            world_size,
            device,
            distributed_type,
        })
    }

    /// True on the process with global rank 0.
    pub fn is_main_process(&self) -> bool {
        self.rank == 0
    }

    /// True on the process with local rank 0 of each machine.
    pub fn is_local_main_process(&self) -> bool {
        self.local_rank == 0
    }
}

/// A float environment variable, `None` when unset.
pub(crate) fn env_f64(var: &str) -> Result<Option<f64>> {
    match std::env::var(var) {
        Ok(v) => v.trim().parse().map(Some).map_err(|_| Error::Config {
            key: var.into(),
            reason: format!("{v:?} is not a number"),
        }),
        Err(_) => Ok(None),
    }
}

/// A process variable: the environment's, else what the engine that started
/// the process implies (`RANK` from `OMPI_COMM_WORLD_RANK` under mpirun,
/// from `SLURM_PROCID` under srun, ...; see `accel_dist::engine`).
pub(crate) fn process_var(var: &str) -> Result<Option<String>> {
    let env = |k: &str| std::env::var(k).ok();
    Ok(accel_dist::engine::detect(&env)?.lookup(var, &env))
}

pub(crate) fn env_usize(var: &str) -> Result<Option<usize>> {
    match process_var(var)? {
        Some(v) => v.trim().parse().map(Some).map_err(|_| Error::Config {
            key: var.into(),
            reason: format!("{v:?} is not a non-negative integer"),
        }),
        None => Ok(None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn distributed_type_parses_reference_names_and_rejects_others() {
        assert_eq!(
            "MULTI_CPU".parse::<DistributedType>().unwrap(),
            DistributedType::MultiCpu
        );
        assert_eq!(
            "no".parse::<DistributedType>().unwrap(),
            DistributedType::No
        );
        let err = "DEEPSPEEDX"
            .parse::<DistributedType>()
            .unwrap_err()
            .to_string();
        assert!(err.contains("DEEPSPEEDX"), "{err}");
        assert_eq!(DistributedType::MultiGpu.to_string(), "MULTI_GPU");
    }
}
