//! `accel launch`: run a program on several processes.

use std::ffi::OsString;
use std::path::PathBuf;
use std::time::Duration;

use accel_core::config::ENV_MIXED_PRECISION;
use accel_core::dist::launch::{self, LaunchConfig, RunOptions};
use accel_core::{DistributedType, Error, PrecisionType, Result};

use crate::config_file::ClusterConfig;

/// Flags of `accel launch` (Accelerate's names, which use underscores; the
/// dashed spellings are accepted too).
///
/// A flag left out falls back to the config file (`--config_file`, else the
/// default file), then to the built-in default; a flag given always wins.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct LaunchArgs {
    /// The config file giving defaults (Accelerate's `default_config.yaml`;
    /// `$HF_HOME/accelerate/default_config.yaml` when it exists).
    #[arg(long = "config_file", visible_alias = "config-file")]
    pub config_file: Option<PathBuf>,
    /// Processes in the whole job, over all machines [default: 1].
    #[arg(long = "num_processes", visible_alias = "num-processes")]
    pub num_processes: Option<usize>,
    /// Processes on each machine, torchrun's way of counting them (the job
    /// then has this many per machine, times the machines or `--nnodes`' MAX).
    #[arg(long = "nproc_per_node", visible_alias = "nproc-per-node")]
    pub nproc_per_node: Option<usize>,
    /// Machines taking part [default: 1].
    #[arg(long = "num_machines", visible_alias = "num-machines")]
    pub num_machines: Option<usize>,
    /// This machine's index (0 hosts the rendezvous) [default: 0].
    #[arg(long = "machine_rank", visible_alias = "machine-rank")]
    pub machine_rank: Option<usize>,
    /// Address of machine 0.
    #[arg(long = "main_process_ip", visible_alias = "main-process-ip")]
    pub main_process_ip: Option<String>,
    /// Port of the rendezvous on machine 0 (a free one on a single machine when unset).
    #[arg(long = "main_process_port", visible_alias = "main-process-port")]
    pub main_process_port: Option<u16>,
    /// Precision for every rank, exported as `ACCELERATE_MIXED_PRECISION` (no, fp16, bf16).
    #[arg(long = "mixed_precision", visible_alias = "mixed-precision")]
    pub mixed_precision: Option<String>,
    /// GPUs the ranks may use (`0,1`), exported as `CUDA_VISIBLE_DEVICES`; `all` for every one.
    #[arg(long = "gpu_ids", visible_alias = "gpu-ids")]
    pub gpu_ids: Option<String>,
    /// Train on the CPU (the default config file is then not read, as in Accelerate).
    #[arg(long)]
    pub cpu: bool,
    /// Pin each local rank to its share of a NUMA node's CPUs.
    #[arg(long = "enable_cpu_affinity", visible_alias = "enable-cpu-affinity")]
    pub enable_cpu_affinity: bool,
    /// CPU threads each rank computes with, exported as `OMP_NUM_THREADS` and
    /// `RAYON_NUM_THREADS` (the pool accel-rs' kernels and candle's run on).
    /// Default, as Accelerate: `OMP_NUM_THREADS` when set, else 1; on a CPU job
    /// with `OMP_NUM_THREADS` unset, the physical cores divided among this
    /// machine's ranks when that is more than 1.
    #[arg(
        long = "num_cpu_threads_per_process",
        visible_alias = "num-cpu-threads-per-process"
    )]
    pub num_cpu_threads_per_process: Option<usize>,
    /// Seconds a collective waits for a missing rank before failing.
    #[arg(long)]
    pub timeout: Option<f64>,
    /// Do not prefix output lines with the rank.
    #[arg(long)]
    pub no_prefix: bool,
    /// Times the whole group is started again after a rank fails (each
    /// start sees `TORCHELASTIC_RESTART_COUNT`); 0 fails fast [default: 0].
    /// Across machines with `--rdzv_backend etcd` only.
    #[arg(long = "max_restarts", visible_alias = "max-restarts")]
    pub max_restarts: Option<usize>,
    /// Seconds between the launcher's checks of its ranks [default: 0.1].
    #[arg(long = "monitor_interval", visible_alias = "monitor-interval")]
    pub monitor_interval: Option<f64>,
    /// Seconds the ranks get to save and exit after a SIGTERM or Ctrl-C to
    /// the launcher (passed on to them as SIGTERM) before they are killed; a
    /// second signal kills at once [default: 30].
    #[arg(long = "term_timeout", visible_alias = "term-timeout")]
    pub term_timeout: Option<f64>,
    /// How the machines' launchers meet: `static` (machine 0's store, fixed
    /// machines, no restarts across machines) or `etcd` (torchrun's elastic
    /// rendezvous: rounds agreed through an etcd server, restarts on every
    /// machine, `--nnodes MIN:MAX`) [default: static].
    #[arg(long = "rdzv_backend", visible_alias = "rdzv-backend")]
    pub rdzv_backend: Option<String>,
    /// etcd's client endpoint, `HOST:PORT` [default:
    /// `main_process_ip:main_process_port`, as Accelerate passes it].
    #[arg(long = "rdzv_endpoint", visible_alias = "rdzv-endpoint")]
    pub rdzv_endpoint: Option<String>,
    /// The job's id, the same on every machine [default: none, as torchrun].
    #[arg(long = "rdzv_id", visible_alias = "rdzv-id")]
    pub rdzv_id: Option<String>,
    /// Machines: `N`, or `MIN:MAX` with etcd (a round starts with MIN and
    /// takes up to MAX; `--num_processes` counts the job at MAX machines).
    #[arg(long)]
    pub nnodes: Option<String>,
    /// Seconds a round that has MIN machines waits for more [default: 30].
    #[arg(long = "rdzv_last_call", visible_alias = "rdzv-last-call")]
    pub rdzv_last_call: Option<f64>,
    /// Seconds one rendezvous may take, etcd unreachable included [default: 900].
    #[arg(long = "rdzv_timeout", visible_alias = "rdzv-timeout")]
    pub rdzv_timeout: Option<f64>,
    /// torchrun's rendezvous settings, `KEY=VALUE,...`: `timeout` or
    /// `join_timeout` (as `--rdzv_timeout`), `last_call_timeout` (as
    /// `--rdzv_last_call`), `keep_alive_interval` and `keep_alive_max_attempt`
    /// (a membership lapses after their product); the flags win.
    #[arg(long = "rdzv_conf", visible_alias = "rdzv-conf")]
    pub rdzv_conf: Option<String>,
    /// The address other machines reach this one at with etcd [default: the
    /// one this machine reaches etcd from].
    #[arg(long = "local_addr", visible_alias = "local-addr")]
    pub local_addr: Option<String>,
    /// The program to run, then its arguments.
    #[arg(required = true, trailing_var_arg = true, allow_hyphen_values = true)]
    pub command: Vec<OsString>,
}

