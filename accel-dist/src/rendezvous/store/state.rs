//! The store's data: keys and values, their byte count, and the ranks claimed.
//!
//! Keys under `accel/rank/<r>/` belong to rank `r`: only a connection that
//! claimed `r` may write them, once. A rank publishes its addresses and its
//! handshake commitments there, so a process holding the token still cannot
//! redirect or impersonate a rank that claimed before it.

use std::collections::HashMap;
use std::io;
use std::time::{Duration, Instant};

use super::super::auth;
use super::super::protocol::{op, reply, Decoder, Encoder};

/// Prefix of the keys owned by one rank: `accel/rank/<r>/...`.
pub(crate) const OWNED_PREFIX: &str = "accel/rank/";

/// A `GET` or `WAIT` that found a key missing and waits for it.
pub(super) struct Pending {
    pub keys: Vec<String>,
    pub deadline: Instant,
    /// `GET` answers with the value, `WAIT` with OK.
    pub get: bool,
}

/// What a request leads to.
pub(super) enum Outcome {
    /// Answer now; `changed` when the map changed (waiters may be done).
    Reply { answer: Vec<u8>, changed: bool },
    /// Answer when the keys exist or at the deadline.
    Wait(Pending),
}

/// Who claimed a rank.
struct Claim {
    secret: auth::Bytes32,
    peer: String,
}

pub(super) struct State {
    map: HashMap<String, Vec<u8>>,
    /// Key and value bytes held.
    bytes: usize,
    max_bytes: usize,
    claims: HashMap<u32, Claim>,
}

/// The rank that owns `key`, or an error for a malformed owned key.
pub(crate) fn owner(key: &str) -> Result<Option<u32>, String> {
    let Some(rest) = key.strip_prefix(OWNED_PREFIX) else {
        return Ok(None);
    };
    let rank = rest.split('/').next().unwrap_or_default();
    match rank.parse() {
        Ok(r) if rest.len() > rank.len() + 1 => Ok(Some(r)),
        _ => Err(format!(
            "key {key:?} is under {OWNED_PREFIX} but not of the form {OWNED_PREFIX}<rank>/<name>"
        )),
    }
}

impl State {
    pub fn new(max_bytes: usize) -> Self {
        Self {
            map: HashMap::new(),
            bytes: 0,
            max_bytes,
            claims: HashMap::new(),
        }
    }

