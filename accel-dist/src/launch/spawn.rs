//! Executing a [`LaunchPlan`]: children, prefixed output, stopping the job
//! as soon as one rank fails, and restarting the whole group up to
//! `max_restarts` times (torchrun's and Accelerate's `--max_restarts`).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::SocketAddr;
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

use super::LaunchPlan;
use crate::process::{ENV_JOB_TOKEN, ENV_MASTER_PORT};
use crate::rendezvous::StoreServer;
use crate::{Error, Result};

/// How a plan runs.
#[derive(Debug, Clone)]
pub struct RunOptions {
    /// Prefix each output line with `[rank N]`.
    pub prefix_output: bool,
    /// Time the other ranks get after SIGTERM before SIGKILL, once one failed.
    pub grace: Duration,
    /// Times the whole group is started again after a rank failed (0: fail
    /// fast). Each start sees `TORCHELASTIC_RESTART_COUNT`.
    pub max_restarts: usize,
    /// How often the launcher checks its ranks (torchrun's
    /// `--monitor-interval`).
    pub monitor_interval: Duration,
    /// On SIGTERM or Ctrl-C to the launcher, how long the ranks (sent
    /// SIGTERM) get to save and exit before SIGKILL; a second signal kills
    /// at once.
    pub term_timeout: Duration,
}

impl Default for RunOptions {
    fn default() -> Self {
        Self {
            prefix_output: true,
            grace: Duration::from_secs(5),
            max_restarts: 0,
            monitor_interval: Duration::from_millis(100),
            term_timeout: Duration::from_secs(30),
        }
    }
}

/// The restart number of this start, as torchrun sets it for every rank.
pub const ENV_RESTART_COUNT: &str = "TORCHELASTIC_RESTART_COUNT";
/// The restarts the launcher allows, as torchrun sets it.
pub const ENV_MAX_RESTARTS: &str = "TORCHELASTIC_MAX_RESTARTS";

/// Copies a child's stream line by line, prefixed, into ours; lines of one
/// rank never interleave mid-line with another's.
fn pump<R: Read + Send + 'static>(
    src: R,
    prefix: String,
    dst: Arc<Mutex<dyn Write + Send>>,
) -> JoinHandle<()> {
    std::thread::spawn(move || {
        let mut reader = BufReader::new(src);
        let mut line = Vec::new();
        loop {
            line.clear();
            match reader.read_until(b'\n', &mut line) {
                Ok(0) | Err(_) => break,
                Ok(_) => {
                    let mut out = dst.lock().unwrap_or_else(|e| e.into_inner());
                    let _ = out.write_all(prefix.as_bytes());
                    let _ = out.write_all(&line);
                    if !line.ends_with(b"\n") {
                        let _ = out.write_all(b"\n");
                    }
                    let _ = out.flush();
                }
            }
        }
    })
}

/// Of the ranks found failed in one poll, the one that most likely failed
/// first: a rank killed by a signal (its peers then lose their connections
/// and exit with an error, often before the launcher looks again), else the
/// lowest rank.
fn root_cause(failed: Vec<(usize, ExitStatus)>) -> Option<(usize, ExitStatus)> {
    use std::os::unix::process::ExitStatusExt;
    failed
        .into_iter()
        .min_by_key(|(rank, status)| (status.signal().is_none(), *rank))
}

fn describe(status: ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(c), _) => format!("exit status {c}"),
        (None, Some(s)) => format!("signal {s}"),
        _ => status.to_string(),
    }
}

/// Termination signals the launcher received. Ranks lead their own process
/// groups, so a Ctrl-C or SIGTERM aimed at the launcher must be passed on;
/// only the first launch in a process can install the handler, later ones
/// rely on it.
static SIGNALS: AtomicUsize = AtomicUsize::new(0);

pub(super) fn interrupted() -> bool {
    SIGNALS.load(Ordering::SeqCst) > 0
}

/// Counts Ctrl-C and SIGTERM to the launcher (see [`SIGNALS`]).
pub(super) fn count_signals() {
    let _ = ctrlc::set_handler(|| {
        SIGNALS.fetch_add(1, Ordering::SeqCst);
    });
}

