//! Safe slice access to the host memory behind candle tensors.
//!
//! candle does not hand out `&mut` access to a tensor's storage, but its
//! in-place custom ops do: [`Tensor::inplace_op1`] locks the storage for
//! writing and calls [`InplaceOp1::cpu_fwd`] with `&mut CpuStorage`. The
//! helpers here smuggle a closure into such an op, so callers get a plain
//! `&mut [T]` for the duration of the closure without any `unsafe`.
//!
//! Writes are visible through every tensor sharing the storage (clones of a
//! tensor, the tensor inside a `Var`): that is the point of updating in place.

use std::any::Any;
use std::cell::RefCell;
use std::collections::HashMap;
use std::marker::PhantomData;

use candle_core::{CpuStorage, DType, InplaceOp1, Layout, Storage, StorageRef, Tensor, WithDType};
use half::{bf16, f16};

use crate::{Error, Result};

/// Runs `f` on the elements of `t` as a mutable slice, in storage order.
///
/// `t` must be a contiguous CPU tensor of element type `T`; `op` names the
/// caller in errors. The storage stays write-locked while `f` runs, so `f`
/// may lock *other* tensors (nesting is how fused kernels mutate several
/// tensors at once) but must not touch `t` or anything sharing its storage,
/// which would deadlock.
pub fn with_slice_mut<T: WithDType, R>(
    t: &Tensor,
    op: &'static str,
    f: impl FnOnce(&mut [T]) -> Result<R>,
) -> Result<R> {
    check_access::<T>(t, op)?;
    let access = SliceMutOp {
        op,
        f: RefCell::new(Some(f)),
        out: RefCell::new(None),
        _elem: PhantomData,
    };
    t.inplace_op1(&access)?;
    // `cpu_fwd` always stores a result for a CPU tensor; the fallback only
    // guards against a candle change that would skip the call.
    access.out.into_inner().unwrap_or_else(|| {
        Err(candle_core::Error::Msg(format!("{op}: storage was not visited")).into())
    })
}

/// Runs `f` on the elements of `t` as a shared slice, in storage order.
///
/// `t` must be a contiguous CPU tensor of element type `T`. The storage stays
/// read-locked while `f` runs.
pub fn with_slice<T: WithDType, R>(
    t: &Tensor,
    op: &'static str,
    f: impl FnOnce(&[T]) -> Result<R>,
) -> Result<R> {
    check_access::<T>(t, op)?;
    let (guard, layout) = t.storage_and_layout();
    let Storage::Cpu(cpu) = &*guard else {
        return Err(Error::RequiresCpu {
            op,
            location: t.device().location(),
        });
    };
    let (start, end) = layout
        .contiguous_offsets()
        .ok_or(Error::RequiresContiguous { op, index: 0 })?;
    f(&T::cpu_storage_as_slice(cpu)?[start..end])
}

/// Rejects tensors the slice helpers cannot view, before any lock is taken.
fn check_access<T: WithDType>(t: &Tensor, op: &'static str) -> Result<()> {
    if !t.device().is_cpu() {
        return Err(Error::RequiresCpu {
            op,
            location: t.device().location(),
        });
    }
    if t.dtype() != T::DTYPE {
        return Err(Error::DTypeMismatch {
            op,
            index: 0,
            expected: T::DTYPE,
            got: t.dtype(),
        });
    }
    if !t.is_contiguous() {
        return Err(Error::RequiresContiguous { op, index: 0 });
    }
    Ok(())
}

/// The in-place op that carries a closure to the locked storage.
///
/// `InplaceOp1::cpu_fwd` takes `&self`, so the `FnOnce` and its result live
/// in `RefCell`s and are moved out / in through the shared reference.
struct SliceMutOp<T, R, F> {
    op: &'static str,
    f: RefCell<Option<F>>,
    out: RefCell<Option<Result<R>>>,
    _elem: PhantomData<fn(&mut [T])>,
}

impl<T: WithDType, R, F: FnOnce(&mut [T]) -> Result<R>> InplaceOp1 for SliceMutOp<T, R, F> {
    fn name(&self) -> &'static str {
        self.op
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> candle_core::Result<()> {
        // Take the closure out first so no RefCell borrow is held while it
        // runs (it may nest further ops).
        let Some(f) = self.f.borrow_mut().take() else {
            return Ok(());
        };
        let op = self.op;
        let res = match (
            layout.contiguous_offsets(),
            vec_mut(storage).downcast_mut::<Vec<T>>(),
        ) {
            (Some((start, end)), Some(data)) => f(&mut data[start..end]),
            (None, _) => Err(Error::RequiresContiguous { op, index: 0 }),
            (_, None) => Err(Error::UnsupportedDType {
                op,
                dtype: T::DTYPE,
            }),
        };
        *self.out.borrow_mut() = Some(res);
        // Our errors travel through `out`, so candle only ever sees success.
        Ok(())
    }
}

