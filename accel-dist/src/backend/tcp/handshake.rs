//! The handshake between two ranks: the dialing side proves the job token and
//! its rank, the accepting side proves the token back.
//!
//! ```text
//! dialer:   "ACCELTC2" rank:u32 world:u32 generation:u64 client_nonce[32]
//! acceptor: 0x00 server_nonce:bytes               | 0x01 reason:str
//! dialer:   proof:bytes secret:bytes
//! acceptor: 0x00 server_proof:bytes               | 0x01 reason:str
//! ```
//!
//! `proof` is `HMAC-SHA256(token, "accel-mesh-client" | server_nonce |
//! client_nonce | rank world generation)`, and `server_proof` the same with
//! `"accel-mesh-server"` and the nonces swapped. `secret` is the one the
//! dialer drew for this acceptor, whose SHA-256 the dialer published in its
//! own rank's keys of the store, which only it can write: holding the token
//! is not enough to pass for a rank.
//!
//! The acceptor handshakes every pending connection at once, without
//! blocking, each under [`HELLO_TIMEOUT`]; a stray that trickles bytes holds
//! only its own slot, and the rank's deadline is checked on every turn.

use std::io::{self, Read};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use super::stream::{Listeners, Stream};
use crate::rendezvous::auth::{self, Bytes32};
use crate::rendezvous::protocol::{read_frame, write_frame, Decoder, Encoder, FrameReader};
use crate::rendezvous::protocol::{ACCEPTED, REFUSED};
use crate::warn_limit::Warnings;
use crate::{Error, Result};

const MAGIC: &[u8; 8] = b"ACCELTC2";
const CLIENT_LABEL: &[u8] = b"accel-mesh-client";
const SERVER_LABEL: &[u8] = b"accel-mesh-server";
/// Largest handshake frame.
const MAX: usize = 4096;
/// How long an accepted connection may take to complete its handshake.
pub(super) const HELLO_TIMEOUT: Duration = Duration::from_secs(2);
/// Connections handshaking at once; past it the oldest is dropped.
const MAX_PENDING: usize = 64;
/// Poll interval of the accept loop.
const ACCEPT_POLL: Duration = Duration::from_millis(1);

/// Who this rank is, in every handshake.
pub(super) struct Me<'a> {
    pub rank: usize,
    pub world: usize,
    pub generation: u64,
    pub token: &'a str,
}

impl Me<'_> {
    fn context(&self, rank: usize) -> [u8; 16] {
        let mut c = [0u8; 16];
        c[..4].copy_from_slice(&(rank as u32).to_le_bytes());
        c[4..8].copy_from_slice(&(self.world as u32).to_le_bytes());
        c[8..].copy_from_slice(&self.generation.to_le_bytes());
        c
    }
}

/// Why a dial did not give a connection.
pub(super) enum DialError {
    /// The peer answered with a refusal: do not retry.
    Refused(String),
    /// The connection failed or went silent: retry until the deadline.
    Io(io::Error),
}

/// Presents this rank to the acceptor on `stream`, revealing `secret`.
pub(super) fn dial(
    stream: Stream,
    me: &Me<'_>,
    secret: &Bytes32,
    deadline: Instant,
) -> std::result::Result<Stream, DialError> {
    let io = DialError::Io;
    let left = deadline.saturating_duration_since(Instant::now());
    stream
        .set_read_timeout(Some(left.max(Duration::from_millis(1))))
        .map_err(io)?;
    let client = auth::random().map_err(io)?;
    let mut hello = MAGIC.to_vec();
    hello.extend(
        Encoder::default()
            .u32(me.rank as u32)
            .u32(me.world as u32)
            .u64(me.generation)
            .0,
    );
    hello.extend_from_slice(&client);
    write_frame(&stream, &hello).map_err(io)?;
    let server: Bytes32 = answer(&stream)?
        .try_into()
        .map_err(|_| DialError::Refused("malformed handshake answer".into()))?;
    let proof = auth::proof(
        me.token,
        CLIENT_LABEL,
        &[&server, &client, &me.context(me.rank)],
    );
    let body = Encoder::default().bytes(&proof).bytes(secret).0;
    write_frame(&stream, &body).map_err(io)?;
    let theirs = answer(&stream)?;
    let want = auth::proof(
        me.token,
        SERVER_LABEL,
        &[&client, &server, &me.context(me.rank)],
    );
    if !auth::same(&want, &theirs) {
        return Err(DialError::Refused(
            "the peer could not prove it holds the job token".into(),
        ));
    }
    Ok(stream)
}

