//! The collectives: on CUDA tensors in place, on host buffers staged
//! through device memory.

use candle_core::backend::BackendStorage;
use candle_core::cuda::CudaStorageSlice;
use candle_core::{DType, Storage, Tensor};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DeviceRepr, SyncOnDrop, ValidAsZeroBits};
use cudarc::nccl::{result, sys};

use super::NcclCommunicator;
use crate::buffer::{with_buffer, with_buffer_pair, Buffer, BufferMut};
use crate::communicator::{check_pair, check_rank, check_reduce_buffer, Longer};
use crate::{tensor, Communicator, Error, ReduceOp, Result};

/// The NCCL element type of a dtype.
fn nccl_dtype(op: &'static str, dtype: DType) -> Result<sys::ncclDataType_t> {
    use sys::ncclDataType_t::*;
    Ok(match dtype {
        DType::F32 => ncclFloat32,
        DType::F64 => ncclFloat64,
        DType::BF16 => ncclBfloat16,
        DType::F16 => ncclFloat16,
        DType::U32 => ncclUint32,
        DType::I64 => ncclInt64,
        DType::U8 => ncclUint8,
        dtype => return Err(Error::UnsupportedDType { op, dtype }),
    })
}

/// The NCCL reduction of a [`ReduceOp`].
fn nccl_op(op: ReduceOp) -> sys::ncclRedOp_t {
    use sys::ncclRedOp_t::*;
    match op {
        ReduceOp::Sum => ncclSum,
        ReduceOp::Mean => ncclAvg,
        ReduceOp::Max => ncclMax,
        ReduceOp::Min => ncclMin,
        ReduceOp::Product => ncclProd,
    }
}

/// The device address of a CUDA storage's allocation, and candle's event
/// guard to drop once the work using it is enqueued.
fn storage_ptr<'a>(
    op: &'static str,
    storage: &'a Storage,
    stream: &'a CudaStream,
) -> Result<(u64, SyncOnDrop<'a>)> {
    let Storage::Cuda(cs) = storage else {
        return Err(Error::DeviceMismatch {
            op,
            expected: "a CUDA device".into(),
            got: "the CPU".into(),
        });
    };
    Ok(match &cs.slice {
        CudaStorageSlice::F32(s) => s.device_ptr(stream),
        CudaStorageSlice::F64(s) => s.device_ptr(stream),
        CudaStorageSlice::BF16(s) => s.device_ptr(stream),
        CudaStorageSlice::F16(s) => s.device_ptr(stream),
        CudaStorageSlice::U32(s) => s.device_ptr(stream),
        CudaStorageSlice::I64(s) => s.device_ptr(stream),
        CudaStorageSlice::U8(s) => s.device_ptr(stream),
        _ => {
            return Err(Error::UnsupportedDType {
                op,
                dtype: cs.dtype(),
            })
        }
    })
}

impl NcclCommunicator {
    fn check_tensor(&self, op: &'static str, t: &Tensor, reduce: Option<ReduceOp>) -> Result<()> {
        if !t.device().same_device(&self.device()) {
            return Err(Error::DeviceMismatch {
                op,
                expected: format!("{:?}", self.device().location()),
                got: format!("{:?}", t.device().location()),
            });
        }
        if !t.is_contiguous() {
            return Err(Error::RequiresContiguous { op });
        }
        nccl_dtype(op, t.dtype())?;
        if reduce == Some(ReduceOp::Mean) && !t.dtype().is_float() {
            return Err(Error::UnsupportedReduce {
                op,
                reduce: ReduceOp::Mean,
                dtype: t.dtype(),
            });
        }
        Ok(())
    }

