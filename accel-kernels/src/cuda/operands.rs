//! Device addresses of the tensors of a call, and the launch tables that
//! hand them to the kernels.

use std::collections::HashMap;

use candle_core::backend::BackendStorage;
use candle_core::cuda::{CudaDType, CudaDevice, CudaStorage, CudaStorageSlice};
use candle_core::{CpuStorage, DType, InplaceOp1, Layout, Storage, Tensor};
use cudarc::driver::{CudaSlice, CudaStream, CudaView, DevicePtr, DevicePtrMut, SyncOnDrop};

use crate::{Error, Result};

/// Smallest and largest chunk of a launch table, in elements. Chunk
/// lengths are powers of two (multiples of the vector width, so every chunk
/// of an aligned tensor is aligned too).
pub(crate) const MIN_CHUNK: usize = 4 * 1024;
/// See [`MIN_CHUNK`].
pub(crate) const MAX_CHUNK: usize = 64 * 1024;

/// The chunk length for a list of `total` elements: about 2048 chunks,
/// enough blocks to fill a large GPU several times over, and each a block's
/// worth of work (up to 64K elements) so that per-chunk costs stay small.
pub(crate) fn chunk_len(total: usize) -> usize {
    (total / 2048)
        .next_power_of_two()
        .clamp(MIN_CHUNK, MAX_CHUNK)
}

/// Most tensors one launch covers (`LAUNCH_TENSORS` in `common.cuh`).
pub(crate) const LAUNCH_TENSORS: usize = 64;

/// The kernels' first parameter, passed by value: up to
/// [`LAUNCH_TENSORS`] tensors of up to four operands each, cut into chunks
/// (`struct Table` in `common.cuh`, same layout). Kernel parameters may
/// take 4 KiB on every CUDA version; this is 2848 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Table {
    /// Base address of operand j of tensor i (0: operand unused).
    pub p: [[u64; LAUNCH_TENSORS]; 4],
    /// Elements of tensor i.
    pub n: [u64; LAUNCH_TENSORS],
    /// First chunk of tensor i; `first[n_tensors]` is the chunk count.
    pub first: [u32; LAUNCH_TENSORS + 1],
    /// Tensors in use.
    pub n_tensors: u32,
    /// Elements per chunk.
    pub chunk: u32,
    /// Element size of operand j, in bytes.
    pub elem: [u32; 4],
}

const _: () = assert!(std::mem::size_of::<Table>() == 2848);

impl Table {
    fn empty(chunk: usize, elem: [u32; 4]) -> Table {
        Table {
            p: [[0; LAUNCH_TENSORS]; 4],
            n: [0; LAUNCH_TENSORS],
            first: [0; LAUNCH_TENSORS + 1],
            n_tensors: 0,
            chunk: chunk as u32,
            elem,
        }
    }

    /// Chunks of this launch.
    pub(crate) fn chunks(&self) -> usize {
        self.first[self.n_tensors as usize] as usize
    }
}

/// A key identifying the allocation behind a CUDA tensor, for the aliasing
/// check and for sharing one lock between views; `None` for other storages
/// and empty allocations.
///
/// It is the address of candle's `Storage` object, which every tensor
/// sharing the allocation shares (one `Arc<RwLock<Storage>>`), and which
/// owns its allocation alone. Not the device address: reading that through
/// cudarc makes the stream wait for the last write and records a read
/// event, two driver calls per tensor, which made up much of a call's host
/// time on lists of many small tensors.
pub(crate) fn storage_key(storage: &Storage) -> Option<usize> {
    let Storage::Cuda(cs) = storage else {
        return None;
    };
    let len = match &cs.slice {
        CudaStorageSlice::U8(s)
        | CudaStorageSlice::F6E2M3(s)
        | CudaStorageSlice::F6E3M2(s)
        | CudaStorageSlice::F4(s)
        | CudaStorageSlice::F8E8M0(s) => s.len(),
        CudaStorageSlice::U32(s) => s.len(),
        CudaStorageSlice::I16(s) => s.len(),
        CudaStorageSlice::I32(s) => s.len(),
        CudaStorageSlice::I64(s) => s.len(),
        CudaStorageSlice::BF16(s) => s.len(),
        CudaStorageSlice::F16(s) => s.len(),
        CudaStorageSlice::F32(s) => s.len(),
        CudaStorageSlice::F64(s) => s.len(),
        CudaStorageSlice::F8E4M3(s) => s.len(),
    };
    (len > 0).then_some(storage as *const Storage as usize)
}

