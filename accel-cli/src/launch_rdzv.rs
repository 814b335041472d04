//! `accel launch`'s rendezvous flags (torchrun's `--rdzv_backend`,
//! `--rdzv_endpoint`, `--rdzv_id`, `--nnodes MIN:MAX`): which backend, and
//! for etcd the settings of [`Elastic`].

use std::time::Duration;

use accel_core::dist::launch::{Elastic, LaunchConfig};
use accel_core::{Error, Result};

use crate::config_file::ClusterConfig;
use crate::launch_cmd::LaunchArgs;

/// `--nnodes`: `N` or `MIN:MAX`.
///
/// # Errors
/// [`Error::Config`] naming `nnodes` for anything else.
pub(crate) fn nnodes(value: &str) -> Result<(usize, usize)> {
    let bad = |reason: &str| Error::Config {
        key: "nnodes".into(),
        reason: format!("{value:?}: {reason}"),
    };
    let number = |s: &str| {
        s.trim()
            .parse::<usize>()
            .ok()
            .filter(|&n| n > 0)
            .ok_or_else(|| bad("expected N or MIN:MAX, positive whole numbers"))
    };
    let (min, max) = match value.split_once(':') {
        Some((a, b)) => (number(a)?, number(b)?),
        None => (number(value)?, number(value)?),
    };
    if min > max {
        return Err(bad("MIN is above MAX"));
    }
    Ok((min, max))
}

/// torchrun's `--rdzv_conf` keys that act here.
#[derive(Debug, Default, PartialEq)]
struct RdzvConf {
    timeout: Option<f64>,
    last_call: Option<f64>,
    keep_alive_interval: Option<f64>,
    keep_alive_max_attempt: Option<f64>,
}

/// `KEY=VALUE,...` as torchrun reads `--rdzv-conf`. Keys torchrun's etcd
/// and dynamic rendezvous take that change nothing here are said at start;
/// TLS to etcd and anything else are named errors.
fn rdzv_conf(text: &str) -> Result<RdzvConf> {
    let bad = |reason: String| Error::Config {
        key: "rdzv_conf".into(),
        reason,
    };
    let mut conf = RdzvConf::default();
    for item in text.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let (key, value) = item
            .split_once('=')
            .ok_or_else(|| bad(format!("{item:?} is not KEY=VALUE")))?;
        let number = || {
            value
                .trim()
                .parse::<f64>()
                .ok()
                .filter(|v| v.is_finite() && *v > 0.0)
                .ok_or_else(|| bad(format!("{key}={value:?} is not a positive number")))
        };
        match key.trim() {
            "timeout" | "join_timeout" => conf.timeout = Some(number()?),
            "last_call_timeout" => conf.last_call = Some(number()?),
            "keep_alive_interval" => conf.keep_alive_interval = Some(number()?),
            "keep_alive_max_attempt" => conf.keep_alive_max_attempt = Some(number()?),
            k @ ("read_timeout" | "close_timeout" | "heartbeat" | "is_host" | "store_type") => {
                eprintln!(
                    "accel launch: rdzv_conf {k} has no effect with accel-rs' etcd rendezvous"
                )
            }
            k @ ("protocol" | "cacert" | "cert" | "key" | "ssl_cert" | "ssl_key") => {
                return Err(bad(format!(
                    "{k}: TLS to etcd is not built; reach etcd over plain HTTP inside the \
                     cluster's network"
                )))
            }
            k => return Err(bad(format!("unknown key {k:?}"))),
        }
    }
    Ok(conf)
}

fn seconds(key: &str, value: Option<f64>, default: f64) -> Result<Duration> {
    let s = value.unwrap_or(default);
    if !(s.is_finite() && s >= 0.0) {
        return Err(Error::Config {
            key: key.into(),
            reason: format!("{s} is not a number of seconds"),
        });
    }
    Ok(Duration::from_secs_f64(s))
}

