//! The safetensors format itself: dtype mapping, tensor -> bytes, and a
//! header parser that validates every offset and says exactly what is wrong.
//!
//! `safetensors::SafeTensors::deserialize` only reports errors such as
//! "invalid shape, data type, or offset for tensor" without a name or
//! numbers; parsing the header here first turns every defect into a reason
//! naming the tensor and the byte positions, and the reference parser then
//! runs as a backstop.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use serde_json::Value;

use crate::{Error, Result};

/// safetensors refuses headers above 100 MB; so do we, before allocating.
const MAX_HEADER_LEN: u64 = 100_000_000;

// ---------------------------------------------------------------- dtypes

/// candle dtype -> safetensors dtype, for the dtypes both can hold.
pub(super) fn st_dtype(dtype: DType) -> Option<safetensors::Dtype> {
    use safetensors::Dtype as S;
    Some(match dtype {
        DType::U8 => S::U8,
        DType::U32 => S::U32,
        DType::I16 => S::I16,
        DType::I32 => S::I32,
        DType::I64 => S::I64,
        DType::BF16 => S::BF16,
        DType::F16 => S::F16,
        DType::F32 => S::F32,
        DType::F64 => S::F64,
        _ => return None,
    })
}

/// Header dtype name -> candle dtype, for the dtypes candle can load.
pub(super) fn candle_dtype(name: &str) -> Option<DType> {
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

// ---------------------------------------------------------------- writing

/// One tensor's little-endian bytes, ready for `safetensors::serialize`.
pub(super) struct Raw {
    dtype: safetensors::Dtype,
    shape: Vec<usize>,
    data: Vec<u8>,
}

impl safetensors::View for &Raw {
    fn dtype(&self) -> safetensors::Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> std::borrow::Cow<'_, [u8]> {
        std::borrow::Cow::Borrowed(&self.data)
    }
    fn data_len(&self) -> usize {
        self.data.len()
    }
}

/// Copies a tensor from any device and layout into little-endian bytes.
pub(super) fn to_raw(path: &Path, name: &str, t: &Tensor) -> Result<Raw> {
    fn le<T, const N: usize>(values: Vec<T>, f: fn(T) -> [u8; N]) -> Vec<u8> {
        let mut out = Vec::with_capacity(values.len() * N);
        for v in values {
            out.extend_from_slice(&f(v));
        }
        out
    }
    let dtype = st_dtype(t.dtype()).ok_or_else(|| Error::Safetensors {
        path: path.to_path_buf(),
        reason: format!(
            "tensor `{name}` has dtype {:?}, which this writer does not support",
            t.dtype()
        ),
    })?;
    // flatten_all + to_vec1 copies to host memory and resolves any strides,
    // which covers "bring to CPU, make contiguous" in one step.
    let flat = t.flatten_all()?;
    let data = match t.dtype() {
        DType::U8 => flat.to_vec1::<u8>()?,
        DType::U32 => le(flat.to_vec1::<u32>()?, u32::to_le_bytes),
        DType::I16 => le(flat.to_vec1::<i16>()?, i16::to_le_bytes),
        DType::I32 => le(flat.to_vec1::<i32>()?, i32::to_le_bytes),
        DType::I64 => le(flat.to_vec1::<i64>()?, i64::to_le_bytes),
        DType::BF16 => le(flat.to_vec1::<half::bf16>()?, half::bf16::to_le_bytes),
        DType::F16 => le(flat.to_vec1::<half::f16>()?, half::f16::to_le_bytes),
        DType::F32 => le(flat.to_vec1::<f32>()?, f32::to_le_bytes),
        DType::F64 => le(flat.to_vec1::<f64>()?, f64::to_le_bytes),
        _ => unreachable!("st_dtype accepted only the dtypes matched above"),
    };
    Ok(Raw {
        dtype,
        shape: t.dims().to_vec(),
        data,
    })
}

// ---------------------------------------------------------------- reading

/// One tensor's header entry; offsets are relative to the data section.
pub(super) struct Entry {
    /// The header's dtype name (`"F32"`, `"BOOL"`, ...), kept as text so
    /// files with dtypes candle lacks can still be inspected.
    pub(super) dtype: String,
    pub(super) shape: Vec<usize>,
    start: usize,
    end: usize,
}

/// A whole safetensors file in memory with its validated header.
pub(super) struct Parsed {
    pub(super) path: PathBuf,
    bytes: Vec<u8>,
    data_start: usize,
    pub(super) entries: BTreeMap<String, Entry>,
    pub(super) metadata: HashMap<String, String>,
}

pub(super) fn read_bytes(path: &Path, what: &str) -> Result<Vec<u8>> {
    std::fs::read(path).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => Error::MissingFile {
            path: path.to_path_buf(),
            what: what.to_string(),
        },
        _ => Error::io("reading", path, e),
    })
}