/// The typed vector behind a CPU storage, for a checked downcast to `Vec<T>`.
fn vec_mut(s: &mut CpuStorage) -> &mut dyn Any {
    match s {
        CpuStorage::U8(v) => v,
        CpuStorage::U32(v) => v,
        CpuStorage::I16(v) => v,
        CpuStorage::I32(v) => v,
        CpuStorage::I64(v) => v,
        CpuStorage::BF16(v) => v,
        CpuStorage::F16(v) => v,
        CpuStorage::F32(v) => v,
        CpuStorage::F64(v) => v,
        CpuStorage::F8E4M3(v) => v,
        // Packed sub-byte formats are raw bytes; `check_access` has already
        // matched the dtype, so a `u8` request never lands here.
        CpuStorage::F6E2M3(v)
        | CpuStorage::F6E3M2(v)
        | CpuStorage::F4(v)
        | CpuStorage::F8E8M0(v) => v,
    }
}

/// A mutable view of one float tensor of a list, whatever its dtype.
pub(crate) enum FloatSliceMut<'a> {
    /// f32 elements.
    F32(&'a mut [f32]),
    /// bf16 elements.
    BF16(&'a mut [bf16]),
    /// f16 elements.
    F16(&'a mut [f16]),
}

/// A shared view of one float tensor of a list, whatever its dtype.
#[derive(Clone, Copy)]
pub(crate) enum FloatSlice<'a> {
    /// f32 elements.
    F32(&'a [f32]),
    /// bf16 elements.
    BF16(&'a [bf16]),
    /// f16 elements.
    F16(&'a [f16]),
}

/// An address identifying the storage allocation of a CPU or CUDA tensor
/// (on the CPU the data's address; on CUDA the address of candle's storage
/// object, which reading costs no driver call); `None` for an empty
/// allocation, which cannot conflict, and for other devices. Two tensors
/// with the same key share storage (clones and views of one another): what
/// aliasing checks and buffer recycling compare, since candle exposes no
/// reference count.
pub fn storage_key(t: &Tensor) -> Option<usize> {
    let (guard, _) = t.storage_and_layout();
    let Storage::Cpu(cpu) = &*guard else {
        return crate::cuda::storage_key(&guard);
    };
    let (ptr, len) = match cpu {
        CpuStorage::BF16(v) => (v.as_ptr() as usize, v.len()),
        CpuStorage::F16(v) => (v.as_ptr() as usize, v.len()),
        CpuStorage::F32(v) => (v.as_ptr() as usize, v.len()),
        CpuStorage::F64(v) => (v.as_ptr() as usize, v.len()),
        CpuStorage::U32(v) => (v.as_ptr() as usize, v.len()),
        CpuStorage::I16(v) => (v.as_ptr() as usize, v.len()),
        CpuStorage::I32(v) => (v.as_ptr() as usize, v.len()),
        CpuStorage::I64(v) => (v.as_ptr() as usize, v.len()),
        CpuStorage::F8E4M3(v) => (v.as_ptr() as usize, v.len()),
        CpuStorage::U8(v)
        | CpuStorage::F6E2M3(v)
        | CpuStorage::F6E3M2(v)
        | CpuStorage::F4(v)
        | CpuStorage::F8E8M0(v) => (v.as_ptr() as usize, v.len()),
    };
    (len > 0).then_some(ptr)
}

/// One list argument of a call, for the aliasing check.
pub(crate) struct ListArg<'t> {
    /// The argument's name, used in error messages.
    pub name: &'static str,
    /// The tensors.
    pub tensors: &'t [Tensor],
    /// Whether the call writes these tensors.
    pub written: bool,
}

/// Refuses a call where a written tensor shares storage with any other
/// tensor of the call: nested locks on one storage deadlock, and two views
/// of one buffer being written at once would be a data race.
pub(crate) fn check_no_alias(op: &'static str, args: &[ListArg<'_>]) -> Result<()> {
    let mut seen: HashMap<usize, (&'static str, usize, bool)> = HashMap::new();
    for arg in args {
        for (i, t) in arg.tensors.iter().enumerate() {
            let Some(key) = storage_key(t) else { continue };
            match seen.get(&key) {
                Some(&(name, j, written)) if written || arg.written => {
                    return Err(Error::AliasedStorage {
                        op,
                        first: format!("{name}[{j}]"),
                        second: format!("{}[{i}]", arg.name),
                    });
                }
                Some(_) => {}
                None => {
                    seen.insert(key, (arg.name, i, arg.written));
                }
            }
        }
    }
    Ok(())
}

/// Write-locks every tensor of `ts` and runs `f` on their float slices, in
/// the order of `ts`.
///
/// The locks nest, so the caller bounds the list length (see
/// `multi_tensor::MAX_LOCKED`). They are taken in storage-address order, as
/// candle does for its own multi-tensor ops, so two threads locking
/// overlapping sets cannot deadlock each other.
pub(crate) fn with_float_slices_mut<R>(
    ts: &[&Tensor],
    op: &'static str,
    f: impl FnOnce(Vec<FloatSliceMut<'_>>) -> Result<R>,
) -> Result<R> {
    let mut order: Vec<usize> = (0..ts.len()).collect();
    order.sort_by_key(|&i| storage_key(ts[i]));
    nest(ts, &order, Vec::with_capacity(ts.len()), op, f)
}

/// One level of [`with_float_slices_mut`]: locks `ts[order[0]]`, recurses on
/// the rest, and finally calls `f` with all slices back in list order.
fn nest<'a, R, F>(
    ts: &[&Tensor],
    order: &[usize],
    acc: Vec<(usize, FloatSliceMut<'a>)>,
    op: &'static str,
    f: F,
) -> Result<R>
where
    F: FnOnce(Vec<FloatSliceMut<'_>>) -> Result<R>,
{
    let Some((&i, rest)) = order.split_first() else {
        let mut acc = acc;
        acc.sort_unstable_by_key(|(i, _)| *i);
        return f(acc.into_iter().map(|(_, s)| s).collect());
    };
    let t = ts[i];
    match t.dtype() {
        DType::F32 => with_slice_mut::<f32, R>(t, op, move |s| {
            let mut acc = acc;
            acc.push((i, FloatSliceMut::F32(s)));
            nest(ts, rest, acc, op, f)
        }),
        DType::BF16 => with_slice_mut::<bf16, R>(t, op, move |s| {
            let mut acc = acc;
            acc.push((i, FloatSliceMut::BF16(s)));
            nest(ts, rest, acc, op, f)
        }),
        DType::F16 => with_slice_mut::<f16, R>(t, op, move |s| {
            let mut acc = acc;
            acc.push((i, FloatSliceMut::F16(s)));
            nest(ts, rest, acc, op, f)
        }),
        dtype => Err(Error::UnsupportedDType { op, dtype }),
    }
}

/// Read-locks every tensor of `ts` and runs `f` on their float slices, in
/// the order of `ts`.
///
/// Read guards are plain values, so any number can be held without nesting.
/// Tensors that share a storage (views of one gradient buffer) share one
/// guard: a second read lock on the same storage from this thread could
/// deadlock behind a waiting writer.
pub(crate) fn with_float_slices<R>(
    ts: &[&Tensor],
    op: &'static str,
    f: impl FnOnce(Vec<FloatSlice<'_>>) -> Result<R>,
) -> Result<R> {
    let mut guards: Vec<StorageRef<'_>> = Vec::new();
    let mut guard_of_key: HashMap<usize, usize> = HashMap::new();
    let mut guard_idx = Vec::with_capacity(ts.len());
    // All keys first: computing a key takes a short read lock of its own.
    let keys: Vec<Option<usize>> = ts.iter().map(|t| storage_key(t)).collect();
    for (t, key) in ts.iter().zip(keys) {
        let idx = match key {
            Some(key) if guard_of_key.contains_key(&key) => guard_of_key[&key],
            key => {
                guards.push(t.storage_and_layout().0);
                if let Some(key) = key {
                    guard_of_key.insert(key, guards.len() - 1);
                }
                guards.len() - 1
            }
        };
        guard_idx.push(idx);
    }
    let mut slices = Vec::with_capacity(ts.len());
    for (index, (t, &g)) in ts.iter().zip(&guard_idx).enumerate() {
        let Storage::Cpu(cpu) = &*guards[g] else {
            return Err(Error::RequiresCpu {
                op,
                location: t.device().location(),
            });
        };
        let (s, e) = t
            .layout()
            .contiguous_offsets()
            .ok_or(Error::RequiresContiguous { op, index })?;
        slices.push(match cpu {
            CpuStorage::F32(v) => FloatSlice::F32(&v[s..e]),
            CpuStorage::BF16(v) => FloatSlice::BF16(&v[s..e]),
            CpuStorage::F16(v) => FloatSlice::F16(&v[s..e]),
            _ => {
                return Err(Error::UnsupportedDType {
                    op,
                    dtype: t.dtype(),
                })
            }
        });
    }
    f(slices)
}