impl LaunchArgs {
    /// The config file these flags ask for: `--config_file`, else the default
    /// file when it exists and `--cpu` is not given (Accelerate's rule).
    ///
    /// # Errors
    /// When the file cannot be read or parsed.
    pub fn load_config_file(&self) -> Result<Option<ClusterConfig>> {
        if self.config_file.is_none() && self.cpu {
            return Ok(None);
        }
        ClusterConfig::load_or_default(self.config_file.as_deref())
    }

    /// The launcher settings these flags describe, with `file` filling in the
    /// flags that were not given.
    ///
    /// # Errors
    /// [`Error::Config`] for an unknown precision, a `distributed_type` accel-rs
    /// does not run, or a file that leaves `num_processes` at -1.
    pub fn to_config(&self, file: Option<&ClusterConfig>) -> Result<LaunchConfig> {
        let nnodes_max = self
            .nnodes
            .as_deref()
            .map(crate::launch_rdzv::nnodes)
            .transpose()?
            .map(|(_, max)| max);
        let num_machines = self
            .num_machines
            .or(nnodes_max)
            .or(file.map(|f| f.num_machines))
            .unwrap_or(1);
        let num_processes = match (self.num_processes, file.and_then(|f| f.num_processes)) {
            (Some(n), _) => n,
            // torchrun's way: ranks per machine (below).
            (None, _) if self.nproc_per_node.is_some() => 0,
            (None, Some(n)) if n < 1 => {
                return Err(Error::Config {
                    key: "num_processes".into(),
                    reason: format!("the config file has {n}; pass --num_processes"),
                })
            }
            (None, Some(n)) => n as usize,
            (None, None) => 1,
        };
        let num_processes = match self.nproc_per_node {
            None => num_processes,
            Some(0) => {
                return Err(Error::Config {
                    key: "nproc_per_node".into(),
                    reason: "at least one process per machine".into(),
                })
            }
            Some(per) if self.num_processes.is_some_and(|n| n != per * num_machines) => {
                return Err(Error::Config {
                    key: "nproc_per_node".into(),
                    reason: format!(
                        "{per} per machine on {num_machines} machine(s) is not --num_processes \
                         {num_processes}"
                    ),
                })
            }
            Some(per) => per * num_machines,
        };
        let mut c = LaunchConfig::local(num_processes, self.command[0].clone());
        c.args = self.command[1..].to_vec();
        c.num_machines = num_machines;
        c.machine_rank = self
            .machine_rank
            .or(file.map(|f| f.machine_rank))
            .unwrap_or(0);
        c.main_process_ip = self
            .main_process_ip
            .clone()
            .or_else(|| file.and_then(|f| f.main_process_ip.clone()));
        c.main_process_port = self
            .main_process_port
            .or(file.and_then(|f| f.main_process_port));
        c.cpu = self.cpu || file.is_some_and(|f| f.use_cpu);
        c.timeout = self.timeout.map(Duration::from_secs_f64);
        c.job_token = std::env::var(accel_core::dist::process::ENV_JOB_TOKEN).ok();

        let precision: PrecisionType = match (&self.mixed_precision, file) {
            (Some(p), _) => p.parse()?,
            (None, Some(f)) => f.precision()?.unwrap_or_default(),
            (None, None) => PrecisionType::No,
        };
        c.extra_env
            .push((ENV_MIXED_PRECISION.to_string(), precision.to_string()));
        let gpu_ids = self
            .gpu_ids
            .clone()
            .or_else(|| file.and_then(|f| f.gpu_ids.clone()));
        if let Some(ids) = gpu_ids.filter(|ids| ids != "all") {
            c.extra_env.push(("CUDA_VISIBLE_DEVICES".to_string(), ids));
        }
        if let Some(f) = file {
            if f.debug {
                c.extra_env
                    .push(("ACCELERATE_DEBUG_MODE".to_string(), "true".to_string()));
            }
            if f.distributed_type.eq_ignore_ascii_case("DEEPSPEED") {
                let (env, notes) =
                    crate::config_file::deepspeed_launch_env(f.unused.get("deepspeed_config"))?;
                for n in notes {
                    eprintln!("accel launch: {n}");
                }
                c.extra_env.extend(env);
            } else if f.distributed()? == DistributedType::Fsdp {
                let fsdp = f.fsdp_config.clone().unwrap_or_default();
                c.extra_env.extend(fsdp.launch_env());
            }
        }
        let threads = CpuThreads {
            flag: self.num_cpu_threads_per_process,
            omp_env: std::env::var("OMP_NUM_THREADS").ok(),
            rayon_env_set: std::env::var_os("RAYON_NUM_THREADS").is_some(),
            // A build without CUDA can only train on the CPU.
            cpu_job: c.cpu || !cfg!(any(feature = "cuda", feature = "nccl")),
            local_ranks: (num_processes / c.num_machines.max(1)).max(1),
            physical_cores: num_cpus::get_physical(),
        };
        let (n, rayon) = threads.resolve()?;
        c.extra_env
            .push(("OMP_NUM_THREADS".to_string(), n.to_string()));
        if rayon {
            c.extra_env
                .push(("RAYON_NUM_THREADS".to_string(), n.to_string()));
        }
        if self.enable_cpu_affinity || file.is_some_and(|f| f.enable_cpu_affinity) {
            c.extra_env.push((
                accel_core::dist::affinity::ENV_CPU_AFFINITY.to_string(),
                "1".to_string(),
            ));
        }
        Ok(c)
    }
}

