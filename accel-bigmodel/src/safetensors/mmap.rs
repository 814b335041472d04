//! Memory-mapped safetensors files (mapped by `crate::mapped`, the one place
//! accel-bigmodel uses `unsafe`).

use std::fs::File;
use std::path::Path;

use candle_core::{DType, Device, Tensor};
use memmap2::Mmap;

use super::header::SafetensorsHeader;
use crate::error::{Error, Result};

/// A safetensors file mapped read-only into memory, with its validated header.
///
/// Mapping instead of reading means a checkpoint larger than RAM costs only
/// the pages of the tensors actually materialised, and the OS can drop them
/// again under pressure.
///
/// Contract: checkpoint files are read-only inputs. Nobody may write or
/// truncate the file while a `MmapFile` is alive (replacing it by renaming a
/// new file over it is fine); a concurrent writer would change bytes under
/// shared references, and a truncation makes reading the lost pages raise
/// SIGBUS. This is the contract of candle's `from_mmaped_safetensors` and of
/// Python's `safe_open` too.
pub struct MmapFile {
    header: SafetensorsHeader,
    map: Mmap,
}

impl std::fmt::Debug for MmapFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MmapFile")
            .field("path", &self.header.path())
            .field("tensors", &self.header.tensors().len())
            .field("len", &self.map.len())
            .finish()
    }
}

impl MmapFile {
    /// Opens and maps a safetensors file and validates its header against it.
    ///
    /// # Errors
    /// [`Error::MissingFile`] when the file is absent, [`Error::Io`] when it
    /// cannot be opened or mapped, [`Error::Safetensors`] naming the defect.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let file = File::open(path).map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => Error::MissingFile {
                path: path.to_path_buf(),
                what: "safetensors tensor file".to_string(),
            },
            _ => Error::io("opening", path, e),
        })?;
        let map = crate::mapped::map_read_only(&file, path)?;
        // Validate against the mapped bytes themselves (not a separate read),
        // so the offsets checked are exactly those of the mapping.
        let header = SafetensorsHeader::from_bytes(path, &map)?;
        Ok(MmapFile { header, map })
    }

    /// The validated header.
    pub fn header(&self) -> &SafetensorsHeader {
        &self.header
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        self.header.path()
    }

    /// A tensor's raw little-endian bytes; `None` when the file lacks it.
    pub fn bytes(&self, name: &str) -> Option<&[u8]> {
        let range = self.header.byte_range(name)?;
        // In range: `from_bytes` checked every entry against `map.len()`.
        Some(&self.map[range.start as usize..range.end as usize])
    }

    /// Drops the pages of tensor `name` from the process's resident set
    /// once it was copied out (see [`crate::mapped`]): a load that reads a
    /// model tensor by tensor then never holds the file as well as the copies.
    pub fn release(&self, name: &str) {
        if let Some(range) = self.header.byte_range(name) {
            let (start, end) = (range.start as usize, range.end as usize);
            crate::mapped::drop_read_pages(&self.map, start, end - start);
        }
    }

    /// Materialises a tensor on `device`, in the dtype the file stores; an
    /// int8 tensor (LLM.int8 weights), which candle cannot hold, as its bytes
    /// in u8.
    ///
    /// # Errors
    /// [`Error::MissingTensor`] when the file lacks it, [`Error::Safetensors`]
    /// when candle cannot hold its dtype, [`Error::Candle`] on device failure.
    pub fn tensor(&self, name: &str, device: &Device) -> Result<Tensor> {
        let (Some(entry), Some(bytes)) = (self.header.get(name), self.bytes(name)) else {
            return Err(Error::MissingTensor {
                name: name.to_string(),
                checkpoint: self.path().to_path_buf(),
            });
        };
        if entry.dtype == "I8" {
            return Ok(Tensor::from_raw_buffer(
                bytes,
                DType::U8,
                &entry.shape,
                device,
            )?);
        }
        let dtype = entry.candle_dtype().ok_or_else(|| Error::Safetensors {
            path: self.path().to_path_buf(),
            tensor: Some(name.to_string()),
            reason: format!(
                "tensor `{name}` has dtype {}, which candle cannot hold",
                entry.dtype
            ),
        })?;
        Ok(Tensor::from_raw_buffer(bytes, dtype, &entry.shape, device)?)
    }
}