fn answer(stream: &Stream) -> std::result::Result<Vec<u8>, DialError> {
    let frame = read_frame(stream, MAX).map_err(DialError::Io)?;
    let mut d = Decoder(&frame);
    let bad = |_| DialError::Refused("malformed handshake answer".into());
    match d.u8().map_err(bad)? {
        ACCEPTED => Ok(d.bytes().map_err(bad)?.to_vec()),
        _ => Err(DialError::Refused(d.str().unwrap_or("refused").to_string())),
    }
}

/// One accepted connection mid-handshake.
struct Shake {
    stream: Stream,
    from: String,
    opened: Instant,
    reader: FrameReader,
    /// Set once the hello is read: the claimed rank and the two nonces.
    hello: Option<(usize, Bytes32, Bytes32)>,
}

enum Turn {
    Waiting,
    Done(usize),
    Refused(String),
}

impl Shake {
    /// Reads what has arrived and answers it.
    fn turn(
        &mut self,
        me: &Me<'_>,
        commitment: &mut impl FnMut(usize) -> Option<Bytes32>,
        got: &[(usize, Stream)],
    ) -> io::Result<Turn> {
        let mut buf = [0u8; 512];
        loop {
            let n = match (&self.stream).read(&mut buf) {
                Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(Turn::Waiting),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            };
            let mut at = 0;
            while at < n {
                let (used, frame) = self.reader.feed(&buf[at..n])?;
                at += used;
                let Some(frame) = frame else { continue };
                match self.answer(&frame, me, commitment, got) {
                    Ok(Some(rank)) => return Ok(Turn::Done(rank)),
                    Ok(None) => {}
                    Err(reason) => return Ok(Turn::Refused(reason)),
                }
            }
        }
    }

    /// Handles one frame; `Ok(Some(rank))` once the peer has proven `rank`.
    fn answer(
        &mut self,
        frame: &[u8],
        me: &Me<'_>,
        commitment: &mut impl FnMut(usize) -> Option<Bytes32>,
        got: &[(usize, Stream)],
    ) -> std::result::Result<Option<usize>, String> {
        let send = |body: &[u8]| write_frame(&self.stream, body).map_err(|e| e.to_string());
        let malformed = |_| "malformed handshake".to_string();
        let Some((rank, server, client)) = self.hello else {
            let body = frame
                .strip_prefix(&MAGIC[..])
                .ok_or("not an accel-rs peer (bad magic or another version)")?;
            let mut d = Decoder(body);
            let rank = d.u32().map_err(malformed)? as usize;
            let world = d.u32().map_err(malformed)? as usize;
            let generation = d.u64().map_err(malformed)?;
            let client: Bytes32 = d.0.try_into().map_err(|_| "malformed handshake")?;
            if world != me.world || generation != me.generation {
                return Err(format!(
                    "peer is in world {world} generation {generation}, this rank in world {} \
                     generation {}",
                    me.world, me.generation
                ));
            }
            if rank <= me.rank || rank >= world || got.iter().any(|(p, _)| *p == rank) {
                return Err(format!("unexpected rank {rank}"));
            }
            let server = auth::random().map_err(|e| e.to_string())?;
            send(&Encoder::new(ACCEPTED).bytes(&server).0)?;
            self.hello = Some((rank, server, client));
            return Ok(None);
        };
        let mut d = Decoder(frame);
        let proof = d.bytes().map_err(malformed)?;
        let secret = d.bytes().map_err(malformed)?;
        let context = me.context(rank);
        let want = auth::proof(me.token, CLIENT_LABEL, &[&server, &client, &context]);
        if !auth::same(&want, proof) {
            return Err("job token mismatch".into());
        }
        let Some(committed) = commitment(rank) else {
            return Err(format!(
                "could not prove it is rank {rank}: rank {rank} has published no commitment yet"
            ));
        };
        if !auth::same(&committed, &auth::digest(secret)) {
            return Err(format!(
                "could not prove it is rank {rank}: its secret does not match rank {rank}'s \
                 commitment in the store"
            ));
        }
        let ours = auth::proof(me.token, SERVER_LABEL, &[&client, &server, &context]);
        send(&Encoder::new(ACCEPTED).bytes(&ours).0)?;
        Ok(Some(rank))
    }
}

