//! The store server: a key-value map served to every client from one poll loop.
//!
//! One thread owns the listener, every connection and the map, and waits in
//! `epoll` (through `mio`), so a thousand idle strays cost a thousand file
//! descriptors and nothing else: no thread each, no CPU. Every connection
//! runs under a deadline. A connection that has not authenticated within
//! [`StoreLimits::handshake_timeout`] is closed, and past
//! [`StoreLimits::max_unauthenticated`] of them the oldest is dropped. When
//! accepting fails for lack of descriptors (`EMFILE`), the loop drops the
//! oldest stray or pauses accepting instead of retrying at once. After
//! authentication, frames are capped and read as they arrive, the map's
//! bytes are capped, and a client neither waiting on a key nor sending is
//! closed after [`StoreLimits::idle_timeout`]; `TcpStore` reconnects by
//! itself.

mod conn;
mod state;

use std::collections::HashMap;
use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use mio::net::TcpListener;
use mio::{Events, Interest, Poll, Token, Waker};

use super::protocol::{reply, Encoder};
use crate::process::parse_env;
use crate::warn_limit::Warnings;
use crate::{Error, Result};
use conn::{Conn, Step};
pub(crate) use conn::{CLIENT_LABEL, SERVER_LABEL};
pub(crate) use state::OWNED_PREFIX;
use state::{Outcome, State};

const LISTENER: Token = Token(0);
const WAKER: Token = Token(1);
/// Pause after an accept failed for lack of descriptors and no stray was left to drop.
const ACCEPT_PAUSE: Duration = Duration::from_millis(100);
/// Connections accepted per turn of the loop.
const ACCEPT_BURST: usize = 128;
/// Longest a started frame may take to arrive in full.
const FRAME_TIMEOUT: Duration = Duration::from_secs(30);
/// The store's bounds; [`StoreLimits::from_env`] reads the `ACCEL_STORE_*` variables.
#[derive(Clone, Debug, PartialEq)]
pub struct StoreLimits {
    /// Largest request an authenticated client may send (`ACCEL_STORE_MAX_FRAME`, bytes; 4 MiB).
    pub max_frame: usize,
    /// Largest total of key and value bytes held (`ACCEL_STORE_MAX_BYTES`; 256 MiB).
    pub max_bytes: usize,
    /// How long an authenticated client may stay silent while not waiting on
    /// a key (`ACCEL_STORE_IDLE_TIMEOUT`, seconds; 300).
    pub idle_timeout: Duration,
    /// How long a new connection has to authenticate (10 s).
    pub handshake_timeout: Duration,
    /// Connections allowed to be mid-handshake at once; the oldest is dropped past it (64).
    pub max_unauthenticated: usize,
}

impl Default for StoreLimits {
    fn default() -> Self {
        Self {
            max_frame: super::protocol::DEFAULT_MAX_FRAME,
            max_bytes: 256 << 20,
            idle_timeout: Duration::from_secs(300),
            handshake_timeout: Duration::from_secs(10),
            max_unauthenticated: 64,
        }
    }
}

impl StoreLimits {
    /// The defaults, with `ACCEL_STORE_MAX_FRAME`, `ACCEL_STORE_MAX_BYTES` and
    /// `ACCEL_STORE_IDLE_TIMEOUT` applied where set.
    ///
    /// # Errors
    /// [`Error::Env`] naming a variable that is not a positive number.
    pub fn from_env() -> Result<Self> {
        let lookup = |k: &str| std::env::var(k).ok();
        let mut l = Self::default();
        let positive = |var: &'static str, v: f64| match v.is_finite() && v > 0.0 {
            true => Ok(v),
            false => Err(Error::Env {
                var,
                value: v.to_string(),
                reason: "must be > 0".into(),
            }),
        };
        if let Some(v) = parse_env::<usize>(&lookup, "ACCEL_STORE_MAX_FRAME")? {
            l.max_frame = positive("ACCEL_STORE_MAX_FRAME", v as f64)? as usize;
        }
        if let Some(v) = parse_env::<usize>(&lookup, "ACCEL_STORE_MAX_BYTES")? {
            l.max_bytes = positive("ACCEL_STORE_MAX_BYTES", v as f64)? as usize;
        }
        if let Some(v) = parse_env::<f64>(&lookup, "ACCEL_STORE_IDLE_TIMEOUT")? {
            l.idle_timeout = Duration::from_secs_f64(positive("ACCEL_STORE_IDLE_TIMEOUT", v)?);
        }
        Ok(l)
    }
}

