//! Secrets and proofs: job tokens, nonces and HMAC-SHA256 challenge-response.
//!
//! The job token never travels. Each side of a handshake sends a fresh
//! random nonce, and each proves it holds the token with
//! `HMAC-SHA256(token, label ‖ server nonce ‖ client nonce ‖ context)`. The
//! label differs per direction and per protocol, so a proof cannot be replayed
//! in the other direction or on the other port, and the nonces make every
//! proof single-use. Proofs are compared in constant time.

use std::io;

use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

/// Bytes in a nonce, a proof and a rank's claim secret.
pub(crate) const LEN: usize = 32;

/// A nonce, an HMAC proof, a claim secret or a SHA-256 digest.
pub(crate) type Bytes32 = [u8; LEN];

/// Fresh bytes from the operating system's cryptographic source.
pub(crate) fn random() -> io::Result<Bytes32> {
    let mut b = [0u8; LEN];
    getrandom::fill(&mut b).map_err(|e| io::Error::other(format!("no random bytes: {e}")))?;
    Ok(b)
}

/// A new job token: 32 random bytes as hex.
///
/// # Errors
/// When the operating system has no random source (never on Linux).
pub fn new_token() -> io::Result<String> {
    Ok(hex(&random()?))
}

/// `HMAC-SHA256(token, label ‖ parts...)`, each part length-prefixed so no two
/// different part lists hash alike.
pub(crate) fn proof(token: &str, label: &[u8], parts: &[&[u8]]) -> Bytes32 {
    let mut mac = Hmac::<Sha256>::new_from_slice(token.as_bytes()).expect("HMAC takes any key");
    mac.update(label);
    for p in parts {
        mac.update(&(p.len() as u64).to_le_bytes());
        mac.update(p);
    }
    mac.finalize().into_bytes().into()
}

/// Whether `got` equals `want`, in time independent of where they differ.
pub(crate) fn same(want: &[u8], got: &[u8]) -> bool {
    want.len() == got.len() && bool::from(want.ct_eq(got))
}

/// SHA-256 of `data`: the commitment a rank publishes for a secret it
/// reveals later.
pub(crate) fn digest(data: &[u8]) -> Bytes32 {
    Sha256::digest(data).into()
}

/// Lower-case hex.
pub(crate) fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Parses lower- or upper-case hex; `None` for anything else.
pub(crate) fn unhex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

/// This process's rank-claim secret, drawn once: a rank that reconnects to the
/// store (or opens a second connection) proves it is the process that
/// claimed the rank first.
pub(crate) fn claim_secret() -> io::Result<Bytes32> {
    static SECRET: std::sync::OnceLock<Bytes32> = std::sync::OnceLock::new();
    if let Some(s) = SECRET.get() {
        return Ok(*s);
    }
    let s = random()?;
    Ok(*SECRET.get_or_init(|| s))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proofs_match_the_rfc_4231_hmac_and_depend_on_every_input() {
        // RFC 4231 test case 2: key "Jefe", data "what do ya want for nothing?".
        let mut mac = Hmac::<Sha256>::new_from_slice(b"Jefe").unwrap();
        mac.update(b"what do ya want for nothing?");
        assert_eq!(
            hex(&mac.finalize().into_bytes()),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
        let p = proof("tok", b"label", &[b"a", b"bc"]);
        assert_eq!(p, proof("tok", b"label", &[b"a", b"bc"]));
        assert_ne!(
            p,
            proof("tok", b"label", &[b"ab", b"c"]),
            "parts are framed"
        );
        assert_ne!(p, proof("tok2", b"label", &[b"a", b"bc"]));
        assert_ne!(p, proof("tok", b"other", &[b"a", b"bc"]));
    }

    #[test]
    fn comparisons_hex_and_randomness() {
        assert!(same(b"abc", b"abc"));
        assert!(!same(b"abc", b"abd"));
        assert!(!same(b"abc", b"ab"));
        let t = new_token().unwrap();
        assert_eq!(t.len(), 64);
        assert_ne!(t, new_token().unwrap());
        assert_eq!(unhex(&t).unwrap(), unhex(&t.to_uppercase()).unwrap());
        assert_eq!(hex(&unhex(&t).unwrap()), t);
        assert_eq!(unhex("0g"), None);
        assert_eq!(unhex("abc"), None);
        assert_eq!(claim_secret().unwrap(), claim_secret().unwrap());
        assert_eq!(
            hex(&digest(b"abc")),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }
}
