//! Which engine started this process, and its variables in torchrun's names.
//!
//! Why: clusters start processes with their own engine. `mpirun` (Open MPI:
//! `OMPI_COMM_WORLD_*`; MPICH and Intel MPI: `PMI_*`) and Slurm's `srun`
//! (`SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`, `SLURM_JOB_NODELIST`) say
//! each process's rank in their own words, and Accelerate and torch read them
//! so that a script joins its job with no launcher of theirs. Here they become
//! `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR` and
//! `MASTER_PORT` for [`crate::ProcessGroupConfig::from_lookup`]; a variable set
//! explicitly always wins.

use std::collections::BTreeMap;

use crate::{Error, Result};

/// What started this process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Engine {
    /// `accel launch`, torchrun, or a process on its own (`RANK` and
    /// friends, or nothing).
    Launcher,
    /// Open MPI's `mpirun` (`OMPI_COMM_WORLD_RANK`).
    OpenMpi,
    /// MPICH or Intel MPI (`PMI_RANK`).
    Pmi,
    /// Slurm's `srun` (`SLURM_PROCID`).
    Slurm,
}

impl Engine {
    /// Its name in `accel env` and in messages.
    pub fn name(self) -> &'static str {
        match self {
            Engine::Launcher => "launcher (RANK/WORLD_SIZE)",
            Engine::OpenMpi => "Open MPI mpirun",
            Engine::Pmi => "MPICH/Intel MPI (PMI)",
            Engine::Slurm => "Slurm srun",
        }
    }
}

/// The engine and the torchrun-named variables it implies (only those the
/// environment does not set itself).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Detected {
    /// What started the process.
    pub engine: Engine,
    /// `RANK`, `WORLD_SIZE`, ... derived from the engine's variables.
    pub vars: BTreeMap<&'static str, String>,
}

impl Detected {
    /// A variable, from the process's own environment first, then derived.
    pub fn lookup(&self, var: &str, env: &impl Fn(&str) -> Option<String>) -> Option<String> {
        env(var).or_else(|| self.vars.get(var).cloned())
    }
}

/// Reads the engine's variables through `lookup`.
///
/// # Errors
/// An engine variable that does not parse, or a multi-host MPI job with no
/// `MASTER_ADDR` (MPI does not name the rendezvous host), named.
pub fn detect(lookup: &impl Fn(&str) -> Option<String>) -> Result<Detected> {
    let mut vars = BTreeMap::new();
    let launcher = Detected {
        engine: Engine::Launcher,
        vars: BTreeMap::new(),
    };
    if lookup(crate::process::ENV_RANK).is_some()
        || lookup(crate::process::ENV_WORLD_SIZE).is_some()
    {
        return Ok(launcher);
    }
    let number = |var: &'static str| -> Result<Option<usize>> {
        lookup(var)
            .map(|v| {
                v.trim().parse::<usize>().map_err(|_| Error::Env {
                    var,
                    value: v.clone(),
                    reason: "expected a whole number".into(),
                })
            })
            .transpose()
    };
    // (engine, rank, world, local rank, local world)
    let found = if let Some(rank) = number("OMPI_COMM_WORLD_RANK")? {
        let world = number("OMPI_COMM_WORLD_SIZE")?;
        let local = number("OMPI_COMM_WORLD_LOCAL_RANK")?;
        let local_world = number("OMPI_COMM_WORLD_LOCAL_SIZE")?;
        (Engine::OpenMpi, rank, world, local, local_world)
    } else if let Some(rank) = number("PMI_RANK")? {
        let world = number("PMI_SIZE")?;
        let local = number("MPI_LOCALRANKID")?.or(number("PMI_LOCAL_RANK")?);
        let local_world = number("MPI_LOCALNRANKS")?.or(number("PMI_LOCAL_SIZE")?);
        (Engine::Pmi, rank, world, local, local_world)
    } else if let Some(rank) = number("SLURM_PROCID")? {
        let world = number("SLURM_NTASKS")?.or(number("SLURM_NPROCS")?);
        let local = number("SLURM_LOCALID")?;
        // `2(x3)` or `2,1`: this node's count is the first figure when uniform.
        let per_node = lookup("SLURM_NTASKS_PER_NODE")
            .or_else(|| lookup("SLURM_TASKS_PER_NODE"))
            .and_then(|v| {
                v.split([',', '('])
                    .next()
                    .and_then(|n| n.trim().parse::<usize>().ok())
            });
        (Engine::Slurm, rank, world, local, per_node)
    } else {
        return Ok(launcher);
    };
    let (engine, rank, world, local, local_world) = found;
    let world = world.unwrap_or(1);
    let local_world = local_world.unwrap_or(world);
    vars.insert(crate::process::ENV_RANK, rank.to_string());
    vars.insert(crate::process::ENV_WORLD_SIZE, world.to_string());
    vars.insert(
        crate::process::ENV_LOCAL_RANK,
        local.unwrap_or(rank).to_string(),
    );
    vars.insert(
        crate::process::ENV_LOCAL_WORLD_SIZE,
        local_world.to_string(),
    );
    if lookup(crate::process::ENV_MASTER_ADDR).is_none() {
        let addr = match engine {
            Engine::Slurm => lookup("SLURM_JOB_NODELIST")
                .or_else(|| lookup("SLURM_NODELIST"))
                .and_then(|l| first_host(&l)),
            _ => None,
        };
        let addr = match addr {
            Some(a) => a,
            // Every rank on this host: the store is here.
            None if local_world >= world => "127.0.0.1".to_string(),
            None => {
                return Err(Error::MissingEnv {
                    var: crate::process::ENV_MASTER_ADDR,
                    reason:
                        "ranks started by MPI on several hosts need the host of rank 0's \
                             store: export MASTER_ADDR=<host> to every rank (mpirun -x MASTER_ADDR)",
                })
            }
        };
        vars.insert(crate::process::ENV_MASTER_ADDR, addr);
    }
    if lookup(crate::process::ENV_MASTER_PORT).is_none() {
        vars.insert(
            crate::process::ENV_MASTER_PORT,
            crate::process::DEFAULT_MASTER_PORT.to_string(),
        );
    }
    Ok(Detected { engine, vars })
}