/// A running store server. Dropping it stops the server and disconnects every client.
pub struct StoreServer {
    addr: SocketAddr,
    waker: Arc<Waker>,
    thread: Option<JoinHandle<()>>,
}

impl StoreServer {
    /// Binds `addr` (port 0 picks a free port, see [`local_addr`](Self::local_addr))
    /// and serves clients that prove they hold `token`, under the limits of
    /// [`StoreLimits::from_env`].
    ///
    /// # Errors
    /// [`Error::Io`] naming the address when it cannot be bound; [`Error::Env`]
    /// for an empty token or a bad `ACCEL_STORE_*` variable.
    pub fn bind(addr: SocketAddr, token: &str) -> Result<Self> {
        Self::bind_with(addr, token, StoreLimits::from_env()?)
    }

    /// [`bind`](Self::bind) with explicit limits.
    pub fn bind_with(addr: SocketAddr, token: &str, limits: StoreLimits) -> Result<Self> {
        check_token(token)?;
        let mut listener = TcpListener::bind(addr)
            .map_err(|e| Error::io(format!("binding the rendezvous store at {addr}"), e))?;
        let addr = listener
            .local_addr()
            .map_err(|e| Error::io(format!("reading the store address {addr}"), e))?;
        let poll = Poll::new().map_err(|e| Error::io("creating the store's poll", e))?;
        poll.registry()
            .register(&mut listener, LISTENER, Interest::READABLE)
            .map_err(|e| Error::io("registering the store listener", e))?;
        let waker = Arc::new(
            Waker::new(poll.registry(), WAKER).map_err(|e| Error::io("creating a waker", e))?,
        );
        let mut server = Server {
            poll,
            listener,
            token: token.to_string(),
            state: State::new(limits.max_bytes),
            limits,
            conns: HashMap::new(),
            next_id: 2,
            accept_paused_until: None,
            accept_more: false,
            dirty: false,
            warnings: Warnings::default(),
        };
        let thread = std::thread::Builder::new()
            .name("accel-store".into())
            .spawn(move || server.run())
            .map_err(|e| Error::io("spawning the store thread", e))?;
        tracing::debug!(%addr, "rendezvous store listening");
        Ok(Self {
            addr,
            waker,
            thread: Some(thread),
        })
    }

    /// The address the server listens on, with the port it actually got.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        // The loop exits at the wake; dropping it closes every connection.
        let _ = self.waker.wake();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Refuses an empty token: it would let in any process that can connect.
pub(crate) fn check_token(token: &str) -> Result<()> {
    match token.is_empty() {
        true => Err(Error::Env {
            var: crate::process::ENV_JOB_TOKEN,
            value: String::new(),
            reason: "an empty job token would admit any local process; `accel launch` makes one"
                .into(),
        }),
        false => Ok(()),
    }
}

/// Where to connect to reach a listener bound to `addr`: loopback for an
/// unspecified address.
pub(crate) fn reachable(mut addr: SocketAddr) -> SocketAddr {
    if addr.ip().is_unspecified() {
        addr.set_ip(match addr {
            SocketAddr::V4(_) => std::net::Ipv4Addr::LOCALHOST.into(),
            SocketAddr::V6(_) => std::net::Ipv6Addr::LOCALHOST.into(),
        });
    }
    addr
}

/// Everything the store thread owns.
struct Server {
    poll: Poll,
    listener: TcpListener,
    token: String,
    state: State,
    limits: StoreLimits,
    conns: HashMap<usize, Conn>,
    next_id: usize,
    accept_paused_until: Option<Instant>,
    /// Whether the last [`accept`](Self::accept) stopped at its burst limit.
    accept_more: bool,
    /// Whether the map changed since waiters were last checked.
    dirty: bool,
    warnings: Warnings,
}

/// Warns (rate-limited) that the store refused a connection.
fn refused(warnings: &mut Warnings, peer: &str, reason: &str) {
    warnings.warn(format!(
        "rendezvous store refused a connection from {peer}: {reason}"
    ));
}

impl Server {
    fn run(&mut self) {
        let mut events = Events::with_capacity(256);
        loop {
            let timeout = match self.accept_more {
                // Connections are still queued: serve the ready clients, then come back.
                true => Some(Duration::ZERO),
                false => self.next_deadline().map(|d| {
                    d.saturating_duration_since(Instant::now())
                        .max(Duration::from_millis(1))
                }),
            };
            if let Err(e) = self.poll.poll(&mut events, timeout) {
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                tracing::error!(error = %e, "the rendezvous store stopped: poll failed");
                return;
            }
            self.warnings.tick("rendezvous store");
            for event in events.iter() {
                match event.token() {
                    WAKER => return,
                    LISTENER => self.accept(),
                    // A client that left while waiting on a key: nothing
                    // reads its socket until the wait ends, so see it here.
                    Token(id)
                        if (event.is_read_closed() || event.is_error())
                            && self.conns.get(&id).is_some_and(|c| c.waiting.is_some()) =>
                    {
                        self.close(id)
                    }
                    Token(id) => self.drive(id),
                }
            }
            if self
                .accept_paused_until
                .is_some_and(|t| Instant::now() >= t)
            {
                self.accept_paused_until = None;
                self.accept();
            } else if self.accept_more {
                self.accept();
            }
            self.expire();
            self.settle();
        }
    }

