//! The `Communicator` trait every backend implements, and the helpers built on it.

use serde::de::DeserializeOwned;
use serde::Serialize;

use candle_core::Tensor;

use crate::buffer::{with_buffer, with_buffer_pair, Buffer, BufferMut};
use crate::{tensor, Error, ReduceOp, Result};

/// A group of processes that exchange data: the seam between the training
/// code and a transport (TCP today, NCCL later).
///
/// Every rank must call the same collectives in the same order with buffers
/// of the same length and dtype. Implementations fail instead of hanging:
/// each blocking call honours the group's timeout and an error names the
/// rank that went missing.
///
/// The required methods move typed host buffers ([`Buffer`]/[`BufferMut`]);
/// the provided ones add candle tensors and raw bytes on top. Generic
/// helpers for serde objects live in [`CommunicatorExt`], which every
/// communicator (including `dyn Communicator`) implements.
pub trait Communicator: Send + Sync {
    /// This process's rank, `0..world_size()`.
    fn rank(&self) -> usize;

    /// The number of processes in the group.
    fn world_size(&self) -> usize;

    /// Combines `buf` across all ranks with `op`; every rank ends up with the result.
    fn all_reduce(&self, buf: BufferMut<'_>, op: ReduceOp) -> Result<()>;

    /// Concatenates every rank's `input` into `output` in rank order;
    /// `output.len() == input.len() * world_size()`.
    fn all_gather(&self, input: Buffer<'_>, output: BufferMut<'_>) -> Result<()>;

    /// Reduces `input` across ranks and leaves block `rank` of the result in
    /// `output`; `input.len() == output.len() * world_size()`.
    fn reduce_scatter(&self, input: Buffer<'_>, output: BufferMut<'_>, op: ReduceOp) -> Result<()>;

    /// Copies `buf` of rank `root` into `buf` of every other rank.
    fn broadcast(&self, buf: BufferMut<'_>, root: usize) -> Result<()>;

    /// Sends `buf` to rank `dst`, which must call [`recv`](Self::recv) with a buffer of the same length.
    fn send(&self, buf: Buffer<'_>, dst: usize) -> Result<()>;

    /// Receives into `buf` what rank `src` passed to [`send`](Self::send).
    fn recv(&self, buf: BufferMut<'_>, src: usize) -> Result<()>;

    /// Returns once every rank has called `barrier`.
    fn barrier(&self) -> Result<()> {
        self.all_reduce(BufferMut::U8(&mut [0]), ReduceOp::Max)
    }

    /// All-reduces a contiguous CPU tensor into a new tensor of the same shape.
    fn all_reduce_tensor(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor> {
        tensor::all_reduce(self, t, op)
    }

    /// All-reduces a contiguous CPU tensor in place (visible through every
    /// tensor sharing its storage, e.g. a `Var`'s gradient).
    fn all_reduce_tensor_inplace(&self, t: &Tensor, op: ReduceOp) -> Result<()> {
        tensor::all_reduce_inplace(self, t, op)
    }

    /// Returns rank `root`'s tensor on every rank; `t` gives the shape and dtype elsewhere.
    fn broadcast_tensor(&self, t: &Tensor, root: usize) -> Result<Tensor> {
        tensor::broadcast(self, t, root)
    }

    /// Concatenates every rank's tensor along dimension 0 (a scalar becomes a
    /// vector of `world_size()` values), as accelerate's `gather`.
    fn all_gather_tensor(&self, t: &Tensor) -> Result<Tensor> {
        tensor::all_gather(self, t)
    }

    /// Reduces tensors across ranks and returns this rank's block of
    /// dimension 0, which must divide by `world_size()`.
    fn reduce_scatter_tensor(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor> {
        tensor::reduce_scatter(self, t, op)
    }

    /// Every rank's byte string, in rank order; lengths may differ between ranks.
    fn all_gather_bytes(&self, bytes: &[u8]) -> Result<Vec<Vec<u8>>> {
        let n = self.world_size();
        let mut lens = vec![0i64; n];
        self.all_gather(Buffer::I64(&[bytes.len() as i64]), (&mut lens).into())?;
        let max = lens.iter().copied().max().unwrap_or(0) as usize;
        if max == 0 {
            return Ok(vec![Vec::new(); n]);
        }
        let mut padded = bytes.to_vec();
        padded.resize(max, 0);
        let mut all = vec![0u8; max * n];
        self.all_gather(Buffer::U8(&padded), (&mut all).into())?;
        Ok(all
            .chunks(max)
            .zip(lens)
            .map(|(c, len)| c[..len as usize].to_vec())
            .collect())
    }

    /// Replaces `bytes` on every rank with rank `root`'s bytes.
    fn broadcast_bytes(&self, bytes: &mut Vec<u8>, root: usize) -> Result<()> {
        let mut len = [bytes.len() as i64];
        self.broadcast((&mut len[..]).into(), root)?;
        bytes.resize(len[0] as usize, 0);
        if !bytes.is_empty() {
            self.broadcast(bytes.into(), root)?;
        }
        Ok(())
    }
}

/// Generic object helpers, available on every [`Communicator`] (also `dyn Communicator`).
///
/// Objects travel as JSON, like accelerate's pickled objects: convenient for
/// metrics and small state, not for bulk data.
pub trait CommunicatorExt: Communicator {
    /// Every rank's object, in rank order (accelerate's `gather_object`).
    fn gather_object<T: Serialize + DeserializeOwned>(&self, obj: &T) -> Result<Vec<T>> {
        const OP: &str = "gather_object";
        let bytes = serde_json::to_vec(obj).map_err(|source| Error::Serde { op: OP, source })?;
        self.all_gather_bytes(&bytes)?
            .iter()
            .map(|b| serde_json::from_slice(b).map_err(|source| Error::Serde { op: OP, source }))
            .collect()
    }

    /// Replaces `objects` on every rank with rank `root`'s list
    /// (PyTorch's `broadcast_object_list`; other ranks may pass any list, e.g. empty).
    fn broadcast_object_list<T: Serialize + DeserializeOwned>(
        &self,
        objects: &mut Vec<T>,
        root: usize,
    ) -> Result<()> {
        const OP: &str = "broadcast_object_list";
        let mut bytes = if self.rank() == root {
            serde_json::to_vec(objects).map_err(|source| Error::Serde { op: OP, source })?
        } else {
            Vec::new()
        };
        self.broadcast_bytes(&mut bytes, root)?;
        if self.rank() != root {
            *objects =
                serde_json::from_slice(&bytes).map_err(|source| Error::Serde { op: OP, source })?;
        }
        Ok(())
    }
}

impl<C: Communicator + ?Sized> CommunicatorExt for C {}

/// Rejects a rank argument outside the world.
pub(crate) fn check_rank(op: &'static str, rank: usize, world: usize) -> Result<()> {
    if rank >= world {
        return Err(Error::InvalidRank { op, rank, world });
    }
    Ok(())
}

/// Which side of a collective is `world_size` times longer.
#[derive(Clone, Copy)]
pub(crate) enum Longer {
    /// `output.len() == input.len() * world` (all-gather).
    Output,
    /// `input.len() == output.len() * world` (reduce-scatter).
    Input,
}

/// Checks that `input` and `output` share a dtype and have matching lengths.
pub(crate) fn check_pair(
    op: &'static str,
    input: &Buffer<'_>,
    output: &BufferMut<'_>,
    world: usize,
    longer: Longer,
) -> Result<()> {
    if input.dtype() != output.dtype() {
        return Err(Error::DTypeMismatch {
            op,
            input: input.dtype(),
            output: output.dtype(),
        });
    }
    let (what, expected, got) = match longer {
        Longer::Output => ("output", input.len() * world, output.len()),
        Longer::Input => ("input", output.len() * world, input.len()),
    };
    if expected != got {
        return Err(Error::LengthMismatch {
            op,
            what,
            expected,
            got,
        });
    }
    Ok(())
}

/// Copies `input` into `output` (same dtype and length, checked by the caller).
pub(crate) fn copy_into(op: &'static str, input: Buffer<'_>, output: BufferMut<'_>) -> Result<()> {
    let (i_dtype, o_dtype) = (input.dtype(), output.dtype());
    with_buffer_pair!(input, output, (i, o) => {
        o.copy_from_slice(i);
        Ok(())
    }, Err(Error::DTypeMismatch { op, input: i_dtype, output: o_dtype }))
}

/// Rejects `Mean` for integer buffers.
pub(crate) fn check_reduce_buffer(
    op: &'static str,
    buf: &Buffer<'_>,
    reduce: ReduceOp,
) -> Result<()> {
    with_buffer!(Buffer, buf, b => check_typed(op, b, reduce))
}

fn check_typed<T: crate::Element>(op: &'static str, _: &[T], reduce: ReduceOp) -> Result<()> {
    crate::reduce::check_reduce::<T>(op, reduce)
}
