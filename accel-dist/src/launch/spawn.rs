//! Executing a [`LaunchPlan`]: children, prefixed output, and stopping the
//! job as soon as one rank fails.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::SocketAddr;
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
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
}

impl Default for RunOptions {
    fn default() -> Self {
        Self {
            prefix_output: true,
            grace: Duration::from_secs(5),
        }
    }
}

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

fn describe(status: ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(c), _) => format!("exit status {c}"),
        (None, Some(s)) => format!("signal {s}"),
        _ => status.to_string(),
    }
}

/// Starts every process of `plan` and waits for all of them. When one exits
/// unsuccessfully, the others get SIGTERM, then SIGKILL after `grace`, and
/// the error names the rank that failed first.
pub fn run(plan: &LaunchPlan, options: &RunOptions) -> Result<()> {
    // Ranks lead their own process groups, so a Ctrl-C or SIGTERM aimed at
    // the launcher must be passed on; only the first launch in a process can
    // install the handler, later ones rely on it.
    static INTERRUPTED: AtomicBool = AtomicBool::new(false);
    let _ = ctrlc::set_handler(|| INTERRUPTED.store(true, Ordering::SeqCst));
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
        for (rank, mut child) in running {
            match child.try_wait() {
                Ok(Some(status)) => {
                    if !status.success() && failure.is_none() {
                        failure = Some((rank, status));
                    }
                }
                Ok(None) => still.push((rank, child)),
                Err(_) => still.push((rank, child)),
            }
        }
        running = still;
        let interrupted = INTERRUPTED.load(Ordering::SeqCst);
        if (failure.is_some() || interrupted) && !running.is_empty() {
            stop(&mut running, options.grace);
            running.clear();
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    for p in pumps {
        let _ = p.join();
    }
    if INTERRUPTED.load(Ordering::SeqCst) && failure.is_none() {
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

/// SIGTERM to every child, then SIGKILL to those still alive after `grace`.
fn stop(children: &mut [(usize, Child)], grace: Duration) {
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
        if alive == 0 || Instant::now() >= deadline {
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
}
