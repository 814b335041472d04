//! Framing and encoding of the store protocol (documented in the module above).

use std::io::{self, Read, Write};

/// First bytes of the handshake; the trailing digit is the protocol version.
pub(crate) const MAGIC: &[u8; 8] = b"ACCELKV2";
/// Largest frame accepted before the handshake, so a stray client cannot
/// make the store allocate much.
pub(crate) const MAX_HANDSHAKE: usize = 4096;
/// Default largest frame of an authenticated client: values are addresses,
/// ids and counters, a few hundred bytes each (`ACCEL_STORE_MAX_FRAME`).
pub(crate) const DEFAULT_MAX_FRAME: usize = 4 << 20;
/// Bytes read per step of a frame body: a frame is allocated as its bytes
/// arrive, never up front from the length it announces.
const CHUNK: usize = 64 << 10;

/// Request opcodes.
pub(crate) mod op {
    pub const SET: u8 = 1;
    pub const GET: u8 = 2;
    pub const WAIT: u8 = 3;
    pub const ADD: u8 = 4;
    pub const DELETE: u8 = 5;
    pub const NUM_KEYS: u8 = 6;
    pub const CHECK: u8 = 7;
    pub const CLAIM: u8 = 8;
}

/// Reply status bytes.
pub(crate) mod reply {
    pub const OK: u8 = 0;
    pub const VALUE: u8 = 1;
    pub const TIMEOUT: u8 = 2;
    pub const INT: u8 = 3;
    pub const BOOL: u8 = 4;
    pub const ERROR: u8 = 5;
}

/// Handshake answer bytes.
pub(crate) const ACCEPTED: u8 = 0;
pub(crate) const REFUSED: u8 = 1;

/// Writes one frame: `u32` little-endian body length, then the body.
pub(crate) fn write_frame(mut w: impl Write, body: &[u8]) -> io::Result<()> {
    let len = u32::try_from(body.len())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "frame over 4 GiB"))?;
    let mut out = Vec::with_capacity(4 + body.len());
    out.extend_from_slice(&len.to_le_bytes());
    out.extend_from_slice(body);
    w.write_all(&out)?;
    w.flush()
}

/// Reads one frame, refusing bodies longer than `max`; the body grows as it
/// arrives.
pub(crate) fn read_frame(mut r: impl Read, max: usize) -> io::Result<Vec<u8>> {
    let mut len = [0u8; 4];
    r.read_exact(&mut len)?;
    let len = frame_len(len, max)?;
    let mut body = Vec::with_capacity(len.min(CHUNK));
    r.take(len as u64).read_to_end(&mut body)?;
    if body.len() < len {
        return Err(io::ErrorKind::UnexpectedEof.into());
    }
    Ok(body)
}

fn frame_len(head: [u8; 4], max: usize) -> io::Result<usize> {
    let len = u32::from_le_bytes(head) as usize;
    if len > max {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("frame of {len} bytes exceeds the limit of {max}"),
        ));
    }
    Ok(len)
}

/// Reassembles frames from the pieces a non-blocking socket delivers.
pub(crate) struct FrameReader {
    max: usize,
    head: [u8; 4],
    head_len: usize,
    /// `Some` once the length is known.
    body: Option<(usize, Vec<u8>)>,
}

impl FrameReader {
    pub fn new(max: usize) -> Self {
        Self {
            max,
            head: [0; 4],
            head_len: 0,
            body: None,
        }
    }

    /// Changes the cap for frames not started yet.
    pub fn set_max(&mut self, max: usize) {
        self.max = max;
    }

    /// Whether part of a frame has arrived.
    pub fn in_progress(&self) -> bool {
        self.head_len > 0
    }

    /// Takes bytes from `data`; returns how many it used and the frame they
    /// completed, if any. Stops at the end of a frame.
    pub fn feed(&mut self, data: &[u8]) -> io::Result<(usize, Option<Vec<u8>>)> {
        let mut used = 0;
        if self.head_len < 4 {
            let n = (4 - self.head_len).min(data.len());
            self.head[self.head_len..self.head_len + n].copy_from_slice(&data[..n]);
            self.head_len += n;
            used = n;
            if self.head_len < 4 {
                return Ok((used, None));
            }
            let len = frame_len(self.head, self.max)?;
            self.body = Some((len, Vec::with_capacity(len.min(CHUNK))));
        }
        let (len, body) = self.body.as_mut().expect("length read");
        let n = (*len - body.len()).min(data.len() - used);
        body.extend_from_slice(&data[used..used + n]);
        used += n;
        if body.len() < *len {
            return Ok((used, None));
        }
        self.head_len = 0;
        Ok((used, self.body.take().map(|(_, b)| b)))
    }
}

/// Builds a frame body field by field.
#[derive(Default)]
pub(crate) struct Encoder(pub Vec<u8>);

