//! One client connection of the store: its buffers, handshake stage and timers.

use std::io::{self, Read, Write};
use std::time::Instant;

use mio::net::TcpStream;

use super::super::auth::{self, Bytes32};
use super::super::protocol::{self, Encoder, FrameReader};
use super::state::Pending;

/// Labels of the two store proofs (see `auth`).
pub(crate) const CLIENT_LABEL: &[u8] = b"accel-store-client";
pub(crate) const SERVER_LABEL: &[u8] = b"accel-store-server";

pub(super) enum Stage {
    /// Waiting for `"ACCELKV2" client_nonce`.
    Hello,
    /// Our nonce is sent; waiting for the client's proof.
    Proof { server: Bytes32, client: Bytes32 },
    /// Authenticated: serving requests.
    Ready,
    /// Refused or broken: send what is queued, then close.
    Closing,
}

/// What the handshake concluded from one frame.
pub(super) enum Step {
    Continue,
    Authenticated,
    Refused(String),
}

pub(super) struct Conn {
    pub stream: TcpStream,
    pub peer: String,
    pub stage: Stage,
    pub opened: Instant,
    pub last_active: Instant,
    /// When the frame being received started, if one is.
    pub frame_started: Option<Instant>,
    pub waiting: Option<Pending>,
    pub claimed: Vec<u32>,
    reader: FrameReader,
    /// Bytes read past the end of the last frame.
    leftover: Vec<u8>,
    out: Vec<u8>,
}

impl Conn {
    pub fn new(stream: TcpStream, peer: String, now: Instant) -> Self {
        Self {
            stream,
            peer,
            stage: Stage::Hello,
            opened: now,
            last_active: now,
            frame_started: None,
            waiting: None,
            claimed: Vec::new(),
            reader: FrameReader::new(protocol::MAX_HANDSHAKE),
            leftover: Vec::new(),
            out: Vec::new(),
        }
    }

    pub fn authenticated(&self) -> bool {
        matches!(self.stage, Stage::Ready)
    }

    /// Queues one frame for sending.
    pub fn send(&mut self, body: &[u8]) {
        self.out
            .extend_from_slice(&(body.len() as u32).to_le_bytes());
        self.out.extend_from_slice(body);
    }

    /// Whether queued bytes are still unsent.
    pub fn sending(&self) -> bool {
        !self.out.is_empty()
    }

    /// Writes queued bytes until the socket is full.
    pub fn flush(&mut self) -> io::Result<()> {
        while !self.out.is_empty() {
            match self.stream.write(&self.out) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => {
                    self.out.drain(..n);
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// The next complete frame, reading the socket as far as needed; `None`
    /// when the socket has no more bytes for now.
    pub fn next_frame(&mut self, now: Instant) -> io::Result<Option<Vec<u8>>> {
        if let Some(frame) = self.take_leftover(now)? {
            return Ok(Some(frame));
        }
        let mut buf = [0u8; 16 << 10];
        loop {
            let n = match self.stream.read(&mut buf) {
                Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(None),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            };
            self.last_active = now;
            self.leftover.extend_from_slice(&buf[..n]);
            if let Some(frame) = self.take_leftover(now)? {
                return Ok(Some(frame));
            }
        }
    }

    fn take_leftover(&mut self, now: Instant) -> io::Result<Option<Vec<u8>>> {
        if self.leftover.is_empty() {
            return Ok(None);
        }
        let (used, frame) = self.reader.feed(&self.leftover)?;
        self.leftover.drain(..used);
        self.frame_started = match (&frame, self.reader.in_progress()) {
            (None, true) => self.frame_started.or(Some(now)),
            _ => None,
        };
        Ok(frame)
    }

    /// Advances the handshake by one frame.
    pub fn handshake(&mut self, frame: &[u8], token: &str, max_frame: usize) -> io::Result<Step> {
        match self.stage {
            Stage::Hello => {
                let Some(rest) = frame.strip_prefix(&protocol::MAGIC[..]) else {
                    let reason = match frame.starts_with(b"ACCELKV") {
                        true => "store protocol version mismatch (an older or newer accel-rs?)",
                        false => "not an accel-rs store client (bad magic)",
                    };
                    return Ok(Step::Refused(reason.into()));
                };
                let Ok(client) = Bytes32::try_from(rest) else {
                    return Ok(Step::Refused("malformed handshake".into()));
                };
                let server = auth::random()?;
                self.send(&Encoder::new(protocol::ACCEPTED).bytes(&server).0);
                self.stage = Stage::Proof { server, client };
                Ok(Step::Continue)
            }
            Stage::Proof { server, client } => {
                let want = auth::proof(token, CLIENT_LABEL, &[&server, &client]);
                if !auth::same(&want, frame) {
                    return Ok(Step::Refused("job token mismatch".into()));
                }
                let ours = auth::proof(token, SERVER_LABEL, &[&client, &server]);
                self.send(&Encoder::new(protocol::ACCEPTED).bytes(&ours).0);
                self.stage = Stage::Ready;
                self.reader.set_max(max_frame);
                Ok(Step::Authenticated)
            }
            Stage::Ready | Stage::Closing => unreachable!("handshake after authentication"),
        }
    }

    /// Queues a refusal and marks the connection for closing.
    pub fn refuse(&mut self, reason: &str) {
        self.send(&Encoder::new(protocol::REFUSED).str(reason).0);
        self.stage = Stage::Closing;
    }
}
