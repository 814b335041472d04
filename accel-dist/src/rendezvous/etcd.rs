//! A client of etcd's v3 API through its JSON gateway (`POST /v3/...` over
//! HTTP, keys and values in base64), for what launchers on several machines
//! must agree on without a store that dies with one of them: the members of
//! a round, under leases that expire with a dead machine.
//!
//! Why the gateway and not gRPC: every etcd since 3.3 serves it on the client
//! port, it needs no protobuf code generation, and the workspace already
//! builds a blocking HTTP client with timeouts (`ureq`, the MLflow tracker's).
//! torchrun's etcd rendezvous uses the same API (through `python-etcd` or
//! `etcd3`).
//!
//! Only what a rendezvous needs: puts (under a lease), reads of a key or a
//! prefix, transactions that create a key only where it is absent or swap it
//! only at the revision read, leases (grant, keep alive, revoke) and deletes.
//! Every call is bounded by the client's timeout and fails naming the
//! endpoint, the operation and the key.

use std::time::Duration;

use base64::engine::general_purpose::STANDARD as B64;
use base64::Engine;
use serde_json::{json, Value};

use crate::{Error, Result};

/// A client of one etcd endpoint (`host:port`, or a URL with `http://`).
#[derive(Clone)]
pub struct Etcd {
    base: String,
    agent: ureq::Agent,
}

impl std::fmt::Debug for Etcd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Etcd")
            .field("endpoint", &self.base)
            .finish()
    }
}

/// A key's value and the revision that last wrote it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// The key.
    pub key: String,
    /// Its value.
    pub value: Vec<u8>,
    /// The store revision of the key's last write (for [`Etcd::swap`]).
    pub mod_revision: i64,
    /// The lease the key is attached to, 0 for none.
    pub lease: i64,
}

impl Etcd {
    /// A client of `endpoint` whose every call gives up after `timeout`;
    /// checks that an etcd answers there (its `maintenance/status`).
    ///
    /// # Errors
    /// [`Error::Etcd`] when nothing answers, or not as etcd does.
    pub fn connect(endpoint: &str, timeout: Duration) -> Result<Self> {
        let base = if endpoint.contains("://") {
            endpoint.trim_end_matches('/').to_string()
        } else {
            format!("http://{endpoint}")
        };
        let agent = ureq::AgentBuilder::new()
            .timeout_connect(timeout)
            .timeout(timeout)
            .build();
        let etcd = Self { base, agent };
        let status = etcd.call("status", "", "maintenance/status", json!({}))?;
        if status.get("version").is_none() {
            return Err(etcd.error("status", "", format!("not etcd's answer: {status}")));
        }
        Ok(etcd)
    }

    /// The endpoint, as the errors name it.
    pub fn endpoint(&self) -> &str {
        &self.base
    }

    /// Sets `key` to `value`, attached to `lease` (0: none).
    ///
    /// # Errors
    /// [`Error::Etcd`].
    pub fn put(&self, key: &str, value: &[u8], lease: i64) -> Result<()> {
        self.call("put", key, "kv/put", put_body(key, value, lease))?;
        Ok(())
    }

    /// The entry of `key`, if it exists.
    ///
    /// # Errors
    /// [`Error::Etcd`].
    pub fn get(&self, key: &str) -> Result<Option<Entry>> {
        let reply = self.call("get", key, "kv/range", json!({ "key": B64.encode(key) }))?;
        Ok(self.entries("get", key, &reply)?.into_iter().next())
    }

    /// Every entry whose key starts with `prefix`, in key order.
    ///
    /// # Errors
    /// [`Error::Etcd`].
    pub fn get_prefix(&self, prefix: &str) -> Result<Vec<Entry>> {
        let reply = self.call("get_prefix", prefix, "kv/range", prefix_range(prefix))?;
        self.entries("get_prefix", prefix, &reply)
    }

