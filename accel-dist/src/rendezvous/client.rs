//! The store client every rank uses, optionally owning the server (rank 0).

use std::collections::HashMap;
use std::io;
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::auth;
use super::protocol::{self, op, read_frame, reply, write_frame, Decoder, Encoder};
use super::store::{check_token, reachable, StoreLimits, StoreServer, CLIENT_LABEL, SERVER_LABEL};
use crate::{Error, ProcessGroupConfig, Result};

/// Extra time the client waits for an answer beyond the wait it asked the
/// server for, so a slow server is not mistaken for a missing key.
const ANSWER_SLACK: Duration = Duration::from_secs(10);
/// How long a reconnect after the store closed the connection may take.
const RECONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// A connection to the rendezvous key-value store (PyTorch's `TCPStore`).
///
/// Requests from one `TcpStore` are serialized; a blocking [`get`](Self::get)
/// holds the connection until it returns. Every blocking call waits at most
/// [`timeout`](Self::timeout). The store closes connections idle for
/// [`StoreLimits::idle_timeout`]; the next request then connects again,
/// claims the same ranks and is sent once more (the store never closes a
/// connection between reading a request and answering it).
pub struct TcpStore {
    addr: SocketAddr,
    token: String,
    timeout: Duration,
    max_frame: usize,
    local_ip: IpAddr,
    conn: Mutex<TcpStream>,
    /// Ranks claimed through this store, claimed again after a reconnect.
    claimed: Mutex<Vec<usize>>,
    generations: Mutex<HashMap<String, u64>>,
    // Declared last: the server outlives this store's own connection.
    server: Option<StoreServer>,
}

impl TcpStore {
    /// Hosts a store on `addr` (port 0 picks one; see [`addr`](Self::addr)) and connects to it.
    ///
    /// # Errors
    /// [`Error::Io`] when the address cannot be bound.
    pub fn host(addr: SocketAddr, token: &str, timeout: Duration) -> Result<Self> {
        let server = StoreServer::bind(addr, token)?;
        let mut store = Self::connect(reachable(server.local_addr()), token, timeout)?;
        store.server = Some(server);
        Ok(store)
    }

    /// Connects to the store at `addr`, retrying until `timeout` while it is not up yet.
    ///
    /// # Errors
    /// [`Error::StoreUnreachable`] after the timeout; [`Error::Refused`] when
    /// the store rejects `token` (a stray client is not retried) or cannot
    /// prove it holds it; [`Error::Env`] for an empty token.
    pub fn connect(addr: SocketAddr, token: &str, timeout: Duration) -> Result<Self> {
        check_token(token)?;
        let max_frame = StoreLimits::from_env()?.max_frame;
        let stream = open(addr, token, timeout, true)?;
        let local_ip = stream
            .local_addr()
            .map_err(|e| {
                Error::io(
                    format!("reading the local address of the store connection to {addr}"),
                    e,
                )
            })?
            .ip();
        Ok(Self {
            addr,
            token: token.to_string(),
            timeout,
            max_frame,
            local_ip,
            conn: Mutex::new(stream),
            claimed: Mutex::new(Vec::new()),
            generations: Mutex::new(HashMap::new()),
            server: None,
        })
    }

    /// Hosts (rank 0, unless a launcher does) or connects to the store of
    /// `config`, and claims `config.rank`.
    pub fn from_config(config: &ProcessGroupConfig) -> Result<Self> {
        let addr = config.master_socket_addr()?;
        let store = if config.hosts_store() {
            Self::host(addr, &config.job_token, config.timeout)?
        } else {
            Self::connect(addr, &config.job_token, config.timeout)?
        };
        store.claim_rank(config.rank)?;
        Ok(store)
    }

    /// Claims `rank` for this process: afterwards only this process may write
    /// the keys under `accel/rank/<rank>/`, each once. Claiming again from
    /// the same process (another connection, a reconnect) succeeds.
    ///
    /// # Errors
    /// [`Error::Store`] when another process claimed `rank` first.
    pub fn claim_rank(&self, rank: usize) -> Result<()> {
        let secret = auth::claim_secret().map_err(|e| self.error("claim", "", e))?;
        let body = Encoder::new(op::CLAIM).u32(rank as u32).bytes(&secret).0;
        let key = format!("rank {rank}");
        self.request("claim", &key, &body, Duration::ZERO)?
            .expect_status("claim", &key, self, reply::OK)?;
        let mut claimed = self.claimed.lock().unwrap_or_else(|p| p.into_inner());
        if !claimed.contains(&rank) {
            claimed.push(rank);
        }
        Ok(())
    }