/// Accepts one proven connection from every higher rank, refusing strays.
/// `commitment(j)` is what rank `j` published for this rank, if it has.
pub(super) fn accept_peers(
    listeners: &Listeners,
    me: &Me<'_>,
    mut commitment: impl FnMut(usize) -> Option<Bytes32>,
    deadline: Instant,
    timeout: Duration,
    give_up: &AtomicBool,
) -> Result<Vec<(usize, Stream)>> {
    let mut got: Vec<(usize, Stream)> = Vec::new();
    let mut pending: Vec<Shake> = Vec::new();
    // Refusals and dropped handshakes: a flood of strays is one line per 5 s.
    let mut warnings = Warnings::default();
    let expected = me.world - me.rank - 1;
    let accepting = |e| Error::io(format!("rank {}: accepting peers", me.rank), e);
    while got.len() < expected {
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
        let mut busy = false;
        // At most a full table of new connections per turn, so a flood
        // cannot keep the pending handshakes from being read.
        for _ in 0..MAX_PENDING {
            let Some(stream) = listeners.try_accept().map_err(accepting)? else {
                break;
            };
            busy = true;
            if stream.set_nonblocking(true).is_err() {
                continue;
            }
            if pending.len() >= MAX_PENDING {
                let oldest = pending.remove(0);
                warnings.warn(format!(
                    "rank {}: dropped the oldest of {MAX_PENDING} unfinished handshakes (from {})",
                    me.rank, oldest.from
                ));
            }
            pending.push(Shake {
                from: stream.describe_peer(),
                stream,
                opened: Instant::now(),
                reader: FrameReader::new(MAX),
                hello: None,
            });
        }
        let mut i = 0;
        while i < pending.len() {
            let shake = &mut pending[i];
            let outcome = match shake.turn(me, &mut commitment, &got) {
                Ok(Turn::Waiting) if shake.opened.elapsed() < HELLO_TIMEOUT => {
                    i += 1;
                    continue;
                }
                Ok(Turn::Waiting) => Err(format!("no handshake within {HELLO_TIMEOUT:?}")),
                Ok(Turn::Done(rank)) => Ok(rank),
                Ok(Turn::Refused(reason)) => Err(reason),
                Err(e) => Err(format!("handshake failed: {e}")),
            };
            busy = true;
            let shake = pending.remove(i);
            match outcome {
                Ok(rank) => match shake.stream.set_nonblocking(false) {
                    Ok(()) => got.push((rank, shake.stream)),
                    Err(e) => {
                        tracing::warn!(rank = me.rank, peer = rank, error = %e, "lost a peer connection")
                    }
                },
                Err(reason) => {
                    warnings.warn(format!(
                        "rank {}: refused a connection from {}: {reason}",
                        me.rank, shake.from
                    ));
                    let _ = write_frame(&shake.stream, &Encoder::new(REFUSED).str(&reason).0);
                }
            }
        }
        if !busy {
            std::thread::sleep(ACCEPT_POLL);
        }
    }
    warnings.flush(&format!("rank {}: refused-connection", me.rank));
    Ok(got)
}