/// The base address of a float storage's allocation and the guard that
/// records candle's read event once the work using it is enqueued.
fn base_ptr<'a>(cs: &'a CudaStorage, stream: &'a CudaStream) -> Result<(u64, SyncOnDrop<'a>)> {
    Ok(match &cs.slice {
        CudaStorageSlice::F32(s) => s.device_ptr(stream),
        CudaStorageSlice::BF16(s) => s.device_ptr(stream),
        CudaStorageSlice::F16(s) => s.device_ptr(stream),
        _ => {
            return Err(Error::UnsupportedDType {
                op: "cuda",
                dtype: cs.dtype(),
            })
        }
    })
}

/// The address of every tensor's first element, list by list.
pub(crate) type Ptrs = Vec<Vec<u64>>;

/// Read-locks the storages of all tensors of `lists` (once per storage),
/// and runs `f` with their device, and the address of each tensor's first
/// element. The locks and cudarc's stream-ordering guards are held until
/// `f` returns, so `f` must enqueue all the work on those addresses; then
/// the tensors of the lists named in `written` get a write fence (see
/// [`fence_writes`]).
///
/// Every tensor must be a contiguous f32/bf16/f16 CUDA tensor of one
/// device (checked by the callers before).
pub(crate) fn with_device_ptrs<R>(
    op: &'static str,
    lists: &[&[Tensor]],
    written: &[usize],
    f: impl FnOnce(&CudaDevice, &Ptrs) -> Result<R>,
) -> Result<R> {
    let all: Vec<&Tensor> = lists.iter().flat_map(|l| l.iter()).collect();
    let Some(first) = all.first() else {
        return Err(Error::InvalidArgument {
            op,
            reason: "no tensors".into(),
        });
    };
    let dev = first.device().as_cuda_device()?.clone();
    let stream = dev.cuda_stream();
    // All keys first: each takes a short read lock of its own, and a second
    // read lock on a storage already held could deadlock behind a writer.
    let keys: Vec<Option<usize>> = all
        .iter()
        .map(|t| storage_key(&t.storage_and_layout().0))
        .collect();
    let mut guards = Vec::new();
    let mut guard_of_key: HashMap<usize, usize> = HashMap::new();
    let mut guard_idx = Vec::with_capacity(all.len());
    for (t, key) in all.iter().zip(keys) {
        let idx = match key.and_then(|k| guard_of_key.get(&k)) {
            Some(&i) => i,
            None => {
                guards.push(t.storage_and_layout().0);
                if let Some(k) = key {
                    guard_of_key.insert(k, guards.len() - 1);
                }
                guards.len() - 1
            }
        };
        guard_idx.push(idx);
    }
    let mut records = Vec::with_capacity(guards.len());
    let mut bases = Vec::with_capacity(guards.len());
    for g in &guards {
        let Storage::Cuda(cs) = &**g else {
            return Err(Error::InvalidArgument {
                op,
                reason: "tensors of a CUDA call must all be on the CUDA device".into(),
            });
        };
        let (ptr, rec) = base_ptr(cs, &stream)?;
        bases.push(ptr);
        records.push(rec);
    }
    let mut ptrs: Ptrs = Vec::with_capacity(lists.len());
    let mut k = 0;
    for list in lists {
        let mut v = Vec::with_capacity(list.len());
        for (index, t) in list.iter().enumerate() {
            let (start, _) = t
                .layout()
                .contiguous_offsets()
                .ok_or(Error::RequiresContiguous { op, index })?;
            v.push(bases[guard_idx[k]] + (start * t.dtype().size_in_bytes()) as u64);
            k += 1;
        }
        ptrs.push(v);
    }
    let out = f(&dev, &ptrs);
    // Recording the read events after the launches orders later writers
    // and frees of other streams behind them; only then may the locks go.
    drop(records);
    drop(guards);
    let out = out?;
    for &l in written {
        fence_writes(op, lists[l])?;
    }
    Ok(out)
}

/// Records each tensor's cudarc *write* event on the calling thread's
/// stream, after the work just enqueued there.
///
/// The launches above hold read locks only: one kernel writes many tensors
/// and candle hands out one write lock at a time (nesting one per tensor
/// would recurse once per parameter). A read guard records the *read*
/// event, which orders later writers and frees but not later readers on
/// other streams: those wait for the write event. So, once the work is
/// enqueued, each written storage is write-locked in turn and
/// `device_ptr_mut` records its write event on this stream, after the
/// kernel. A reader on any stream (another host thread's, NCCL's) then
/// waits for the kernel. With event tracking off (one stream in the
/// context) the calls record nothing, as cudarc intends.
pub(crate) fn fence_writes(op: &'static str, tensors: &[Tensor]) -> Result<()> {
    let mut seen = std::collections::HashSet::new();
    for t in tensors {
        if seen.insert(t.id()) {
            t.inplace_op1(&WriteFence { op })?;
        }
    }
    Ok(())
}

