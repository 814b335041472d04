//! The world-of-one communicator for single-process runs.

use crate::buffer::{Buffer, BufferMut};
use crate::communicator::{check_pair, check_rank, check_reduce_buffer, copy_into, Longer};
use crate::{Communicator, Error, ReduceOp, Result};

/// A communicator with a single rank: every collective is the identity
/// (after the same argument checks a real backend makes), so single-process
/// code runs the multi-process code path unchanged.
#[derive(Clone, Copy, Debug, Default)]
pub struct LocalCommunicator;

impl LocalCommunicator {
    /// The single-process communicator.
    pub fn new() -> Self {
        Self
    }
}

impl Communicator for LocalCommunicator {
    fn rank(&self) -> usize {
        0
    }

    fn world_size(&self) -> usize {
        1
    }

    fn all_reduce(&self, buf: BufferMut<'_>, op: ReduceOp) -> Result<()> {
        // The mean over one rank is the value itself.
        check_reduce_buffer("all_reduce", &buf.as_buffer(), op)
    }

    fn all_gather(&self, input: Buffer<'_>, output: BufferMut<'_>) -> Result<()> {
        check_pair("all_gather", &input, &output, 1, Longer::Output)?;
        copy_into("all_gather", input, output)
    }

    fn reduce_scatter(&self, input: Buffer<'_>, output: BufferMut<'_>, op: ReduceOp) -> Result<()> {
        check_pair("reduce_scatter", &input, &output, 1, Longer::Input)?;
        check_reduce_buffer("reduce_scatter", &input, op)?;
        copy_into("reduce_scatter", input, output)
    }

    fn broadcast(&self, _buf: BufferMut<'_>, root: usize) -> Result<()> {
        check_rank("broadcast", root, 1)
    }

    fn send(&self, _buf: Buffer<'_>, dst: usize) -> Result<()> {
        // A world of one has no peer to talk to, not even itself.
        Err(Error::InvalidRank {
            op: "send",
            rank: dst,
            world: 1,
        })
    }

    fn recv(&self, _buf: BufferMut<'_>, src: usize) -> Result<()> {
        Err(Error::InvalidRank {
            op: "recv",
            rank: src,
            world: 1,
        })
    }

    fn barrier(&self) -> Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::CommunicatorExt;

    #[test]
    fn every_collective_is_the_identity() -> Result<()> {
        let c = LocalCommunicator::new();
        let mut v = vec![1.0f32, 2.0];
        c.all_reduce((&mut v).into(), ReduceOp::Mean)?;
        assert_eq!(v, [1.0, 2.0]);
        let mut out = vec![0.0f32; 2];
        c.all_gather((&v).into(), (&mut out).into())?;
        assert_eq!(out, v);
        c.broadcast((&mut v).into(), 0)?;
        c.barrier()?;
        assert_eq!(c.gather_object(&"x".to_string())?, ["x"]);
        let mut list = vec![1, 2];
        c.broadcast_object_list(&mut list, 0)?;
        assert_eq!(list, [1, 2]);
        Ok(())
    }

    #[test]
    fn bad_arguments_are_rejected() {
        let c = LocalCommunicator::new();
        assert!(c.broadcast(BufferMut::U8(&mut []), 1).is_err());
        assert!(c.send(Buffer::U8(&[]), 0).is_err());
        let err = c
            .all_gather(Buffer::F32(&[1.0]), BufferMut::F32(&mut [0.0; 2]))
            .unwrap_err();
        assert!(
            err.to_string()
                .contains("output has 2 elements, expected 1"),
            "{err}"
        );
        let err = c
            .all_gather(Buffer::F32(&[1.0]), BufferMut::F64(&mut [0.0]))
            .unwrap_err();
        assert!(matches!(err, Error::DTypeMismatch { .. }), "{err}");
        assert!(c
            .all_reduce(BufferMut::U32(&mut [1]), ReduceOp::Mean)
            .is_err());
    }
}
