//! The rendezvous store: a small TCP key-value service the ranks meet through.
//!
//! Rank 0 (or a launcher) hosts a [`StoreServer`]; every rank holds a
//! [`TcpStore`] client. Ranks publish their listening addresses in it, count
//! arrivals with [`TcpStore::add`] and block on each other with
//! [`TcpStore::get`]/[`TcpStore::wait`]/[`TcpStore::barrier`], like PyTorch's
//! `TCPStore`.
//!
//! # Wire protocol
//!
//! Hand-written and length-prefixed; all integers are little-endian.
//!
//! ```text
//! frame    = len:u32 body[len]
//! str      = n:u32 utf8[n]            bytes = n:u32 byte[n]
//!
//! handshake (frames of at most 4 KiB; the token never travels, see `auth`):
//!     client: "ACCELKV2" client_nonce[32]
//!     server: 0x00 server_nonce:bytes
//!     client: HMAC-SHA256(token, "accel-store-client" | server_nonce | client_nonce)
//!     server: 0x00 HMAC-SHA256(token, "accel-store-server" | client_nonce | server_nonce):bytes
//! either server answer may instead be
//!     0x01 reason:str                 refused (wrong token, bad magic); the server closes
//!
//! requests (client -> server):        replies (server -> client):
//!     0x01 SET      key:str value:bytes           0x00 OK
//!     0x02 GET      key:str wait_ms:u64           0x01 VALUE value:bytes | 0x02 TIMEOUT key:str
//!     0x03 WAIT     n:u32 key:str*n wait_ms:u64   0x00 OK | 0x02 TIMEOUT first_missing:str
//!     0x04 ADD      key:str delta:i64             0x03 INT new_value:i64
//!     0x05 DELETE   key:str                       0x04 BOOL existed:u8
//!     0x06 NUM_KEYS                               0x03 INT count:i64
//!     0x07 CHECK    n:u32 key:str*n               0x04 BOOL all_present:u8
//!     0x08 CLAIM    rank:u32 secret:bytes         0x00 OK
//! any request may instead get                     0x05 ERROR message:str
//! ```
//!
//! `CLAIM` binds a rank to the first process that claims it (the secret is
//! drawn once per process, so its reconnects claim again). Keys under
//! `accel/rank/<r>/` may then be set only by connections that claimed `r`,
//! once each, and never added to or deleted: ranks publish their addresses
//! and handshake commitments there.
//!
//! `GET` and `WAIT` block on the server for at most `wait_ms`, so a client
//! knows a missing key from a dead store. `ADD` keeps the counter as decimal
//! text, so `GET` of a counter reads e.g. `b"3"`. One client sends one request
//! at a time and reads its reply before the next.

pub(crate) mod auth;
mod client;
mod etcd;
pub(crate) mod protocol;
mod rounds;
mod store;

pub use auth::new_token;
pub use client::TcpStore;
pub use etcd::{Entry as EtcdEntry, Etcd};
pub use rounds::{join as join_round, waiting as waiting_nodes, Round, RoundSpec};
pub(crate) use store::OWNED_PREFIX;
pub use store::{StoreLimits, StoreServer};
