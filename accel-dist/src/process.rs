//! Where this process sits in the job, read from torchrun-style environment variables.

use std::net::{SocketAddr, ToSocketAddrs};
use std::time::Duration;

use crate::{Error, Result};

/// Global rank of this process (torchrun's name).
pub const ENV_RANK: &str = "RANK";
/// Number of processes in the job.
pub const ENV_WORLD_SIZE: &str = "WORLD_SIZE";
/// Rank of this process on its machine.
pub const ENV_LOCAL_RANK: &str = "LOCAL_RANK";
/// Number of processes on this machine.
pub const ENV_LOCAL_WORLD_SIZE: &str = "LOCAL_WORLD_SIZE";
/// Host of the rendezvous store.
pub const ENV_MASTER_ADDR: &str = "MASTER_ADDR";
/// Port of the rendezvous store.
pub const ENV_MASTER_PORT: &str = "MASTER_PORT";
/// Secret shared by the processes of one job; connections without it are refused.
pub const ENV_JOB_TOKEN: &str = "ACCEL_JOB_TOKEN";
/// A file holding the job's secret (for engines that cannot pass variables
/// safely); read when `ACCEL_JOB_TOKEN` is unset.
pub const ENV_JOB_TOKEN_FILE: &str = "ACCEL_JOB_TOKEN_FILE";
/// Collective and rendezvous timeout in seconds (fractions allowed).
pub const ENV_TIMEOUT: &str = "ACCEL_DIST_TIMEOUT";
/// `1` when a launcher hosts the store and rank 0 must not (torchrun's
/// `TORCHELASTIC_USE_AGENT_STORE`).
pub const ENV_USE_AGENT_STORE: &str = "ACCEL_USE_AGENT_STORE";

/// The collective backend: `auto`, `tcp` (alias `gloo`) or `nccl`.
pub const ENV_BACKEND: &str = "ACCEL_DIST_BACKEND";

/// The timeout PyTorch uses for process groups: 30 minutes.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(1800);
/// torchrun's default store port.
pub const DEFAULT_MASTER_PORT: u16 = 29500;

/// Options for setting up the process group, as accelerate's `InitProcessGroupKwargs`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InitProcessGroupKwargs {
    /// How long any blocking collective or rendezvous step may wait for a peer.
    pub timeout: Duration,
    /// The transport; `None` keeps the launcher's (`ACCEL_DIST_BACKEND`, else auto).
    pub backend: Option<Backend>,
}

impl Default for InitProcessGroupKwargs {
    fn default() -> Self {
        Self {
            timeout: DEFAULT_TIMEOUT,
            backend: None,
        }
    }
}

impl InitProcessGroupKwargs {
    /// Sets the timeout.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Sets the transport (PyTorch's `backend=`).
    pub fn with_backend(mut self, backend: Backend) -> Self {
        self.backend = Some(backend);
        self
    }
}

/// The transport of a process group (PyTorch's `backend=` argument).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Backend {
    /// NCCL when the training device is a CUDA device and this build has
    /// the `nccl` feature (`ProcessGroup::init_on`); TCP (or the local
    /// communicator for one process) otherwise.
    #[default]
    Auto,
    /// TCP between processes (PyTorch's `gloo`).
    Tcp,
    /// NCCL on `cuda:LOCAL_RANK`, also for a world of one; an error without
    /// the `nccl` feature.
    Nccl,
}

impl std::str::FromStr for Backend {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "" | "auto" => Ok(Backend::Auto),
            "tcp" | "gloo" => Ok(Backend::Tcp),
            "nccl" => Ok(Backend::Nccl),
            _ => Err("expected auto, tcp, gloo or nccl".into()),
        }
    }
}

