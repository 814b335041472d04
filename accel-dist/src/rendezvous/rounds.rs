//! Rounds of a job's launchers, agreed through etcd: who is in a round and
//! which node each one is, with a lease per node so that a dead machine's
//! membership expires (torchrun's etcd rendezvous, simplified).
//!
//! One key per job, `accel/<job>/state`, holds `{"round", "open", "members"}`
//! and changes only by compare-and-swap at the revision read, so racing
//! launchers never both win. A node joins the open round by appending itself
//! (after it has put its alive key under its lease); the round closes when
//! `max` nodes are in, or `last_call` after this node saw `min` of them; the
//! members' order is the nodes' order (node rank = index). A node that ran
//! round `k` asks for a round after `k` (a restart): the first one to ask
//! opens round `k + 1`. A member whose alive key is gone (its lease lapsed:
//! the machine died) is dropped from an open round, and named by
//! [`Round::lost`] while the round runs. A node that arrives while a round
//! runs waits for the next, and puts `accel/<job>/waiting/<node>` under its
//! lease meanwhile ([`waiting`]), so that the running round's launchers can
//! restart it to admit the node (torchrun's scale-up).

use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::Etcd;
use crate::{Error, Result};

/// What a node asks of a round.
#[derive(Debug, Clone)]
pub struct RoundSpec {
    /// The job's id (`--rdzv_id`): the key prefix.
    pub job: String,
    /// This node's name, unique in the job (a host name, or host and pid).
    pub node: String,
    /// A round starts with at least this many nodes...
    pub min_nodes: usize,
    /// ...and at most this many.
    pub max_nodes: usize,
    /// How long a round with `min_nodes` waits for more (`--rdzv_last_call`).
    pub last_call: Duration,
    /// How long joining may take in all.
    pub timeout: Duration,
    /// The lease of this node's membership: it expires this long after the
    /// node's last renewal.
    pub lease_ttl: Duration,
}

/// The state key's value.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct State {
    round: u64,
    open: bool,
    members: Vec<String>,
}

/// A closed round this node is a member of.
#[derive(Debug, Clone)]
pub struct Round {
    /// The round's number, from 0.
    pub number: u64,
    /// Its members, in node-rank order.
    pub members: Vec<String>,
    /// This node's rank.
    pub rank: usize,
    lease: i64,
    job: String,
}

/// Between two reads of the state.
const POLL: Duration = Duration::from_millis(100);

fn state_key(job: &str) -> String {
    format!("accel/{job}/state")
}

fn alive_key(job: &str, round: u64, node: &str) -> String {
    format!("accel/{job}/alive/{round}/{node}")
}

fn waiting_prefix(job: &str) -> String {
    format!("accel/{job}/waiting/")
}

fn waiting_key(job: &str, node: &str) -> String {
    format!("{}{node}", waiting_prefix(job))
}

/// The nodes waiting to join `job` while a round runs without them (their
/// keys live under their leases: a waiting node that died drops out).
///
/// # Errors
/// [`Error::Etcd`].
pub fn waiting(etcd: &Etcd, job: &str) -> Result<Vec<String>> {
    let prefix = waiting_prefix(job);
    Ok(etcd
        .get_prefix(&prefix)?
        .into_iter()
        .map(|e| e.key[prefix.len()..].to_string())
        .collect())
}

