//! Building the full mesh of peer connections through the store.
//!
//! Each rank claims its rank in the store, listens on an ephemeral TCP port
//! of the interface that reaches the store (and, on Linux, on an abstract
//! Unix socket; see `stream.rs`) and publishes, under its own write-once key
//! `accel/rank/<rank>/tcp/<generation>`,
//! `{"tcp": "ip:port", "unix": name, "commitments": [hex; rank]}`: where it
//! listens, and for every lower rank `i` the SHA-256 of a secret drawn for
//! `i`. Rank `j` then reads the records of the ranks below it and dials
//! each (over the Unix socket when it can reach it, TCP otherwise), and
//! accepts from every rank above it, reading a dialer's record when it dials. The handshake (`handshake.rs`) proves the job
//! token both ways and, by revealing the secret, the dialer's rank: a
//! process with the token but without the rank's claim cannot take its
//! place, and since only rank `i` could publish its addresses, a dialer
//! reaches the real rank `i`.

use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use super::handshake::{self, DialError, Me};
use super::stream::{connect_unix, Listeners, Stream};
use super::wire::Link;
use crate::rendezvous::auth::{self, Bytes32};
use crate::rendezvous::OWNED_PREFIX;
use crate::{Error, Result, TcpStore};

/// Where a rank can be reached, as published in the store.
#[derive(serde::Serialize, serde::Deserialize)]
struct Published {
    tcp: String,
    unix: Option<String>,
    /// `commitments[i]`: hex SHA-256 of the secret this rank reveals to rank `i`.
    commitments: Vec<String>,
}

/// Connects this rank to every other rank; `links[peer]` is `None` only for `rank` itself.
pub(crate) fn connect(
    store: &TcpStore,
    rank: usize,
    world: usize,
    timeout: Duration,
    unix: bool,
) -> Result<Vec<Option<Link>>> {
    let deadline = Instant::now() + timeout;
    store.claim_rank(rank)?;
    let generation = store.next_generation("tcp");
    let key = |r: usize| format!("{OWNED_PREFIX}{r}/tcp/{generation}");
    let bind = SocketAddr::new(store.local_ip(), 0);
    let listeners = Listeners::bind(bind, unix)
        .map_err(|e| Error::io(format!("rank {rank}: listening on {bind}"), e))?;
    let tcp_addr = listeners
        .tcp
        .local_addr()
        .map_err(|e| Error::io(format!("rank {rank}: reading the listener address"), e))?;
    let secrets = (0..rank)
        .map(|_| auth::random())
        .collect::<std::io::Result<Vec<Bytes32>>>()
        .map_err(|e| Error::io(format!("rank {rank}: drawing handshake secrets"), e))?;
    let published = Published {
        tcp: tcp_addr.to_string(),
        unix: listeners.unix_name().map(str::to_string),
        commitments: secrets
            .iter()
            .map(|s| auth::hex(&auth::digest(s)))
            .collect(),
    };
    let record = serde_json::to_vec(&published).expect("plain strings serialize");
    store.set(&key(rank), &record)?;
    let mut records = Vec::with_capacity(rank);
    for peer in 0..rank {
        records.push(read_record(store, rank, peer, world, &key(peer), timeout)?);
    }
    // The acceptor reads the higher ranks' commitments as they dial, on a
    // connection of its own (this thread's may be blocked in a long get).
    let acceptor_store = match rank + 1 < world {
        true => Some(TcpStore::connect(store.addr(), store.token(), timeout)?),
        false => None,
    };
    let commitment = |peer: usize| -> Option<Bytes32> {
        let store = acceptor_store.as_ref()?;
        let key = key(peer);
        if !store.check(&[&key]).ok()? {
            return None;
        }
        let record: Published = serde_json::from_slice(&store.get(&key).ok()?).ok()?;
        auth::unhex(record.commitments.get(rank)?)?.try_into().ok()
    };
    let me = Me {
        rank,
        world,
        generation,
        token: store.token(),
    };

    let mut streams: Vec<Option<Stream>> = (0..world).map(|_| None).collect();
    let give_up = AtomicBool::new(false);
    std::thread::scope(|s| -> Result<()> {
        let acceptor = s.spawn(|| {
            handshake::accept_peers(&listeners, &me, commitment, deadline, timeout, &give_up)
        });
        let mut outcome = Ok(());
        for (peer, slot) in streams.iter_mut().enumerate().take(rank) {
            match dial(&me, peer, &records[peer], &secrets[peer], unix, deadline) {
                Ok(stream) => *slot = Some(stream),
                Err(e) => {
                    give_up.store(true, Ordering::Relaxed);
                    outcome = Err(e);
                    break;
                }
            }
        }
        let accepted = acceptor.join().expect("the accept thread does not panic");
        outcome?;
        for (peer, stream) in accepted? {
            streams[peer] = Some(stream);
        }
        Ok(())
    })?;

    let tick = (timeout / 10).clamp(Duration::from_millis(1), Duration::from_millis(100));
    streams
        .into_iter()
        .enumerate()
        .map(|(peer, stream)| {
            let Some(stream) = stream else {
                return Ok(None);
            };
            let setup = |s: &Stream| {
                s.set_nodelay()?;
                s.set_read_timeout(Some(tick))?;
                s.set_write_timeout(Some(tick))
            };
            setup(&stream).map_err(|e| {
                Error::io(
                    format!("rank {rank}: configuring the connection to rank {peer}"),
                    e,
                )
            })?;
            Ok(Some(Link {
                peer,
                stream,
                tx_clean: AtomicBool::new(true),
            }))
        })
        .collect()
}