/// What decides the CPU threads of each rank (Accelerate's
/// `--num_cpu_threads_per_process` logic in `_validate_launch_command`).
#[derive(Debug, Clone)]
struct CpuThreads {
    flag: Option<usize>,
    omp_env: Option<String>,
    rayon_env_set: bool,
    cpu_job: bool,
    local_ranks: usize,
    physical_cores: usize,
}

impl CpuThreads {
    /// The thread count, and whether `RAYON_NUM_THREADS` is to be exported
    /// too: always for the flag (it wins), else only when the launcher's
    /// environment does not already set it. Without this every rank sized
    /// its pools to all the machine's cores: 2 ranks on 2 cores ran 4
    /// compute threads (plus candle's spinning pool) on 2 cores.
    ///
    /// # Errors
    /// [`Error::Config`] for `--num_cpu_threads_per_process 0` or an
    /// `OMP_NUM_THREADS` that is not a positive integer.
    fn resolve(&self) -> Result<(usize, bool)> {
        let bad = |key: &str, value: &str| Error::Config {
            key: key.into(),
            reason: format!("{value:?} is not a positive number of threads"),
        };
        if let Some(n) = self.flag {
            if n == 0 {
                return Err(bad("num_cpu_threads_per_process", "0"));
            }
            return Ok((n, true));
        }
        let omp = match &self.omp_env {
            Some(v) => Some(
                v.trim()
                    .parse::<usize>()
                    .ok()
                    .filter(|&n| n > 0)
                    .ok_or_else(|| bad("OMP_NUM_THREADS", v))?,
            ),
            None => None,
        };
        let mut n = omp.unwrap_or(1);
        if self.cpu_job && omp.is_none() {
            let share = self.physical_cores / self.local_ranks.max(1);
            if share > 1 {
                n = share;
                eprintln!(
                    "accel launch: --num_cpu_threads_per_process was set to {n} \
                     ({} physical cores / {} local processes) to improve out-of-box \
                     performance when training on CPUs",
                    self.physical_cores, self.local_ranks
                );
            }
        }
        Ok((n, !self.rayon_env_set))
    }
}

