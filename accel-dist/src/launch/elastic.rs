//! `accel launch --rdzv_backend etcd`: launchers on several machines that
//! agree on each start of the job through etcd, so that a failed rank
//! anywhere, or a machine lost, restarts the job on every machine (torchrun's
//! elastic agent with its etcd rendezvous).
//!
//! Each start is a round ([`join_round`]): the launchers join it under
//! leases, it closes with `MAX` nodes or `last_call` after `MIN`, and its
//! members (sorted by name, names led by `--machine_rank`) give the node
//! ranks. Node 0 of the round hosts the rendezvous store for the round's
//! ranks on its own address and publishes it under its lease; the others
//! read it. While the ranks run, a watcher thread renews this node's lease
//! and stops the local ranks when another node reports a failed rank or a
//! member's lease lapses. Then every launcher joins the next round, and the
//! ranks see its number as `TORCHELASTIC_RESTART_COUNT` (so they resume from
//! the newest checkpoint). A node that arrives while a round runs with room
//! for it waits under `accel/<job>/waiting/`; the watchers then restart the
//! round to admit it (the ranks get SIGTERM and `--term_timeout` to save the
//! step they are at; such restarts do not count against `--max_restarts`).
//! A job that ends well marks each node done, and the last node deletes the
//! job's keys.
//!
//! etcd is needed to meet, not to run: a round whose etcd dies goes on (the
//! watcher says so once), and a rendezvous retries etcd until
//! `--rdzv_timeout` before failing with the endpoint's name.

use std::net::{IpAddr, SocketAddr, ToSocketAddrs, UdpSocket};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::spawn::{count_signals, interrupted, raise_descriptor_limit, run_once};
use super::{plan, LaunchConfig, RunOptions};
use crate::process::{ENV_JOB_TOKEN, ENV_USE_AGENT_STORE};
use crate::rendezvous::{join_round, waiting_nodes, Etcd, Round, RoundSpec, StoreServer};
use crate::{Error, Result};

/// Where and how the launchers meet (torchrun's `--rdzv-*` and `--nnodes`).
#[derive(Debug, Clone, PartialEq)]
pub struct Elastic {
    /// etcd's client endpoint, `host:port` or a URL.
    pub endpoint: String,
    /// The job's id: every launcher of the job gives the same.
    pub job: String,
    /// Nodes a round needs...
    pub min_nodes: usize,
    /// ...and takes at most.
    pub max_nodes: usize,
    /// Ranks each node starts.
    pub procs_per_node: usize,
    /// How long a round with `min_nodes` waits for more.
    pub last_call: Duration,
    /// How long one rendezvous may take (etcd unreachable included).
    pub timeout: Duration,
    /// The address other nodes reach this one at; by default the one this
    /// machine reaches etcd from.
    pub local_addr: Option<String>,
    /// Leads this node's name, so that node ranks follow it
    /// (`--machine_rank`).
    pub machine_rank: Option<usize>,
    /// A membership expires this long after the node's last renewal
    /// (torchrun's etcd rendezvous keeps workers alive on a 10 s TTL too;
    /// `--rdzv_conf keep_alive_interval=S,keep_alive_max_attempt=N` gives
    /// `S * N`).
    pub lease_ttl: Duration,
}

/// [`Elastic::lease_ttl`]'s default.
pub const DEFAULT_LEASE_TTL: Duration = Duration::from_secs(10);

/// How long an etcd call may take before the launcher moves on.
const CALL_TIMEOUT: Duration = Duration::from_secs(3);
/// Between two looks of the watcher at etcd.
const WATCH_EVERY: Duration = Duration::from_millis(500);

fn prefix(job: &str) -> String {
    format!("accel/{job}/")
}

fn round_key(job: &str, what: &str, round: u64) -> String {
    format!("accel/{job}/{what}/{round}")
}

/// Where the nodes that ended `round` well put their keys.
fn done_prefix(job: &str, round: u64) -> String {
    format!("{}/", round_key(job, "done", round))
}