impl MmapFile {
    /// Tensor `name` in `dtype` on the CPU, read (and converted) straight
    /// from the file's bytes a chunk at a time, each chunk's pages dropped
    /// once read, so the file's copy never stands beside the tensor (a
    /// 32000 x 1536 f32 head read as bf16 held its 196 MB of pages and a
    /// 196 MB f32 copy to make 98 MB; read as f32, its pages and the copy).
    /// `None` unless both dtypes are f32, bf16 or f16. Converted values are
    /// `to_dtype`'s (`from_f32` of the f32 value, round to nearest even);
    /// equal dtypes keep the bits.
    ///
    /// # Errors
    /// [`Error::MissingTensor`] when the file lacks it.
    pub fn tensor_read(&self, name: &str, dtype: DType) -> Result<Option<Tensor>> {
        let (Some(entry), Some(range)) = (self.header.get(name), self.header.byte_range(name))
        else {
            return Err(Error::MissingTensor {
                name: name.to_string(),
                checkpoint: self.path().to_path_buf(),
            });
        };
        let floats = [DType::F32, DType::BF16, DType::F16];
        let Some(stored) = entry.candle_dtype().filter(|d| floats.contains(d)) else {
            return Ok(None);
        };
        if !floats.contains(&dtype) {
            return Ok(None);
        }
        let (start, end) = (range.start as usize, range.end as usize);
        let bytes = &self.map[start..end];
        let release = |at: usize, len: usize| {
            crate::mapped::drop_read_pages(&self.map, start + at, len);
        };
        let size = stored.size_in_bytes();
        let f32_of = |b: &[u8]| match stored {
            DType::F32 => f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
            DType::BF16 => half::bf16::from_bits(bits16(b)).to_f32(),
            _ => half::f16::from_bits(bits16(b)).to_f32(),
        };
        let (shape, cpu) = (entry.shape.as_slice(), &Device::Cpu);
        Ok(Some(match (stored, dtype) {
            (_, DType::F32) => Tensor::from_vec(read(bytes, size, f32_of, release), shape, cpu)?,
            (DType::BF16, DType::BF16) => {
                let v = read(bytes, size, |b| half::bf16::from_bits(bits16(b)), release);
                Tensor::from_vec(v, shape, cpu)?
            }
            (DType::F16, DType::F16) => {
                let v = read(bytes, size, |b| half::f16::from_bits(bits16(b)), release);
                Tensor::from_vec(v, shape, cpu)?
            }
            (_, DType::BF16) => {
                let v = read(bytes, size, |b| half::bf16::from_f32(f32_of(b)), release);
                Tensor::from_vec(v, shape, cpu)?
            }
            _ => {
                let v = read(bytes, size, |b| half::f16::from_f32(f32_of(b)), release);
                Tensor::from_vec(v, shape, cpu)?
            }
        }))
    }
}

/// A little-endian 16-bit value.
fn bits16(b: &[u8]) -> u16 {
    u16::from_le_bytes([b[0], b[1]])
}

/// Elements read between two page drops.
const READ_CHUNK: usize = 1 << 20;