/// Starts the ranks and waits; the error names the first rank that failed.
pub fn launch(args: &LaunchArgs) -> Result<()> {
    let file = args.load_config_file()?;
    let mut config = args.to_config(file.as_ref())?;
    let options = run_options(args, file.as_ref())?;
    match crate::launch_rdzv::elastic(args, file.as_ref(), &mut config)? {
        Some(elastic) => launch::run_elastic(&config, &elastic, &options)?,
        None => launch::run(&launch::plan(&config)?, &options)?,
    }
    Ok(())
}

/// How the launcher runs the plan: the flags, then the config file's keys.
///
/// # Errors
/// [`Error::Config`] for a monitor interval or term timeout that is not a
/// usable number of seconds.
fn run_options(args: &LaunchArgs, file: Option<&ClusterConfig>) -> Result<RunOptions> {
    let mut options = RunOptions {
        prefix_output: !args.no_prefix,
        ..Default::default()
    };
    if let Some(n) = args.max_restarts.or(file.and_then(|f| f.max_restarts)) {
        options.max_restarts = n;
    }
    let monitor = args
        .monitor_interval
        .or(file.and_then(|f| f.monitor_interval));
    if let Some(s) = monitor {
        if !(s.is_finite() && s > 0.0) {
            return Err(Error::Config {
                key: "monitor_interval".into(),
                reason: format!("{s} is not a positive number of seconds"),
            });
        }
        options.monitor_interval = Duration::from_secs_f64(s);
    }
    if let Some(s) = args.term_timeout {
        if !(s.is_finite() && s >= 0.0) {
            return Err(Error::Config {
                key: "term_timeout".into(),
                reason: format!("{s} is not a number of seconds"),
            });
        }
        options.term_timeout = Duration::from_secs_f64(s);
    }
    Ok(options)
}

/// `accel launch FLAGS prog` as parsed, for the tests of this and the
/// rendezvous module.
#[cfg(test)]
pub(crate) fn test_args(flags: &[&str]) -> LaunchArgs {
    use clap::Parser;
    #[derive(Parser)]
    struct Wrap {
        #[command(flatten)]
        a: LaunchArgs,
    }
    let mut argv = vec!["accel"];
    argv.extend_from_slice(flags);
    argv.push("prog");
    Wrap::parse_from(argv).a
}

#[cfg(test)]
mod tests {
    use super::test_args as args;
    use super::*;

