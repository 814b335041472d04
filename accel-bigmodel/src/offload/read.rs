//! Positioned reads of raw tensor bytes (a `.dat` file, a tensor inside a
//! safetensors shard) into a new tensor or into an existing buffer.
//!
//! Positioned reads rather than a memory map: mapped pages stay counted in
//! the process's resident set after use, so a forward over a disk-offloaded
//! model would end with the whole model resident; a buffer read into is
//! freed (or recycled by a [`super::StagingPool`]) once the forward is done.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;

use candle_core::{DType, Device, Tensor, WithDType};

use crate::dtype::with_pod_type;
use crate::error::{Error, Result};

fn open(path: &Path) -> Result<File> {
    File::open(path).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => Error::MissingFile {
            path: path.to_path_buf(),
            what: "offloaded weight".to_string(),
        },
        _ => Error::io("opening", path, e),
    })
}

/// Reads the tensor of `dtype` and `shape` stored at `offset` of `path` (a
/// scalar is stored as one element).
pub(super) fn read_tensor(
    path: &Path,
    offset: u64,
    dtype: DType,
    shape: &[usize],
) -> Result<Tensor> {
    fn typed<T: WithDType + bytemuck::Pod>(
        file: &File,
        offset: u64,
        shape: &[usize],
    ) -> std::io::Result<candle_core::Result<Tensor>> {
        let n = shape.iter().product::<usize>().max(1);
        let mut v = vec![T::zeroed(); n];
        file.read_exact_at(bytemuck::cast_slice_mut(&mut v), offset)?;
        Ok(Tensor::from_vec(v, n, &Device::Cpu).and_then(|t| t.reshape(shape)))
    }
    let file = open(path)?;
    let t = with_pod_type!(dtype, |T| typed::<T>(&file, offset, shape), _ => {
        // Every dtype an index or header entry resolves to has a plain
        // element type (`dtype_from_numpy`, `candle_dtype`).
        let reason = format!("no plain element type for {dtype:?}");
        Err(std::io::Error::new(std::io::ErrorKind::Unsupported, reason))
    });
    Ok(t.map_err(|e| Error::io("reading", path, e))??)
}

/// Reads the bytes at `offset` of `path` over all of `dst`, a contiguous CPU
/// tensor whose dtype is the stored one: the weight lands in memory that is
/// already faulted in, with no allocation. `Ok(false)` for a dtype candle
/// has no plain element type for (sub-byte and f8 formats).
pub(super) fn read_into(path: &Path, offset: u64, dst: &Tensor) -> Result<bool> {
    fn typed<T: WithDType + bytemuck::Pod>(path: &Path, offset: u64, dst: &Tensor) -> Result<bool> {
        let file = open(path)?;
        let mut io = Ok(());
        accel_kernels::with_slice_mut::<T, ()>(dst, "read_into", |s| {
            io = file.read_exact_at(bytemuck::cast_slice_mut(s), offset);
            Ok(())
        })?;
        io.map_err(|e| Error::io("reading", path, e))?;
        Ok(true)
    }
    with_pod_type!(dst.dtype(), |T| typed::<T>(path, offset, dst), _ => Ok(false))
}
