//! Kernel launches, and the two driver calls on the device memory pool:
//! the only `unsafe` of accel-kernels.
//!
//! A launch is unsafe because the driver cannot check that the arguments
//! match the kernel's C signature or that the kernel stays inside its
//! buffers. [`launch`] makes both hold by construction: each [`KernelId`]
//! has one [`Args`] shape, checked before launching, and the launch tables
//! it passes only hold addresses of live, locked tensors (built by
//! `operands::with_device_ptrs`) with the tensors' own element counts.
#![allow(unsafe_code)]

use candle_core::cuda::CudaDevice;
use std::sync::Arc;

use cudarc::driver::{
    result, sys, CudaContext, CudaSlice, CudaView, DeviceRepr, LaunchArgs, LaunchConfig,
    PushKernelArg,
};

use super::args::{
    BackwardInputs, FlashArgs, FlashDims, LossArgs, PointwiseArgs, QuantArgs, QuantCodes,
    QuantDims, QuantScales, RowArgs, FLASH_WARPS, GEMV_ROWS, GEMV_WARPS, ROWS_PER_PARTIAL,
};
use super::compile::{function, WrapDriver};
use super::operands::Table;
use super::registry::KernelId;
use crate::{Error, Result};

/// Threads per block.
const BLOCK: u32 = 256;
/// Most blocks per launch; more chunks are walked grid-stride.
const MAX_BLOCKS: u32 = 8192;

/// The f32 factors of one AdamW step, laid out as `struct AdamW` in
/// `optim.cu` (eight 4-byte fields, no padding).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(crate) struct AdamWArgs {
    pub decay: f32,
    pub apply_decay: i32,
    pub w1: f32,
    pub beta2: f32,
    pub c2: f32,
    pub step_size: f32,
    pub bc2_sqrt: f32,
    pub eps: f32,
}

/// The f32 factors of one SGD step, laid out as `struct Sgd` in `optim.cu`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(crate) struct SgdArgs {
    pub lr: f32,
    pub momentum: f32,
    pub weight_decay: f32,
    pub one_minus_dampening: f32,
    pub has_momentum: i32,
    pub has_weight_decay: i32,
    pub nesterov: i32,
    pub first: i32,
}

// SAFETY: both are `#[repr(C)]` structs of 4-byte plain-old-data fields,
// identical in size and layout to the C structs the kernels take by value.
unsafe impl DeviceRepr for AdamWArgs {}
// SAFETY: as above.
unsafe impl DeviceRepr for SgdArgs {}
// SAFETY: `#[repr(C)]`: ten 4-byte fields, then thirteen u64s starting at
// byte 40, identical in size and layout to `struct FlashDims` in
// attention.cu (144 bytes; `attention.rs` asserts the size).
unsafe impl DeviceRepr for FlashDims {}
// SAFETY: `#[repr(C)]` arrays of u64 then u32 fields, identical in size
// and layout to `struct Table` in common.cuh (both sides assert 2848
// bytes), which every kernel takes by value as its first parameter.
unsafe impl DeviceRepr for Table {}
// SAFETY: `#[repr(C)]`: 16 then 256 f32s, identical to `struct QuantCodes`
// in quant.cu (1088 bytes, asserted on both sides).
unsafe impl DeviceRepr for QuantCodes {}
// SAFETY: `#[repr(C)]`: four u64s then eight 4-byte fields, identical to
// `struct QuantDims` in quant.cu (64 bytes, asserted on both sides).
unsafe impl DeviceRepr for QuantDims {}