    /// Runs a collective reading `input` and writing `output` (CUDA tensors,
    /// checked), as `f(send, recv, comm, stream)` on their first elements.
    fn tensor_call(
        &self,
        op: &'static str,
        call: &'static str,
        input: &Tensor,
        output: &Tensor,
        f: impl FnOnce(
            u64,
            u64,
            sys::ncclComm_t,
            sys::cudaStream_t,
        ) -> std::result::Result<result::NcclStatus, result::NcclError>,
    ) -> Result<()> {
        if input.elem_count() == 0 && output.elem_count() == 0 {
            return Ok(()); // nothing to move on any rank (shapes match)
        }
        let addr = |t: &Tensor, base: u64| {
            let start = t.layout().start_offset() * t.dtype().size_in_bytes();
            base + start as u64
        };
        let (gi, _) = input.storage_and_layout();
        let (pi, _ri) = storage_ptr(op, &gi, &self.stream)?;
        let send = addr(input, pi);
        if input.id() == output.id() {
            return self.run(op, call, self.config.blocking_wait, |c, s| {
                f(send, send, c, s)
            });
        }
        let (go, _) = output.storage_and_layout();
        let (po, _ro) = storage_ptr(op, &go, &self.stream)?;
        let recv = addr(output, po);
        self.run(op, call, self.config.blocking_wait, |c, s| {
            f(send, recv, c, s)
        })
    }

    /// Copies `host` to the device, runs `f(ptr, comm, stream)` on the copy,
    /// waits, and copies the result back when `back`.
    fn staged<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        op: &'static str,
        call: &'static str,
        host: &mut [T],
        back: bool,
        f: impl FnOnce(
            u64,
            sys::ncclComm_t,
            sys::cudaStream_t,
        ) -> std::result::Result<result::NcclStatus, result::NcclError>,
    ) -> Result<()> {
        if host.is_empty() {
            // Lengths match on every rank, so all skip alike; NCCL would
            // do nothing, and a zero-byte device allocation is refused.
            return Ok(());
        }
        let copy_err =
            |e: cudarc::driver::DriverError| self.nccl_err(op, "memcpy", format!("{e:?}"));
        let dev: CudaSlice<T> = self.stream.clone_htod(&*host).map_err(copy_err)?;
        {
            let (ptr, _rec) = dev.device_ptr(&self.stream);
            self.run(op, call, true, |c, s| f(ptr, c, s))?;
        }
        if back {
            self.stream.memcpy_dtoh(&dev, host).map_err(copy_err)?;
            self.stream.synchronize().map_err(copy_err)?;
        }
        Ok(())
    }

    /// As [`staged`](Self::staged) with a separate device output of
    /// `out.len()` elements: `f(send, recv, comm, stream)`.
    fn staged_pair<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        op: &'static str,
        call: &'static str,
        input: &[T],
        out: &mut [T],
        f: impl FnOnce(
            u64,
            u64,
            sys::ncclComm_t,
            sys::cudaStream_t,
        ) -> std::result::Result<result::NcclStatus, result::NcclError>,
    ) -> Result<()> {
        if input.is_empty() || out.is_empty() {
            return Ok(()); // as in `staged`
        }
        let copy_err =
            |e: cudarc::driver::DriverError| self.nccl_err(op, "memcpy", format!("{e:?}"));
        let src: CudaSlice<T> = self.stream.clone_htod(input).map_err(copy_err)?;
        let dst: CudaSlice<T> = self.stream.alloc_zeros(out.len()).map_err(copy_err)?;
        {
            let (s_ptr, _rs) = src.device_ptr(&self.stream);
            let (d_ptr, _rd) = dst.device_ptr(&self.stream);
            self.run(op, call, true, |c, s| f(s_ptr, d_ptr, c, s))?;
        }
        self.stream.memcpy_dtoh(&dst, out).map_err(copy_err)?;
        self.stream.synchronize().map_err(copy_err)
    }
}

/// Type-erased device pointer, as NCCL takes it.
fn vp(p: u64) -> *mut std::ffi::c_void {
    p as usize as *mut std::ffi::c_void
}

// The NCCL calls below share one safety argument, referred to as "the NCCL
// call note": the pointers come from `storage_ptr` / `staged*` and point to
// device allocations that stay alive and locked (storage read guards, or
// owned `CudaSlice`s) until the call is enqueued and, for staged buffers,
// completed; the counts are the element counts of those allocations
// (checked pairwise by `check_pair`, or by construction of the output);
// the NCCL dtype is the element type's; `comm` and `stream` are the live
// communicator (`run` holds its lock) and candle's stream of its device.