/// Starts every process of `plan` and waits for all of them. When one exits
/// unsuccessfully, the others get SIGTERM, then SIGKILL after `grace`; then
/// the group starts again, up to `max_restarts` times, each time with a
/// fresh rendezvous (the launcher's store is bound anew). The error names
/// the rank that failed first in the last start.
///
/// # Errors
/// [`Error::RankFailed`] once the restarts are spent, [`Error::Interrupted`]
/// on Ctrl-C or SIGTERM (never followed by a restart), [`Error::Env`] when
/// restarts are asked of a job spanning machines (the group restart needs
/// the launchers of all machines to agree, which is not built yet).
pub fn run(plan: &LaunchPlan, options: &RunOptions) -> Result<()> {
    count_signals();
    if options.max_restarts > 0 && !plan.agent_store {
        return Err(Error::Env {
            var: "max_restarts",
            value: options.max_restarts.to_string(),
            reason: "restarts need a single-machine job whose launcher hosts the rendezvous \
                     (no --main_process_port), or --rdzv_backend etcd across machines"
                .into(),
        });
    }
    raise_descriptor_limit();
    let mut restart = 0;
    loop {
        match run_once(plan, options, restart, &mut || None) {
            Err(Error::RankFailed { rank, status, .. })
                if restart < options.max_restarts && !interrupted() =>
            {
                restart += 1;
                eprintln!(
                    "accel launch: rank {rank} failed with {status}; stopped the other ranks; \
                     restart {restart} of {}",
                    options.max_restarts
                );
            }
            other => return other,
        }
    }
}

/// One start of the group: [`run`] without restarts; `restart` is this
/// start's number. `watch`, asked at every look at the ranks, stops them
/// all when it gives a reason (a rank of another machine failed), with the
/// time they get between SIGTERM and SIGKILL.
pub(super) fn run_once(
    plan: &LaunchPlan,
    options: &RunOptions,
    restart: usize,
    watch: &mut dyn FnMut() -> Option<(String, Duration)>,
) -> Result<()> {
    let stdout: Arc<Mutex<dyn Write + Send>> = Arc::new(Mutex::new(std::io::stdout()));
    let stderr: Arc<Mutex<dyn Write + Send>> = Arc::new(Mutex::new(std::io::stderr()));
    let mut children: Vec<(usize, Child)> = vec![];
    let mut pumps = vec![];
    // Held until every rank has exited (see `LaunchPlan::agent_store`).
    let store = match plan.agent_store {
        true => Some(agent_store(plan)?),
        false => None,
    };
    for p in &plan.processes {
        let mut cmd = Command::new(&plan.program);
        cmd.args(&plan.args).envs(p.env.iter().map(|(k, v)| (k, v)));
        cmd.env(ENV_RESTART_COUNT, restart.to_string())
            .env(ENV_MAX_RESTARTS, options.max_restarts.to_string());
        if let Some(s) = &store {
            cmd.env(ENV_MASTER_PORT, s.local_addr().port().to_string());
        }
        // Each rank leads its own process group so stopping it also stops
        // whatever it started (a wrapper script's children would otherwise
        // live on and keep its output pipes open).
        cmd.process_group(0);
        if options.prefix_output {
            cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
        }
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) => {
                stop(&mut children, options.grace);
                return Err(Error::Io {
                    context: format!("starting {}", plan.program.to_string_lossy()),
                    source: e,
                });
            }
        };
        if options.prefix_output {
            let prefix = format!("[rank{}]: ", p.rank);
            if let Some(out) = child.stdout.take() {
                pumps.push(pump(out, prefix.clone(), stdout.clone()));
            }
            if let Some(err) = child.stderr.take() {
                pumps.push(pump(err, prefix, stderr.clone()));
            }
        }
        children.push((p.rank, child));
    }

    let mut failure: Option<(usize, ExitStatus)> = None;
    let mut running: Vec<(usize, Child)> = children;
    while !running.is_empty() {
        let mut still = vec![];
        let mut failed_now = vec![];
        for (rank, mut child) in running {
            match child.try_wait() {
                Ok(Some(status)) if !status.success() => failed_now.push((rank, status)),
                Ok(Some(_)) => {}
                Ok(None) | Err(_) => still.push((rank, child)),
            }
        }
        if failure.is_none() {
            failure = root_cause(failed_now);
        }
        running = still;
        if interrupted() && !running.is_empty() {
            // Passed on as SIGTERM: the ranks save at their next step
            // boundary (`Accelerator::should_stop`) and exit.
            stop_on_signal(&mut running, options.term_timeout);
            running.clear();
            break;
        }
        if failure.is_some() && !running.is_empty() {
            stop(&mut running, options.grace);
            running.clear();
            break;
        }
        if failure.is_none() && !running.is_empty() {
            if let Some((reason, grace)) = watch() {
                stop(&mut running, grace);
                for p in pumps {
                    let _ = p.join();
                }
                return Err(Error::Stopped { reason });
            }
        }
        std::thread::sleep(options.monitor_interval);
    }
    for p in pumps {
        let _ = p.join();
    }
    if interrupted() && failure.is_none() {
        return Err(Error::Interrupted {
            world: plan.processes.len(),
        });
    }
    match failure {
        None => Ok(()),
        Some((rank, status)) => Err(Error::RankFailed {
            rank,
            status: describe(status),
            world: plan.processes.len(),
        }),
    }
}