/// The arguments after the table of each kernel family.
pub(crate) enum Args<'a> {
    /// `cast_*`, `add_*`: none.
    None,
    /// `unscale_*`: the factor and the found-non-finite flag.
    FactorFlag(f32, &'a mut CudaSlice<u32>),
    /// `nonfinite_*`: the flag.
    Flag(&'a mut CudaSlice<u32>),
    /// `scale_*`: the factor.
    Factor(f32),
    /// `clamp_*`: the bounds.
    Range(f32, f32),
    /// `adamw_*`.
    AdamW(AdamWArgs),
    /// `sgd_*`.
    Sgd(SgdArgs),
    /// `sumsq_*`, `maxabs_*`: one f64 result per chunk.
    Partials(&'a mut CudaSlice<f64>),
}

/// The one argument shape `id` was written for.
fn matches(id: KernelId, args: &Args<'_>, chunks: usize) -> bool {
    let name = id.name();
    match args {
        Args::None => name.starts_with("cast_") || name.starts_with("add_"),
        Args::FactorFlag(..) => name.starts_with("unscale_"),
        Args::Flag(_) => name.starts_with("nonfinite_"),
        Args::Factor(_) => name.starts_with("scale_"),
        Args::Range(..) => name.starts_with("clamp_"),
        Args::AdamW(_) => name.starts_with("adamw_"),
        Args::Sgd(_) => name.starts_with("sgd_"),
        Args::Partials(p) => {
            (name.starts_with("sumsq_") || name.starts_with("maxabs_")) && p.len() == chunks
        }
    }
}

/// Launches `id` once per table on candle's stream of `dev` (nothing when
/// `tables` is empty). `op` names the caller in errors. `Args::Partials`
/// has one slot per chunk of all the tables together; each launch writes
/// its own range.
///
/// The caller must keep the tensors whose addresses are in `tables` locked
/// until the launches are enqueued (`with_device_ptrs` does), and must
/// have built the tables with `launch_tables` from those tensors, with the
/// operand columns the kernel documents.
pub(crate) fn launch(
    op: &'static str,
    dev: &CudaDevice,
    id: KernelId,
    tables: &[Table],
    args: Args<'_>,
) -> Result<()> {
    let chunks: usize = tables.iter().map(Table::chunks).sum();
    if !matches(id, &args, chunks) {
        return Err(Error::InvalidArgument {
            op,
            reason: format!("internal: bad arguments for kernel {}", id.name()),
        });
    }
    if chunks == 0 {
        return Ok(());
    }
    let func = function(dev, id)?;
    let stream = dev.cuda_stream();
    // Scalars are pushed by reference, so they live in locals that
    // outlive the builder.
    let (mut factor, mut lo, mut hi) = (0f32, 0f32, 0f32);
    let (mut adamw, mut sgd) = (None, None);
    let mut flag = None;
    let mut partials = None;
    match args {
        Args::None => {}
        Args::FactorFlag(f, fl) => (factor, flag) = (f, Some(fl)),
        Args::Flag(fl) => flag = Some(fl),
        Args::Factor(f) => factor = f,
        Args::Range(l, h) => (lo, hi) = (l, h),
        Args::AdamW(a) => adamw = Some(a),
        Args::Sgd(s) => sgd = Some(s),
        Args::Partials(p) => partials = Some(p),
    }
    let name = id.name();
    let mut done = 0;
    for table in tables {
        let n = table.chunks();
        if n == 0 {
            continue;
        }
        let cfg = LaunchConfig {
            // n <= u32::MAX: `launch_tables` checked it.
            grid_dim: ((n as u32).min(MAX_BLOCKS), 1, 1),
            block_dim: (BLOCK, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = stream.launch_builder(&func);
        b.arg(table);
        if name.starts_with("unscale_") || name.starts_with("scale_") {
            b.arg(&factor);
        }
        if name.starts_with("clamp_") {
            b.arg(&lo).arg(&hi);
        }
        if let Some(a) = &adamw {
            b.arg(a);
        }
        if let Some(s) = &sgd {
            b.arg(s);
        }
        if let Some(fl) = flag.as_deref_mut() {
            b.arg(fl);
        }
        let mut slots = partials.as_deref_mut().map(|p| p.slice_mut(done..done + n));
        if let Some(v) = slots.as_mut() {
            b.arg(v);
        }
        // SAFETY: `matches` checked that the pushed arguments are exactly
        // the kernel's parameters after `const Table t`, with the same C
        // types (the table and the other `#[repr(C)]` structs by value, f32
        // = float; the flag is a device u32, the partials a device f64
        // array with one slot per chunk of this launch: `matches` checked
        // the total and `done` walks it). The table holds base addresses
        // of locked, live tensors with their own element counts (the
        // caller's contract), and the kernels only touch `[p, p + n)` of
        // each operand. The flag and the partials are device memory passed
        // through `arg`, so cudarc orders their reuse and free after this
        // launch.
        unsafe { b.launch(cfg) }.w(op, "launch")?;
        done += n;
    }
    Ok(())
}

/// Warps (rows) per block of the row passes.
const ROW_WARPS: u32 = 8;
/// Most blocks of a row pass; more rows are walked grid-stride.
const ROW_MAX_BLOCKS: u32 = 1 << 16;

/// Launches one row kernel on candle's stream of `dev`, after checking that
/// every buffer holds what the kernel reads or writes.
pub(crate) fn launch_rows(op: &'static str, dev: &CudaDevice, args: RowArgs<'_>) -> Result<()> {
    let bad = |what: &str| Error::InvalidArgument {
        op,
        reason: format!("internal: {what} too short for its row kernel"),
    };
    let row_cfg = |rows: u32| LaunchConfig {
        grid_dim: (rows.div_ceil(ROW_WARPS).clamp(1, ROW_MAX_BLOCKS), 1, 1),
        block_dim: (32 * ROW_WARPS, 1, 1),
        shared_mem_bytes: 0,
    };
    let col_cfg = |d: u32, blocks: u32| LaunchConfig {
        grid_dim: (d.div_ceil(BLOCK), blocks, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    };
    let stream = dev.cuda_stream();
    let null = 0u64;
    match args {
        RowArgs::Forward {
            x,
            w,
            b,
            y,
            rows,
            d,
            eps,
            rms,
        } => {
            let n = rows as usize * d as usize;
            if x.len() < n
                || y.len() < n
                || w.len() < d as usize
                || b.is_some_and(|b| b.len() < d as usize)
            {
                return Err(bad("an operand"));
            }
            let func = function(dev, KernelId::RowNormFwd)?;
            let rms = rms as i32;
            let mut l = stream.launch_builder(&func);
            l.arg(x).arg(w);
            match b {
                Some(b) => l.arg(b),
                None => l.arg(&null),
            };
            l.arg(y).arg(&rows).arg(&d).arg(&eps).arg(&rms);
            // SAFETY: the arguments are `rownorm_fwd`'s parameters in order
            // and C types (device f32 pointers, or a null bias; u32, u32,
            // float, int). It reads `rows * d` elements of x, `d` of w and
            // b, and writes `rows * d` of y: the lengths checked above.
            unsafe { l.launch(row_cfg(rows)) }.w(op, "launch")?;
        }
        RowArgs::BackwardDx {
            x,
            w,
            g,
            dx,
            stats,
            rows,
            d,
            eps,
            rms,
        } => {
            let n = rows as usize * d as usize;
            if x.len() < n
                || g.len() < n
                || dx.len() < n
                || w.len() < d as usize
                || stats.len() < 2 * rows as usize
            {
                return Err(bad("an operand"));
            }
            let func = function(dev, KernelId::RowNormBwdDx)?;
            let rms = rms as i32;
            let mut l = stream.launch_builder(&func);
            l.arg(x).arg(w).arg(g).arg(dx).arg(stats);
            l.arg(&rows).arg(&d).arg(&eps).arg(&rms);
            // SAFETY: `rownorm_bwd_dx`'s parameters in order and C types; it
            // reads `rows * d` of x and g and `d` of w, writes `rows * d` of
            // dx and `2 * rows` of stats: the lengths checked above.
            unsafe { l.launch(row_cfg(rows)) }.w(op, "launch")?;
        }
        RowArgs::BackwardPartials {
            x,
            g,
            stats,
            pw,
            pb,
            rows,
            d,
        } => {
            let n = rows as usize * d as usize;
            let blocks = (rows as usize).div_ceil(ROWS_PER_PARTIAL);
            if x.len() < n
                || g.len() < n
                || stats.len() < 2 * rows as usize
                || pw.len() < blocks * d as usize
                || pb.len() < blocks * d as usize
            {
                return Err(bad("an operand"));
            }
            let blocks = u32::try_from(blocks)
                .ok()
                .filter(|&b| b <= 65_535)
                .ok_or_else(|| Error::InvalidArgument {
                    op,
                    reason: format!("{rows} rows exceed one launch of the weight gradients"),
                })?;
            let func = function(dev, KernelId::RowNormBwdPartials)?;
            let mut l = stream.launch_builder(&func);
            l.arg(x)
                .arg(g)
                .arg(stats)
                .arg(pw)
                .arg(pb)
                .arg(&rows)
                .arg(&d);
            // SAFETY: `rownorm_bwd_partials`' parameters in order and C
            // types; block (column block, p) reads rows [64p, 64p + 64) of x
            // and g (and their stats) for columns < d and writes
            // `pw/pb[p * d + j]`, p < blocks: the lengths checked above.
            unsafe { l.launch(col_cfg(d, blocks)) }.w(op, "launch")?;
        }
        RowArgs::Softmax { x, y, rows, d, log } => {
            let n = rows as usize * d as usize;
            if x.len() < n || y.len() < n {
                return Err(bad("an operand"));
            }
            let func = function(dev, KernelId::SoftmaxFwd)?;
            let log = log as i32;
            let mut l = stream.launch_builder(&func);
            l.arg(x).arg(y).arg(&rows).arg(&d).arg(&log);
            // SAFETY: `softmax_fwd(x, y, rows, d, log)`'s parameters in order
            // and C types (f32 pointers, u32, u32, int); it reads and writes
            // `rows * d` elements of x and y: the lengths checked above.
            unsafe { l.launch(row_cfg(rows)) }.w(op, "launch")?;
        }
        RowArgs::SoftmaxBackward {
            y,
            g,
            dx,
            rows,
            d,
            log,
        } => {
            let n = rows as usize * d as usize;
            if y.len() < n || g.len() < n || dx.len() < n {
                return Err(bad("an operand"));
            }
            let func = function(dev, KernelId::SoftmaxBwd)?;
            let log = log as i32;
            let mut l = stream.launch_builder(&func);
            l.arg(y).arg(g).arg(dx).arg(&rows).arg(&d).arg(&log);
            // SAFETY: `softmax_bwd(y, g, dx, rows, d, log)`'s parameters in
            // order and C types; it reads `rows * d` elements of y and g and
            // writes as many of dx: the lengths checked above.
            unsafe { l.launch(row_cfg(rows)) }.w(op, "launch")?;
        }
        RowArgs::BackwardSum {
            pw,
            pb,
            dwdb,
            blocks,
            d,
        } => {
            if pw.len() < blocks as usize * d as usize
                || pb.len() < blocks as usize * d as usize
                || dwdb.len() < 2 * d as usize
            {
                return Err(bad("an operand"));
            }
            let func = function(dev, KernelId::RowNormBwdSum)?;
            let mut l = stream.launch_builder(&func);
            l.arg(pw).arg(pb).arg(dwdb).arg(&blocks).arg(&d);
            // SAFETY: `rownorm_bwd_sum`'s parameters in order and C types;
            // it reads `blocks * d` of pw and pb and writes `2 * d` of dwdb:
            // the lengths checked above.
            unsafe { l.launch(col_cfg(d, 1)) }.w(op, "launch")?;
        }
    }
    Ok(())
}

/// The current memory pool of the context's device.
fn current_pool(ctx: &Arc<CudaContext>) -> Result<sys::CUmemoryPool> {
    // SAFETY: `cu_device` is the device handle cudarc got from `cuDeviceGet`
    // for this live context; the call only writes the out-parameter.
    unsafe { result::device::get_mem_pool(ctx.cu_device()) }.w("memory_pool", "cuDeviceGetMemPool")
}

/// Sets the release threshold (bytes kept reserved across synchronisations)
/// of the context's current memory pool.
pub(crate) fn set_release_threshold(ctx: &Arc<CudaContext>, bytes: u64) -> Result<()> {
    let pool = current_pool(ctx)?;
    let mut value = bytes;
    // SAFETY: `pool` is the device's live current pool, and
    // CU_MEMPOOL_ATTR_RELEASE_THRESHOLD takes a pointer to a `cuuint64_t`,
    // which `value` is (a u64 that outlives the call).
    unsafe {
        result::mem_pool::set_attribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (&mut value as *mut u64).cast(),
        )
    }
    .w("memory_pool", "cuMemPoolSetAttribute")
}

/// The context's current pool's high-water mark of memory in use by
/// allocations (`CU_MEMPOOL_ATTR_USED_MEM_HIGH`), in bytes.
pub(crate) fn pool_used_high(ctx: &Arc<CudaContext>) -> Result<u64> {
    let pool = current_pool(ctx)?;
    let mut value = 0u64;
    // SAFETY: `pool` is the device's live current pool, and
    // CU_MEMPOOL_ATTR_USED_MEM_HIGH writes a `cuuint64_t` through the
    // pointer, which `value` is (a u64 that outlives the call).
    unsafe {
        sys::cuMemPoolGetAttribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
            (&mut value as *mut u64).cast(),
        )
    }
    .result()
    .w("memory_pool", "cuMemPoolGetAttribute")?;
    Ok(value)
}

/// Resets that high-water mark to the memory in use now (the driver
/// accepts only 0, which it takes to mean "now").
pub(crate) fn reset_pool_used_high(ctx: &Arc<CudaContext>) -> Result<()> {
    let pool = current_pool(ctx)?;
    let mut zero = 0u64;
    // SAFETY: as in `pool_used_high`; setting USED_MEM_HIGH reads a
    // `cuuint64_t` that must be 0, which `zero` is.
    unsafe {
        result::mem_pool::set_attribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
            (&mut zero as *mut u64).cast(),
        )
    }
    .w("memory_pool", "cuMemPoolSetAttribute")
}

/// Releases the memory the context's current pool holds beyond its live
/// allocations.
pub(crate) fn trim_pool(ctx: &Arc<CudaContext>) -> Result<()> {
    let pool = current_pool(ctx)?;
    // SAFETY: `pool` is the device's live current pool; trimming only
    // releases memory no allocation holds.
    unsafe { result::mem_pool::trim_to(pool, 0) }.w("memory_pool", "cuMemPoolTrimTo")
}

/// Launches an element-wise kernel of `act.cu` on `dev`'s stream, grid-stride
/// over its `n` elements.
pub(crate) fn launch_pointwise(
    op: &'static str,
    dev: &CudaDevice,
    args: PointwiseArgs<'_>,
) -> Result<()> {
    let bad = || Error::InvalidArgument {
        op,
        reason: "internal: an operand too short for its element-wise kernel".into(),
    };
    let cfg = |n: u64| LaunchConfig {
        grid_dim: (
            n.div_ceil(u64::from(BLOCK)).clamp(1, u64::from(MAX_BLOCKS)) as u32,
            1,
            1,
        ),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    };
    let stream = dev.cuda_stream();
    match args {
        PointwiseArgs::SwigluForward { g, u, y, n } => {
            let len = usize::try_from(n).map_err(|_| bad())?;
            if g.len() < len || u.len() < len || y.len() < len {
                return Err(bad());
            }
            let func = function(dev, KernelId::SwigluFwd)?;
            let mut l = stream.launch_builder(&func);
            l.arg(g).arg(u).arg(y).arg(&n);
            // SAFETY: `swiglu_fwd(g, u, y, n)`'s parameters in order and C
            // types (device f32 pointers, u64); it reads `n` elements of g
            // and u and writes `n` of y: the lengths checked above.
            unsafe { l.launch(cfg(n)) }.w(op, "launch")?;
        }
        PointwiseArgs::SwigluBackward { g, u, dy, dgu, n } => {
            let len = usize::try_from(n).map_err(|_| bad())?;
            if g.len() < len || u.len() < len || dy.len() < len || dgu.len() < 2 * len {
                return Err(bad());
            }
            let func = function(dev, KernelId::SwigluBwd)?;
            let mut l = stream.launch_builder(&func);
            l.arg(g).arg(u).arg(dy).arg(dgu).arg(&n);
            // SAFETY: `swiglu_bwd(g, u, dy, dgu, n)`'s parameters in order
            // and C types; it reads `n` elements of g, u and dy and writes
            // `2 n` of dgu: the lengths checked above.
            unsafe { l.launch(cfg(n)) }.w(op, "launch")?;
        }
        PointwiseArgs::ActForward { x, y, n, act } => {
            let len = usize::try_from(n).map_err(|_| bad())?;
            if x.len() < len || y.len() < len {
                return Err(bad());
            }
            let func = function(dev, KernelId::ActFwd)?;
            let mut l = stream.launch_builder(&func);
            l.arg(x).arg(y).arg(&n).arg(&act);
            // SAFETY: `act_fwd(x, y, n, act)`'s parameters in order and C
            // types (f32 pointers, u64, int); it reads `n` elements of x and
            // writes `n` of y: the lengths checked above.
            unsafe { l.launch(cfg(n)) }.w(op, "launch")?;
        }
        PointwiseArgs::Rope {
            x,
            cos,
            sin,
            y,
            rows,
            t,
            d,
            interleaved,
            sign,
        } => {
            let n = usize::try_from(rows)
                .ok()
                .and_then(|r| r.checked_mul(d as usize))
                .ok_or_else(bad)?;
            let table = t as usize * (d as usize / 2);
            if t == 0 || !d.is_multiple_of(2) || x.len() < n || y.len() < n {
                return Err(bad());
            }
            if cos.len() < table || sin.len() < table {
                return Err(bad());
            }
            let func = function(dev, KernelId::RopeF32)?;
            let mut l = stream.launch_builder(&func);
            let interleaved = interleaved as i32;
            l.arg(x).arg(cos).arg(sin).arg(y);
            l.arg(&rows).arg(&t).arg(&d).arg(&interleaved).arg(&sign);
            // SAFETY: `rope_f32(x, cos, sin, y, rows, t, d, interleaved,
            // sign)`'s parameters in order and C types (f32 pointers, u64,
            // u32, u32, int, float); it reads and writes `rows * d` elements
            // of x and y and reads `t * d / 2` of cos and sin (the row's
            // position is `r % t`, t > 0, d even): the lengths checked above.
            unsafe { l.launch(cfg(rows * u64::from(d / 2))) }.w(op, "launch")?;
        }
        PointwiseArgs::ActBackward { x, dy, dx, n, act } => {
            let len = usize::try_from(n).map_err(|_| bad())?;
            if x.len() < len || dy.len() < len || dx.len() < len {
                return Err(bad());
            }
            let func = function(dev, KernelId::ActBwd)?;
            let mut l = stream.launch_builder(&func);
            l.arg(x).arg(dy).arg(dx).arg(&n).arg(&act);
            // SAFETY: `act_bwd(x, dy, dx, n, act)`'s parameters in order and
            // C types; it reads `n` elements of x and dy and writes `n` of
            // dx: the lengths checked above.
            unsafe { l.launch(cfg(n)) }.w(op, "launch")?;
        }
    }
    Ok(())
}

/// Launches a kernel of `loss.cu` on `dev`'s stream.
pub(crate) fn launch_loss(op: &'static str, dev: &CudaDevice, args: LossArgs<'_>) -> Result<()> {
    let bad = || Error::InvalidArgument {
        op,
        reason: "internal: an operand too short for its loss kernel".into(),
    };
    let stream = dev.cuda_stream();
    match args {
        LossArgs::Rows {
            x,
            t,
            lse,
            loss,
            rows,
            c,
        } => {
            let (r, n) = (rows as usize, rows as usize * c as usize);
            if x.len() < n || t.len() < r || lse.len() < r || loss.len() < r {
                return Err(bad());
            }
            let func = function(dev, KernelId::XentRows)?;
            let mut l = stream.launch_builder(&func);
            l.arg(x).arg(t).arg(lse).arg(loss).arg(&rows).arg(&c);
            let cfg = LaunchConfig {
                grid_dim: (rows.div_ceil(ROW_WARPS).clamp(1, ROW_MAX_BLOCKS), 1, 1),
                block_dim: (32 * ROW_WARPS, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: `xent_rows(x, t, lse, loss, rows, c)`'s parameters in
            // order and C types (f32 and u32 pointers, u32, u32); it reads
            // `rows * c` of x and `rows` of t, writes `rows` of lse and loss,
            // and reads x[r * c + t[r]] only when t[r] < c: the lengths
            // checked above.
            unsafe { l.launch(cfg) }.w(op, "launch")?;
        }
        LossArgs::Mean {
            loss,
            t,
            mean,
            count,
            rows,
        } => {
            let r = rows as usize;
            if loss.len() < r || t.len() < r || mean.is_empty() || count.is_empty() {
                return Err(bad());
            }
            let func = function(dev, KernelId::XentMean)?;
            let mut l = stream.launch_builder(&func);
            l.arg(loss).arg(t).arg(mean).arg(count).arg(&rows);
            let cfg = LaunchConfig {
                grid_dim: (1, 1, 1),
                block_dim: (1024, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: `xent_mean(loss, t, mean, count, rows)`'s parameters in
            // order and C types; one block of 1024 threads (its XE_THREADS,
            // the size of its shared arrays) reads `rows` of loss and t and
            // writes one element each of mean and count: checked above.
            unsafe { l.launch(cfg) }.w(op, "launch")?;
        }
        LossArgs::Grad {
            x,
            t,
            lse,
            dy,
            count,
            dx,
            rows,
            c,
        } => {
            let (r, n) = (rows as usize, rows as usize * c as usize);
            if x.len() < n || dx.len() < n || t.len() < r || lse.len() < r {
                return Err(bad());
            }
            if dy.is_empty() || count.is_empty() {
                return Err(bad());
            }
            let func = function(dev, KernelId::XentGrad)?;
            let mut l = stream.launch_builder(&func);
            l.arg(x).arg(t).arg(lse).arg(dy).arg(count).arg(dx);
            l.arg(&rows).arg(&c);
            let n = n as u64;
            let cfg = LaunchConfig {
                grid_dim: (
                    n.div_ceil(u64::from(BLOCK)).clamp(1, u64::from(MAX_BLOCKS)) as u32,
                    1,
                    1,
                ),
                block_dim: (BLOCK, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: `xent_grad(x, t, lse, dy, count, dx, rows, c)`'s
            // parameters in order and C types; it reads `rows * c` of x,
            // `rows` of t and lse, one element of dy and count, and writes
            // `rows * c` of dx: the lengths checked above.
            unsafe { l.launch(cfg) }.w(op, "launch")?;
        }
    }
    Ok(())
}

/// Launches one kernel of `attention.cu` on `dev`'s stream. The wrappers in
/// `attention.rs` have checked every operand's extent against `dims` (each
/// view holds every element its strides reach, the contiguous outputs
/// `b * h * t * d` or `b * kvh * s * d`, the row vectors `b * h * t`);
/// here the contiguous lengths are checked again before launching.
pub(crate) fn launch_flash<T: DeviceRepr>(
    op: &'static str,
    dev: &CudaDevice,
    kernel: KernelId,
    args: FlashArgs<'_, T>,
) -> Result<()> {
    let bad = || Error::InvalidArgument {
        op,
        reason: "internal: an operand too short for its attention kernel".into(),
    };
    let stream = dev.cuda_stream();
    let func = function(dev, kernel)?;
    let mut l = stream.launch_builder(&func);
    let block = (32 * FLASH_WARPS, 1, 1);
    // The delta kernel's row count, which the builder borrows until launch.
    let rows;
    let cfg = match args {
        FlashArgs::Forward {
            q,
            k,
            v,
            bias,
            o,
            lse,
            dims,
            tiles,
        } => {
            if o.len() < dims.q_elems() || lse.len() < dims.q_rows() {
                return Err(bad());
            }
            l.arg(q).arg(k).arg(v).arg(bias).arg(o).arg(lse).arg(dims);
            LaunchConfig {
                grid_dim: (dims.b * dims.h, tiles, 1),
                block_dim: block,
                shared_mem_bytes: 0,
            }
        }
        FlashArgs::Delta { o, g, delta, dims } => {
            rows = dims.q_rows() as u64;
            if o.len() < dims.q_elems() || g.len() < dims.q_elems() || delta.len() < dims.q_rows() {
                return Err(bad());
            }
            l.arg(o).arg(g).arg(delta).arg(&rows).arg(&dims.d);
            LaunchConfig {
                grid_dim: (rows.div_ceil(8).clamp(1, 65_535) as u32, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            }
        }
        FlashArgs::Dq {
            ins,
            dq,
            dims,
            tiles,
        } => {
            if !backward_inputs_fit(ins, dims) || dq.len() < dims.q_elems() {
                return Err(bad());
            }
            push_backward_inputs(&mut l, ins).arg(dq).arg(dims);
            LaunchConfig {
                grid_dim: (dims.b * dims.h, tiles, 1),
                block_dim: block,
                shared_mem_bytes: 0,
            }
        }
        FlashArgs::Dkdv {
            ins,
            dk,
            dv,
            dims,
            tiles,
        } => {
            let short = dk.len() < dims.kv_elems() || dv.len() < dims.kv_elems();
            if !backward_inputs_fit(ins, dims) || short {
                return Err(bad());
            }
            push_backward_inputs(&mut l, ins).arg(dk).arg(dv).arg(dims);
            LaunchConfig {
                grid_dim: (dims.b * dims.kvh, tiles, 1),
                block_dim: block,
                shared_mem_bytes: 0,
            }
        }
    };
    // SAFETY: each variant pushes its kernel's parameters in order with the
    // C types of `attention.cu` (device pointers of the element type or
    // f32, `FlashDims` by value, u64 and u32 for the delta kernel). The
    // kernels read q, k, v and the bias only at offsets their strides in
    // `dims` reach for indices below `dims`' sizes, which `attention.rs`
    // checked against each view's length, and write the contiguous outputs
    // within the lengths checked above; blocks of `32 * FLASH_WARPS`
    // threads match the kernels' `__launch_bounds__` and static shared
    // memory (at most 48 KiB, no dynamic part). The tensor-core forward has
    // the scalar forward's parameters and is only picked on sm_80+, where
    // its `mma.sync` exists.
    unsafe { l.launch(cfg) }.w(op, "launch")?;
    Ok(())
}

/// Whether the contiguous backward inputs hold what `dims` reads of them.
fn backward_inputs_fit<T>(ins: &BackwardInputs<'_, T>, dims: &FlashDims) -> bool {
    ins.g.len() >= dims.q_elems()
        && ins.lse.len() >= dims.q_rows()
        && ins.delta.len() >= dims.q_rows()
}

/// Pushes the backward kernels' shared leading parameters, in order.
fn push_backward_inputs<'a, 'b, T: DeviceRepr>(
    l: &'b mut LaunchArgs<'a>,
    ins: &'a BackwardInputs<'a, T>,
) -> &'b mut LaunchArgs<'a> {
    l.arg(&ins.q)
        .arg(&ins.k)
        .arg(&ins.v)
        .arg(&ins.bias)
        .arg(&ins.g)
        .arg(&ins.lse)
        .arg(&ins.delta)
}

/// Launches one kernel of `quant.cu` (`kernel`, of the output's element
/// type `T`) on `dev`'s stream, after checking that every operand holds
/// what `dims` makes the kernel read or write.
pub(crate) fn launch_quant<T: DeviceRepr>(
    op: &'static str,
    dev: &CudaDevice,
    kernel: KernelId,
    args: QuantArgs<'_, T>,
) -> Result<()> {
    let bad = |what: &str| Error::InvalidArgument {
        op,
        reason: format!("internal: {what} does not fit its quantized-weight kernel"),
    };
    // The weight's element count, and that the tile lies inside it.
    let weight = |d: &QuantDims| -> Result<usize> {
        let inside = d.r0 + u64::from(d.rows) <= d.out && d.k0 + u64::from(d.cols) <= d.inp;
        let n = d
            .out
            .checked_mul(d.inp)
            .and_then(|n| usize::try_from(n).ok());
        match n {
            Some(n) if inside && d.store <= 2 => Ok(n),
            _ => Err(bad("the tile or the weight's size")),
        }
    };
    // The 4-bit weight's parts hold every block of it.
    let four_bit = |d: &QuantDims, packed: &CudaView<'_, u8>, scales: &QuantScales| -> Result<()> {
        let n = weight(d)?;
        if d.blocksize == 0 || packed.len() < n.div_ceil(2) {
            return Err(bad("the packed codes"));
        }
        let blocks = n.div_ceil(d.blocksize as usize);
        let fits = match scales {
            QuantScales::F32(a) => d.nested_per == 0 && a.len() >= blocks,
            QuantScales::Nested { codes, nested } => {
                d.nested_per > 0
                    && codes.len() >= blocks
                    && nested.len() >= blocks.div_ceil(d.nested_per as usize)
            }
        };
        if fits {
            Ok(())
        } else {
            Err(bad("the block maxima"))
        }
    };
    let tile = |d: &QuantDims| LaunchConfig {
        grid_dim: (
            (u64::from(d.rows) * u64::from(d.cols))
                .div_ceil(u64::from(BLOCK))
                .clamp(1, u64::from(MAX_BLOCKS)) as u32,
            1,
            1,
        ),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    };
    let stream = dev.cuda_stream();
    let func = function(dev, kernel)?;
    let mut l = stream.launch_builder(&func);
    // Pushes the three pointers of the maxima (`absmax`, `absmax_codes`,
    // `nested`); the form not in use gets a live view it never reads.
    fn push_scales<'a, 'b>(
        l: &'b mut LaunchArgs<'a>,
        packed: &'a CudaView<'a, u8>,
        scales: &QuantScales<'a>,
    ) -> &'b mut LaunchArgs<'a> {
        match *scales {
            QuantScales::F32(a) => l.arg(a).arg(packed).arg(a),
            QuantScales::Nested { codes, nested } => l.arg(nested).arg(codes).arg(nested),
        }
    }
    let cfg = match args {
        QuantArgs::Dequant4 {
            packed,
            scales,
            dims,
            codes,
            dst,
        } => {
            four_bit(dims, packed, &scales)?;
            if dst.len() < dims.rows as usize * dims.cols as usize {
                return Err(bad("the tile's buffer"));
            }
            push_scales(l.arg(packed), packed, &scales)
                .arg(dims)
                .arg(codes)
                .arg(dst);
            tile(dims)
        }
        QuantArgs::Dequant8 {
            codes,
            row_max,
            dims,
            dst,
        } => {
            let n = weight(dims)?;
            if codes.len() < n || row_max.len() < dims.out as usize {
                return Err(bad("the int8 codes or row maxima"));
            }
            if dst.len() < dims.rows as usize * dims.cols as usize {
                return Err(bad("the tile's buffer"));
            }
            l.arg(codes).arg(row_max).arg(dims).arg(dst);
            tile(dims)
        }
        QuantArgs::Gemv4 {
            x,
            packed,
            scales,
            dims,
            codes,
            y,
        } => {
            four_bit(dims, packed, &scales)?;
            let n = dims.n as usize;
            let short = x.len() < n * dims.inp as usize || y.len() < n * dims.out as usize;
            if n == 0 || n > GEMV_ROWS || short {
                return Err(bad("x or y"));
            }
            push_scales(l.arg(x).arg(packed), packed, &scales)
                .arg(dims)
                .arg(codes)
                .arg(y);
            LaunchConfig {
                grid_dim: (
                    u32::try_from(dims.out.div_ceil(u64::from(GEMV_WARPS)))
                        .map_err(|_| bad("the output size"))?,
                    1,
                    1,
                ),
                block_dim: (32 * GEMV_WARPS, 1, 1),
                shared_mem_bytes: 0,
            }
        }
    };
    // SAFETY: each variant pushes its kernel's parameters in order with the
    // C types of `quant.cu` (device pointers to u8, f32 or the element type,
    // `QuantDims` and `QuantCodes` by value). The kernels read the packed
    // codes at `e / 2` and the maxima at `e / blocksize` (and
    // `/ nested_per`) for flattened elements `e < out * inp` of the tile,
    // x at `n * inp` and write `rows * cols` elements of the tile or
    // `n * out` of y: the lengths checked above. The maxima form not in
    // use is never read (`nested_per` says which). Blocks of 256 threads
    // match `__launch_bounds__` of `gemv4_*` and the grid-stride loops of
    // the others.
    unsafe { l.launch(cfg) }.w(op, "launch")?;
    Ok(())
}