/// The in-place "op" behind [`fence_writes`]: it takes the write lock and
/// records the write event, touching no data.
struct WriteFence {
    op: &'static str,
}

impl InplaceOp1 for WriteFence {
    fn name(&self) -> &'static str {
        self.op
    }

    fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout) -> candle_core::Result<()> {
        Ok(())
    }

    fn cuda_fwd(&self, cs: &mut CudaStorage, _: &Layout) -> candle_core::Result<()> {
        let stream = cs.device.cuda_stream();
        match &mut cs.slice {
            CudaStorageSlice::F32(s) => drop(s.device_ptr_mut(&stream)),
            CudaStorageSlice::BF16(s) => drop(s.device_ptr_mut(&stream)),
            CudaStorageSlice::F16(s) => drop(s.device_ptr_mut(&stream)),
            CudaStorageSlice::F64(s) => drop(s.device_ptr_mut(&stream)),
            CudaStorageSlice::U32(s) => drop(s.device_ptr_mut(&stream)),
            CudaStorageSlice::U8(s) => drop(s.device_ptr_mut(&stream)),
            CudaStorageSlice::I64(s) => drop(s.device_ptr_mut(&stream)),
            _ => {}
        }
        Ok(())
    }
}

/// One operand column of a table: per tensor, its address and element size.
pub(crate) struct Column<'a> {
    /// Address of each tensor's first element (0: operand unused).
    pub ptrs: &'a [u64],
    /// Element size of each tensor, in bytes (one per column within a
    /// launch: the callers group tensors by dtype).
    pub elem: &'a [usize],
}

/// The launch tables for tensors `idx` (positions in the columns), `lens[i]`
/// elements each, cut into chunks of [`chunk_len`] of the group's total:
/// [`LAUNCH_TENSORS`] tensors per table, in order. Empty tensors are left
/// out (no table at all when every tensor is empty).
pub(crate) fn launch_tables(
    idx: &[usize],
    lens: &[usize],
    cols: &[Column<'_>],
) -> Result<Vec<Table>> {
    let chunk = chunk_len(idx.iter().map(|&i| lens[i]).sum());
    launch_tables_with(idx, lens, cols, chunk)
}

/// [`launch_tables`] with an explicit chunk length.
fn launch_tables_with(
    idx: &[usize],
    lens: &[usize],
    cols: &[Column<'_>],
    chunk: usize,
) -> Result<Vec<Table>> {
    assert!(cols.len() <= 4, "at most four operands");
    let live: Vec<usize> = idx.iter().copied().filter(|&i| lens[i] > 0).collect();
    let mut elem = [0u32; 4];
    if let Some(&i) = live.first() {
        for (j, c) in cols.iter().enumerate() {
            elem[j] = c.elem[i] as u32;
        }
    }
    let mut tables = Vec::with_capacity(live.len().div_ceil(LAUNCH_TENSORS));
    for group in live.chunks(LAUNCH_TENSORS) {
        let mut t = Table::empty(chunk, elem);
        let mut first = 0usize;
        for (k, &i) in group.iter().enumerate() {
            for (j, c) in cols.iter().enumerate() {
                debug_assert_eq!(c.elem[i] as u32, elem[j], "one dtype per column");
                t.p[j][k] = c.ptrs[i];
            }
            t.n[k] = lens[i] as u64;
            t.first[k] = first as u32;
            first += lens[i].div_ceil(chunk);
        }
        t.n_tensors = group.len() as u32;
        t.first[group.len()] = u32::try_from(first).map_err(|_| Error::InvalidArgument {
            op: "cuda",
            reason: format!("{first} chunks of {chunk} elements exceed one launch"),
        })?;
        tables.push(t);
    }
    Ok(tables)
}

/// Element sizes of a list's tensors.
pub(crate) fn elem_sizes(ts: &[Tensor]) -> Vec<usize> {
    ts.iter().map(|t| t.dtype().size_in_bytes()).collect()
}

/// Positions of `ts` grouped by dtype, in a fixed dtype order.
pub(crate) fn by_dtype(ts: &[Tensor]) -> Vec<(DType, Vec<usize>)> {
    [DType::F32, DType::BF16, DType::F16]
        .into_iter()
        .map(|d| {
            let idx: Vec<usize> = (0..ts.len()).filter(|&i| ts[i].dtype() == d).collect();
            (d, idx)
        })
        .filter(|(_, idx)| !idx.is_empty())
        .collect()
}

/// The contiguous f32 elements of `(s, l)` as a view; `index` names the
/// operand in errors.
pub(crate) fn f32_view<'a>(
    op: &'static str,
    index: usize,
    s: &'a CudaStorage,
    l: &Layout,
) -> Result<CudaView<'a, f32>> {
    view(op, index, s, l)
}

