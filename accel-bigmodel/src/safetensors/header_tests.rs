//! Tests of header parsing (kept apart to keep the parser short).

use super::*;
use std::io::Cursor;

/// A safetensors file assembled by hand: length prefix, header, data.
fn craft(header: &str, data: &[u8]) -> Vec<u8> {
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(header.as_bytes());
    out.extend_from_slice(data);
    out
}

/// Counts the bytes a parser pulls out of a reader.
struct Counting<R> {
    inner: R,
    read: usize,
}

impl<R: Read> Read for Counting<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.read += n;
        Ok(n)
    }
}

fn failure(err: Error) -> (Option<String>, String) {
    match err {
        Error::Safetensors { tensor, reason, .. } => (tensor, reason),
        other => panic!("expected a Safetensors error, got: {other}"),
    }
}

#[test]
fn reading_a_header_pulls_only_the_prefix_and_the_header_bytes() {
    let h = r#"{"w":{"dtype":"F32","shape":[256,1024],"data_offsets":[0,1048576]}}"#;
    let bytes = craft(h, &vec![0xAB; 1 << 20]);
    let mut reader = Counting {
        inner: Cursor::new(&bytes),
        read: 0,
    };
    let header =
        SafetensorsHeader::from_reader(Path::new("m.safetensors"), &mut reader, bytes.len() as u64)
            .unwrap();
    assert_eq!(reader.read, 8 + h.len());
    assert_eq!(header.get("w").unwrap().shape, vec![256, 1024]);
    assert_eq!(
        header.byte_range("w"),
        Some(8 + h.len() as u64..bytes.len() as u64)
    );
    assert_eq!(header.data_start(), 8 + h.len() as u64);
}

#[test]
fn an_absurd_header_length_is_refused_before_allocating() {
    let path = Path::new("huge.safetensors");
    let bytes = u64::MAX.to_le_bytes();
    let mut reader = Cursor::new(&bytes);
    let (tensor, reason) =
        failure(SafetensorsHeader::from_reader(path, &mut reader, 1 << 40).unwrap_err());
    assert_eq!(tensor, None);
    assert_eq!(
        reason,
        format!(
            "header length is {} bytes, above the 100000000-byte limit",
            u64::MAX
        )
    );
    // Under the limit but past the end of the file: refused from the file length alone.
    let bytes = 99_999_999u64.to_le_bytes();
    let (_, reason) =
        failure(SafetensorsHeader::from_reader(path, &mut Cursor::new(&bytes), 16).unwrap_err());
    assert_eq!(
        reason,
        "header length is 99999999 bytes but only 8 bytes follow the length prefix (truncated?)"
    );
}

#[test]
fn defects_name_the_tensor_at_fault() {
    let h = r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}"#;
    let err = SafetensorsHeader::from_bytes(Path::new("x"), &craft(h, &[0; 12])).unwrap_err();
    assert_eq!(
        failure(err),
        (
            Some("b".to_string()),
            "tensors `a` (data bytes 0..8) and `b` (data bytes 4..12) overlap".to_string()
        )
    );
    let h = r#"{"w":{"dtype":"F32","shape":[100],"data_offsets":[0,400]}}"#;
    let bytes = craft(h, &[0; 40]);
    let err = SafetensorsHeader::from_bytes(Path::new("x"), &bytes).unwrap_err();
    let msg = err.to_string();
    assert_eq!(
        failure(err),
        (
            Some("w".to_string()),
            format!(
                "tensor `w` data ends at byte {} but the file has {}",
                8 + h.len() + 400,
                bytes.len()
            )
        )
    );
    assert!(
        msg.starts_with("x: invalid safetensors file: tensor `w`"),
        "{msg}"
    );
}

#[test]
fn short_files_and_non_object_headers_are_reported() {
    let err = SafetensorsHeader::from_bytes(Path::new("x"), &[1, 2, 3]).unwrap_err();
    assert_eq!(
        failure(err).1,
        "the file has 3 bytes, too few for the 8-byte header length (truncated?)"
    );
    let err = SafetensorsHeader::from_bytes(Path::new("x"), &craft("[]", &[])).unwrap_err();
    assert_eq!(failure(err).1, "header is not a JSON object");
}

#[test]
fn dtypes_map_to_candle_and_torch_where_they_exist() {
    let h = r#"{"m":{"dtype":"BOOL","shape":[2],"data_offsets":[0,2]},"q":{"dtype":"F4","shape":[4],"data_offsets":[2,4]},"w":{"dtype":"BF16","shape":[1],"data_offsets":[4,6]}}"#;
    let header = SafetensorsHeader::from_bytes(Path::new("x"), &craft(h, &[0; 6])).unwrap();
    let m = header.get("m").unwrap();
    assert_eq!(
        (m.candle_dtype(), m.torch_dtype()),
        (None, Some(DTypeName::BOOL))
    );
    let q = header.get("q").unwrap();
    assert_eq!(
        (q.candle_dtype(), q.torch_dtype(), q.byte_len()),
        (None, None, 2)
    );
    let w = header.get("w").unwrap();
    assert_eq!(
        (w.candle_dtype(), w.torch_dtype()),
        (Some(DType::BF16), Some(DTypeName::BFLOAT16))
    );
}

#[test]
fn missing_file_is_missing_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("nope.safetensors");
    match SafetensorsHeader::read(&path).unwrap_err() {
        Error::MissingFile { path: p, what } => {
            assert_eq!(p, path);
            assert_eq!(what, "safetensors tensor file");
        }
        other => panic!("{other}"),
    }
}