impl Encoder {
    pub fn new(first: u8) -> Self {
        Self(vec![first])
    }
    pub fn u8(mut self, v: u8) -> Self {
        self.0.push(v);
        self
    }
    pub fn u32(mut self, v: u32) -> Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn u64(mut self, v: u64) -> Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn i64(mut self, v: i64) -> Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    /// A length-prefixed byte string.
    pub fn bytes(self, v: &[u8]) -> Self {
        let mut s = self.u32(v.len() as u32);
        s.0.extend_from_slice(v);
        s
    }
    pub fn str(self, v: &str) -> Self {
        self.bytes(v.as_bytes())
    }
}

/// Reads a frame body field by field; every getter fails on truncation.
pub(crate) struct Decoder<'a>(pub &'a [u8]);

impl<'a> Decoder<'a> {
    fn take(&mut self, n: usize) -> io::Result<&'a [u8]> {
        if self.0.len() < n {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "truncated store message",
            ));
        }
        let (head, tail) = self.0.split_at(n);
        self.0 = tail;
        Ok(head)
    }
    pub fn u8(&mut self) -> io::Result<u8> {
        Ok(self.take(1)?[0])
    }
    pub fn u32(&mut self) -> io::Result<u32> {
        Ok(u32::from_le_bytes(
            self.take(4)?.try_into().expect("4 bytes"),
        ))
    }
    pub fn u64(&mut self) -> io::Result<u64> {
        Ok(u64::from_le_bytes(
            self.take(8)?.try_into().expect("8 bytes"),
        ))
    }
    pub fn i64(&mut self) -> io::Result<i64> {
        Ok(i64::from_le_bytes(
            self.take(8)?.try_into().expect("8 bytes"),
        ))
    }
    pub fn bytes(&mut self) -> io::Result<&'a [u8]> {
        let n = self.u32()? as usize;
        self.take(n)
    }
    pub fn str(&mut self) -> io::Result<&'a str> {
        std::str::from_utf8(self.bytes()?)
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "key is not UTF-8"))
    }
    /// A count-prefixed list of strings.
    pub fn strs(&mut self) -> io::Result<Vec<String>> {
        let n = self.u32()? as usize;
        (0..n).map(|_| self.str().map(str::to_string)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_round_trip_through_a_frame() {
        let body = Encoder::new(op::SET).str("k").bytes(&[1, 2]).i64(-5).0;
        let mut wire = Vec::new();
        write_frame(&mut wire, &body).unwrap();
        assert_eq!(&wire[..4], &(body.len() as u32).to_le_bytes());
        let got = read_frame(&wire[..], DEFAULT_MAX_FRAME).unwrap();
        let mut d = Decoder(&got);
        assert_eq!(d.u8().unwrap(), op::SET);
        assert_eq!(d.str().unwrap(), "k");
        assert_eq!(d.bytes().unwrap(), &[1, 2]);
        assert_eq!(d.i64().unwrap(), -5);
        assert!(d.u8().is_err());
    }

    #[test]
    fn the_frame_reader_reassembles_frames_split_anywhere() {
        let mut wire = Vec::new();
        write_frame(&mut wire, b"hello").unwrap();
        write_frame(&mut wire, b"").unwrap();
        write_frame(&mut wire, &[7; 300]).unwrap();
        for piece in [1, 2, 3, 5, 7, 1000] {
            let mut r = FrameReader::new(1000);
            let mut frames = Vec::new();
            for chunk in wire.chunks(piece) {
                let mut at = 0;
                while at < chunk.len() {
                    let (n, frame) = r.feed(&chunk[at..]).unwrap();
                    at += n;
                    frames.extend(frame);
                }
            }
            assert_eq!(frames, vec![b"hello".to_vec(), vec![], vec![7; 300]]);
            assert!(!r.in_progress());
        }
        let mut r = FrameReader::new(100);
        assert_eq!(r.feed(&[1, 0]).unwrap(), (2, None));
        assert!(r.in_progress());
        let err = r.feed(&[1, 0]).unwrap_err();
        assert!(
            err.to_string()
                .contains("65537 bytes exceeds the limit of 100"),
            "{err}"
        );
    }

    #[test]
    fn a_frame_announcing_more_than_arrives_allocates_only_what_arrived() {
        let mut wire = (1u32 << 22).to_le_bytes().to_vec();
        wire.extend_from_slice(&[0; 10]);
        let err = read_frame(&wire[..], DEFAULT_MAX_FRAME).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::UnexpectedEof);
    }

    #[test]
    fn oversized_frames_are_rejected_before_allocating() {
        let wire = u32::MAX.to_le_bytes();
        let err = read_frame(&wire[..], MAX_HANDSHAKE).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidData);
    }
}