    /// The store address (with the real port when hosted on port 0).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Whether this process hosts the store.
    pub fn is_host(&self) -> bool {
        self.server.is_some()
    }

    /// How long blocking calls wait.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Sets how long blocking calls wait.
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
    }

    /// The job token the store proofs use; peers prove it to each other too.
    pub fn token(&self) -> &str {
        &self.token
    }

    /// The local IP address that reaches the store: the interface other ranks can reach us on.
    pub fn local_ip(&self) -> IpAddr {
        self.local_ip
    }

    /// Stores `value` under `key`, replacing any previous value.
    pub fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        let body = Encoder::new(op::SET).str(key).bytes(value).0;
        self.request("set", key, &body, Duration::ZERO)?
            .expect_status("set", key, self, reply::OK)
    }

    /// Returns the value of `key`, waiting up to the timeout for another rank to set it.
    ///
    /// # Errors
    /// [`Error::StoreTimeout`] naming the key and the address.
    pub fn get(&self, key: &str) -> Result<Vec<u8>> {
        let body = Encoder::new(op::GET).str(key).u64(millis(self.timeout)).0;
        let answer = self.request("get", key, &body, self.timeout)?;
        match answer.status {
            reply::VALUE => answer.field("get", key, self, |d| d.bytes().map(<[u8]>::to_vec)),
            reply::TIMEOUT => Err(self.timeout_error("get", key)),
            _ => Err(answer.unexpected("get", key, self)),
        }
    }

    /// Waits up to the timeout until every key in `keys` exists.
    ///
    /// # Errors
    /// [`Error::StoreTimeout`] naming the first missing key.
    pub fn wait(&self, keys: &[&str]) -> Result<()> {
        let mut e = Encoder::new(op::WAIT).u32(keys.len() as u32);
        for k in keys {
            e = e.str(k);
        }
        let body = e.u64(millis(self.timeout)).0;
        let first = keys.first().copied().unwrap_or_default();
        let answer = self.request("wait", first, &body, self.timeout)?;
        match answer.status {
            reply::OK => Ok(()),
            reply::TIMEOUT => {
                let missing = answer.field("wait", first, self, |d| d.str().map(str::to_string))?;
                Err(self.timeout_error("wait", &missing))
            }
            _ => Err(answer.unexpected("wait", first, self)),
        }
    }

    /// Adds `delta` to the integer under `key` (missing keys count as 0) and
    /// returns the new value; the value reads back through [`get`](Self::get) as decimal text.
    pub fn add(&self, key: &str, delta: i64) -> Result<i64> {
        let body = Encoder::new(op::ADD).str(key).i64(delta).0;
        let answer = self.request("add", key, &body, Duration::ZERO)?;
        match answer.status {
            reply::INT => answer.field("add", key, self, |d| d.i64()),
            _ => Err(answer.unexpected("add", key, self)),
        }
    }

    /// Removes `key`; returns whether it existed.
    pub fn delete(&self, key: &str) -> Result<bool> {
        let body = Encoder::new(op::DELETE).str(key).0;
        let answer = self.request("delete", key, &body, Duration::ZERO)?;
        match answer.status {
            reply::BOOL => answer.field("delete", key, self, |d| d.u8().map(|b| b != 0)),
            _ => Err(answer.unexpected("delete", key, self)),
        }
    }

    /// The number of keys in the store.
    pub fn num_keys(&self) -> Result<usize> {
        let answer = self.request("num_keys", "", &[op::NUM_KEYS], Duration::ZERO)?;
        match answer.status {
            reply::INT => answer.field("num_keys", "", self, |d| d.i64().map(|n| n as usize)),
            _ => Err(answer.unexpected("num_keys", "", self)),
        }
    }

    /// Whether every key in `keys` exists, without waiting.
    pub fn check(&self, keys: &[&str]) -> Result<bool> {
        let mut e = Encoder::new(op::CHECK).u32(keys.len() as u32);
        for k in keys {
            e = e.str(k);
        }
        let first = keys.first().copied().unwrap_or_default();
        let answer = self.request("check", first, &e.0, Duration::ZERO)?;
        match answer.status {
            reply::BOOL => answer.field("check", first, self, |d| d.u8().map(|b| b != 0)),
            _ => Err(answer.unexpected("check", first, self)),
        }
    }

    /// Blocks until all `world_size` ranks have called `barrier` with the same
    /// `name` (the n-th call with a name matches every rank's n-th call).
    ///
    /// # Errors
    /// [`Error::BarrierTimeout`] listing the ranks that did not arrive.
    pub fn barrier(&self, name: &str, rank: usize, world_size: usize) -> Result<()> {
        let generation = self.next_generation(&format!("barrier/{name}"));
        let prefix = format!("accel/barrier/{name}/{generation}");
        self.set(&format!("{prefix}/rank/{rank}"), b"")?;
        if self.add(&format!("{prefix}/count"), 1)? == world_size as i64 {
            self.set(&format!("{prefix}/done"), b"")?;
        }
        match self.wait(&[&format!("{prefix}/done")]) {
            Err(Error::StoreTimeout { .. }) => {
                let mut missing = Vec::new();
                for r in 0..world_size {
                    if !self.check(&[&format!("{prefix}/rank/{r}")])? {
                        missing.push(r);
                    }
                }
                Err(Error::BarrierTimeout {
                    name: name.to_string(),
                    missing,
                    waited: self.timeout,
                    world: world_size,
                })
            }
            other => other,
        }
    }

    /// Returns how many times `scope` was asked for before, so ranks that
    /// create objects in the same order derive the same key prefixes.
    pub(crate) fn next_generation(&self, scope: &str) -> u64 {
        let mut gens = self.generations.lock().unwrap_or_else(|p| p.into_inner());
        let g = gens.entry(scope.to_string()).or_insert(0);
        *g += 1;
        *g - 1
    }

    fn timeout_error(&self, op: &'static str, key: &str) -> Error {
        Error::StoreTimeout {
            op,
            key: key.to_string(),
            addr: self.addr.to_string(),
            waited: self.timeout,
        }
    }

    fn error(&self, op: &'static str, key: &str, reason: impl ToString) -> Error {
        Error::Store {
            op,
            key: key.to_string(),
            addr: self.addr.to_string(),
            reason: reason.to_string(),
        }
    }

    /// Sends one request and reads its answer; `wait` is how long the server
    /// may block. A connection the store closed while idle is replaced and the
    /// request sent again, once.
    fn request(&self, op: &'static str, key: &str, body: &[u8], wait: Duration) -> Result<Answer> {
        let mut conn = self.lock_conn();
        match self.exchange(&conn, body, wait) {
            Err(e) if closed(&e) => {
                tracing::debug!(addr = %self.addr, "store connection closed; reconnecting");
                // The store was up a moment ago: if it does not take a new
                // connection soon, it is gone, and waiting the whole timeout
                // would only delay the error.
                let timeout = self.timeout.min(RECONNECT_TIMEOUT);
                *conn = open(self.addr, &self.token, timeout, false)?;
                let claimed = self
                    .claimed
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .clone();
                for rank in claimed {
                    let secret = auth::claim_secret().map_err(|e| self.error(op, key, e))?;
                    let claim = Encoder::new(op::CLAIM).u32(rank as u32).bytes(&secret).0;
                    let answer = self.exchange(&conn, &claim, Duration::ZERO);
                    let answer = answer.map_err(|e| self.io_error(op, key, e))?;
                    answer.expect_status(op, key, self, reply::OK)?;
                }
                self.exchange(&conn, body, wait)
            }
            other => other,
        }
        .map_err(|e| self.io_error(op, key, e))
    }

    fn io_error(&self, op: &'static str, key: &str, e: io::Error) -> Error {
        match e.kind() {
            io::ErrorKind::UnexpectedEof => self.error(op, key, "the store closed the connection"),
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => {
                self.error(op, key, "the store did not answer")
            }
            _ => self.error(op, key, e),
        }
    }

    fn exchange(&self, conn: &TcpStream, body: &[u8], wait: Duration) -> io::Result<Answer> {
        conn.set_read_timeout(Some(wait + ANSWER_SLACK))?;
        write_frame(conn, body)?;
        let frame = read_frame(conn, self.max_frame)?;
        let (&status, rest) = frame
            .split_first()
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "empty answer"))?;
        Ok(Answer {
            status,
            rest: rest.to_vec(),
        })
    }

    fn lock_conn(&self) -> MutexGuard<'_, TcpStream> {
        // A panic mid-request may leave a half-read answer on the socket, but
        // the next request then fails loudly rather than silently.
        self.conn.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// A decoded reply: status byte and remaining fields.