impl Communicator for NcclCommunicator {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn all_reduce(&self, buf: BufferMut<'_>, op: ReduceOp) -> Result<()> {
        const OP: &str = "all_reduce";
        check_reduce_buffer(OP, &buf.as_buffer(), op)?;
        let dt = nccl_dtype(OP, buf.as_buffer().dtype())?;
        with_buffer!(BufferMut, buf, b => {
            let n = b.len();
            self.staged(OP, "ncclAllReduce", b, true, |p, c, s| {
                // SAFETY: the NCCL call note.
                unsafe { result::all_reduce(vp(p), vp(p), n, dt, nccl_op(op), c, s) }
            })
        })
    }

    fn all_gather(&self, input: Buffer<'_>, output: BufferMut<'_>) -> Result<()> {
        const OP: &str = "all_gather";
        check_pair(OP, &input, &output, self.world, Longer::Output)?;
        let dt = nccl_dtype(OP, input.dtype())?;
        let n = input.len();
        let (i_dtype, o_dtype) = (input.dtype(), output.as_buffer().dtype());
        with_buffer_pair!(input, output, (i, o) => {
            self.staged_pair(OP, "ncclAllGather", i, o, |src, dst, c, s| {
                // SAFETY: the NCCL call note.
                unsafe { result::all_gather(vp(src), vp(dst), n, dt, c, s) }
            })
        }, Err(Error::DTypeMismatch { op: OP, input: i_dtype, output: o_dtype }))
    }

    fn reduce_scatter(&self, input: Buffer<'_>, output: BufferMut<'_>, op: ReduceOp) -> Result<()> {
        const OP: &str = "reduce_scatter";
        check_pair(OP, &input, &output, self.world, Longer::Input)?;
        check_reduce_buffer(OP, &input, op)?;
        let dt = nccl_dtype(OP, input.dtype())?;
        let n = output.as_buffer().len();
        let (i_dtype, o_dtype) = (input.dtype(), output.as_buffer().dtype());
        with_buffer_pair!(input, output, (i, o) => {
            self.staged_pair(OP, "ncclReduceScatter", i, o, |src, dst, c, s| {
                // SAFETY: the NCCL call note.
                unsafe { result::reduce_scatter(vp(src), vp(dst), n, dt, nccl_op(op), c, s) }
            })
        }, Err(Error::DTypeMismatch { op: OP, input: i_dtype, output: o_dtype }))
    }

    fn broadcast(&self, buf: BufferMut<'_>, root: usize) -> Result<()> {
        const OP: &str = "broadcast";
        check_rank(OP, root, self.world)?;
        let dt = nccl_dtype(OP, buf.as_buffer().dtype())?;
        with_buffer!(BufferMut, buf, b => {
            let n = b.len();
            self.staged(OP, "ncclBroadcast", b, true, |p, c, s| {
                // SAFETY: the NCCL call note.
                unsafe { result::broadcast(vp(p), vp(p), n, dt, root as i32, c, s) }
            })
        })
    }

    fn send(&self, buf: Buffer<'_>, dst: usize) -> Result<()> {
        const OP: &str = "send";
        check_rank(OP, dst, self.world)?;
        let dt = nccl_dtype(OP, buf.dtype())?;
        with_buffer!(Buffer, buf, b => {
            let n = b.len();
            let mut copy = b.to_vec();
            self.staged(OP, "ncclSend", &mut copy, false, |p, c, s| {
                // SAFETY: the NCCL call note.
                unsafe { result::send(vp(p), n, dt, dst as i32, c, s) }
            })
        })
    }

    fn recv(&self, buf: BufferMut<'_>, src: usize) -> Result<()> {
        const OP: &str = "recv";
        check_rank(OP, src, self.world)?;
        let dt = nccl_dtype(OP, buf.as_buffer().dtype())?;
        with_buffer!(BufferMut, buf, b => {
            let n = b.len();
            self.staged(OP, "ncclRecv", b, true, |p, c, s| {
                // SAFETY: the NCCL call note.
                unsafe { result::recv(vp(p), n, dt, src as i32, c, s) }
            })
        })
    }

