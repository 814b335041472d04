//! From launcher settings to the processes to start.

use std::ffi::OsString;
use std::time::Duration;

use crate::process::{
    ENV_JOB_TOKEN, ENV_LOCAL_RANK, ENV_LOCAL_WORLD_SIZE, ENV_MASTER_ADDR, ENV_MASTER_PORT,
    ENV_RANK, ENV_TIMEOUT, ENV_USE_AGENT_STORE, ENV_WORLD_SIZE,
};
use crate::{Error, Result};

/// What `accel launch` was asked for; the field names follow Accelerate's flags.
#[derive(Debug, Clone, PartialEq)]
pub struct LaunchConfig {
    /// Processes in the whole job, over all machines.
    pub num_processes: usize,
    /// Machines taking part.
    pub num_machines: usize,
    /// This machine's index.
    pub machine_rank: usize,
    /// Address of machine 0, where rank 0 hosts the rendezvous store.
    pub main_process_ip: Option<String>,
    /// Port of the rendezvous store. Unset on one machine, the launcher hosts
    /// the store itself on a port it holds (see [`LaunchPlan::agent_store`]).
    pub main_process_port: Option<u16>,
    /// Train on the CPU even where a GPU is present (`ACCELERATE_USE_CPU`).
    pub cpu: bool,
    /// Timeout of collectives and the rendezvous (`ACCEL_DIST_TIMEOUT`).
    pub timeout: Option<Duration>,
    /// Job token; a fresh random one per single-machine job when unset.
    pub job_token: Option<String>,
    /// More variables for every rank (e.g. `ACCELERATE_MIXED_PRECISION`).
    pub extra_env: Vec<(String, String)>,
    /// The program to run.
    pub program: OsString,
    /// Its arguments.
    pub args: Vec<OsString>,
}

impl LaunchConfig {
    /// `num_processes` ranks of `program` on this machine.
    pub fn local(num_processes: usize, program: impl Into<OsString>) -> Self {
        Self {
            num_processes,
            num_machines: 1,
            machine_rank: 0,
            main_process_ip: None,
            main_process_port: None,
            cpu: false,
            timeout: None,
            job_token: None,
            extra_env: vec![],
            program: program.into(),
            args: vec![],
        }
    }
}

/// One process to start.
#[derive(Debug, Clone, PartialEq)]
pub struct RankProcess {
    /// Global rank.
    pub rank: usize,
    /// Rank on this machine.
    pub local_rank: usize,
    /// Variables set for it, on top of the launcher's environment.
    pub env: Vec<(String, String)>,
}

/// The processes this machine starts.
#[derive(Debug, Clone, PartialEq)]
pub struct LaunchPlan {
    /// The program.
    pub program: OsString,
    /// Its arguments.
    pub args: Vec<OsString>,
    /// One entry per local rank.
    pub processes: Vec<RankProcess>,
    /// The launcher hosts the rendezvous store itself (torchrun's agent
    /// store): set for a single-machine job with no `main_process_port`.
    /// [`run`](super::run) binds it on a free loopback port and fills in
    /// every rank's `MASTER_PORT`; ranks get `ACCEL_USE_AGENT_STORE=1`.
    ///
    /// Why: picking a free port, releasing it and letting rank 0 bind it
    /// later leaves a window in which another job can take the port (rank 0
    /// then fails with "address in use", or ranks reach the other job's
    /// store and are refused for the wrong token). A port the launcher holds
    /// from the start has no such window.
    pub agent_store: bool,
}

fn invalid(var: &'static str, value: impl ToString, reason: impl Into<String>) -> Error {
    Error::Env {
        var,
        value: value.to_string(),
        reason: reason.into(),
    }
}

/// Works out every local rank's environment: `RANK`, `LOCAL_RANK`,
/// `WORLD_SIZE`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT` as torchrun
/// sets them, plus the job token and timeout accel-dist reads.
pub fn plan(config: &LaunchConfig) -> Result<LaunchPlan> {
    let c = config;
    if c.num_processes == 0 {
        return Err(invalid(
            "num_processes",
            0,
            "at least one process is needed",
        ));
    }
    if c.num_machines == 0 || !c.num_processes.is_multiple_of(c.num_machines) {
        return Err(invalid(
            "num_machines",
            c.num_machines,
            format!(
                "num_processes ({}) must be a multiple of num_machines",
                c.num_processes
            ),
        ));
    }
    if c.machine_rank >= c.num_machines {
        return Err(invalid(
            "machine_rank",
            c.machine_rank,
            format!("must be below num_machines ({})", c.num_machines),
        ));
    }
    let multi = c.num_machines > 1;
    let addr = match (&c.main_process_ip, multi) {
        (Some(ip), _) => ip.clone(),
        (None, false) => "127.0.0.1".to_string(),
        (None, true) => {
            return Err(invalid(
                "main_process_ip",
                "",
                "required with several machines",
            ))
        }
    };
    let agent_store = c.main_process_port.is_none() && !multi;
    let port = match (c.main_process_port, multi) {
        (Some(p), _) => p,
        // torchrun's default; every machine must agree without talking first.
        (None, true) => 29500,
        // Filled in by `run` once the launcher's store is bound.
        (None, false) => 0,
    };
    let token = match (&c.job_token, multi) {
        (Some(t), _) if t.is_empty() => {
            return Err(invalid(
                ENV_JOB_TOKEN,
                "",
                "is empty; an empty token would admit any local process (unset it and the \
                 launcher makes one)",
            ))
        }
        (Some(t), _) => t.clone(),
        (None, false) => random_token()?,
        (None, true) => {
            return Err(invalid(
                ENV_JOB_TOKEN,
                "",
                "set the same job token on every machine (export ACCEL_JOB_TOKEN=...)",
            ))
        }
    };
    let per_machine = c.num_processes / c.num_machines;
    let processes = (0..per_machine)
        .map(|local_rank| {
            let rank = c.machine_rank * per_machine + local_rank;
            let mut env = vec![
                (ENV_RANK.to_string(), rank.to_string()),
                (ENV_LOCAL_RANK.to_string(), local_rank.to_string()),
                (ENV_WORLD_SIZE.to_string(), c.num_processes.to_string()),
                (ENV_LOCAL_WORLD_SIZE.to_string(), per_machine.to_string()),
                // torchrun's node rank.
                ("GROUP_RANK".to_string(), c.machine_rank.to_string()),
                (ENV_MASTER_ADDR.to_string(), addr.clone()),
                (ENV_MASTER_PORT.to_string(), port.to_string()),
                (ENV_JOB_TOKEN.to_string(), token.clone()),
            ];
            if agent_store {
                env.push((ENV_USE_AGENT_STORE.to_string(), "1".to_string()));
            }
            if let Some(t) = c.timeout {
                env.push((ENV_TIMEOUT.to_string(), t.as_secs_f64().to_string()));
            }
            if c.cpu {
                env.push(("ACCELERATE_USE_CPU".to_string(), "true".to_string()));
            }
            env.extend(c.extra_env.iter().cloned());
            RankProcess {
                rank,
                local_rank,
                env,
            }
        })
        .collect();
    Ok(LaunchPlan {
        program: c.program.clone(),
        args: c.args.clone(),
        processes,
        agent_store,
    })
}