/// Everything a process needs to join a job: its ranks, the store address,
/// the job token, the timeout and the backend.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProcessGroupConfig {
    /// Global rank, `0..world_size`.
    pub rank: usize,
    /// Number of processes.
    pub world_size: usize,
    /// Rank on this machine.
    pub local_rank: usize,
    /// Processes on this machine.
    pub local_world_size: usize,
    /// Host of the rendezvous store (rank 0 binds it unless `use_agent_store`).
    pub master_addr: String,
    /// Port of the rendezvous store; 0 lets the host pick one (single-host tests).
    pub master_port: u16,
    /// Secret every connection must present; empty accepts any peer that speaks the protocol.
    pub job_token: String,
    /// Timeout of every blocking step.
    pub timeout: Duration,
    /// Whether a launcher hosts the store (then rank 0 only connects).
    pub use_agent_store: bool,
    /// The collective transport.
    pub backend: Backend,
}

impl Default for ProcessGroupConfig {
    /// A single-process job on loopback.
    fn default() -> Self {
        Self {
            rank: 0,
            world_size: 1,
            local_rank: 0,
            local_world_size: 1,
            master_addr: "127.0.0.1".into(),
            master_port: DEFAULT_MASTER_PORT,
            job_token: String::new(),
            timeout: DEFAULT_TIMEOUT,
            use_agent_store: false,
            backend: Backend::Auto,
        }
    }
}

impl ProcessGroupConfig {
    /// Reads the configuration from the process environment.
    ///
    /// With neither `RANK` nor `WORLD_SIZE` set, this is a single-process job.
    /// A multi-process job needs `RANK`, `MASTER_ADDR` and `MASTER_PORT`;
    /// `LOCAL_RANK`/`LOCAL_WORLD_SIZE` default to the global values.
    ///
    /// # Errors
    /// [`Error::MissingEnv`] or [`Error::Env`] naming the variable.
    pub fn from_env() -> Result<Self> {
        Self::from_lookup(|var| std::env::var(var).ok())
    }

    /// As [`from_env`](Self::from_env), reading variables through `lookup`
    /// (tests and launchers pass a map instead of mutating the environment).
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Self> {
        // mpirun's or srun's variables, in torchrun's names where those are unset.
        let detected = crate::engine::detect(&lookup)?;
        let engine = detected.engine;
        let lookup = |var: &str| detected.lookup(var, &lookup);
        let mut cfg = Self::default();
        let rank = parse::<usize>(&lookup, ENV_RANK)?;
        let world = parse::<usize>(&lookup, ENV_WORLD_SIZE)?;
        cfg.world_size = world.unwrap_or(1);
        if cfg.world_size == 0 {
            return Err(env_err(ENV_WORLD_SIZE, "0", "must be at least 1"));
        }
        cfg.rank = match rank {
            Some(r) => r,
            None if cfg.world_size > 1 => {
                return Err(Error::MissingEnv {
                    var: ENV_RANK,
                    reason: "WORLD_SIZE > 1 needs the rank of this process",
                })
            }
            None => 0,
        };
        if cfg.rank >= cfg.world_size {
            let reason = format!("must be below WORLD_SIZE={}", cfg.world_size);
            return Err(env_err(ENV_RANK, &cfg.rank.to_string(), &reason));
        }
        cfg.local_rank = parse(&lookup, ENV_LOCAL_RANK)?.unwrap_or(cfg.rank);
        cfg.local_world_size = parse(&lookup, ENV_LOCAL_WORLD_SIZE)?.unwrap_or(cfg.world_size);
        if cfg.local_rank >= cfg.local_world_size {
            let reason = format!("must be below LOCAL_WORLD_SIZE={}", cfg.local_world_size);
            return Err(env_err(
                ENV_LOCAL_RANK,
                &cfg.local_rank.to_string(),
                &reason,
            ));
        }
        let distributed = cfg.world_size > 1;
        match lookup(ENV_MASTER_ADDR) {
            Some(addr) if addr.trim().is_empty() => {
                return Err(env_err(ENV_MASTER_ADDR, &addr, "is empty"))
            }
            Some(addr) => cfg.master_addr = addr.trim().to_string(),
            None if distributed => {
                return Err(Error::MissingEnv {
                    var: ENV_MASTER_ADDR,
                    reason: "a multi-process job needs the host of the rendezvous store",
                })
            }
            None => {}
        }
        match parse::<u16>(&lookup, ENV_MASTER_PORT)? {
            Some(port) => cfg.master_port = port,
            None if distributed => {
                return Err(Error::MissingEnv {
                    var: ENV_MASTER_PORT,
                    reason: "a multi-process job needs the port of the rendezvous store",
                })
            }
            None => {}
        }
        cfg.job_token = job_token(&lookup, distributed, engine)?;
        if let Some(secs) = parse::<f64>(&lookup, ENV_TIMEOUT)? {
            if !(secs.is_finite() && secs > 0.0) {
                return Err(env_err(
                    ENV_TIMEOUT,
                    &secs.to_string(),
                    "must be > 0 seconds",
                ));
            }
            cfg.timeout = Duration::from_secs_f64(secs);
        }
        if let Some(v) = lookup(ENV_BACKEND) {
            cfg.backend = v
                .parse()
                .map_err(|reason: String| env_err(ENV_BACKEND, &v, &reason))?;
        }
        if let Some(v) = lookup(ENV_USE_AGENT_STORE) {
            cfg.use_agent_store = match v.trim().to_ascii_lowercase().as_str() {
                "1" | "true" | "yes" => true,
                "0" | "false" | "no" | "" => false,
                _ => return Err(env_err(ENV_USE_AGENT_STORE, &v, "expected 0 or 1")),
            };
        }
        Ok(cfg)
    }

