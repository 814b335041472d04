//! TFRecord framing: the container format of TensorBoard event files.
//!
//! Each record is
//!
//! ```text
//! u64 length (little-endian) | u32 masked CRC32C of those 8 bytes | payload | u32 masked CRC32C of payload
//! ```
//!
//! The CRC32C (Castagnoli) is written by hand because accel-core has no checksum
//! dependency and the algorithm is thirty lines; the known-answer tests below pin it.

use std::io::Write;

/// The reflected Castagnoli polynomial (0x1EDC6F41 bit-reversed).
const CASTAGNOLI_REFLECTED: u32 = 0x82F6_3B78;

/// The constant TensorFlow adds after rotating a CRC, so that a CRC of data
/// that itself holds CRCs does not degenerate (see `tensorflow/core/lib/hash/crc32c.h`).
const MASK_DELTA: u32 = 0xa282_ead8;

/// Byte-at-a-time lookup table, built at compile time so there is no lazy
/// initialisation (and no `unsafe` or `OnceLock`) at run time.
const CRC32C_TABLE: [u32; 256] = build_table();

const fn build_table() -> [u32; 256] {
    let mut table = [0u32; 256];
    let mut i = 0;
    while i < 256 {
        let mut crc = i as u32;
        let mut bit = 0;
        while bit < 8 {
            crc = if crc & 1 != 0 {
                (crc >> 1) ^ CASTAGNOLI_REFLECTED
            } else {
                crc >> 1
            };
            bit += 1;
        }
        table[i] = crc;
        i += 1;
    }
    table
}

/// CRC32C (Castagnoli) of `data`, as used by TFRecord and iSCSI.
pub(crate) fn crc32c(data: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &byte in data {
        crc = CRC32C_TABLE[((crc ^ byte as u32) & 0xff) as usize] ^ (crc >> 8);
    }
    !crc
}

/// The CRC32C of `data`, masked the way TFRecord stores it.
pub(crate) fn masked_crc32c(data: &[u8]) -> u32 {
    // TensorFlow's `(crc >> 15) | (crc << 17)`: a right rotation by 15.
    crc32c(data).rotate_right(15).wrapping_add(MASK_DELTA)
}

/// Writes one framed record holding `payload`.
///
/// The frame is assembled in memory and written with one call so a record is
/// never half-written by this function's own buffering (the OS may still cut
/// it short on a crash, which the reader's CRCs detect).
pub(crate) fn write_record<W: Write>(out: &mut W, payload: &[u8]) -> std::io::Result<()> {
    let len = (payload.len() as u64).to_le_bytes();
    let mut frame = Vec::with_capacity(payload.len() + 16);
    frame.extend_from_slice(&len);
    frame.extend_from_slice(&masked_crc32c(&len).to_le_bytes());
    frame.extend_from_slice(payload);
    frame.extend_from_slice(&masked_crc32c(payload).to_le_bytes());
    out.write_all(&frame)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32c_of_the_standard_check_string_is_e3069283() {
        assert_eq!(crc32c(b"123456789"), 0xE306_9283);
    }

    #[test]
    fn crc32c_of_32_zero_bytes_matches_rfc3720() {
        assert_eq!(crc32c(&[0u8; 32]), 0x8A91_36AA);
    }

    #[test]
    fn crc32c_of_32_ff_bytes_and_ascending_bytes_match_rfc3720() {
        assert_eq!(crc32c(&[0xffu8; 32]), 0x62A8_AB43);
        let ascending: Vec<u8> = (0u8..32).collect();
        assert_eq!(crc32c(&ascending), 0x46DD_794E);
    }

    #[test]
    fn crc32c_of_nothing_is_zero() {
        assert_eq!(crc32c(b""), 0);
    }

    #[test]
    fn masked_crc_rotates_right_by_15_and_adds_the_delta() {
        let crc = crc32c(b"123456789");
        let expected = crc.rotate_right(15).wrapping_add(0xa282_ead8);
        assert_eq!(masked_crc32c(b"123456789"), expected);
        // 0xE3069283 rotated right by 15 is 0x2507C60D; plus the delta it is
        // 0xC78AB0E5, the value tensorboard's own Python `masked_crc32c` gives.
        assert_eq!(masked_crc32c(b"123456789"), 0xC78A_B0E5);
    }

    #[test]
    fn a_record_is_length_crc_payload_crc() {
        let mut out = Vec::new();
        write_record(&mut out, b"abc").unwrap();
        assert_eq!(out.len(), 8 + 4 + 3 + 4);
        assert_eq!(&out[..8], &3u64.to_le_bytes());
        assert_eq!(
            &out[8..12],
            &masked_crc32c(&3u64.to_le_bytes()).to_le_bytes()
        );
        assert_eq!(&out[12..15], b"abc");
        assert_eq!(&out[15..], &masked_crc32c(b"abc").to_le_bytes());
    }
}
