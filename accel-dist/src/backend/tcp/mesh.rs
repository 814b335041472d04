//! Building the full mesh of peer connections through the store.
//!
//! Each rank listens on an ephemeral TCP port of the interface that reaches
//! the store (and, on Linux, on an abstract Unix socket; see `stream.rs`)
//! and publishes `{"tcp": "ip:port", "unix": name}` under
//! `accel/tcp/<generation>/addr/<rank>`. Rank `j` then connects to every
//! rank `i < j`, over the Unix socket when it can reach it and TCP
//! otherwise, and accepts from every rank above it. The connecting side
//! opens with a handshake frame (store framing: `u32` length + body):
//!
//! ```text
//! "ACCELTC1" rank:u32 world:u32 generation:u64 token:str
//! ```
//!
//! answered by `0x00` (accepted) or `0x01 reason:str`. A connection with the
//! wrong token, world size or generation is refused and logged, and the
//! listener keeps waiting for the real peer until the timeout.

use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use super::stream::{connect_unix, Listeners, Stream};
use super::wire::Link;
use crate::rendezvous::protocol::{read_frame, write_frame, Decoder, Encoder, ACCEPTED, REFUSED};
use crate::{Error, Result, TcpStore};

const MAGIC: &[u8; 8] = b"ACCELTC1";
/// How long an accepted connection may take to present its handshake.
const HELLO_TIMEOUT: Duration = Duration::from_secs(2);
/// Poll interval of the accept loop.
const ACCEPT_POLL: Duration = Duration::from_millis(1);

/// Where a rank can be reached, as published in the store.
#[derive(serde::Serialize, serde::Deserialize)]
struct Published {
    tcp: String,
    unix: Option<String>,
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
    let generation = store.next_generation("tcp");
    let prefix = format!("accel/tcp/{generation}");
    let bind = SocketAddr::new(store.local_ip(), 0);
    let listeners = Listeners::bind(bind, unix)
        .map_err(|e| Error::io(format!("rank {rank}: listening on {bind}"), e))?;
    let tcp_addr = listeners
        .tcp
        .local_addr()
        .map_err(|e| Error::io(format!("rank {rank}: reading the listener address"), e))?;
    let published = Published {
        tcp: tcp_addr.to_string(),
        unix: listeners.unix_name().map(str::to_string),
    };
    let record = serde_json::to_vec(&published).expect("plain strings serialize");
    store.set(&format!("{prefix}/addr/{rank}"), &record)?;
    let hello = Hello {
        rank,
        world,
        generation,
        token: store.token(),
    };