/// Raises the soft limit on open files to the hard one (capped at 2^20), as
/// the launcher's store holds one descriptor per client; the ranks inherit it.
pub(super) fn raise_descriptor_limit() {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    let Ok((soft, hard)) = getrlimit(Resource::RLIMIT_NOFILE) else {
        return;
    };
    let want = hard.min(1 << 20);
    if soft < want {
        if let Err(e) = setrlimit(Resource::RLIMIT_NOFILE, want, hard) {
            tracing::debug!(error = %e, soft, want, "could not raise the open-file limit");
        }
    }
}

/// The launcher's rendezvous store on a free loopback port, serving the
/// job's token.
fn agent_store(plan: &LaunchPlan) -> Result<StoreServer> {
    let token = plan
        .processes
        .first()
        .and_then(|p| p.env.iter().find(|(k, _)| k == ENV_JOB_TOKEN))
        .map(|(_, v)| v.as_str())
        .unwrap_or_default();
    StoreServer::bind(SocketAddr::from(([127, 0, 0, 1], 0)), token)
}

/// SIGTERM to every child, then SIGKILL to those still alive after
/// `timeout` or at a second signal to the launcher.
fn stop_on_signal(children: &mut [(usize, Child)], timeout: Duration) {
    eprintln!(
        "accel launch: termination signal; passing SIGTERM to every rank ({} s to save and exit; \
         a second signal kills)",
        timeout.as_secs_f64()
    );
    terminate(children, timeout, || SIGNALS.load(Ordering::SeqCst) >= 2);
}

/// SIGTERM to every child, then SIGKILL to those still alive after `grace`.
pub(super) fn stop(children: &mut [(usize, Child)], grace: Duration) {
    terminate(children, grace, || false);
}