/// The whole buffer of `s` as elements of `T`, or the dtype error naming `op`.
pub(crate) fn slice_of<'a, T: CudaDType>(
    op: &'static str,
    s: &'a CudaStorage,
) -> Result<&'a CudaSlice<T>> {
    s.as_cuda_slice::<T>().map_err(|_| Error::UnsupportedDType {
        op,
        dtype: s.dtype(),
    })
}

/// The contiguous elements of `(s, l)`, of type `T`, as a view; `index`
/// names the operand in errors.
pub(crate) fn view<'a, T: CudaDType>(
    op: &'static str,
    index: usize,
    s: &'a CudaStorage,
    l: &Layout,
) -> Result<CudaView<'a, T>> {
    let slice = slice_of::<T>(op, s)?;
    let (start, end) = l
        .contiguous_offsets()
        .ok_or(Error::RequiresContiguous { op, index })?;
    Ok(slice.slice(start..end))
}

#[cfg(test)]
mod tests {
    use super::*;
    use super::{MAX_CHUNK, MIN_CHUNK};

    #[test]
    fn tables_number_the_chunks_of_each_tensor_and_skip_empty_ones() {
        const CHUNK: usize = 4096;
        let lens = [CHUNK + 3, 0, 5];
        let a = [1000, 7, 2000];
        let b = [0, 0, 3000];
        let cols = [
            Column {
                ptrs: &a,
                elem: &[4, 4, 4],
            },
            Column {
                ptrs: &b,
                elem: &[2, 2, 2],
            },
        ];
        let t = launch_tables_with(&[0, 1, 2], &lens, &cols, CHUNK).unwrap();
        assert_eq!(t.len(), 1);
        let t = &t[0];
        assert_eq!(
            (t.n_tensors, t.chunk, t.elem),
            (2, CHUNK as u32, [4, 2, 0, 0])
        );
        assert_eq!(&t.first[..3], &[0, 2, 3]);
        assert_eq!(t.chunks(), 3);
        assert_eq!(&t.n[..3], &[CHUNK as u64 + 3, 5, 0]);
        assert_eq!(
            (t.p[0][0], t.p[0][1], t.p[1][0], t.p[1][1]),
            (1000, 2000, 0, 3000)
        );
        assert!(t.p[2].iter().chain(&t.p[3]).all(|&p| p == 0));
        assert!(launch_tables_with(&[1], &lens, &cols, CHUNK)
            .unwrap()
            .is_empty());
    }

    #[test]
    fn long_lists_are_split_into_launches_of_at_most_sixty_four_tensors() {
        let n = 2 * LAUNCH_TENSORS + 1;
        let lens: Vec<usize> = (0..n).map(|i| i + 1).collect();
        let ptrs: Vec<u64> = (0..n as u64).map(|i| 8 * (i + 1)).collect();
        let elem = vec![4; n];
        let cols = [Column {
            ptrs: &ptrs,
            elem: &elem,
        }];
        let idx: Vec<usize> = (0..n).collect();
        let t = launch_tables_with(&idx, &lens, &cols, 4).unwrap();
        assert_eq!(
            t.iter().map(|t| t.n_tensors).collect::<Vec<_>>(),
            [64, 64, 1]
        );
        // Every tensor appears once, in order, with its chunks counted.
        let seen: Vec<u64> = t
            .iter()
            .flat_map(|t| t.p[0][..t.n_tensors as usize].to_vec())
            .collect();
        assert_eq!(seen, ptrs);
        let chunks: usize = t.iter().map(Table::chunks).sum();
        assert_eq!(chunks, lens.iter().map(|l| l.div_ceil(4)).sum::<usize>());
        assert_eq!(t[2].first[..2], [0, (n as u32).div_ceil(4)]);
    }

    #[test]
    fn chunks_aim_for_about_two_thousand_per_launch() {
        assert_eq!(chunk_len(0), MIN_CHUNK);
        assert_eq!(chunk_len(1 << 20), MIN_CHUNK);
        assert_eq!(chunk_len(1 << 24), 8192);
        assert_eq!(chunk_len(1 << 30), MAX_CHUNK);
        for total in [1usize, 5000, 3 << 20, 7 << 25] {
            let c = chunk_len(total);
            assert!(c.is_power_of_two() && c.is_multiple_of(4), "{total}: {c}");
        }
    }
}