    let mut streams: Vec<Option<Stream>> = (0..world).map(|_| None).collect();
    let give_up = AtomicBool::new(false);
    std::thread::scope(|s| -> Result<()> {
        let acceptor = s.spawn(|| accept_peers(&listeners, &hello, deadline, timeout, &give_up));
        let mut outcome = Ok(());
        for (peer, slot) in streams.iter_mut().enumerate().take(rank) {
            let key = format!("{prefix}/addr/{peer}");
            let connected = match store.get(&key) {
                Ok(record) => dial(&hello, peer, &record, unix, deadline),
                Err(Error::StoreTimeout { .. }) => Err(Error::PeerTimeout {
                    op: "connect",
                    rank: peer,
                    waited: timeout,
                    world,
                }),
                Err(e) => Err(e),
            };
            match connected {
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

/// What a connecting rank presents.
struct Hello<'a> {
    rank: usize,
    world: usize,
    generation: u64,
    token: &'a str,
}

/// Connects to `peer`, over its Unix socket when `unix` allows and it is
/// reachable, else over TCP, and completes the handshake.
fn dial(
    hello: &Hello<'_>,
    peer: usize,
    record: &[u8],
    unix: bool,
    deadline: Instant,
) -> Result<Stream> {
    let published: Published = serde_json::from_slice(record).map_err(|e| Error::Connect {
        rank: hello.rank,
        peer,
        addr: String::from_utf8_lossy(record).into_owned(),
        reason: format!("the published address does not parse: {e}"),
    })?;
    if let (true, Some(name)) = (unix, &published.unix) {
        // A peer on another host (or in another network namespace) has no
        // such socket here; TCP is then the way.
        match connect_unix(name).and_then(|s| handshake(s, hello, deadline)) {
            Ok(Ok(stream)) => return Ok(stream),
            Ok(Err(reason)) => tracing::debug!(peer, %reason, "unix socket refused, using tcp"),
            Err(e) => tracing::debug!(peer, error = %e, "unix socket unreachable, using tcp"),
        }
    }
    let addr = &published.tcp;
    let fail = |reason: String| Error::Connect {
        rank: hello.rank,
        peer,
        addr: addr.clone(),
        reason,
    };
    let sock: SocketAddr = addr
        .parse()
        .map_err(|_| fail("the published address does not parse".into()))?;
    let stream = loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match TcpStream::connect_timeout(&sock, left.max(Duration::from_millis(1))) {
            Ok(s) => break s,
            Err(e) if Instant::now() >= deadline => return Err(fail(e.to_string())),
            Err(_) => std::thread::sleep(Duration::from_millis(10)),
        }
    };
    match handshake(Stream::Tcp(stream), hello, deadline) {
        Ok(Ok(stream)) => Ok(stream),
        Ok(Err(reason)) => Err(Error::Refused {
            addr: addr.clone(),
            reason,
        }),
        Err(e) => Err(fail(format!("handshake failed: {e}"))),
    }
}

/// Presents `hello`; the inner error is the peer's refusal.
fn handshake(
    stream: Stream,
    hello: &Hello<'_>,
    deadline: Instant,
) -> std::io::Result<std::result::Result<Stream, String>> {
    let mut frame = MAGIC.to_vec();
    frame.extend(
        Encoder::default()
            .u32(hello.rank as u32)
            .u32(hello.world as u32)
            .u64(hello.generation)
            .str(hello.token)
            .0,
    );
    let left = deadline.saturating_duration_since(Instant::now());
    stream.set_read_timeout(Some(left.max(Duration::from_millis(1))))?;
    write_frame(&stream, &frame)?;
    let answer = read_frame(&stream, 4096)?;
    let mut d = Decoder(&answer);
    Ok(match d.u8()? {
        ACCEPTED => Ok(stream),
        _ => Err(d.str().unwrap_or("refused").to_string()),
    })
}

/// Accepts one connection from every higher rank, refusing strays.
fn accept_peers(
    listeners: &Listeners,
    me: &Hello<'_>,
    deadline: Instant,
    timeout: Duration,
    give_up: &AtomicBool,
) -> Result<Vec<(usize, Stream)>> {
    let mut got: Vec<(usize, Stream)> = Vec::new();
    let expected = me.world - me.rank - 1;
    while got.len() < expected {
        let stream = match listeners.try_accept() {
            Ok(Some(s)) => s,
            Ok(None) => {
                if Instant::now() >= deadline || give_up.load(Ordering::Relaxed) {
                    let missing = (me.rank + 1..me.world)
                        .find(|r| got.iter().all(|(p, _)| p != r))
                        .expect("some rank is missing");
                    return Err(Error::PeerTimeout {
                        op: "connect",
                        rank: missing,
                        waited: timeout,
                        world: me.world,
                    });
                }
                std::thread::sleep(ACCEPT_POLL);
                continue;
            }
            Err(e) => return Err(Error::io(format!("rank {}: accepting peers", me.rank), e)),
        };
        match check_hello(&stream, me, &got) {
            Ok(peer) => {
                let _ = write_frame(&stream, &[ACCEPTED]);
                got.push((peer, stream));
            }
            Err(reason) => {
                let from = stream.describe_peer();
                tracing::warn!(rank = me.rank, %from, %reason, "refused a connection");
                let _ = write_frame(&stream, &Encoder::new(REFUSED).str(&reason).0);
            }
        }
    }
    Ok(got)
}

/// Validates a handshake; returns the peer's rank or why it is refused.
fn check_hello(
    stream: &Stream,
    me: &Hello<'_>,
    got: &[(usize, Stream)],
) -> std::result::Result<usize, String> {
    stream
        .set_nonblocking(false)
        .and_then(|()| stream.set_read_timeout(Some(HELLO_TIMEOUT)))
        .map_err(|e| e.to_string())?;
    let frame = read_frame(stream, 4096).map_err(|e| format!("no handshake: {e}"))?;
    let body = frame
        .strip_prefix(&MAGIC[..])
        .ok_or("not an accel-rs peer (bad magic)")?;
    let mut d = Decoder(body);
    let malformed = |_| "malformed handshake".to_string();
    let rank = d.u32().map_err(malformed)? as usize;
    let world = d.u32().map_err(malformed)? as usize;
    let generation = d.u64().map_err(malformed)?;
    let token = d.str().map_err(malformed)?;
    if token != me.token {
        return Err("job token mismatch".into());
    }
    if world != me.world || generation != me.generation {
        return Err(format!(
            "peer is in world {world} generation {generation}, this rank in world {} generation {}",
            me.world, me.generation
        ));
    }
    if rank <= me.rank || rank >= world || got.iter().any(|(p, _)| *p == rank) {
        return Err(format!("unexpected rank {rank}"));
    }
    Ok(rank)
}