struct Answer {
    status: u8,
    rest: Vec<u8>,
}

impl Answer {
    fn field<T>(
        &self,
        op: &'static str,
        key: &str,
        store: &TcpStore,
        f: impl FnOnce(&mut Decoder<'_>) -> io::Result<T>,
    ) -> Result<T> {
        f(&mut Decoder(&self.rest)).map_err(|e| store.error(op, key, e))
    }

    fn expect_status(self, op: &'static str, key: &str, store: &TcpStore, want: u8) -> Result<()> {
        if self.status == want {
            Ok(())
        } else {
            Err(self.unexpected(op, key, store))
        }
    }

    fn unexpected(&self, op: &'static str, key: &str, store: &TcpStore) -> Error {
        if self.status == reply::ERROR {
            let msg = Decoder(&self.rest)
                .str()
                .unwrap_or("(unreadable message)")
                .to_string();
            store.error(op, key, msg)
        } else {
            store.error(op, key, format!("unexpected answer status {}", self.status))
        }
    }
}

/// Whether `e` means the store closed the connection before answering.
fn closed(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::UnexpectedEof
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::BrokenPipe
    )
}

/// Connects and authenticates, retrying until `timeout` while the store is
/// not up yet; when not `patient`, a refused connection (no store listening)
/// fails at once.
fn open(addr: SocketAddr, token: &str, timeout: Duration, patient: bool) -> Result<TcpStream> {
    let start = Instant::now();
    let mut backoff = Duration::from_millis(5);
    loop {
        let left = timeout.saturating_sub(start.elapsed());
        let attempt = TcpStream::connect_timeout(&addr, left.max(Duration::from_millis(1)));
        match attempt.and_then(|s| handshake(s, token)) {
            Ok(Ok(s)) => return Ok(s),
            Ok(Err(reason)) => {
                return Err(Error::Refused {
                    addr: addr.to_string(),
                    reason,
                })
            }
            Err(e)
                if start.elapsed() + backoff >= timeout
                    || (!patient && e.kind() == io::ErrorKind::ConnectionRefused) =>
            {
                return Err(Error::StoreUnreachable {
                    addr: addr.to_string(),
                    waited: timeout,
                    reason: e.to_string(),
                })
            }
            Err(_) => {
                std::thread::sleep(backoff);
                backoff = (backoff * 2).min(Duration::from_millis(200));
            }
        }
    }
}