/// The values of `bytes` (elements of `size` bytes) made by `value`,
/// calling `release(offset, len)` for each chunk of bytes once it is read.
fn read<D>(
    bytes: &[u8],
    size: usize,
    value: impl Fn(&[u8]) -> D,
    release: impl Fn(usize, usize),
) -> Vec<D> {
    let n = bytes.len() / size;
    let mut out = Vec::with_capacity(n);
    for c0 in (0..n).step_by(READ_CHUNK) {
        let m = READ_CHUNK.min(n - c0);
        let chunk = &bytes[c0 * size..(c0 + m) * size];
        out.extend(chunk.chunks_exact(size).map(&value));
        release(c0 * size, m * size);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Read from the bytes: `to_dtype`'s values bit for bit, over more than
    /// one chunk, every pair of float dtypes (equal ones the stored bits).
    #[test]
    fn a_tensor_read_from_the_file_equals_to_dtype() {
        let dir = tempfile::tempdir().unwrap();
        let n = READ_CHUNK + 4099;
        // Values past bf16's and f16's precision and range, ties included.
        let v: Vec<f32> = (0..n)
            .map(|i| ((i as f32) * 0.618_034).sin() * 7e4 + (i % 3) as f32 * 1.000_000_1)
            .collect();
        let t = Tensor::from_vec(v, n, &Device::Cpu).unwrap();
        for stored in [DType::F32, DType::BF16, DType::F16] {
            let path = dir.path().join(format!("{stored:?}.safetensors"));
            let s = t.to_dtype(stored).unwrap();
            candle_core::safetensors::save(
                &[("w".to_string(), s.clone())].into_iter().collect(),
                &path,
            )
            .unwrap();
            let file = MmapFile::open(&path).unwrap();
            for dtype in [DType::F32, DType::BF16, DType::F16] {
                let got = file
                    .tensor_read("w", dtype)
                    .unwrap()
                    .expect("floats are read");
                let want = s.to_dtype(dtype).unwrap();
                let bits = |t: &Tensor| -> Vec<u32> {
                    match t.dtype() {
                        DType::F32 => t
                            .to_vec1::<f32>()
                            .unwrap()
                            .iter()
                            .map(|x| x.to_bits())
                            .collect(),
                        DType::BF16 => t
                            .to_vec1::<half::bf16>()
                            .unwrap()
                            .iter()
                            .map(|x| x.to_bits().into())
                            .collect(),
                        _ => t
                            .to_vec1::<half::f16>()
                            .unwrap()
                            .iter()
                            .map(|x| x.to_bits().into())
                            .collect(),
                    }
                };
                assert_eq!(got.dtype(), dtype);
                assert!(bits(&got) == bits(&want), "{stored:?} -> {dtype:?}");
            }
        }
        let file = MmapFile::open(dir.path().join("F32.safetensors")).unwrap();
        assert!(file.tensor_read("nope", DType::BF16).is_err());
        assert!(file.tensor_read("w", DType::U8).unwrap().is_none());
    }

    #[test]
    fn a_mapped_file_hands_out_each_tensor_from_its_own_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.safetensors");
        let h = r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"U8","shape":[3],"data_offsets":[8,11]}}"#;
        let mut bytes = (h.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(h.as_bytes());
        bytes.extend_from_slice(&1.5f32.to_le_bytes());
        bytes.extend_from_slice(&(-2f32).to_le_bytes());
        bytes.extend_from_slice(&[7, 8, 9]);
        std::fs::write(&path, &bytes).unwrap();

        let file = MmapFile::open(&path).unwrap();
        assert_eq!(file.bytes("b"), Some(&[7u8, 8, 9][..]));
        let a = file.tensor("a", &Device::Cpu).unwrap();
        assert_eq!(a.to_vec1::<f32>().unwrap(), vec![1.5, -2.0]);
        match file.tensor("c", &Device::Cpu).unwrap_err() {
            Error::MissingTensor { name, checkpoint } => {
                assert_eq!((name.as_str(), checkpoint), ("c", path.clone()));
            }
            other => panic!("{other}"),
        }
    }

    #[test]
    fn an_empty_file_maps_and_is_reported_as_truncated() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("empty.safetensors");
        std::fs::write(&path, b"").unwrap();
        let err = MmapFile::open(&path).unwrap_err();
        assert_eq!(
            err.to_string(),
            format!(
                "{}: invalid safetensors file: the file has 0 bytes, too few for the 8-byte header length (truncated?)",
                path.display()
            )
        );
    }
}