/// The etcd rendezvous these flags ask for, or `None` for the static one.
/// `config` (from [`LaunchArgs::to_config`]) is checked against it.
///
/// # Errors
/// [`Error::Config`] naming the flag: an unknown backend, etcd flags with
/// the static backend, `MIN:MAX` without etcd, no endpoint, a
/// `--num_machines` that is not MAX, processes that do not divide.
pub(crate) fn elastic(
    args: &LaunchArgs,
    file: Option<&ClusterConfig>,
    config: &mut LaunchConfig,
) -> Result<Option<Elastic>> {
    let config_err = |key: &str, reason: String| Error::Config {
        key: key.into(),
        reason,
    };
    let backend = args
        .rdzv_backend
        .clone()
        .or_else(|| file.and_then(|f| f.rdzv_backend.clone()))
        .unwrap_or_else(|| "static".into());
    let etcd = match backend.as_str() {
        "static" => false,
        "etcd" | "etcd-v2" => true,
        "c10d" => {
            // Accelerate's configs often say c10d; its store hosted by an
            // agent is what `static` does here, without restarts across
            // machines.
            eprintln!(
                "accel launch: rdzv_backend: c10d has no effect in accel-rs: the launchers \
                 meet through machine 0's store (static); use etcd for restarts across machines"
            );
            false
        }
        other => {
            return Err(config_err(
                "rdzv_backend",
                format!("{other:?} is not a backend here (static, etcd, c10d)"),
            ))
        }
    };
    let range = args.nnodes.as_deref().map(nnodes).transpose()?;
    if !etcd {
        let flags = [
            ("rdzv_endpoint", args.rdzv_endpoint.is_some()),
            ("rdzv_id", args.rdzv_id.is_some()),
            ("rdzv_last_call", args.rdzv_last_call.is_some()),
            ("rdzv_timeout", args.rdzv_timeout.is_some()),
            ("rdzv_conf", args.rdzv_conf.is_some()),
            ("local_addr", args.local_addr.is_some()),
        ];
        if let Some((flag, _)) = flags.iter().find(|(_, given)| *given) {
            return Err(config_err(
                flag,
                format!("acts only with --rdzv_backend etcd (the backend is {backend})"),
            ));
        }
        if let Some((n, _)) = range.filter(|(n, _)| *n != config.num_machines) {
            return Err(config_err(
                "nnodes",
                format!("{n} differs from --num_machines {}", config.num_machines),
            ));
        }
        if let Some((min, max)) = range.filter(|(a, b)| a != b) {
            return Err(config_err(
                "nnodes",
                format!("{min}:{max} needs --rdzv_backend etcd (a static job has fixed machines)"),
            ));
        }
        return Ok(None);
    }
    let (min, max) = range.unwrap_or((config.num_machines, config.num_machines));
    if config.num_machines != max && args.num_machines.is_some() {
        return Err(config_err(
            "num_machines",
            format!("{} differs from --nnodes' MAX {max}", config.num_machines),
        ));
    }
    if !config.num_processes.is_multiple_of(max) {
        return Err(config_err(
            "num_processes",
            format!(
                "{} is not a multiple of the {max} machines of a full round",
                config.num_processes
            ),
        ));
    }
    let endpoint = match (&args.rdzv_endpoint, &config.main_process_ip) {
        (Some(e), _) => e.clone(),
        // Accelerate gives torchrun `main_process_ip:main_process_port`.
        (None, Some(ip)) => format!(
            "{ip}:{}",
            config
                .main_process_port
                .unwrap_or(accel_core::dist::process::DEFAULT_MASTER_PORT)
        ),
        (None, None) => {
            return Err(config_err(
                "rdzv_endpoint",
                "etcd's address is needed (--rdzv_endpoint HOST:PORT, or main_process_ip and \
                 main_process_port)"
                    .into(),
            ))
        }
    };
    let machine_rank = args.machine_rank.or(file.map(|f| f.machine_rank));
    let conf = args.rdzv_conf.as_deref().map(rdzv_conf).transpose()?;
    let conf = conf.unwrap_or_default();
    let lease_ttl = match (conf.keep_alive_interval, conf.keep_alive_max_attempt) {
        (None, None) => accel_core::dist::launch::DEFAULT_LEASE_TTL,
        // torchrun's dynamic rendezvous defaults: 5 s, 3 attempts.
        (i, n) => Duration::from_secs_f64(i.unwrap_or(5.0) * n.unwrap_or(3.0)),
    };
    Ok(Some(Elastic {
        endpoint,
        job: args.rdzv_id.clone().unwrap_or_else(|| "none".into()),
        min_nodes: min,
        max_nodes: max,
        procs_per_node: config.num_processes / max,
        last_call: seconds(
            "rdzv_last_call",
            args.rdzv_last_call.or(conf.last_call),
            30.0,
        )?,
        timeout: seconds("rdzv_timeout", args.rdzv_timeout.or(conf.timeout), 900.0)?,
        local_addr: args.local_addr.clone(),
        machine_rank,
        lease_ttl,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::launch_cmd::test_args as args;

    fn resolve(flags: &[&str]) -> Result<Option<Elastic>> {
        let a = args(flags);
        let mut c = a.to_config(None)?;
        elastic(&a, None, &mut c)
    }

    #[test]
    fn nnodes_reads_torchruns_forms() {
        assert_eq!(nnodes("2").unwrap(), (2, 2));
        assert_eq!(nnodes("2:3").unwrap(), (2, 3));
        for bad in ["0", "3:2", "a", "1:", ":"] {
            let err = nnodes(bad).unwrap_err().to_string();
            assert!(err.contains("nnodes"), "{bad}: {err}");
        }
    }

    #[test]
    fn etcd_settings_follow_the_flags_and_torchruns_defaults() {
        let e = resolve(&[
            "--num_processes",
            "6",
            "--nnodes",
            "2:3",
            "--machine_rank",
            "1",
            "--rdzv_backend",
            "etcd",
            "--rdzv_endpoint",
            "10.0.0.9:2379",
            "--rdzv_id",
            "job7",
            "--rdzv_last_call",
            "2",
        ])
        .unwrap()
        .unwrap();
        assert_eq!(
            (e.min_nodes, e.max_nodes, e.procs_per_node),
            (2, 3, 2),
            "{e:?}"
        );
        assert_eq!(
            (e.endpoint.as_str(), e.job.as_str()),
            ("10.0.0.9:2379", "job7")
        );
        assert_eq!(e.machine_rank, Some(1));
        assert_eq!(e.last_call, Duration::from_secs(2));
        assert_eq!(e.timeout, Duration::from_secs(900));
        assert_eq!(e.lease_ttl, Duration::from_secs(10));
        // Accelerate's endpoint: the main process's address and port.
        let e = resolve(&[
            "--num_processes",
            "4",
            "--num_machines",
            "2",
            "--main_process_ip",
            "10.0.0.1",
            "--main_process_port",
            "2379",
            "--rdzv_backend",
            "etcd",
        ])
        .unwrap()
        .unwrap();
        assert_eq!(
            (
                e.endpoint.as_str(),
                e.job.as_str(),
                e.min_nodes,
                e.max_nodes
            ),
            ("10.0.0.1:2379", "none", 2, 2)
        );
    }

    #[test]
    fn rdzv_conf_takes_torchruns_keys_and_the_flags_win() {
        let base = [
            "--num_processes",
            "2",
            "--rdzv_backend",
            "etcd",
            "--rdzv_endpoint",
            "h:1",
            "--rdzv_conf",
        ];
        let with = |conf: &str, more: &[&str]| {
            let mut flags = base.to_vec();
            flags.push(conf);
            flags.extend_from_slice(more);
            resolve(&flags)
        };
        let e = with(
            "join_timeout=60, last_call_timeout=5,keep_alive_interval=2,read_timeout=9",
            &[],
        )
        .unwrap()
        .unwrap();
        assert_eq!(
            (e.timeout, e.last_call, e.lease_ttl),
            (
                Duration::from_secs(60),
                Duration::from_secs(5),
                Duration::from_secs(6)
            )
        );
        let e = with("timeout=60", &["--rdzv_timeout", "7"])
            .unwrap()
            .unwrap();
        assert_eq!(e.timeout, Duration::from_secs(7));
        for (conf, said) in [
            ("cacert=/x.pem", "TLS"),
            ("flavour=1", "unknown key"),
            ("timeout", "KEY=VALUE"),
            ("timeout=-1", "positive"),
        ] {
            let err = with(conf, &[]).unwrap_err().to_string();
            assert!(
                err.contains("rdzv_conf") && err.contains(said),
                "{conf}: {err}"
            );
        }
    }

    #[test]
    fn rendezvous_flags_that_cannot_act_are_named() {
        assert!(resolve(&["--num_processes", "2"]).unwrap().is_none());
        let cases: &[(&[&str], &str)] = &[
            (&["--rdzv_backend", "zookeeper"], "rdzv_backend"),
            (&["--rdzv_endpoint", "h:1"], "rdzv_endpoint"),
            (&["--rdzv_id", "j"], "rdzv_id"),
            (&["--nnodes", "1:2", "--num_processes", "2"], "nnodes"),
            (&["--rdzv_backend", "etcd"], "rdzv_endpoint"),
            (
                &[
                    "--rdzv_backend",
                    "etcd",
                    "--rdzv_endpoint",
                    "h:1",
                    "--nnodes",
                    "2:3",
                    "--num_processes",
                    "4",
                ],
                "num_processes",
            ),
            (
                &[
                    "--rdzv_backend",
                    "etcd",
                    "--rdzv_endpoint",
                    "h:1",
                    "--nnodes",
                    "2:3",
                    "--num_machines",
                    "2",
                    "--num_processes",
                    "6",
                ],
                "num_machines",
            ),
        ];
        for (flags, key) in cases {
            let err = resolve(flags).unwrap_err().to_string();
            assert!(err.contains(key), "{flags:?}: {err}");
        }
    }
}