    /// Accepts every waiting connection.
    /// Accepts waiting connections, at most [`ACCEPT_BURST`] per call so a
    /// flood cannot starve the clients already connected.
    fn accept(&mut self) {
        self.accept_more = false;
        for _ in 0..ACCEPT_BURST {
            if self.accept_paused_until.is_some() {
                return;
            }
            match self.listener.accept() {
                Ok((mut stream, peer)) => {
                    let _ = stream.set_nodelay(true);
                    let id = self.next_id;
                    self.next_id += 1;
                    let interest = Interest::READABLE | Interest::WRITABLE;
                    if let Err(e) = self
                        .poll
                        .registry()
                        .register(&mut stream, Token(id), interest)
                    {
                        tracing::warn!(error = %e, "the rendezvous store could not watch a connection");
                        continue;
                    }
                    let unauthenticated = self.conns.values().filter(|c| !c.authenticated());
                    if unauthenticated.count() >= self.limits.max_unauthenticated {
                        self.drop_oldest_stray();
                    }
                    let conn = Conn::new(stream, peer.to_string(), Instant::now());
                    self.conns.insert(id, conn);
                    self.drive(id);
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) if out_of_descriptors(&e) => {
                    if !self.drop_oldest_stray() {
                        self.warnings.warn(format!(
                            "rendezvous store: accepting failed ({e}); pausing {ACCEPT_PAUSE:?}"
                        ));
                        self.accept_paused_until = Some(Instant::now() + ACCEPT_PAUSE);
                    }
                }
                // A peer that reset before we accepted, and the like.
                Err(_) => {}
            }
        }
        self.accept_more = true;
    }

    /// Drops the unauthenticated connection open the longest; false if none is.
    fn drop_oldest_stray(&mut self) -> bool {
        let oldest = self
            .conns
            .iter()
            .filter(|(_, c)| !c.authenticated())
            .min_by_key(|(_, c)| c.opened)
            .map(|(id, _)| *id);
        let Some(id) = oldest else { return false };
        let peer = self.conns[&id].peer.clone();
        self.close(id);
        let max = self.limits.max_unauthenticated;
        self.warnings.warn(format!(
            "rendezvous store: more than {max} connections were not authenticated; dropped the \
             oldest, from {peer}"
        ));
        true
    }

