//! The safetensors format as accel-core uses it: dtype mapping and tensor ->
//! bytes for writing; reading goes through accel-bigmodel's validating header
//! parser and memory-mapped files (`accel_bigmodel::safetensors`), whose
//! errors name the file, tensor and byte offsets, mapped here onto
//! accel-core's error variants.

use std::path::Path;

use accel_bigmodel::MmapFile;
use candle_core::{DType, Tensor};

use crate::{Error, Result};

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

impl Raw {
    /// The same bytes typed `I8` (a u8 tensor holding int8 values).
    pub(super) fn as_int8(&mut self, path: &Path, name: &str) -> Result<()> {
        if self.dtype != safetensors::Dtype::U8 {
            return Err(Error::Safetensors {
                path: path.to_path_buf(),
                reason: format!(
                    "tensor `{name}` is {:?}, not u8 bytes to write as int8",
                    self.dtype
                ),
            });
        }
        self.dtype = safetensors::Dtype::I8;
        Ok(())
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

/// Opens and memory-maps a safetensors file through accel-bigmodel's
/// validating parser.
pub(super) fn open(path: &Path) -> Result<MmapFile> {
    MmapFile::open(path).map_err(file_error)
}

/// Maps accel-bigmodel's file errors onto accel-core's own variants, so a
/// caller matches one `Error::Safetensors` / `MissingFile` / `Json` whichever
/// crate found the defect; anything else stays wrapped as `Error::Bigmodel`.
pub(super) fn file_error(e: accel_bigmodel::Error) -> Error {
    use accel_bigmodel::Error as B;
    match e {
        B::Safetensors { path, reason, .. } => Error::Safetensors { path, reason },
        B::MissingFile { path, what } => Error::MissingFile { path, what },
        B::BadIndex { path, reason } => Error::Json { path, reason },
        B::Io { op, path, source } => Error::Io { op, path, source },
        other => Error::Bigmodel(other),
    }
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