    fn file() -> ClusterConfig {
        ClusterConfig {
            distributed_type: "MULTI_GPU".into(),
            num_processes: Some(4),
            num_machines: 2,
            machine_rank: 1,
            main_process_ip: Some("10.0.0.1".into()),
            main_process_port: Some(29500),
            mixed_precision: Some("bf16".into()),
            use_cpu: true,
            gpu_ids: Some("0,1".into()),
            ..ClusterConfig::default()
        }
    }

    fn env<'a>(c: &'a LaunchConfig, k: &str) -> Option<&'a str> {
        c.extra_env
            .iter()
            .find(|(n, _)| n == k)
            .map(|(_, v)| v.as_str())
    }

    #[test]
    fn the_config_file_fills_in_flags_that_were_not_given() -> Result<()> {
        let c = args(&[]).to_config(Some(&file()))?;
        assert_eq!((c.num_processes, c.num_machines, c.machine_rank), (4, 2, 1));
        assert_eq!(c.main_process_ip.as_deref(), Some("10.0.0.1"));
        assert_eq!(c.main_process_port, Some(29500));
        assert!(c.cpu);
        assert_eq!(env(&c, ENV_MIXED_PRECISION), Some("bf16"));
        assert_eq!(env(&c, "CUDA_VISIBLE_DEVICES"), Some("0,1"));
        Ok(())
    }

    #[test]
    fn flags_given_override_the_config_file() -> Result<()> {
        let a = args(&[
            "--num_processes",
            "2",
            "--num_machines",
            "1",
            "--machine_rank",
            "0",
            "--main_process_ip",
            "127.0.0.1",
            "--main_process_port",
            "1234",
            "--mixed_precision",
            "fp16",
            "--gpu_ids",
            "all",
        ]);
        let c = a.to_config(Some(&file()))?;
        assert_eq!((c.num_processes, c.num_machines, c.machine_rank), (2, 1, 0));
        assert_eq!(c.main_process_ip.as_deref(), Some("127.0.0.1"));
        assert_eq!(c.main_process_port, Some(1234));
        assert_eq!(env(&c, ENV_MIXED_PRECISION), Some("fp16"));
        assert_eq!(env(&c, "CUDA_VISIBLE_DEVICES"), None);
        Ok(())
    }

    #[test]
    fn nproc_per_node_counts_as_torchrun_does() {
        let c = args(&["--nproc_per_node", "2", "--nnodes", "3"])
            .to_config(None)
            .unwrap();
        assert_eq!((c.num_processes, c.num_machines), (6, 3));
        let c = args(&["--nproc-per-node", "4"]).to_config(None).unwrap();
        assert_eq!((c.num_processes, c.num_machines), (4, 1));
        for bad in [
            &["--nproc_per_node", "0"][..],
            &[
                "--nproc_per_node",
                "2",
                "--num_machines",
                "2",
                "--num_processes",
                "3",
            ],
        ] {
            let err = args(bad).to_config(None).unwrap_err().to_string();
            assert!(err.contains("nproc_per_node"), "{bad:?}: {err}");
        }
    }

    #[test]
    fn without_a_file_the_built_in_defaults_apply() -> Result<()> {
        let c = args(&[]).to_config(None)?;
        assert_eq!((c.num_processes, c.num_machines, c.machine_rank), (1, 1, 0));
        assert!(!c.cpu && c.main_process_ip.is_none());
        assert_eq!(env(&c, ENV_MIXED_PRECISION), Some("no"));
        Ok(())
    }

    #[test]
    fn unusable_file_values_are_named() {
        let mut f = file();
        f.num_processes = Some(-1);
        let e = args(&[]).to_config(Some(&f)).unwrap_err().to_string();
        assert!(e.contains("num_processes"), "{e}");
        assert!(args(&["--num_processes", "2"]).to_config(Some(&f)).is_ok());
        let mut f = file();
        f.distributed_type = "XLA".into();
        let e = args(&[]).to_config(Some(&f)).unwrap_err().to_string();
        assert!(e.contains("XLA"), "{e}");
        let e = args(&["--mixed_precision", "fp8"])
            .to_config(None)
            .unwrap_err();
        assert!(e.to_string().contains("mixed_precision"), "{e}");
    }

    fn threads(flag: Option<usize>, omp: Option<&str>, cpu_job: bool, ranks: usize) -> CpuThreads {
        CpuThreads {
            flag,
            omp_env: omp.map(str::to_string),
            rayon_env_set: false,
            cpu_job,
            local_ranks: ranks,
            physical_cores: 8,
        }
    }

    #[test]
    fn cpu_threads_follow_accelerates_rule() -> Result<()> {
        // A CPU job without OMP_NUM_THREADS shares the physical cores among local ranks.
        assert_eq!(threads(None, None, true, 2).resolve()?, (4, true));
        assert_eq!(threads(None, None, true, 1).resolve()?, (8, true));
        // ... unless that share is one core or less: then the default, 1.
        assert_eq!(threads(None, None, true, 16).resolve()?, (1, true));
        // A GPU job defaults to 1 (as torchrun and Accelerate do).
        assert_eq!(threads(None, None, false, 2).resolve()?, (1, true));
        // The launcher's OMP_NUM_THREADS wins over the default, the flag over both.
        assert_eq!(threads(None, Some("3"), true, 2).resolve()?, (3, true));
        assert_eq!(threads(Some(5), Some("3"), true, 2).resolve()?, (5, true));
        // A RAYON_NUM_THREADS already set is left alone unless the flag is given.
        let mut t = threads(None, None, true, 2);
        t.rayon_env_set = true;
        assert_eq!(t.resolve()?, (4, false));
        t.flag = Some(2);
        assert_eq!(t.resolve()?, (2, true));
        Ok(())
    }

    #[test]
    fn bad_thread_counts_are_named() {
        let e = threads(Some(0), None, true, 1).resolve().unwrap_err();
        assert!(e.to_string().contains("num_cpu_threads_per_process"), "{e}");
        let e = threads(None, Some("many"), true, 1).resolve().unwrap_err();
        assert!(e.to_string().contains("OMP_NUM_THREADS"), "{e}");
    }

    #[test]
    fn the_thread_count_is_exported_to_every_rank() -> Result<()> {
        let c = args(&["--cpu", "--num_cpu_threads_per_process", "3"]).to_config(None)?;
        assert_eq!(env(&c, "OMP_NUM_THREADS"), Some("3"));
        assert_eq!(env(&c, "RAYON_NUM_THREADS"), Some("3"));
        Ok(())
    }

    #[test]
    fn an_fsdp_file_exports_fsdp_variables() -> Result<()> {
        let mut f = file();
        f.distributed_type = "FSDP".into();
        let c = args(&[]).to_config(Some(&f))?;
        assert_eq!(env(&c, "ACCELERATE_USE_FSDP"), Some("true"));
        // Unset in the file: not exported, so fsdp_reshard_after_forward decides.
        assert_eq!(env(&c, "FSDP_SHARDING_STRATEGY"), None);
        assert_eq!(env(&c, "FSDP_RESHARD_AFTER_FORWARD"), Some("true"));
        let lookup = |k: &str| env(&c, k).map(str::to_string);
        let plugin = accel_core::fsdp::FullyShardedDataParallelPlugin::from_vars(&lookup)?;
        assert_eq!(
            plugin.map(|p| p.sharding_strategy),
            Some(accel_core::dist::fsdp::ShardingStrategy::FullShard)
        );
        Ok(())
    }

    #[test]
    fn restarts_come_from_the_flags_then_the_file() -> Result<()> {
        let mut f = file();
        f.max_restarts = Some(3);
        f.monitor_interval = Some(0.5);
        let o = run_options(&args(&[]), Some(&f))?;
        assert_eq!(
            (o.max_restarts, o.monitor_interval),
            (3, Duration::from_millis(500))
        );
        let o = run_options(
            &args(&["--max_restarts", "1", "--term_timeout", "2"]),
            Some(&f),
        )?;
        assert_eq!(
            (o.max_restarts, o.term_timeout),
            (1, Duration::from_secs(2))
        );
        let o = run_options(&args(&[]), None)?;
        assert_eq!(
            (o.max_restarts, o.term_timeout),
            (0, Duration::from_secs(30))
        );
        let bad = run_options(&args(&["--monitor_interval", "0"]), None).unwrap_err();
        assert!(bad.to_string().contains("monitor_interval"), "{bad}");
        Ok(())
    }
}