/// Proves the token to the store and checks the store's proof; the outer
/// error is a transport failure (retried), the inner one a refusal (not retried).
fn handshake(stream: TcpStream, token: &str) -> io::Result<std::result::Result<TcpStream, String>> {
    stream.set_nodelay(true)?;
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    let client = auth::random()?;
    let mut hello = protocol::MAGIC.to_vec();
    hello.extend_from_slice(&client);
    write_frame(&stream, &hello)?;
    let server: auth::Bytes32 = match accepted(&stream)? {
        Ok(nonce) => nonce.try_into().map_err(|_| malformed())?,
        Err(reason) => return Ok(Err(reason)),
    };
    write_frame(
        &stream,
        &auth::proof(token, CLIENT_LABEL, &[&server, &client]),
    )?;
    let theirs = match accepted(&stream)? {
        Ok(proof) => proof,
        Err(reason) => return Ok(Err(reason)),
    };
    let want = auth::proof(token, SERVER_LABEL, &[&client, &server]);
    if !auth::same(&want, &theirs) {
        return Ok(Err(
            "the server could not prove it holds the job token (not this job's store)".into(),
        ));
    }
    Ok(Ok(stream))
}

/// Reads `ACCEPTED bytes` (the bytes) or `REFUSED reason` (the reason).
fn accepted(stream: &TcpStream) -> io::Result<std::result::Result<Vec<u8>, String>> {
    let answer = read_frame(stream, protocol::MAX_HANDSHAKE)?;
    let mut d = Decoder(&answer);
    Ok(match d.u8()? {
        protocol::ACCEPTED => Ok(d.bytes()?.to_vec()),
        _ => Err(d.str().unwrap_or("refused").to_string()),
    })
}

fn malformed() -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, "malformed store handshake")
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}
