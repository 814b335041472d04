//! The collectives: on CUDA tensors in place, on host buffers staged
//! through device memory.

use std::cell::RefCell;

use candle_core::backend::BackendStorage;
use candle_core::cuda::{CudaStorage, CudaStorageSlice};
use candle_core::{CpuStorage, DType, InplaceOp1, InplaceOp2, Layout, Tensor};
use cudarc::driver::{
    CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, SyncOnDrop, ValidAsZeroBits,
};
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

/// The address of a storage read by a collective: the NCCL stream waits for
/// its last write; the guard records the NCCL stream's read event.
fn read_ptr<'a>(
    op: &'static str,
    cs: &'a CudaStorage,
    stream: &'a CudaStream,
) -> Result<(u64, SyncOnDrop<'a>)> {
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

/// The address of a storage written by a collective: the NCCL stream waits
/// for its last write and reads; the guard records the NCCL stream's write
/// event, which later readers on any stream wait for.
fn write_ptr<'a>(
    op: &'static str,
    cs: &'a mut CudaStorage,
    stream: &'a CudaStream,
) -> Result<(u64, SyncOnDrop<'a>)> {
    let dtype = cs.dtype();
    Ok(match &mut cs.slice {
        CudaStorageSlice::F32(s) => s.device_ptr_mut(stream),
        CudaStorageSlice::F64(s) => s.device_ptr_mut(stream),
        CudaStorageSlice::BF16(s) => s.device_ptr_mut(stream),
        CudaStorageSlice::F16(s) => s.device_ptr_mut(stream),
        CudaStorageSlice::U32(s) => s.device_ptr_mut(stream),
        CudaStorageSlice::I64(s) => s.device_ptr_mut(stream),
        CudaStorageSlice::U8(s) => s.device_ptr_mut(stream),
        _ => return Err(Error::UnsupportedDType { op, dtype }),
    })
}

/// The address of the element at `layout`'s start in an allocation at `base`.
fn at(base: u64, layout: &Layout, dtype: DType) -> u64 {
    base + (layout.start_offset() * dtype.size_in_bytes()) as u64
}

/// An enqueued NCCL call: `f(send, recv, comm, stream)`.
trait NcclCall:
    FnOnce(
    u64,
    u64,
    sys::ncclComm_t,
    sys::cudaStream_t,
) -> std::result::Result<result::NcclStatus, result::NcclError>
{
}

impl<F> NcclCall for F where
    F: FnOnce(
        u64,
        u64,
        sys::ncclComm_t,
        sys::cudaStream_t,
    ) -> std::result::Result<result::NcclStatus, result::NcclError>
{
}

/// An NCCL call `f(send, recv, comm, stream)` run as a candle in-place op
/// on its output, so that the output is written under candle's write lock
/// and its cudarc write event (see the module docs on streams).
struct TensorCall<'c, F> {
    comm: &'c NcclCommunicator,
    op: &'static str,
    call: &'static str,
    f: RefCell<Option<F>>,
    out: RefCell<Option<Result<()>>>,
}

impl<F> TensorCall<'_, F>
where
    F: NcclCall,
{
    /// Runs the call on `dst` (and `src`, or `dst` itself when `None`),
    /// keeping the result for [`TensorCall::finish`].
    fn enqueue(&self, dst: &mut CudaStorage, dst_l: &Layout, src: Option<(&CudaStorage, &Layout)>) {
        let stream = &self.comm.stream;
        let dtype = dst.dtype();
        let result = (|| {
            let f = self.f.borrow_mut().take().ok_or(Error::Poisoned {
                op: self.op,
                cause: "a tensor call ran twice".into(),
            })?;
            match src {
                None => {
                    let (base, _write) = write_ptr(self.op, dst, stream)?;
                    let p = at(base, dst_l, dtype);
                    self.comm.run(
                        self.op,
                        self.call,
                        self.comm.config.blocking_wait,
                        |c, s| f(p, p, c, s),
                    )
                }
                Some((src, src_l)) => {
                    let (s_base, _read) = read_ptr(self.op, src, stream)?;
                    let (d_base, _write) = write_ptr(self.op, dst, stream)?;
                    let (send, recv) = (at(s_base, src_l, src.dtype()), at(d_base, dst_l, dtype));
                    self.comm.run(
                        self.op,
                        self.call,
                        self.comm.config.blocking_wait,
                        |c, s| f(send, recv, c, s),
                    )
                }
            }
        })();
        *self.out.borrow_mut() = Some(result);
    }

    fn finish(self, ran: candle_core::Result<()>) -> Result<()> {
        ran?;
        self.out.into_inner().unwrap_or_else(|| {
            Err(Error::Poisoned {
                op: self.op,
                cause: "candle did not run the collective on the CUDA storage".into(),
            })
        })
    }
}

impl<F> InplaceOp1 for TensorCall<'_, F>
where
    F: NcclCall,
{
    fn name(&self) -> &'static str {
        self.op
    }

    fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout) -> candle_core::Result<()> {
        candle_core::bail!("{}: NCCL needs a CUDA tensor", self.op)
    }

    fn cuda_fwd(&self, dst: &mut CudaStorage, dst_l: &Layout) -> candle_core::Result<()> {
        self.enqueue(dst, dst_l, None);
        Ok(())
    }
}

impl<F> InplaceOp2 for TensorCall<'_, F>
where
    F: NcclCall,
{
    fn name(&self) -> &'static str {
        self.op
    }

    fn cpu_fwd(
        &self,
        _: &mut CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<()> {
        candle_core::bail!("{}: NCCL needs CUDA tensors", self.op)
    }

    fn cuda_fwd(
        &self,
        dst: &mut CudaStorage,
        dst_l: &Layout,
        src: &CudaStorage,
        src_l: &Layout,
    ) -> candle_core::Result<()> {
        self.enqueue(dst, dst_l, Some((src, src_l)));
        Ok(())
    }
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
        let task = TensorCall {
            comm: self,
            op,
            call,
            f: RefCell::new(Some(f)),
            out: RefCell::new(None),
        };
        let ran = if input.id() == output.id() {
            output.inplace_op1(&task)
        } else {
            output.inplace_op2(input, &task)
        };
        task.finish(ran)
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
// call note": the pointers come from `read_ptr`/`write_ptr` or `staged*` and
// point to device allocations that stay alive and locked (candle's storage
// locks inside `TensorCall`, or owned `CudaSlice`s) until the call is
// enqueued and, for staged buffers, completed; their frees wait for the
// NCCL stream's events recorded by the guards; the counts are the element counts of those allocations
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