    /// Sets `key` only where it does not exist yet (one transaction); whether
    /// it did.
    ///
    /// # Errors
    /// [`Error::Etcd`].
    pub fn create(&self, key: &str, value: &[u8], lease: i64) -> Result<bool> {
        let cmp = json!({
            "key": B64.encode(key),
            "target": "CREATE",
            "result": "EQUAL",
            "create_revision": "0",
        });
        self.txn("create", key, cmp, put_body(key, value, lease))
    }

    /// Sets `key` only while its last write is still `mod_revision` (read
    /// with [`Etcd::get`]); whether it was.
    ///
    /// # Errors
    /// [`Error::Etcd`].
    pub fn swap(&self, key: &str, mod_revision: i64, value: &[u8], lease: i64) -> Result<bool> {
        let cmp = json!({
            "key": B64.encode(key),
            "target": "MOD",
            "result": "EQUAL",
            "mod_revision": mod_revision.to_string(),
        });
        self.txn("swap", key, cmp, put_body(key, value, lease))
    }

    /// Deletes `key`; whether it existed.
    ///
    /// # Errors
    /// [`Error::Etcd`].
    pub fn delete(&self, key: &str) -> Result<bool> {
        let reply = self.call(
            "delete",
            key,
            "kv/deleterange",
            json!({ "key": B64.encode(key) }),
        )?;
        Ok(int(&reply["deleted"]).unwrap_or(0) > 0)
    }

    /// Deletes every key that starts with `prefix`; how many there were.
    ///
    /// # Errors
    /// [`Error::Etcd`].
    pub fn delete_prefix(&self, prefix: &str) -> Result<u64> {
        let reply = self.call(
            "delete_prefix",
            prefix,
            "kv/deleterange",
            prefix_range(prefix),
        )?;
        Ok(int(&reply["deleted"]).unwrap_or(0).max(0) as u64)
    }

    /// A new lease that expires `ttl` (whole seconds, at least 1) after its
    /// last keep-alive; its id.
    ///
    /// # Errors
    /// [`Error::Etcd`].
    pub fn grant(&self, ttl: Duration) -> Result<i64> {
        let ttl = ttl.as_secs().max(1);
        let reply = self.call(
            "grant",
            "",
            "lease/grant",
            json!({ "TTL": ttl.to_string() }),
        )?;
        int(&reply["ID"]).ok_or_else(|| self.error("grant", "", format!("no lease id in {reply}")))
    }

    /// Renews `lease`; the seconds it now has left.
    ///
    /// # Errors
    /// [`Error::Etcd`], also when the lease has expired (its keys are gone).
    pub fn keep_alive(&self, lease: i64) -> Result<Duration> {
        self.renew(lease)?
            .ok_or_else(|| self.error("keep_alive", "", format!("lease {lease:x} has expired")))
    }

    /// Renews `lease`: the seconds it now has left, or `None` when it has
    /// already expired (etcd answered, and its keys are gone).
    ///
    /// # Errors
    /// [`Error::Etcd`] when etcd does not answer.
    pub fn renew(&self, lease: i64) -> Result<Option<Duration>> {
        let reply = self.call(
            "keep_alive",
            "",
            "lease/keepalive",
            json!({ "ID": lease.to_string() }),
        )?;
        // The gateway streams replies; one renewal answers `{"result": {...}}`.
        let result = reply.get("result").unwrap_or(&reply);
        Ok(int(&result["TTL"])
            .filter(|&ttl| ttl > 0)
            .map(|ttl| Duration::from_secs(ttl as u64)))
    }

    /// Ends `lease` now, deleting its keys.
    ///
    /// # Errors
    /// [`Error::Etcd`].
    pub fn revoke(&self, lease: i64) -> Result<()> {
        self.call(
            "revoke",
            "",
            "lease/revoke",
            json!({ "ID": lease.to_string() }),
        )?;
        Ok(())
    }

    /// One compare-then-put transaction: whether the comparison held.
    fn txn(&self, op: &'static str, key: &str, cmp: Value, put: Value) -> Result<bool> {
        let body = json!({ "compare": [cmp], "success": [{ "request_put": put }] });
        let reply = self.call(op, key, "kv/txn", body)?;
        Ok(reply["succeeded"].as_bool().unwrap_or(false))
    }