    fn all_reduce_tensor(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor> {
        const OP: &str = "all_reduce_tensor";
        if t.device().is_cpu() {
            return tensor::all_reduce(self, t, op);
        }
        self.check_tensor(OP, t, Some(op))?;
        let out = Tensor::zeros(t.shape(), t.dtype(), t.device())?;
        let (n, dt) = (t.elem_count(), nccl_dtype(OP, t.dtype())?);
        self.tensor_call(OP, "ncclAllReduce", t, &out, |src, dst, c, s| {
            // SAFETY: the NCCL call note.
            unsafe { result::all_reduce(vp(src), vp(dst), n, dt, nccl_op(op), c, s) }
        })?;
        Ok(out)
    }

    fn all_reduce_tensor_inplace(&self, t: &Tensor, op: ReduceOp) -> Result<()> {
        const OP: &str = "all_reduce_tensor_inplace";
        if t.device().is_cpu() {
            return tensor::all_reduce_inplace(self, t, op);
        }
        self.check_tensor(OP, t, Some(op))?;
        let (n, dt) = (t.elem_count(), nccl_dtype(OP, t.dtype())?);
        self.tensor_call(OP, "ncclAllReduce", t, t, |src, dst, c, s| {
            // SAFETY: the NCCL call note; in place is allowed by NCCL.
            unsafe { result::all_reduce(vp(src), vp(dst), n, dt, nccl_op(op), c, s) }
        })
    }

    fn broadcast_tensor(&self, t: &Tensor, root: usize) -> Result<Tensor> {
        const OP: &str = "broadcast_tensor";
        if t.device().is_cpu() {
            return tensor::broadcast(self, t, root);
        }
        check_rank(OP, root, self.world)?;
        self.check_tensor(OP, t, None)?;
        let out = Tensor::zeros(t.shape(), t.dtype(), t.device())?;
        let (n, dt) = (t.elem_count(), nccl_dtype(OP, t.dtype())?);
        self.tensor_call(OP, "ncclBroadcast", t, &out, |src, dst, c, s| {
            // SAFETY: the NCCL call note.
            unsafe { result::broadcast(vp(src), vp(dst), n, dt, root as i32, c, s) }
        })?;
        Ok(out)
    }

    fn all_gather_tensor(&self, t: &Tensor) -> Result<Tensor> {
        const OP: &str = "all_gather_tensor";
        if t.device().is_cpu() {
            return tensor::all_gather(self, t);
        }
        self.check_tensor(OP, t, None)?;
        let mut dims = t.dims().to_vec();
        match dims.first_mut() {
            Some(d0) => *d0 *= self.world,
            None => dims.push(self.world),
        }
        let out = Tensor::zeros(dims, t.dtype(), t.device())?;
        let (n, dt) = (t.elem_count(), nccl_dtype(OP, t.dtype())?);
        self.tensor_call(OP, "ncclAllGather", t, &out, |src, dst, c, s| {
            // SAFETY: the NCCL call note; `out` holds `n * world` elements.
            unsafe { result::all_gather(vp(src), vp(dst), n, dt, c, s) }
        })?;
        Ok(out)
    }

    fn reduce_scatter_tensor(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor> {
        const OP: &str = "reduce_scatter_tensor";
        if t.device().is_cpu() {
            return tensor::reduce_scatter(self, t, op);
        }
        self.check_tensor(OP, t, Some(op))?;
        let mut dims = t.dims().to_vec();
        match dims.first_mut() {
            Some(d0) if *d0 % self.world == 0 => *d0 /= self.world,
            _ => {
                return Err(Error::BadShape {
                    op: OP,
                    reason: format!(
                        "dimension 0 of shape {:?} must divide by the world size {}",
                        t.dims(),
                        self.world
                    ),
                })
            }
        }
        let out = Tensor::zeros(dims, t.dtype(), t.device())?;
        let (n, dt) = (out.elem_count(), nccl_dtype(OP, t.dtype())?);
        self.tensor_call(OP, "ncclReduceScatter", t, &out, |src, dst, c, s| {
            // SAFETY: the NCCL call note; `t` holds `n * world` elements.
            unsafe { result::reduce_scatter(vp(src), vp(dst), n, dt, nccl_op(op), c, s) }
        })?;
        Ok(out)
    }
}
