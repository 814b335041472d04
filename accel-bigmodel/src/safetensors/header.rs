//! The safetensors header, parsed and validated so that every defect names the
//! file, the tensor and the byte offsets at fault.
//!
//! `safetensors::SafeTensors::deserialize` reports errors such as "invalid
//! shape, data type, or offset for tensor" without a name or numbers, and needs
//! the whole file in memory. Parsing the header here needs only its own bytes
//! (so a model's layout can be read without touching gigabytes of weights) and
//! turns every defect into a reason naming the tensor and positions; where the
//! whole file is at hand the reference parser still runs as a backstop.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::Read;
use std::ops::Range;
use std::path::{Path, PathBuf};

use candle_core::DType;
use serde_json::Value;

use crate::dtype::DTypeName;
use crate::error::{Error, Result};

/// The largest header accepted, in bytes; safetensors refuses larger ones, and
/// so do we, before allocating anything for it.
pub const MAX_HEADER_LEN: u64 = 100_000_000;

/// One tensor's entry in a safetensors header.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HeaderEntry {
    /// The header's dtype name (`"F32"`, `"BOOL"`, ...), kept as text so files
    /// with dtypes candle lacks can still be inspected and planned.
    pub dtype: String,
    /// Dimensions; empty for a scalar.
    pub shape: Vec<usize>,
    /// `[start, end)` of the tensor's bytes, relative to the data section.
    pub data_offsets: [usize; 2],
}

impl HeaderEntry {
    /// The candle dtype of this tensor, for the dtypes candle can load.
    pub fn candle_dtype(&self) -> Option<DType> {
        candle_dtype(&self.dtype)
    }

    /// The candle dtype it loads as: its own, or u8 for int8 (whose bytes
    /// candle holds as u8: LLM.int8 weights).
    pub fn loaded_dtype(&self) -> Option<DType> {
        match self.dtype.as_str() {
            "I8" => Some(DType::U8),
            _ => self.candle_dtype(),
        }
    }

    /// The torch dtype the planner sizes this tensor with, if torch has one.
    pub fn torch_dtype(&self) -> Option<DTypeName> {
        let st: safetensors::Dtype =
            serde_json::from_value(Value::String(self.dtype.clone())).ok()?;
        DTypeName::try_from(st).ok()
    }

    /// Number of data bytes.
    pub fn byte_len(&self) -> usize {
        self.data_offsets[1] - self.data_offsets[0]
    }
}

/// Header dtype name -> candle dtype, for the dtypes candle can load.
pub fn candle_dtype(name: &str) -> Option<DType> {
    Some(match name {
        "U8" => DType::U8,
        "U32" => DType::U32,
        "I16" => DType::I16,
        "I32" => DType::I32,
        "I64" => DType::I64,
        "BF16" => DType::BF16,
        "F16" => DType::F16,
        "F32" => DType::F32,
        "F64" => DType::F64,
        _ => return None,
    })
}

/// Bits per element of every dtype the safetensors format defines, so that
/// offsets can be validated even for tensors candle cannot hold.
fn dtype_bits(name: &str) -> Option<usize> {
    Some(match name {
        "F4" => 4,
        "F6_E2M3" | "F6_E3M2" => 6,
        "BOOL" | "U8" | "I8" | "F8_E5M2" | "F8_E4M3" | "F8_E8M0" => 8,
        "I16" | "U16" | "F16" | "BF16" => 16,
        "I32" | "U32" | "F32" => 32,
        "I64" | "U64" | "F64" => 64,
        _ => return None,
    })
}

/// The validated header of one safetensors file.
#[derive(Clone, Debug, PartialEq)]
pub struct SafetensorsHeader {
    path: PathBuf,
    file_len: u64,
    data_start: u64,
    tensors: BTreeMap<String, HeaderEntry>,
    metadata: HashMap<String, String>,
}