/// Runs the job elastically: rounds until one ends well, after at most
/// `options.max_restarts` failed ones (rounds restarted to admit waiting
/// nodes do not count).
///
/// # Errors
/// [`Error::Env`] without a job token; [`Error::Etcd`] when etcd stays
/// unreachable for `timeout`; [`Error::RoundTimeout`]; the last round's
/// failure ([`Error::RankFailed`] or [`Error::Stopped`]) once the restarts
/// are spent; [`Error::Interrupted`].
pub fn run_elastic(config: &LaunchConfig, elastic: &Elastic, options: &RunOptions) -> Result<()> {
    count_signals();
    raise_descriptor_limit();
    let token = config
        .job_token
        .clone()
        .filter(|t| !t.is_empty())
        .ok_or_else(|| Error::Env {
            var: ENV_JOB_TOKEN,
            value: String::new(),
            reason: "an etcd rendezvous needs the same job token on every machine (export \
                     ACCEL_JOB_TOKEN=...)"
                .into(),
        })?;
    let etcd = connect(&elastic.endpoint, elastic.timeout)?;
    let host = local_ip(elastic)?;
    let node = match elastic.machine_rank {
        Some(k) => format!("m{k:05}-{host}-{}", std::process::id()),
        None => format!("{host}-{}", std::process::id()),
    };
    let spec = RoundSpec {
        job: elastic.job.clone(),
        node: node.clone(),
        min_nodes: elastic.min_nodes,
        max_nodes: elastic.max_nodes,
        last_call: elastic.last_call,
        timeout: elastic.timeout,
        lease_ttl: elastic.lease_ttl,
    };
    let mut after = None;
    let mut world_before = None;
    let mut failures = 0;
    loop {
        let round = join_retrying(&etcd, &spec, after)?;
        let world = round.members.len() * elastic.procs_per_node;
        eprintln!(
            "accel launch: rendezvous {:?} round {}: node {} of {} ({world} ranks)",
            elastic.job,
            round.number,
            round.rank,
            round.members.len()
        );
        if let Some(before) = world_before.filter(|&w| w != world) {
            eprintln!(
                "accel launch: the world size is now {world} (it was {before}): the data \
                 loaders shard by the new world size"
            );
        }
        world_before = Some(world);
        let outcome = run_round(config, elastic, options, &etcd, &round, (host, &token));
        let admit_key = round_key(&elastic.job, "admit", round.number);
        // A round stopped to admit waiting nodes is not a failure, whatever
        // its ranks' exits (they stop together, after saving).
        let admitting = match outcome {
            Ok(()) => None,
            Err(_) => etcd.get(&admit_key).ok().flatten(),
        };
        let admitting = admitting.map(|e| String::from_utf8_lossy(&e.value).into_owned());
        match outcome {
            Ok(()) => {
                finish(&etcd, round, &node);
                return Ok(());
            }
            Err(Error::RankFailed { .. } | Error::Stopped { .. }) if admitting.is_some() => {
                eprintln!(
                    "accel launch: round {}: {}; restarting to admit them (not counted as a \
                     restart)",
                    round.number,
                    admitting.as_deref().unwrap_or_default()
                );
            }
            Err(Error::RankFailed { rank, status, .. }) => {
                let what = format!("rank {rank} on node {node} failed with {status}");
                let key = round_key(&elastic.job, "failed", round.number);
                // Unreachable etcd: the others learn it from their own ranks.
                let _ = etcd.create(&key, what.as_bytes(), 0);
                eprintln!("accel launch: round {}: {what}", round.number);
            }
            Err(Error::Stopped { reason }) => {
                eprintln!("accel launch: round {}: {reason}", round.number);
            }
            Err(e) => {
                // Interrupted, or the ranks could not start: the others
                // stop at once rather than at their next collective.
                let key = round_key(&elastic.job, "failed", round.number);
                let _ = etcd.create(&key, format!("node {node}: {e}").as_bytes(), 0);
                let _ = round.leave(&etcd);
                return Err(e);
            }
        }
        let number = round.number;
        let done = done_prefix(&elastic.job, number);
        let ended = etcd.get_prefix(&done).map(|d| d.len()).unwrap_or(0);
        let _ = round.leave(&etcd);
        if ended > 0 {
            // Another node's ranks finished the job: no round would start
            // again, and waiting for one would last until --rdzv_timeout.
            return Err(Error::Stopped {
                reason: format!(
                    "round {number} failed here after {ended} node(s) had finished the job"
                ),
            });
        }
        if interrupted() {
            return Err(Error::Interrupted {
                world: elastic.procs_per_node,
            });
        }
        if admitting.is_none() {
            if failures >= options.max_restarts {
                return Err(Error::Stopped {
                    reason: format!(
                        "round {number} failed and the {} restarts are spent",
                        options.max_restarts
                    ),
                });
            }
            failures += 1;
            eprintln!(
                "accel launch: restart {failures} of {}",
                options.max_restarts
            );
        }
        after = Some(number);
    }
}