/// The first host of a Slurm host list: `node[01-04,07],gpu1` gives
/// `node01`, `a,b` gives `a`.
pub fn first_host(list: &str) -> Option<String> {
    let list = list.trim();
    let (prefix, rest) = match list.find(['[', ',']) {
        None => return (!list.is_empty()).then(|| list.to_string()),
        Some(i) if list.as_bytes()[i] == b',' => return Some(list[..i].to_string()),
        Some(i) => (&list[..i], &list[i + 1..]),
    };
    let first = rest.split([',', '-', ']']).next()?;
    Some(format!("{prefix}{first}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: BTreeMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| map.get(k).cloned()
    }

    #[test]
    fn slurm_host_lists_give_their_first_host() {
        assert_eq!(first_host("node[01-04,07],gpu1").as_deref(), Some("node01"));
        assert_eq!(first_host("n[7,9]").as_deref(), Some("n7"));
        assert_eq!(first_host("alpha,beta").as_deref(), Some("alpha"));
        assert_eq!(first_host("solo").as_deref(), Some("solo"));
        assert_eq!(first_host(""), None);
    }

    #[test]
    fn each_engines_variables_become_torchruns() {
        let d = detect(&env(&[
            ("OMPI_COMM_WORLD_RANK", "1"),
            ("OMPI_COMM_WORLD_SIZE", "2"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
        ]))
        .unwrap();
        assert_eq!(d.engine, Engine::OpenMpi);
        assert_eq!(d.vars["RANK"], "1");
        assert_eq!(d.vars["MASTER_ADDR"], "127.0.0.1");
        assert_eq!(d.vars["MASTER_PORT"], "29500");
        let d = detect(&env(&[
            ("SLURM_PROCID", "3"),
            ("SLURM_NTASKS", "4"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_NTASKS_PER_NODE", "2(x2)"),
            ("SLURM_JOB_NODELIST", "gpu[12-13]"),
            ("MASTER_PORT", "4000"),
        ]))
        .unwrap();
        assert_eq!(d.engine, Engine::Slurm);
        assert_eq!(
            (
                d.vars["RANK"].as_str(),
                d.vars["WORLD_SIZE"].as_str(),
                d.vars["LOCAL_RANK"].as_str()
            ),
            ("3", "4", "1")
        );
        assert_eq!(d.vars["LOCAL_WORLD_SIZE"], "2");
        assert_eq!(d.vars["MASTER_ADDR"], "gpu12");
        // Set by the environment: not derived.
        assert!(!d.vars.contains_key("MASTER_PORT"));
        let d = detect(&env(&[("PMI_RANK", "0"), ("PMI_SIZE", "2")])).unwrap();
        assert_eq!(d.engine, Engine::Pmi);
        // A launcher's variables win over an engine's.
        let d = detect(&env(&[("RANK", "0"), ("OMPI_COMM_WORLD_RANK", "1")])).unwrap();
        assert_eq!(d.engine, Engine::Launcher);
        assert!(d.vars.is_empty());
    }

    #[test]
    fn a_multi_host_mpi_job_without_master_addr_is_named() {
        let err = detect(&env(&[
            ("OMPI_COMM_WORLD_RANK", "0"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
        ]))
        .unwrap_err()
        .to_string();
        assert!(err.contains("MASTER_ADDR"), "{err}");
        let err = detect(&env(&[("SLURM_PROCID", "x")]))
            .unwrap_err()
            .to_string();
        assert!(err.contains("SLURM_PROCID"), "{err}");
    }
}