    /// Applies accelerate-style kwargs.
    pub fn with_kwargs(mut self, kwargs: &InitProcessGroupKwargs) -> Self {
        self.timeout = kwargs.timeout;
        if let Some(b) = kwargs.backend {
            self.backend = b;
        }
        self
    }

    /// Sets the timeout.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Sets the backend.
    pub fn with_backend(mut self, backend: Backend) -> Self {
        self.backend = backend;
        self
    }

    /// Sets the job token.
    pub fn with_job_token(mut self, token: impl Into<String>) -> Self {
        self.job_token = token.into();
        self
    }

    /// Sets the rank and world size (local values follow on a single host).
    pub fn with_rank(mut self, rank: usize, world_size: usize) -> Self {
        self.rank = rank;
        self.world_size = world_size;
        self.local_rank = rank;
        self.local_world_size = world_size;
        self
    }

    /// Sets the store address.
    pub fn with_master(mut self, addr: impl Into<String>, port: u16) -> Self {
        self.master_addr = addr.into();
        self.master_port = port;
        self
    }

    /// Whether this process hosts the rendezvous store.
    pub fn hosts_store(&self) -> bool {
        self.rank == 0 && !self.use_agent_store
    }

    /// Whether more than one process takes part.
    pub fn is_distributed(&self) -> bool {
        self.world_size > 1
    }

    /// Resolves `master_addr:master_port`, preferring IPv4.
    ///
    /// # Errors
    /// [`Error::Env`] naming `MASTER_ADDR` when the host does not resolve.
    pub fn master_socket_addr(&self) -> Result<SocketAddr> {
        let host = self.master_addr.trim_matches(|c| c == '[' || c == ']');
        let addrs: Vec<SocketAddr> = (host, self.master_port)
            .to_socket_addrs()
            .map_err(|e| env_err(ENV_MASTER_ADDR, &self.master_addr, &e.to_string()))?
            .collect();
        addrs
            .iter()
            .find(|a| a.is_ipv4())
            .or(addrs.first())
            .copied()
            .ok_or_else(|| env_err(ENV_MASTER_ADDR, &self.master_addr, "resolves to no address"))
    }
}

fn env_err(var: &'static str, value: &str, reason: &str) -> Error {
    Error::Env {
        var,
        value: value.to_string(),
        reason: reason.to_string(),
    }
}