/// One round: the store, the plan, the ranks under the watcher.
fn run_round(
    config: &LaunchConfig,
    elastic: &Elastic,
    options: &RunOptions,
    etcd: &Etcd,
    round: &Round,
    (host, token): (IpAddr, &str),
) -> Result<()> {
    let store_key = round_key(&elastic.job, "store", round.number);
    // Held until the round's ranks have exited.
    let mut store = None;
    let addr: SocketAddr = if round.rank == 0 {
        let server = StoreServer::bind(SocketAddr::new(host, 0), token)?;
        let addr = server.local_addr();
        etcd.put(&store_key, addr.to_string().as_bytes(), round.lease())?;
        store = Some(server);
        addr
    } else {
        wait_for_store(etcd, &store_key, elastic.timeout, round)?
    };
    let mut c = config.clone();
    c.num_processes = round.members.len() * elastic.procs_per_node;
    c.num_machines = round.members.len();
    c.machine_rank = round.rank;
    c.main_process_ip = Some(addr.ip().to_string());
    c.main_process_port = Some(addr.port());
    c.job_token = Some(token.to_string());
    let mut plan = plan(&c)?;
    for p in &mut plan.processes {
        p.env
            .push((ENV_USE_AGENT_STORE.to_string(), "1".to_string()));
        p.env
            .push(("TORCHELASTIC_RUN_ID".to_string(), elastic.job.clone()));
    }
    let watcher = Watcher::start(etcd.clone(), round.clone(), elastic);
    let outcome = run_once(&plan, options, round.number as usize, &mut || {
        // Failed elsewhere: the ranks are stopped as a failed rank's peers
        // are. Admitting nodes: they get the time a SIGTERM gives them to
        // save the step they are at.
        watcher.reason().map(|stop| match stop {
            Stop::Failed(why) => (why, options.grace),
            Stop::Admit(why) => (why, options.term_timeout),
        })
    });
    watcher.stop();
    drop(store);
    outcome
}