    /// Sends, reads and answers on connection `id` as far as it can go now.
    /// Waiters its requests satisfy are answered by [`settle`](Self::settle).
    fn drive(&mut self, id: usize) {
        let now = Instant::now();
        let closed = loop {
            let Some(conn) = self.conns.get_mut(&id) else {
                return;
            };
            if conn.flush().is_err() {
                break true;
            }
            if conn.sending() || conn.waiting.is_some() {
                break false;
            }
            if matches!(conn.stage, conn::Stage::Closing) {
                break true;
            }
            let frame = match conn.next_frame(now) {
                Ok(Some(f)) => f,
                Ok(None) => break false,
                Err(e) => match (&conn.stage, e.kind()) {
                    (conn::Stage::Ready, io::ErrorKind::InvalidData) => {
                        let msg = format!("request refused: {e} (ACCEL_STORE_MAX_FRAME)");
                        tracing::warn!(peer = %conn.peer, "rendezvous store: {msg}");
                        conn.send(&Encoder::new(reply::ERROR).str(&msg).0);
                        conn.stage = conn::Stage::Closing;
                        continue;
                    }
                    (conn::Stage::Ready, _) => break true,
                    (_, io::ErrorKind::UnexpectedEof) => {
                        tracing::debug!(peer = %conn.peer, "a client left during its handshake");
                        break true;
                    }
                    _ => {
                        let reason = format!("no valid handshake: {e}");
                        refused(&mut self.warnings, &conn.peer, &reason);
                        conn.refuse(&reason);
                        continue;
                    }
                },
            };
            if !conn.authenticated() {
                match conn.handshake(&frame, &self.token, self.limits.max_frame) {
                    Ok(Step::Continue) | Ok(Step::Authenticated) => {}
                    Ok(Step::Refused(reason)) => {
                        refused(&mut self.warnings, &conn.peer, &reason);
                        conn.refuse(&reason);
                    }
                    Err(_) => break true,
                }
                continue;
            }
            match self.state.handle(&frame, &mut conn.claimed, &conn.peer) {
                Ok(Outcome::Reply { answer, changed }) => {
                    conn.send(&answer);
                    self.dirty |= changed;
                }
                Ok(Outcome::Wait(p)) => conn.waiting = Some(p),
                Err(e) => conn.send(
                    &Encoder::new(reply::ERROR)
                        .str(&format!("bad request: {e}"))
                        .0,
                ),
            }
        };
        if closed {
            self.close(id);
        }
    }

    /// Answers waiting clients whose keys now exist, one at a time, until
    /// none is left: a client answered may send a request that satisfies
    /// another, and each is answered exactly once.
    fn settle(&mut self) {
        if !self.dirty {
            return;
        }
        loop {
            let done = self.conns.iter().find_map(|(id, c)| {
                let answer = self.state.finish(c.waiting.as_ref()?)?;
                Some((*id, answer))
            });
            let Some((id, answer)) = done else {
                self.dirty = false;
                return;
            };
            let conn = self.conns.get_mut(&id).expect("found above");
            conn.waiting = None;
            conn.send(&answer);
            self.drive(id);
        }
    }

    /// Closes connections and answers waits whose time is up.
    fn expire(&mut self) {
        let now = Instant::now();
        let mut close = Vec::new();
        let mut answered = Vec::new();
        for (id, c) in &mut self.conns {
            if let Some(p) = &c.waiting {
                if now >= p.deadline {
                    let answer = self.state.timed_out(p);
                    c.waiting = None;
                    c.last_active = now;
                    c.send(&answer);
                    answered.push(*id);
                }
                continue;
            }
            match self::deadline(c, &self.limits) {
                Some((t, why)) if now >= t => {
                    if !c.authenticated() {
                        let msg = format!(
                            "rendezvous store closed a connection from {}: {why}",
                            c.peer
                        );
                        self.warnings.warn(msg);
                    } else {
                        tracing::debug!(peer = %c.peer, "rendezvous store closed a connection: {why}");
                    }
                    close.push(*id);
                }
                _ => {}
            }
        }
        for id in close {
            self.close(id);
        }
        for id in answered {
            self.drive(id);
        }
    }

    fn next_deadline(&self) -> Option<Instant> {
        let conns = self.conns.values().filter_map(|c| match &c.waiting {
            Some(p) => Some(p.deadline),
            None => deadline(c, &self.limits).map(|(t, _)| t),
        });
        conns.chain(self.accept_paused_until).min()
    }

    fn close(&mut self, id: usize) {
        if let Some(mut c) = self.conns.remove(&id) {
            let _ = self.poll.registry().deregister(&mut c.stream);
        }
    }
}

/// When connection `c` is closed if nothing happens, and why.
fn deadline(c: &Conn, limits: &StoreLimits) -> Option<(Instant, &'static str)> {
    if !c.authenticated() {
        return Some((
            c.opened + limits.handshake_timeout,
            "no handshake within the handshake timeout",
        ));
    }
    if let Some(started) = c.frame_started {
        return Some((
            started + FRAME_TIMEOUT,
            "a request took over 30 s to arrive",
        ));
    }
    if c.sending() {
        return None;
    }
    Some((c.last_active + limits.idle_timeout, "idle"))
}

fn out_of_descriptors(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM)
    )
}