/// Joins a round of `spec.job`: the open one, or after round `after` (the
/// one this node ran last) a newer one. Returns once the round has closed
/// with this node in it.
///
/// # Errors
/// [`Error::Etcd`]; [`Error::RoundTimeout`] when no round took this node
/// within `spec.timeout`; [`Error::RoundSettings`] for `min > max` or 0.
pub fn join(etcd: &Etcd, spec: &RoundSpec, after: Option<u64>) -> Result<Round> {
    if spec.min_nodes == 0 || spec.min_nodes > spec.max_nodes {
        return Err(Error::RoundSettings {
            job: spec.job.clone(),
            reason: format!(
                "{}:{} nodes (MIN:MAX needs 1 <= MIN <= MAX)",
                spec.min_nodes, spec.max_nodes
            ),
        });
    }
    let key = state_key(&spec.job);
    let lease = etcd.grant(spec.lease_ttl)?;
    let started = Instant::now();
    let mut min_since: Option<(u64, Instant)> = None;
    let mut waiting_said = false;
    let mut last_seen = None;
    loop {
        if started.elapsed() > spec.timeout {
            return Err(Error::RoundTimeout {
                job: spec.job.clone(),
                node: spec.node.clone(),
                waited: spec.timeout,
                state: last_seen.map_or("no round".into(), |s: State| {
                    format!(
                        "round {} {} with {:?} (at least {} needed)",
                        s.round,
                        if s.open { "open" } else { "running" },
                        s.members,
                        spec.min_nodes
                    )
                }),
            });
        }
        etcd.keep_alive(lease)?;
        let Some(entry) = etcd.get(&key)? else {
            let first = State {
                round: after.map_or(0, |a| a + 1),
                open: true,
                members: Vec::new(),
            };
            etcd.create(&key, &encode(&first), 0)?;
            continue;
        };
        let state: State = serde_json::from_slice(&entry.value).map_err(|e| Error::Etcd {
            endpoint: etcd.endpoint().to_string(),
            op: "join",
            key: key.clone(),
            reason: format!("not a round's state: {e}"),
        })?;
        last_seen = Some(state.clone());
        let swap = |next: &State| etcd.swap(&key, entry.mod_revision, &encode(next), 0);
        if after.is_some_and(|a| state.round <= a) {
            // A restart: the first node to ask opens the next round.
            let next = State {
                round: after.unwrap_or(0) + 1,
                open: true,
                members: Vec::new(),
            };
            swap(&next)?;
            continue;
        }
        let me = state.members.iter().position(|m| *m == spec.node);
        if !state.open {
            if let Some(rank) = me {
                return Ok(Round {
                    number: state.round,
                    members: state.members,
                    rank,
                    lease,
                    job: spec.job.clone(),
                });
            }
            if live_members(etcd, &spec.job, &state)?.is_empty() {
                // Every member of the last round is gone (a job that died
                // whole, or ended without cleaning up): a new round.
                swap(&State {
                    round: state.round + 1,
                    open: true,
                    members: Vec::new(),
                })?;
                continue;
            }
            // A round runs without this node: wait for the next one, and
            // say so (the running round's launchers may restart to admit it).
            if !waiting_said {
                etcd.put(&waiting_key(&spec.job, &spec.node), b"", lease)?;
                waiting_said = true;
            }
            std::thread::sleep(POLL);
            continue;
        }
        let Some(_) = me else {
            if state.members.len() < spec.max_nodes {
                if waiting_said {
                    etcd.delete(&waiting_key(&spec.job, &spec.node))?;
                    waiting_said = false;
                }
                etcd.put(&alive_key(&spec.job, state.round, &spec.node), b"", lease)?;
                let mut next = state.clone();
                next.members.push(spec.node.clone());
                swap(&next)?;
            } else {
                std::thread::sleep(POLL);
            }
            continue;
        };
        // A member of the open round: drop members that died, close when full
        // or when the last call is over.
        let alive = live_members(etcd, &spec.job, &state)?;
        if alive.len() < state.members.len() {
            let mut next = state.clone();
            next.members.retain(|m| alive.contains(m));
            swap(&next)?;
            continue;
        }
        let n = state.members.len();
        let since = match min_since {
            Some((round, since)) if round == state.round && n >= spec.min_nodes => Some(since),
            _ if n >= spec.min_nodes => {
                let now = Instant::now();
                min_since = Some((state.round, now));
                Some(now)
            }
            _ => {
                min_since = None;
                None
            }
        };
        let close = n >= spec.max_nodes || since.is_some_and(|s| s.elapsed() >= spec.last_call);
        if close {
            let mut next = state.clone();
            next.open = false;
            // Node ranks by name, not by who joined first: a node keeps its
            // place from round to round (names lead with `--machine_rank`).
            next.members.sort();
            swap(&next)?;
            continue;
        }
        std::thread::sleep(POLL);
    }
}

/// The members of `state` whose alive key (for its round) exists.
fn live_members(etcd: &Etcd, job: &str, state: &State) -> Result<Vec<String>> {
    let prefix = format!("accel/{job}/alive/{}/", state.round);
    let alive = etcd.get_prefix(&prefix)?;
    Ok(state
        .members
        .iter()
        .filter(|m| alive.iter().any(|e| e.key[prefix.len()..] == *m.as_str()))
        .cloned()
        .collect())
}

fn encode(state: &State) -> Vec<u8> {
    serde_json::to_vec(state).expect("a round's state serializes")
}

impl Round {
    /// Renews this node's membership; call it well within the lease's TTL
    /// while the round runs.
    ///
    /// # Errors
    /// [`Error::Etcd`], also when the lease has lapsed (the others may
    /// have counted this node as lost).
    pub fn keep_alive(&self, etcd: &Etcd) -> Result<()> {
        etcd.keep_alive(self.lease).map(|_| ())
    }

    /// The members whose membership has lapsed (their machine died or lost
    /// etcd for longer than the lease).
    ///
    /// # Errors
    /// [`Error::Etcd`].
    pub fn lost(&self, etcd: &Etcd) -> Result<Vec<String>> {
        let state = State {
            round: self.number,
            open: false,
            members: self.members.clone(),
        };
        let alive = live_members(etcd, &self.job, &state)?;
        Ok(self
            .members
            .iter()
            .filter(|m| !alive.contains(m))
            .cloned()
            .collect())
    }

    /// The job's id.
    pub fn job(&self) -> &str {
        &self.job
    }

    /// The lease this node's membership lives under: keys put under it
    /// vanish with the node.
    pub fn lease(&self) -> i64 {
        self.lease
    }

    /// Ends this node's membership now (a clean exit), so that nobody waits
    /// for its lease to lapse.
    ///
    /// # Errors
    /// [`Error::Etcd`].
    pub fn leave(self, etcd: &Etcd) -> Result<()> {
        etcd.revoke(self.lease)
    }
}