/// SIGTERM to every child, then SIGKILL to those still alive after `grace`
/// or once `now` says so.
fn terminate(children: &mut [(usize, Child)], grace: Duration, now: impl Fn() -> bool) {
    // A negative pid addresses the child's whole process group.
    let group = |c: &Child| Pid::from_raw(-(c.id() as i32));
    for (_, c) in children.iter() {
        let _ = kill(group(c), Signal::SIGTERM);
    }
    let deadline = Instant::now() + grace;
    loop {
        let alive = children
            .iter_mut()
            .filter_map(|(_, c)| c.try_wait().ok())
            .filter(Option::is_none)
            .count();
        if alive == 0 || Instant::now() >= deadline || now() {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    for (_, c) in children.iter_mut() {
        // SIGKILL the group even when the leader is gone: its children may live on.
        let _ = kill(group(c), Signal::SIGKILL);
        let _ = c.wait();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::launch::{plan, LaunchConfig};

    #[test]
    fn ranks_of_a_single_machine_job_reach_the_launchers_store() {
        // Each rank checks that it was told to use the agent store and that
        // a store answering the job's token listens on MASTER_PORT (bash's
        // /dev/tcp connects; a refused port fails the rank).
        let mut c = LaunchConfig::local(2, "bash");
        c.args = vec![
            "-c".into(),
            "test \"$ACCEL_USE_AGENT_STORE\" = 1 && test \"$MASTER_PORT\" -gt 0 \
             && exec 3<>/dev/tcp/127.0.0.1/$MASTER_PORT"
                .into(),
        ];
        let p = plan(&c).unwrap();
        let options = RunOptions {
            prefix_output: false,
            ..Default::default()
        };
        run(&p, &options).unwrap();
    }

    /// A 2-rank plan of `bash -c script`, quiet, restarting up to `max`.
    fn bash_job(script: &str, max: usize) -> (LaunchPlan, RunOptions) {
        let mut c = LaunchConfig::local(2, "bash");
        c.args = vec!["-c".into(), script.into()];
        let options = RunOptions {
            prefix_output: false,
            max_restarts: max,
            monitor_interval: Duration::from_millis(10),
            grace: Duration::from_secs(2),
            ..Default::default()
        };
        (plan(&c).unwrap(), options)
    }

    #[test]
    fn a_failed_rank_restarts_the_whole_group_with_the_restart_count() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("starts");
        // Rank 1 fails on the first start; every start of every rank is
        // logged with the variables torchrun sets.
        let script = format!(
            "echo \"$RANK $TORCHELASTIC_RESTART_COUNT $TORCHELASTIC_MAX_RESTARTS\" >> {log}; \
             test \"$RANK$TORCHELASTIC_RESTART_COUNT\" != 10",
            log = log.display()
        );
        let (p, options) = bash_job(&script, 1);
        run(&p, &options).unwrap();
        let mut starts: Vec<String> = std::fs::read_to_string(&log)
            .unwrap()
            .lines()
            .map(String::from)
            .collect();
        starts.sort();
        assert_eq!(starts, ["0 0 1", "0 1 1", "1 0 1", "1 1 1"]);
    }

    #[test]
    fn restarts_stop_after_max_with_the_last_failure_and_zero_fails_fast() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("starts");
        let script = format!(
            "echo $TORCHELASTIC_RESTART_COUNT >> {log}; test $RANK = 0 || exit 3",
            log = log.display()
        );
        for (max, starts) in [(0, 1), (2, 3)] {
            let _ = std::fs::remove_file(&log);
            let (p, options) = bash_job(&script, max);
            let err = run(&p, &options).unwrap_err().to_string();
            assert!(err.contains("rank 1 failed with exit status 3"), "{err}");
            // Rank 1 starts once per start of the group (rank 0 too).
            let lines = std::fs::read_to_string(&log).unwrap();
            assert_eq!(lines.lines().count(), 2 * starts, "max {max}: {lines}");
            assert!(lines.contains(&(starts - 1).to_string()));
        }
    }

    #[test]
    fn a_killed_rank_is_named_over_the_peer_that_exited_after_it() {
        // Both ranks are gone by the launcher's second look: rank 1 killed
        // (SIGKILL), rank 0 exiting with an error just after, as a rank
        // whose peer's connection closed does. Rank 1 is the cause.
        let (p, mut options) = bash_job(
            "if [ $RANK = 1 ]; then kill -9 $$; else sleep 0.2; exit 1; fi",
            0,
        );
        options.monitor_interval = Duration::from_secs(2);
        let err = run(&p, &options).unwrap_err().to_string();
        assert!(err.contains("rank 1 failed with signal 9"), "{err}");
    }

    #[test]
    fn restarts_across_machines_are_refused_at_start() {
        let mut c = LaunchConfig::local(2, "true");
        c.num_machines = 2;
        c.main_process_ip = Some("127.0.0.1".into());
        c.main_process_port = Some(29555);
        c.job_token = Some("t".into());
        let p = plan(&c).unwrap();
        let options = RunOptions {
            max_restarts: 1,
            ..Default::default()
        };
        let err = run(&p, &options).unwrap_err().to_string();
        assert!(err.contains("max_restarts"), "{err}");
    }
}