    /// Answers one request from a connection that claimed `claimed` and came
    /// from `peer`.
    pub fn handle(
        &mut self,
        request: &[u8],
        claimed: &mut Vec<u32>,
        peer: &str,
    ) -> io::Result<Outcome> {
        let mut d = Decoder(request);
        let done = |e: Encoder, changed| Outcome::Reply {
            answer: e.0,
            changed,
        };
        let refuse = |msg: String| done(Encoder::new(reply::ERROR).str(&msg), false);
        Ok(match d.u8()? {
            op::SET => {
                let key = d.str()?;
                let value = d.bytes()?;
                match owner(key) {
                    Err(msg) => return Ok(refuse(msg)),
                    Ok(Some(r)) if !claimed.contains(&r) => {
                        return Ok(refuse(format!(
                            "key {key:?} belongs to rank {r}, which this connection has not claimed"
                        )))
                    }
                    Ok(Some(_)) if self.map.contains_key(key) => {
                        return Ok(refuse(format!("key {key:?} is write-once and already set")))
                    }
                    _ => {}
                }
                match self.insert(key, value.to_vec()) {
                    Ok(()) => done(Encoder::new(reply::OK), true),
                    Err(msg) => refuse(msg),
                }
            }
            op::GET | op::WAIT => {
                let get = request[0] == op::GET;
                let keys = match get {
                    true => vec![d.str()?.to_string()],
                    false => d.strs()?,
                };
                let wait = Duration::from_millis(d.u64()?);
                let deadline = Instant::now()
                    .checked_add(wait)
                    .unwrap_or_else(|| Instant::now() + Duration::from_secs(1 << 32));
                let pending = Pending {
                    keys,
                    deadline,
                    get,
                };
                match self.finish(&pending) {
                    Some(answer) => done(Encoder(answer), false),
                    None => Outcome::Wait(pending),
                }
            }
            op::ADD => {
                let key = d.str()?;
                let delta = d.i64()?;
                if let Some(msg) = self.owned_refusal(key) {
                    return Ok(refuse(msg));
                }
                let old = match self.map.get(key) {
                    None => 0,
                    Some(v) => match std::str::from_utf8(v).ok().and_then(|s| s.parse().ok()) {
                        Some(n) => n,
                        None => {
                            return Ok(refuse(format!("add: key {key:?} does not hold an integer")))
                        }
                    },
                };
                let new = i64::wrapping_add(old, delta);
                match self.insert(key, new.to_string().into_bytes()) {
                    Ok(()) => done(Encoder::new(reply::INT).i64(new), true),
                    Err(msg) => refuse(msg),
                }
            }
            op::DELETE => {
                let key = d.str()?;
                if let Some(msg) = self.owned_refusal(key) {
                    return Ok(refuse(msg));
                }
                let old = self.map.remove(key);
                if let Some(v) = &old {
                    self.bytes -= key.len() + v.len();
                }
                done(Encoder::new(reply::BOOL).u8(old.is_some() as u8), false)
            }
            op::NUM_KEYS => done(Encoder::new(reply::INT).i64(self.map.len() as i64), false),
            op::CHECK => {
                let keys = d.strs()?;
                let all = keys.iter().all(|k| self.map.contains_key(k));
                done(Encoder::new(reply::BOOL).u8(all as u8), false)
            }
            op::CLAIM => {
                let rank = d.u32()?;
                let secret: auth::Bytes32 = d
                    .bytes()?
                    .try_into()
                    .map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "claim secret"))?;
                match self.claims.get(&rank) {
                    Some(c) if !auth::same(&c.secret, &secret) => {
                        tracing::warn!(rank, %peer, first = %c.peer, "refused a second claim of a rank");
                        return Ok(refuse(format!(
                            "rank {rank} is already claimed by another process (connected from {})",
                            c.peer
                        )));
                    }
                    Some(_) => {}
                    None => {
                        let claim = Claim {
                            secret,
                            peer: peer.to_string(),
                        };
                        self.claims.insert(rank, claim);
                    }
                }
                if !claimed.contains(&rank) {
                    claimed.push(rank);
                }
                done(Encoder::new(reply::OK), false)
            }
            other => refuse(format!("unknown opcode {other}")),
        })
    }

    /// The answer to `pending` if every key it waits for exists.
    pub fn finish(&self, pending: &Pending) -> Option<Vec<u8>> {
        if !pending.keys.iter().all(|k| self.map.contains_key(k)) {
            return None;
        }
        Some(match pending.get {
            true => {
                Encoder::new(reply::VALUE)
                    .bytes(&self.map[&pending.keys[0]])
                    .0
            }
            false => vec![reply::OK],
        })
    }

    /// The answer to `pending` at its deadline: the first key still missing.
    pub fn timed_out(&self, pending: &Pending) -> Vec<u8> {
        let missing = pending.keys.iter().find(|k| !self.map.contains_key(*k));
        let missing = missing.map(String::as_str).unwrap_or_default();
        Encoder::new(reply::TIMEOUT).str(missing).0
    }

    fn owned_refusal(&self, key: &str) -> Option<String> {
        match owner(key) {
            Err(msg) => Some(msg),
            Ok(Some(r)) => Some(format!("key {key:?} belongs to rank {r} and is write-once")),
            Ok(None) => None,
        }
    }

    fn insert(&mut self, key: &str, value: Vec<u8>) -> Result<(), String> {
        let old = self.map.get(key).map_or(0, |v| key.len() + v.len());
        let total = self.bytes - old + key.len() + value.len();
        if total > self.max_bytes {
            return Err(format!(
                "store full: setting {key:?} would hold {total} bytes, over the limit of {} \
                 (ACCEL_STORE_MAX_BYTES)",
                self.max_bytes
            ));
        }
        self.bytes = total;
        self.map.insert(key.to_string(), value);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(o: Outcome) -> (u8, String) {
        match o {
            Outcome::Reply { answer, .. } => {
                let msg = match answer[0] {
                    reply::ERROR => Decoder(&answer[1..]).str().unwrap().to_string(),
                    _ => String::new(),
                };
                (answer[0], msg)
            }
            Outcome::Wait(_) => panic!("waits"),
        }
    }

    fn set(k: &str, v: &[u8]) -> Vec<u8> {
        Encoder::new(op::SET).str(k).bytes(v).0
    }

    #[test]
    fn owned_keys_take_one_write_from_the_claiming_connection() {
        let mut s = State::new(1 << 20);
        let (mut a, mut b) = (Vec::new(), Vec::new());
        let claim = |secret: u8| Encoder::new(op::CLAIM).u32(1).bytes(&[secret; 32]).0;
        assert_eq!(
            answer(s.handle(&claim(7), &mut a, "a").unwrap()).0,
            reply::OK
        );
        let (st, msg) = answer(s.handle(&claim(8), &mut b, "b").unwrap());
        assert_eq!(st, reply::ERROR);
        assert!(
            msg.contains("rank 1 is already claimed") && msg.contains("from a"),
            "{msg}"
        );
        let key = "accel/rank/1/tcp/0";
        let (_, msg) = answer(s.handle(&set(key, b"x"), &mut b, "b").unwrap());
        assert!(msg.contains("has not claimed"), "{msg}");
        assert_eq!(
            answer(s.handle(&set(key, b"x"), &mut a, "a").unwrap()).0,
            reply::OK
        );
        let (_, msg) = answer(s.handle(&set(key, b"y"), &mut a, "a").unwrap());
        assert!(msg.contains("write-once"), "{msg}");
        let del = Encoder::new(op::DELETE).str(key).0;
        let (_, msg) = answer(s.handle(&del, &mut a, "a").unwrap());
        assert!(msg.contains("write-once"), "{msg}");
        // The same secret on another connection (a reconnect) may write.
        assert_eq!(
            answer(s.handle(&claim(7), &mut b, "b").unwrap()).0,
            reply::OK
        );
        let other = "accel/rank/1/tcp/1";
        assert_eq!(
            answer(s.handle(&set(other, b"z"), &mut b, "b").unwrap()).0,
            reply::OK
        );
        let (_, msg) = answer(s.handle(&set("accel/rank/x/y", b""), &mut a, "a").unwrap());
        assert!(msg.contains("not of the form"), "{msg}");
        assert_eq!(owner("accel/rank/12/a/b"), Ok(Some(12)));
        assert!(owner("accel/rank/12").is_err());
        assert_eq!(owner("accel/ranks"), Ok(None));
    }

    #[test]
    fn the_byte_limit_counts_keys_and_values_and_frees_on_delete() {
        let mut s = State::new(10);
        let mut c = Vec::new();
        assert_eq!(
            answer(s.handle(&set("k", b"123456"), &mut c, "").unwrap()).0,
            reply::OK
        );
        // Replacing a value counts only the new one.
        assert_eq!(
            answer(s.handle(&set("k", b"123456789"), &mut c, "").unwrap()).0,
            reply::OK
        );
        let (st, msg) = answer(s.handle(&set("j", b"1"), &mut c, "").unwrap());
        assert_eq!(st, reply::ERROR);
        assert!(
            msg.contains("store full") && msg.contains("12 bytes"),
            "{msg}"
        );
        let del = Encoder::new(op::DELETE).str("k").0;
        answer(s.handle(&del, &mut c, "").unwrap());
        assert_eq!(s.bytes, 0);
        assert_eq!(
            answer(s.handle(&set("j", b"1"), &mut c, "").unwrap()).0,
            reply::OK
        );
    }
}