impl SafetensorsHeader {
    /// Reads and validates the header of the file at `path`, reading only the
    /// 8-byte length prefix and the header itself, never the tensor data.
    ///
    /// # Errors
    /// [`Error::MissingFile`] when the file is absent, [`Error::Io`] when it
    /// cannot be read, [`Error::Safetensors`] naming the defect otherwise.
    pub fn read(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let mut file = File::open(path).map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => Error::MissingFile {
                path: path.to_path_buf(),
                what: "safetensors tensor file".to_string(),
            },
            _ => Error::io("opening", path, e),
        })?;
        let file_len = file
            .metadata()
            .map_err(|e| Error::io("inspecting", path, e))?
            .len();
        Self::from_reader(path, &mut file, file_len)
    }

    /// Parses a header from `reader`, positioned at the start of a file of
    /// `file_len` bytes. Reads exactly the length prefix and the header.
    ///
    /// # Errors
    /// As [`SafetensorsHeader::read`].
    pub fn from_reader(path: &Path, reader: &mut impl Read, file_len: u64) -> Result<Self> {
        let mut prefix = [0u8; 8];
        let got = (file_len as usize).min(8);
        reader
            .read_exact(&mut prefix[..got])
            .map_err(|e| Error::io("reading", path, e))?;
        let n = header_len(path, &prefix[..got], file_len)?;
        // `header_len` bounded n by both the file and MAX_HEADER_LEN, so this
        // allocation is at most 100 MB and never larger than the file.
        let mut header = vec![0u8; n as usize];
        reader
            .read_exact(&mut header)
            .map_err(|e| Error::io("reading", path, e))?;
        parse_json(path, &header, file_len)
    }

    /// Parses the header of a whole file held in memory (or memory-mapped), and
    /// checks that the reference `safetensors` parser accepts the file too, so
    /// anything we accept Python's `safetensors` accepts.
    ///
    /// # Errors
    /// [`Error::Safetensors`] naming the defect.
    pub fn from_bytes(path: &Path, bytes: &[u8]) -> Result<Self> {
        let file_len = bytes.len() as u64;
        let n = header_len(path, &bytes[..bytes.len().min(8)], file_len)?;
        let header = parse_json(path, &bytes[8..8 + n as usize], file_len)?;
        // Only the header is read here: `read_metadata` checks offsets against
        // the buffer's length without touching the data pages.
        if let Err(e) = safetensors::SafeTensors::read_metadata(bytes) {
            return Err(bad(path, None, e.to_string()));
        }
        Ok(header)
    }

    /// The file this header was read from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Length of the whole file, in bytes.
    pub fn file_len(&self) -> u64 {
        self.file_len
    }

    /// Offset of the data section in the file (8 + header length).
    pub fn data_start(&self) -> u64 {
        self.data_start
    }

    /// Tensor entries by name.
    pub fn tensors(&self) -> &BTreeMap<String, HeaderEntry> {
        &self.tensors
    }

    /// One tensor's entry.
    pub fn get(&self, name: &str) -> Option<&HeaderEntry> {
        self.tensors.get(name)
    }

    /// The `__metadata__` strings (empty when the file has none).
    pub fn metadata(&self) -> &HashMap<String, String> {
        &self.metadata
    }

    /// The tensor's bytes as a range of absolute file offsets.
    pub fn byte_range(&self, name: &str) -> Option<Range<u64>> {
        let [start, end] = self.tensors.get(name)?.data_offsets;
        Some(self.data_start + start as u64..self.data_start + end as u64)
    }
}

fn bad(path: &Path, tensor: Option<&str>, reason: String) -> Error {
    Error::Safetensors {
        path: path.to_path_buf(),
        tensor: tensor.map(str::to_string),
        reason,
    }
}

/// Checks the 8-byte length prefix (`prefix` holds what the file has of it)
/// against the limit and the file, and returns the header length.
fn header_len(path: &Path, prefix: &[u8], file_len: u64) -> Result<u64> {
    let Ok(prefix) = <[u8; 8]>::try_from(prefix) else {
        return Err(bad(
            path,
            None,
            format!(
                "the file has {file_len} bytes, too few for the 8-byte header length (truncated?)"
            ),
        ));
    };
    let n = u64::from_le_bytes(prefix);
    if n > MAX_HEADER_LEN {
        return Err(bad(
            path,
            None,
            format!("header length is {n} bytes, above the {MAX_HEADER_LEN}-byte limit"),
        ));
    }
    if n > file_len - 8 {
        return Err(bad(
            path,
            None,
            format!(
                "header length is {n} bytes but only {} bytes follow the length prefix (truncated?)",
                file_len - 8
            ),
        ));
    }
    Ok(n)
}

/// Parses the header JSON of a file of `file_len` bytes and checks every
/// entry against the file.
fn parse_json(path: &Path, header: &[u8], file_len: u64) -> Result<SafetensorsHeader> {
    let data_start = 8 + header.len() as u64;
    let text = std::str::from_utf8(header)
        .map_err(|e| bad(path, None, format!("header is not valid UTF-8: {e}")))?;
    let value: Value = serde_json::from_str(text)
        .map_err(|e| bad(path, None, format!("header is not valid JSON: {e}")))?;
    let Value::Object(object) = value else {
        return Err(bad(path, None, "header is not a JSON object".to_string()));
    };

    let mut tensors = BTreeMap::new();
    let mut metadata = HashMap::new();
    for (name, info) in object {
        if name == "__metadata__" {
            metadata = parse_metadata(info).map_err(|r| bad(path, None, r))?;
            continue;
        }
        let entry = parse_entry(&name, &info).map_err(|r| bad(path, Some(&name), r))?;
        let end = data_start + entry.data_offsets[1] as u64;
        if end > file_len {
            return Err(bad(
                path,
                Some(&name),
                format!("tensor `{name}` data ends at byte {end} but the file has {file_len}"),
            ));
        }
        tensors.insert(name, entry);
    }
    check_coverage(&tensors, (file_len - data_start) as usize)
        .map_err(|(tensor, r)| bad(path, tensor.as_deref(), r))?;
    Ok(SafetensorsHeader {
        path: path.to_path_buf(),
        file_len,
        data_start,
        tensors,
        metadata,
    })
}

