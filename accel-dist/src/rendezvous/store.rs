//! The store server: a key-value map behind a TCP listener, one thread per client.

use std::collections::HashMap;
use std::io;
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::protocol::{self, op, read_frame, reply, write_frame, Decoder, Encoder};
use crate::{Error, Result};

/// How long a new connection may take to present its handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// A running store server. Dropping it stops the server and disconnects every client.
pub struct StoreServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
    accept: Option<JoinHandle<()>>,
}

struct Shared {
    token: String,
    map: Mutex<HashMap<String, Vec<u8>>>,
    changed: Condvar,
    shutdown: AtomicBool,
    /// Clones of the client sockets, so shutdown can disconnect them.
    clients: Mutex<HashMap<u64, TcpStream>>,
    next_client: std::sync::atomic::AtomicU64,
}

impl StoreServer {
    /// Binds `addr` (port 0 picks a free port, see [`local_addr`](Self::local_addr))
    /// and serves clients that present `token`.
    ///
    /// # Errors
    /// [`Error::Io`] naming the address when it cannot be bound.
    pub fn bind(addr: SocketAddr, token: &str) -> Result<Self> {
        let listener = TcpListener::bind(addr)
            .map_err(|e| Error::io(format!("binding the rendezvous store at {addr}"), e))?;
        let addr = listener
            .local_addr()
            .map_err(|e| Error::io(format!("reading the store address {addr}"), e))?;
        let shared = Arc::new(Shared {
            token: token.to_string(),
            map: Mutex::new(HashMap::new()),
            changed: Condvar::new(),
            shutdown: AtomicBool::new(false),
            clients: Mutex::new(HashMap::new()),
            next_client: Default::default(),
        });
        let accept_shared = Arc::clone(&shared);
        let accept = std::thread::Builder::new()
            .name("accel-store-accept".into())
            .spawn(move || accept_loop(listener, accept_shared))
            .map_err(|e| Error::io("spawning the store thread", e))?;
        tracing::debug!(%addr, "rendezvous store listening");
        Ok(Self {
            addr,
            shared,
            accept: Some(accept),
        })
    }

    /// The address the server listens on, with the port it actually got.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::SeqCst);
        // Wake the accept loop with a throwaway connection.
        let _ = TcpStream::connect_timeout(&reachable(self.addr), Duration::from_secs(1));
        for (_, client) in lock(&self.shared.clients).drain() {
            let _ = client.shutdown(Shutdown::Both);
        }
        self.shared.changed.notify_all();
        if let Some(accept) = self.accept.take() {
            let _ = accept.join();
        }
    }
}

/// Where to connect to reach a listener bound to `addr`: loopback for an
/// unspecified address.
pub(super) fn reachable(mut addr: SocketAddr) -> SocketAddr {
    if addr.ip().is_unspecified() {
        addr.set_ip(match addr {
            SocketAddr::V4(_) => std::net::Ipv4Addr::LOCALHOST.into(),
            SocketAddr::V6(_) => std::net::Ipv6Addr::LOCALHOST.into(),
        });
    }
    addr
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A client thread that panicked leaves the map consistent (every update
    // is a single insert), so a poisoned lock is still usable.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    for conn in listener.incoming() {
        if shared.shutdown.load(Ordering::SeqCst) {
            return;
        }
        let Ok(stream) = conn else { continue };
        let shared = Arc::clone(&shared);
        let spawned = std::thread::Builder::new()
            .name("accel-store-client".into())
            .spawn(move || {
                let peer = stream
                    .peer_addr()
                    .map(|a| a.to_string())
                    .unwrap_or_default();
                if let Err(e) = serve(stream, &shared) {
                    if !shared.shutdown.load(Ordering::SeqCst) {
                        tracing::debug!(%peer, error = %e, "store client disconnected");
                    }
                }
            });
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "store could not spawn a client thread");
        }
    }
}

/// Authenticates one client, then answers its requests until it disconnects.
fn serve(stream: TcpStream, shared: &Shared) -> io::Result<()> {
    stream.set_nodelay(true)?;
    stream.set_read_timeout(Some(HANDSHAKE_TIMEOUT))?;
    let hello = read_frame(&stream, protocol::MAX_HANDSHAKE)?;
    if let Err(reason) = check_hello(&hello, &shared.token) {
        let peer = stream
            .peer_addr()
            .map(|a| a.to_string())
            .unwrap_or_default();
        tracing::warn!(%peer, %reason, "rendezvous store refused a connection");
        let body = Encoder::new(protocol::REFUSED).str(reason).0;
        let _ = write_frame(&stream, &body);
        return Ok(());
    }
    write_frame(&stream, &[protocol::ACCEPTED])?;
    stream.set_read_timeout(None)?;
    let id = shared.next_client.fetch_add(1, Ordering::Relaxed);
    lock(&shared.clients).insert(id, stream.try_clone()?);
    let result = answer_requests(&stream, shared);
    lock(&shared.clients).remove(&id);
    result
}