/// The store address node 0 published for this round.
fn wait_for_store(etcd: &Etcd, key: &str, timeout: Duration, round: &Round) -> Result<SocketAddr> {
    let start = Instant::now();
    loop {
        round.keep_alive(etcd)?;
        if let Some(entry) = etcd.get(key)? {
            let text = String::from_utf8_lossy(&entry.value).into_owned();
            return text.parse().map_err(|e| Error::Etcd {
                endpoint: etcd.endpoint().to_string(),
                op: "get",
                key: key.to_string(),
                reason: format!("{text:?} is not a store address: {e}"),
            });
        }
        if start.elapsed() > timeout || !round.lost(etcd)?.is_empty() {
            return Err(Error::Stopped {
                reason: format!(
                    "node 0 of round {} ({}) published no store address within {timeout:?}",
                    round.number, round.members[0]
                ),
            });
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A client of `endpoint`, retried until `timeout`.
fn connect(endpoint: &str, timeout: Duration) -> Result<Etcd> {
    let start = Instant::now();
    loop {
        match Etcd::connect(endpoint, CALL_TIMEOUT) {
            Ok(etcd) => return Ok(etcd),
            Err(e) if start.elapsed() >= timeout => return Err(gave_up(e, timeout)),
            Err(_) => std::thread::sleep(Duration::from_secs(1)),
        }
    }
}

/// [`join_round`], retried while etcd does not answer, until the spec's
/// timeout.
fn join_retrying(etcd: &Etcd, spec: &RoundSpec, after: Option<u64>) -> Result<Round> {
    let start = Instant::now();
    let mut said = false;
    loop {
        let mut left = spec.clone();
        left.timeout = spec.timeout.saturating_sub(start.elapsed());
        match join_round(etcd, &left, after) {
            Err(e @ Error::Etcd { .. }) if start.elapsed() >= spec.timeout => {
                return Err(gave_up(e, spec.timeout))
            }
            Err(e @ Error::Etcd { .. }) => {
                if !said {
                    eprintln!("accel launch: {e}; retrying until --rdzv_timeout");
                    said = true;
                }
                std::thread::sleep(Duration::from_secs(1));
            }
            other => return other,
        }
    }
}

fn gave_up(e: Error, timeout: Duration) -> Error {
    match e {
        Error::Etcd {
            endpoint,
            op,
            key,
            reason,
        } => Error::Etcd {
            endpoint,
            op,
            key,
            reason: format!("{reason} (tried for {timeout:?}, --rdzv_timeout)"),
        },
        other => other,
    }
}

/// The address this node's store listens on: `--local_addr`, else the one
/// this machine reaches etcd from (a UDP socket connected towards etcd
/// sends nothing, but the kernel picks its route and source address).
fn local_ip(elastic: &Elastic) -> Result<IpAddr> {
    let resolve = |what: &str, target: &str| -> Result<SocketAddr> {
        target
            .to_socket_addrs()
            .ok()
            .and_then(|mut a| a.next())
            .ok_or_else(|| Error::Env {
                var: if what == "local" {
                    "local_addr"
                } else {
                    "rdzv_endpoint"
                },
                value: target.to_string(),
                reason: "not an address this machine resolves".into(),
            })
    };
    if let Some(a) = &elastic.local_addr {
        return Ok(resolve("local", &format!("{a}:0"))?.ip());
    }
    let host_port = elastic
        .endpoint
        .split("://")
        .last()
        .unwrap_or_default()
        .trim_end_matches('/');
    let etcd = resolve("etcd", host_port)?;
    let any: SocketAddr = match etcd {
        SocketAddr::V4(_) => ([0, 0, 0, 0], 0).into(),
        SocketAddr::V6(_) => (std::net::Ipv6Addr::UNSPECIFIED, 0).into(),
    };
    UdpSocket::bind(any)
        .and_then(|s| s.connect(etcd).and_then(|_| s.local_addr()))
        .map(|a| a.ip())
        .map_err(|e| {
            Error::io(
                format!("finding the address that reaches etcd at {etcd}"),
                e,
            )
        })
}

/// The end of a round that went well: this node is done; the last node
/// done deletes the job's keys. Failures here change nothing for the job.
fn finish(etcd: &Etcd, round: Round, node: &str) {
    let done = done_prefix(round.job(), round.number);
    let _ = etcd.put(&format!("{done}{node}"), b"", 0);
    let members = round.members.len();
    let job = round.job().to_string();
    let _ = round.leave(etcd);
    if etcd.get_prefix(&done).is_ok_and(|d| d.len() >= members) {
        let _ = etcd.delete_prefix(&prefix(&job));
    }
}

/// Why a running round stops.
#[derive(Debug, Clone, PartialEq)]
enum Stop {
    /// A rank failed, or a member was lost.
    Failed(String),
    /// Nodes wait to join and the round has room: restart with them.
    Admit(String),
}

/// Renews this node's lease and watches the round while its ranks run; a
/// thread of its own, as an etcd call may take [`CALL_TIMEOUT`].
struct Watcher {
    reason: Arc<Mutex<Option<Stop>>>,
    done: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Watcher {
    fn start(etcd: Etcd, round: Round, elastic: &Elastic) -> Self {
        let reason = Arc::new(Mutex::new(None));
        let done = Arc::new(AtomicBool::new(false));
        let (r, d) = (reason.clone(), done.clone());
        let (job, max_nodes, ttl) = (elastic.job.clone(), elastic.max_nodes, elastic.lease_ttl);
        let thread = std::thread::spawn(move || {
            let mut etcd_lost = false;
            while !d.load(Ordering::SeqCst) {
                match look(&etcd, &round, (&job, max_nodes, ttl)) {
                    Ok(None) => etcd_lost = false,
                    Ok(Some(why)) => {
                        *r.lock().unwrap_or_else(|e| e.into_inner()) = Some(why);
                        return;
                    }
                    Err(e) if !etcd_lost => {
                        eprintln!("accel launch: {e}; the running round goes on without etcd");
                        etcd_lost = true;
                    }
                    Err(_) => {}
                }
                std::thread::sleep(WATCH_EVERY);
            }
        });
        Self {
            reason,
            done,
            thread: Some(thread),
        }
    }

    fn reason(&self) -> Option<Stop> {
        self.reason
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    fn stop(mut self) {
        self.done.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// One look: renew the lease; a reason to stop when another node failed,
/// a member's membership lapsed (one that ended well is not lost), or nodes
/// wait to join a round that has room for them.
fn look(
    etcd: &Etcd,
    round: &Round,
    (job, max_nodes, ttl): (&str, usize, Duration),
) -> Result<Option<Stop>> {
    if etcd.renew(round.lease())?.is_none() {
        return Ok(Some(Stop::Failed(format!(
            "this node's membership of round {} lapsed (etcd at {} did not hear from it for \
             {ttl:?}); the others restart without it",
            round.number,
            etcd.endpoint()
        ))));
    }
    if let Some(failed) = etcd.get(&round_key(job, "failed", round.number))? {
        let why = String::from_utf8_lossy(&failed.value).into_owned();
        return Ok(Some(Stop::Failed(why)));
    }
    let admit = round_key(job, "admit", round.number);
    if let Some(entry) = etcd.get(&admit)? {
        let why = String::from_utf8_lossy(&entry.value).into_owned();
        return Ok(Some(Stop::Admit(why)));
    }
    if round.members.len() < max_nodes {
        let waiting = waiting_nodes(etcd, job)?;
        if !waiting.is_empty() {
            let why = format!(
                "node(s) {waiting:?} wait to join round {} of {} nodes (up to {max_nodes})",
                round.number,
                round.members.len()
            );
            etcd.create(&admit, why.as_bytes(), 0)?;
            return Ok(Some(Stop::Admit(why)));
        }
    }
    let lost = round.lost(etcd)?;
    if lost.is_empty() {
        return Ok(None);
    }
    let under = done_prefix(job, round.number);
    let done = etcd.get_prefix(&under)?;
    let lost: Vec<&String> = lost
        .iter()
        .filter(|m| !done.iter().any(|d| d.key[under.len()..] == ***m))
        .collect();
    Ok((!lost.is_empty()).then(|| {
        Stop::Failed(format!(
            "node(s) {lost:?} of round {} lost: membership lapsed (no renewal for {ttl:?})",
            round.number
        ))
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_store_address_is_the_one_that_reaches_etcd() {
        let e = |endpoint: &str, local: Option<&str>| Elastic {
            endpoint: endpoint.into(),
            job: "j".into(),
            min_nodes: 1,
            max_nodes: 1,
            procs_per_node: 1,
            last_call: Duration::ZERO,
            timeout: Duration::ZERO,
            local_addr: local.map(String::from),
            machine_rank: None,
            lease_ttl: DEFAULT_LEASE_TTL,
        };
        let loopback: IpAddr = [127, 0, 0, 1].into();
        assert_eq!(local_ip(&e("127.0.0.1:2379", None)).unwrap(), loopback);
        assert_eq!(
            local_ip(&e("http://127.0.0.1:2379/", None)).unwrap(),
            loopback
        );
        assert_eq!(
            local_ip(&e("127.0.0.1:2379", Some("127.0.0.2"))).unwrap(),
            IpAddr::from([127, 0, 0, 2])
        );
        let err = local_ip(&e("no.such.host.invalid:2379", None))
            .unwrap_err()
            .to_string();
        assert!(err.contains("rdzv_endpoint"), "{err}");
    }
}