impl Parsed {
    pub(super) fn open(path: &Path) -> Result<Self> {
        let bytes = read_bytes(path, "safetensors tensor file")?;
        Self::parse(path, bytes)
    }

    pub(super) fn parse(path: &Path, bytes: Vec<u8>) -> Result<Self> {
        let bad = |reason: String| Error::Safetensors {
            path: path.to_path_buf(),
            reason,
        };
        let len = bytes.len();
        let Some(prefix) = bytes.get(..8) else {
            return Err(bad(format!(
                "the file has {len} bytes, too few for the 8-byte header length (truncated?)"
            )));
        };
        let n = u64::from_le_bytes(prefix.try_into().expect("8 bytes"));
        if n > MAX_HEADER_LEN {
            return Err(bad(format!(
                "header length is {n} bytes, above the {MAX_HEADER_LEN}-byte limit"
            )));
        }
        if n > (len - 8) as u64 {
            return Err(bad(format!(
                "header length is {n} bytes but only {} bytes follow the length prefix (truncated?)",
                len - 8
            )));
        }
        let data_start = 8 + n as usize;
        let header = std::str::from_utf8(&bytes[8..data_start])
            .map_err(|e| bad(format!("header is not valid UTF-8: {e}")))?;
        let header: Value = serde_json::from_str(header)
            .map_err(|e| bad(format!("header is not valid JSON: {e}")))?;
        let Value::Object(header) = header else {
            return Err(bad("header is not a JSON object".to_string()));
        };

        let mut entries = BTreeMap::new();
        let mut metadata = HashMap::new();
        for (name, info) in header {
            if name == "__metadata__" {
                metadata = parse_metadata(info).map_err(&bad)?;
                continue;
            }
            let entry = parse_entry(&name, &info).map_err(&bad)?;
            if data_start + entry.end > len {
                return Err(bad(format!(
                    "tensor `{name}` data ends at byte {} but the file has {len}",
                    data_start + entry.end
                )));
            }
            entries.insert(name, entry);
        }
        check_coverage(&entries, len - data_start).map_err(&bad)?;

        // Backstop: the reference parser must agree, so anything we accept
        // Python's safetensors accepts too.
        if let Err(e) = safetensors::SafeTensors::deserialize(&bytes) {
            return Err(bad(e.to_string()));
        }
        Ok(Self {
            path: path.to_path_buf(),
            bytes,
            data_start,
            entries,
            metadata,
        })
    }

    /// Materializes one tensor on `device`.
    pub(super) fn tensor(&self, name: &str, device: &Device) -> Result<Tensor> {
        let e = &self.entries[name];
        let dtype = candle_dtype(&e.dtype).ok_or_else(|| Error::Safetensors {
            path: self.path.clone(),
            reason: format!(
                "tensor `{name}` has dtype {}, which candle cannot hold",
                e.dtype
            ),
        })?;
        let data = &self.bytes[self.data_start + e.start..self.data_start + e.end];
        Ok(Tensor::from_raw_buffer(data, dtype, &e.shape, device)?)
    }
}

pub(super) fn parse_metadata(info: Value) -> std::result::Result<HashMap<String, String>, String> {
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

pub(super) fn parse_entry(name: &str, info: &Value) -> std::result::Result<Entry, String> {
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
    Ok(Entry {
        dtype,
        shape,
        start,
        end,
    })
}

/// The data section must be tiled exactly by the tensors: no overlaps, no
/// gaps, nothing after the last one (the format requires it; it also means
/// no two names can alias the same bytes).
pub(super) fn check_coverage(
    entries: &BTreeMap<String, Entry>,
    data_len: usize,
) -> std::result::Result<(), String> {
    let mut by_offset: Vec<(&String, &Entry)> = entries.iter().collect();
    by_offset.sort_by_key(|(name, e)| (e.start, e.end, *name));
    let mut cursor = 0;
    let mut prev: Option<(&String, &Entry)> = None;
    for (name, e) in by_offset {
        if e.start < cursor {
            let (pname, pe) = prev.expect("cursor > 0 implies a previous tensor");
            return Err(format!(
                "tensors `{pname}` (data bytes {}..{}) and `{name}` (data bytes {}..{}) overlap",
                pe.start, pe.end, e.start, e.end
            ));
        }
        if e.start > cursor {
            return Err(format!(
                "data bytes {cursor}..{} belong to no tensor (gap before tensor `{name}`)",
                e.start
            ));
        }
        cursor = e.end;
        prev = Some((name, e));
    }
    if cursor != data_len {
        return Err(format!(
            "the file has {} bytes after the end of the last tensor's data",
            data_len - cursor
        ));
    }
    Ok(())
}