fn answer_requests(stream: &TcpStream, shared: &Shared) -> io::Result<()> {
    loop {
        let request = match read_frame(stream, protocol::MAX_FRAME) {
            Ok(r) => r,
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e),
        };
        let answer = handle(&request, shared).unwrap_or_else(|e| {
            Encoder::new(reply::ERROR)
                .str(&format!("bad request: {e}"))
                .0
        });
        write_frame(stream, &answer)?;
    }
}

fn check_hello(hello: &[u8], token: &str) -> std::result::Result<(), &'static str> {
    let Some(rest) = hello.strip_prefix(&protocol::MAGIC[..]) else {
        return Err("not an accel-rs store client (bad magic)");
    };
    match Decoder(rest).str() {
        Ok(t) if t == token => Ok(()),
        Ok(_) => Err("job token mismatch"),
        Err(_) => Err("malformed handshake"),
    }
}

fn handle(request: &[u8], shared: &Shared) -> io::Result<Vec<u8>> {
    let mut d = Decoder(request);
    let answer = match d.u8()? {
        op::SET => {
            let key = d.str()?.to_string();
            let value = d.bytes()?.to_vec();
            lock(&shared.map).insert(key, value);
            shared.changed.notify_all();
            Encoder::new(reply::OK)
        }
        op::GET => {
            let key = d.str()?.to_string();
            let timeout = Duration::from_millis(d.u64()?);
            let keys = [key];
            match wait_for(shared, &keys, timeout) {
                Ok(map) => Encoder::new(reply::VALUE).bytes(&map[&keys[0]]),
                Err(missing) => Encoder::new(reply::TIMEOUT).str(&missing),
            }
        }
        op::WAIT => {
            let keys = d.strs()?;
            let timeout = Duration::from_millis(d.u64()?);
            match wait_for(shared, &keys, timeout) {
                Ok(_) => Encoder::new(reply::OK),
                Err(missing) => Encoder::new(reply::TIMEOUT).str(&missing),
            }
        }
        op::ADD => {
            let key = d.str()?.to_string();
            let delta = d.i64()?;
            let mut map = lock(&shared.map);
            let old = match map.get(&key) {
                None => 0,
                Some(v) => match std::str::from_utf8(v).ok().and_then(|s| s.parse().ok()) {
                    Some(n) => n,
                    None => {
                        let msg = format!("add: key {key:?} does not hold an integer");
                        return Ok(Encoder::new(reply::ERROR).str(&msg).0);
                    }
                },
            };
            let new = i64::wrapping_add(old, delta);
            map.insert(key, new.to_string().into_bytes());
            drop(map);
            shared.changed.notify_all();
            Encoder::new(reply::INT).i64(new)
        }
        op::DELETE => {
            let key = d.str()?;
            let existed = lock(&shared.map).remove(key).is_some();
            Encoder::new(reply::BOOL).u8(existed as u8)
        }
        op::NUM_KEYS => Encoder::new(reply::INT).i64(lock(&shared.map).len() as i64),
        op::CHECK => {
            let keys = d.strs()?;
            let map = lock(&shared.map);
            let all = keys.iter().all(|k| map.contains_key(k));
            Encoder::new(reply::BOOL).u8(all as u8)
        }
        other => {
            let msg = format!("unknown opcode {other}");
            Encoder::new(reply::ERROR).str(&msg)
        }
    };
    Ok(answer.0)
}

/// Blocks until every key exists, returning the locked map, or returns the
/// first missing key once `timeout` has passed (or the server shuts down).
fn wait_for<'a>(
    shared: &'a Shared,
    keys: &[String],
    timeout: Duration,
) -> std::result::Result<MutexGuard<'a, HashMap<String, Vec<u8>>>, String> {
    let deadline = Instant::now() + timeout;
    let mut map = lock(&shared.map);
    loop {
        let missing = keys.iter().find(|k| !map.contains_key(*k));
        let Some(missing) = missing else {
            return Ok(map);
        };
        let now = Instant::now();
        if now >= deadline || shared.shutdown.load(Ordering::SeqCst) {
            return Err(missing.clone());
        }
        map = shared
            .changed
            .wait_timeout(map, deadline - now)
            .unwrap_or_else(|p| p.into_inner())
            .0;
    }
}