fn parse_metadata(info: Value) -> std::result::Result<HashMap<String, String>, String> {
    let Value::Object(map) = info else {
        return Err("`__metadata__` is not a JSON object".to_string());
    };
    map.into_iter()
        .map(|(k, v)| match v {
            Value::String(s) => Ok((k, s)),
            other => Err(format!(
                "`__metadata__` entry `{k}` is {other}, not a string"
            )),
        })
        .collect()
}

fn parse_entry(name: &str, info: &Value) -> std::result::Result<HeaderEntry, String> {
    let field = |key: &str| {
        info.get(key)
            .ok_or_else(|| format!("tensor `{name}` has no `{key}` in the header"))
    };
    let usizes = |key: &str| -> std::result::Result<Vec<usize>, String> {
        field(key)?
            .as_array()
            .and_then(|a| {
                a.iter()
                    .map(|v| v.as_u64().and_then(|v| usize::try_from(v).ok()))
                    .collect()
            })
            .ok_or_else(|| {
                format!("tensor `{name}` has a `{key}` that is not a list of non-negative integers")
            })
    };
    let dtype = field("dtype")?
        .as_str()
        .ok_or_else(|| format!("tensor `{name}` has a `dtype` that is not a string"))?
        .to_string();
    let shape = usizes("shape")?;
    let offsets = usizes("data_offsets")?;
    let [start, end] = offsets[..] else {
        return Err(format!(
            "tensor `{name}` has {} data_offsets, expected 2",
            offsets.len()
        ));
    };
    let bits =
        dtype_bits(&dtype).ok_or_else(|| format!("tensor `{name}` has unknown dtype `{dtype}`"))?;
    let overflow = || format!("tensor `{name}` has a shape {shape:?} too large to address");
    let nbits = shape
        .iter()
        .try_fold(bits, |acc, &d| acc.checked_mul(d))
        .ok_or_else(overflow)?;
    if nbits % 8 != 0 {
        return Err(format!(
            "tensor `{name}` ({dtype}, shape {shape:?}) does not fill whole bytes"
        ));
    }
    if end < start {
        return Err(format!(
            "tensor `{name}` has data_offsets [{start}, {end}] that end before they start"
        ));
    }
    if end - start != nbits / 8 {
        return Err(format!(
            "tensor `{name}` has dtype {dtype} and shape {shape:?} ({} bytes) but data_offsets [{start}, {end}] span {} bytes",
            nbits / 8,
            end - start
        ));
    }
    Ok(HeaderEntry {
        dtype,
        shape,
        data_offsets: [start, end],
    })
}

/// The data section must be tiled exactly by the tensors: no overlaps, no
/// gaps, nothing after the last one (the format requires it; it also means
/// no two names can alias the same bytes). On failure, returns the tensor at
/// fault (if any) and the reason.
fn check_coverage(
    tensors: &BTreeMap<String, HeaderEntry>,
    data_len: usize,
) -> std::result::Result<(), (Option<String>, String)> {
    let mut by_offset: Vec<(&String, &HeaderEntry)> = tensors.iter().collect();
    by_offset.sort_by_key(|(name, e)| (e.data_offsets, *name));
    let mut cursor = 0;
    let mut prev: Option<(&String, &HeaderEntry)> = None;
    for (name, e) in by_offset {
        let [start, end] = e.data_offsets;
        if start < cursor {
            let (pname, pe) = prev.expect("cursor > 0 implies a previous tensor");
            let [pstart, pend] = pe.data_offsets;
            return Err((
                Some(name.clone()),
                format!(
                    "tensors `{pname}` (data bytes {pstart}..{pend}) and `{name}` (data bytes {start}..{end}) overlap"
                ),
            ));
        }
        if start > cursor {
            return Err((
                Some(name.clone()),
                format!(
                    "data bytes {cursor}..{start} belong to no tensor (gap before tensor `{name}`)"
                ),
            ));
        }
        cursor = end;
        prev = Some((name, e));
    }
    if cursor != data_len {
        return Err((
            None,
            format!(
                "the file has {} bytes after the end of the last tensor's data",
                data_len - cursor
            ),
        ));
    }
    Ok(())
}

#[cfg(test)]
#[path = "header_tests.rs"]
mod tests;