    /// The entries of a range reply.
    fn entries(&self, op: &'static str, key: &str, reply: &Value) -> Result<Vec<Entry>> {
        let Some(kvs) = reply.get("kvs") else {
            return Ok(Vec::new());
        };
        let kvs = kvs
            .as_array()
            .ok_or_else(|| self.error(op, key, format!("kvs is not a list: {reply}")))?;
        kvs.iter()
            .map(|kv| {
                let text = |field: &str| -> Result<Vec<u8>> {
                    let s = kv[field].as_str().unwrap_or("");
                    B64.decode(s)
                        .map_err(|e| self.error(op, key, format!("{field} is not base64: {e}")))
                };
                let name = String::from_utf8(text("key")?)
                    .map_err(|e| self.error(op, key, format!("a key is not UTF-8: {e}")))?;
                Ok(Entry {
                    key: name,
                    value: text("value")?,
                    mod_revision: int(&kv["mod_revision"]).unwrap_or(0),
                    lease: int(&kv["lease"]).unwrap_or(0),
                })
            })
            .collect()
    }

    /// `POST /v3/<path>` with `body`; the JSON reply.
    fn call(&self, op: &'static str, key: &str, path: &str, body: Value) -> Result<Value> {
        let url = format!("{}/v3/{path}", self.base);
        match self.agent.post(&url).send_json(body) {
            Ok(reply) => reply
                .into_json()
                .map_err(|e| self.error(op, key, format!("unreadable reply: {e}"))),
            Err(ureq::Error::Status(code, reply)) => {
                let text = reply.into_string().unwrap_or_default();
                Err(self.error(op, key, format!("HTTP {code}: {}", text.trim())))
            }
            Err(e) => Err(self.error(op, key, e.to_string())),
        }
    }

    fn error(&self, op: &'static str, key: &str, reason: String) -> Error {
        Error::Etcd {
            endpoint: self.base.clone(),
            op,
            key: key.to_string(),
            reason,
        }
    }
}

/// The body of a put (also a transaction's).
fn put_body(key: &str, value: &[u8], lease: i64) -> Value {
    let mut body = json!({ "key": B64.encode(key), "value": B64.encode(value) });
    if lease != 0 {
        body["lease"] = json!(lease.to_string());
    }
    body
}

/// The range of every key that starts with `prefix`, as a range or delete
/// request takes it.
fn prefix_range(prefix: &str) -> Value {
    json!({ "key": B64.encode(prefix), "range_end": B64.encode(prefix_end(prefix)) })
}

/// The end of the range of keys that start with `prefix` (etcd's
/// `clientv3.GetPrefixRangeEnd`): the prefix with its last byte that is not
/// 0xff incremented, and what follows dropped.
fn prefix_end(prefix: &str) -> Vec<u8> {
    let mut end = prefix.as_bytes().to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    // Every byte 0xff (or empty): to the end of the key space.
    vec![0]
}

/// An int64 of a reply: protobuf's JSON writes them as strings.
fn int(v: &Value) -> Option<i64> {
    match v {
        Value::String(s) => s.parse().ok(),
        Value::Number(n) => n.as_i64(),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_ends_are_etcds() {
        assert_eq!(prefix_end("accel/a"), b"accel/b".to_vec());
        assert_eq!(prefix_end("x\u{7f}"), b"x\x80".to_vec());
        assert_eq!(prefix_end(""), vec![0]);
    }

    #[test]
    fn int64s_are_read_as_protobuf_writes_them() {
        assert_eq!(
            int(&json!("7587873340512712324")),
            Some(7587873340512712324)
        );
        assert_eq!(int(&json!(5)), Some(5));
        assert_eq!(int(&json!(null)), None);
    }

    #[test]
    fn an_endpoint_where_nothing_listens_is_named() {
        // A port nothing listens on: bind one, note it, close it.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .unwrap();
        let err = Etcd::connect(&format!("127.0.0.1:{port}"), Duration::from_secs(2)).unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains(&format!("http://127.0.0.1:{port}")) && text.contains("status"),
            "{text}"
        );
    }
}