/// The job token: `ACCEL_JOB_TOKEN`, or the run id `torchrun --standalone`
/// draws (a random UUID, in the workers' environment only). A multi-process
/// job without either is refused: its store and peers would admit any
/// local process.
fn job_token(
    lookup: &impl Fn(&str) -> Option<String>,
    distributed: bool,
    engine: crate::engine::Engine,
) -> Result<String> {
    let token = match (lookup(ENV_JOB_TOKEN), lookup(ENV_JOB_TOKEN_FILE)) {
        (Some(t), _) => Some(t),
        (None, Some(path)) => {
            let text = std::fs::read_to_string(&path)
                .map_err(|e| env_err(ENV_JOB_TOKEN_FILE, &path, &format!("cannot be read: {e}")))?;
            Some(text.trim().to_string())
        }
        (None, None) => None,
    };
    match token {
        Some(t) if t.is_empty() => Err(env_err(
            ENV_JOB_TOKEN,
            "",
            "is empty; an empty token would admit any local process (unset it to run alone, \
             or use `accel launch`, which makes one)",
        )),
        Some(t) => Ok(t),
        None if distributed && engine != crate::engine::Engine::Launcher => {
            Err(Error::MissingEnv {
                var: ENV_JOB_TOKEN,
                reason: "ranks started by mpirun or srun need a secret shared by the job, so its \
                     store and peers admit no other process: export ACCEL_JOB_TOKEN=<secret> \
                     to every rank (mpirun -x ACCEL_JOB_TOKEN; srun --export=ALL), or \
                     ACCEL_JOB_TOKEN_FILE=<a file every rank can read>",
            })
        }
        None => match lookup(ENV_TORCHELASTIC_RUN_ID) {
            Some(id) if distributed && is_uuid(&id) => Ok(format!("torchrun-{id}")),
            _ if distributed => Err(Error::MissingEnv {
                var: ENV_JOB_TOKEN,
                reason: "a multi-process job needs a secret shared by its ranks, so its store \
                         and peers admit no other process: `accel launch` makes one; with \
                         torchrun, export the same ACCEL_JOB_TOKEN=<secret> (or \
                         ACCEL_JOB_TOKEN_FILE=<path>) to every rank or use `torchrun --standalone`",
            }),
            _ => Ok(String::new()),
        },
    }
}

/// torchrun's run id, a random UUID under `--standalone` (`none` by default).
const ENV_TORCHELASTIC_RUN_ID: &str = "TORCHELASTIC_RUN_ID";

/// Whether `s` has the shape of a UUID (`8-4-4-4-12` hex digits).
fn is_uuid(s: &str) -> bool {
    let groups: Vec<&str> = s.split('-').collect();
    groups.len() == 5
        && groups
            .iter()
            .zip([8, 4, 4, 4, 12])
            .all(|(g, n)| g.len() == n && g.bytes().all(|b| b.is_ascii_hexdigit()))
}

/// Parses an optional variable, naming it in the error.
pub(crate) fn parse_env<T: std::str::FromStr>(
    lookup: &impl Fn(&str) -> Option<String>,
    var: &'static str,
) -> Result<Option<T>>
where
    T::Err: std::fmt::Display,
{
    parse(lookup, var)
}