/// Reads `peer`'s published record, waiting for it up to the timeout.
fn read_record(
    store: &TcpStore,
    rank: usize,
    peer: usize,
    world: usize,
    key: &str,
    timeout: Duration,
) -> Result<Published> {
    let record = match store.get(key) {
        Ok(r) => r,
        Err(Error::StoreTimeout { .. }) => {
            return Err(Error::PeerTimeout {
                op: "connect",
                rank: peer,
                waited: timeout,
                world,
            })
        }
        Err(e) => return Err(e),
    };
    serde_json::from_slice(&record).map_err(|e| Error::Connect {
        rank,
        peer,
        addr: String::from_utf8_lossy(&record).into_owned(),
        reason: format!("the published address does not parse: {e}"),
    })
}

/// Connects to `peer`, over its Unix socket when `unix` allows and it is
/// reachable, else over TCP, and completes the handshake. A connection that
/// fails or goes silent is tried again until the deadline; a refusal is final.
fn dial(
    me: &Me<'_>,
    peer: usize,
    published: &Published,
    secret: &Bytes32,
    unix: bool,
    deadline: Instant,
) -> Result<Stream> {
    if let (true, Some(name)) = (unix, &published.unix) {
        // A peer on another host (or in another network namespace) has no
        // such socket here; TCP is then the way.
        match connect_unix(name).map_err(DialError::Io) {
            Ok(s) => match handshake::dial(s, me, secret, deadline) {
                Ok(stream) => return Ok(stream),
                Err(DialError::Refused(reason)) => {
                    return Err(refused(me, peer, &format!("unix:{name}"), reason))
                }
                Err(DialError::Io(e)) => {
                    tracing::debug!(peer, error = %e, "unix socket handshake failed, using tcp")
                }
            },
            Err(_) => tracing::debug!(peer, "unix socket unreachable, using tcp"),
        }
    }
    let addr = &published.tcp;
    let fail = |reason: String| Error::Connect {
        rank: me.rank,
        peer,
        addr: addr.clone(),
        reason,
    };
    let sock: SocketAddr = addr
        .parse()
        .map_err(|_| fail("the published address does not parse".into()))?;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let attempt = TcpStream::connect_timeout(&sock, left.max(Duration::from_millis(1)));
        let outcome = match attempt {
            Ok(s) => handshake::dial(Stream::Tcp(s), me, secret, deadline),
            Err(e) => Err(DialError::Io(e)),
        };
        match outcome {
            Ok(stream) => return Ok(stream),
            Err(DialError::Refused(reason)) => return Err(refused(me, peer, addr, reason)),
            Err(DialError::Io(e)) if Instant::now() >= deadline => {
                let reason = match e.kind() {
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
                        format!("rank {peer} did not answer the handshake in time")
                    }
                    _ => format!("no connection in time, the last attempt failed with: {e}"),
                };
                return Err(fail(reason));
            }
            Err(DialError::Io(_)) => std::thread::sleep(Duration::from_millis(10)),
        }
    }
}

fn refused(me: &Me<'_>, peer: usize, addr: &str, reason: String) -> Error {
    Error::Connect {
        rank: me.rank,
        peer,
        addr: addr.to_string(),
        reason: format!("refused: {reason}"),
    }
}