/// 256 bits from the operating system's cryptographic source, as hex.
fn random_token() -> Result<String> {
    crate::rendezvous::new_token().map_err(|e| Error::io("drawing a job token", e))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn get<'a>(p: &'a RankProcess, k: &str) -> &'a str {
        &p.env.iter().find(|(key, _)| key == k).unwrap().1
    }

    #[test]
    fn a_single_machine_job_numbers_ranks_like_torchrun() {
        let mut c = LaunchConfig::local(3, "train");
        c.main_process_port = Some(1234);
        c.job_token = Some("t".into());
        let p = plan(&c).unwrap();
        assert_eq!(p.processes.len(), 3);
        for (i, proc_) in p.processes.iter().enumerate() {
            assert_eq!(get(proc_, "RANK"), i.to_string());
            assert_eq!(get(proc_, "LOCAL_RANK"), i.to_string());
            assert_eq!(get(proc_, "WORLD_SIZE"), "3");
            assert_eq!(get(proc_, "LOCAL_WORLD_SIZE"), "3");
            assert_eq!(get(proc_, "MASTER_ADDR"), "127.0.0.1");
            assert_eq!(get(proc_, "MASTER_PORT"), "1234");
            assert_eq!(get(proc_, "ACCEL_JOB_TOKEN"), "t");
        }
    }

    #[test]
    fn the_second_machine_owns_the_upper_ranks() {
        let c = LaunchConfig {
            num_processes: 4,
            num_machines: 2,
            machine_rank: 1,
            main_process_ip: Some("10.0.0.1".into()),
            job_token: Some("tok".into()),
            ..LaunchConfig::local(4, "train")
        };
        let p = plan(&c).unwrap();
        let ranks: Vec<usize> = p.processes.iter().map(|p| p.rank).collect();
        assert_eq!(ranks, [2, 3]);
        assert_eq!(get(&p.processes[1], "LOCAL_RANK"), "1");
        assert_eq!(get(&p.processes[0], "MASTER_PORT"), "29500");
        assert_eq!(get(&p.processes[0], "LOCAL_WORLD_SIZE"), "2");
        assert_eq!(get(&p.processes[1], "GROUP_RANK"), "1");
    }

    #[test]
    fn inconsistent_settings_name_the_flag() {
        let mut c = LaunchConfig::local(3, "train");
        c.num_machines = 2;
        assert!(plan(&c).unwrap_err().to_string().contains("num_machines"));
        let mut c = LaunchConfig::local(2, "train");
        c.num_machines = 2;
        c.job_token = Some("t".into());
        assert!(plan(&c)
            .unwrap_err()
            .to_string()
            .contains("main_process_ip"));
        let mut c = LaunchConfig::local(2, "train");
        c.machine_rank = 1;
        assert!(plan(&c).unwrap_err().to_string().contains("machine_rank"));
        let mut c = LaunchConfig::local(2, "train");
        c.job_token = Some(String::new());
        let err = plan(&c).unwrap_err().to_string();
        assert!(
            err.contains("ACCEL_JOB_TOKEN") && err.contains("is empty"),
            "{err}"
        );
    }

    #[test]
    fn each_single_machine_job_gets_its_own_token_and_the_launchers_store() {
        let a = plan(&LaunchConfig::local(1, "x")).unwrap();
        let b = plan(&LaunchConfig::local(1, "x")).unwrap();
        assert_ne!(
            get(&a.processes[0], "ACCEL_JOB_TOKEN"),
            get(&b.processes[0], "ACCEL_JOB_TOKEN")
        );
        assert!(a.agent_store);
        assert_eq!(get(&a.processes[0], "ACCEL_USE_AGENT_STORE"), "1");
        // An explicit port, or several machines, keep rank 0's store.
        let mut c = LaunchConfig::local(2, "x");
        c.main_process_port = Some(29511);
        let p = plan(&c).unwrap();
        assert!(!p.agent_store);
        assert_eq!(get(&p.processes[1], "MASTER_PORT"), "29511");
        assert!(p.processes[1]
            .env
            .iter()
            .all(|(k, _)| k != "ACCEL_USE_AGENT_STORE"));
    }
}