fn parse<T: std::str::FromStr>(
    lookup: &impl Fn(&str) -> Option<String>,
    var: &'static str,
) -> Result<Option<T>>
where
    T::Err: std::fmt::Display,
{
    match lookup(var) {
        None => Ok(None),
        Some(v) => v
            .trim()
            .parse()
            .map(Some)
            .map_err(|e: T::Err| env_err(var, &v, &e.to_string())),
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    fn lookup(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| map.get(k).cloned()
    }

    #[test]
    fn an_empty_environment_is_a_single_process_job() {
        let cfg = ProcessGroupConfig::from_lookup(lookup(&[])).unwrap();
        assert_eq!(cfg, ProcessGroupConfig::default());
        assert!(!cfg.is_distributed());
        assert_eq!(cfg.timeout, Duration::from_secs(1800));
    }

    #[test]
    fn torchrun_variables_are_read() {
        let cfg = ProcessGroupConfig::from_lookup(lookup(&[
            ("RANK", "3"),
            ("WORLD_SIZE", "4"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("MASTER_ADDR", "localhost"),
            ("MASTER_PORT", "1234"),
            ("ACCEL_JOB_TOKEN", "secret"),
            ("ACCEL_DIST_TIMEOUT", "2.5"),
            ("ACCEL_USE_AGENT_STORE", "1"),
        ]))
        .unwrap();
        assert_eq!(
            (
                cfg.rank,
                cfg.world_size,
                cfg.local_rank,
                cfg.local_world_size
            ),
            (3, 4, 1, 2)
        );
        assert_eq!(cfg.job_token, "secret");
        assert_eq!(cfg.timeout, Duration::from_millis(2500));
        assert!(cfg.use_agent_store && !cfg.hosts_store());
        assert_eq!(cfg.master_socket_addr().unwrap().port(), 1234);
    }

    #[test]
    fn errors_name_the_variable() {
        let cases: &[(&[(&str, &str)], &str)] = &[
            (
                &[
                    ("WORLD_SIZE", "2"),
                    ("MASTER_ADDR", "x"),
                    ("MASTER_PORT", "1"),
                ],
                "RANK",
            ),
            (&[("RANK", "2"), ("WORLD_SIZE", "2")], "RANK"),
            (&[("RANK", "0"), ("WORLD_SIZE", "two")], "WORLD_SIZE"),
            (
                &[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_PORT", "1")],
                "MASTER_ADDR",
            ),
            (
                &[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "h")],
                "MASTER_PORT",
            ),
            (&[("MASTER_PORT", "70000")], "MASTER_PORT"),
            (&[("ACCEL_DIST_TIMEOUT", "-1")], "ACCEL_DIST_TIMEOUT"),
            (&[("ACCEL_JOB_TOKEN", "")], "ACCEL_JOB_TOKEN=\"\": is empty"),
            (
                &[("LOCAL_RANK", "1"), ("LOCAL_WORLD_SIZE", "1")],
                "LOCAL_RANK",
            ),
        ];
        for (vars, name) in cases {
            let err = ProcessGroupConfig::from_lookup(lookup(vars)).unwrap_err();
            assert!(err.to_string().contains(name), "{vars:?}: {err}");
        }
    }

    #[test]
    fn a_multi_process_job_needs_a_token_or_torchruns_standalone_run_id() {
        let job = [
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "h"),
            ("MASTER_PORT", "1"),
        ];
        let err = ProcessGroupConfig::from_lookup(lookup(&job)).unwrap_err();
        assert!(
            err.to_string().contains("ACCEL_JOB_TOKEN is not set"),
            "{err}"
        );
        let with = |extra: (&'static str, &'static str)| {
            let mut vars = job.to_vec();
            vars.push(extra);
            ProcessGroupConfig::from_lookup(lookup(&vars))
        };
        // torchrun's default run id is not a secret.
        assert!(with(("TORCHELASTIC_RUN_ID", "none")).is_err());
        let id = "0c1a2b3c-4d5e-4f60-8a9b-0123456789ab";
        let cfg = with(("TORCHELASTIC_RUN_ID", id)).unwrap();
        assert_eq!(cfg.job_token, format!("torchrun-{id}"));
        assert_eq!(with(("ACCEL_JOB_TOKEN", "s")).unwrap().job_token, "s");
        // One process needs none.
        let alone = ProcessGroupConfig::from_lookup(lookup(&[])).unwrap();
        assert_eq!(alone.job_token, "");
    }

    #[test]
    fn kwargs_override_the_timeout() {
        let kwargs = InitProcessGroupKwargs::default().with_timeout(Duration::from_secs(5));
        let cfg = ProcessGroupConfig::default().with_kwargs(&kwargs);
        assert_eq!(cfg.timeout, Duration::from_secs(5));
    }
}
