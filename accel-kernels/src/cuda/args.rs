//! What the kernels take: each family's arguments in its C parameter order,
//! and the blocking constants the host shares with the sources. The op
//! modules (`rows.rs`, `pointwise.rs`, `loss.rs`, `attention.rs`,
//! `quant.rs`) build these and `launch.rs` checks and launches them, so they
//! live apart from both (neither side imports the other's module).

use cudarc::driver::{CudaSlice, CudaView, CudaViewMut};

/// Rows per partial sum of the weight gradients (`ROWS_PER_PARTIAL` in
/// `rownorm.cu`).
pub(crate) const ROWS_PER_PARTIAL: usize = 64;

/// The arguments of each row kernel (`rownorm.cu`, `softmax.cu`), in its parameter
/// order; the sizes are checked against the views before launching.
pub(crate) enum RowArgs<'a> {
    /// `rownorm_fwd(x, w, b, y, rows, d, eps, rms)`.
    Forward {
        x: &'a CudaView<'a, f32>,
        w: &'a CudaView<'a, f32>,
        b: Option<&'a CudaView<'a, f32>>,
        y: &'a mut CudaSlice<f32>,
        rows: u32,
        d: u32,
        eps: f32,
        rms: bool,
    },
    /// `rownorm_bwd_dx(x, w, g, dx, stats, rows, d, eps, rms)`.
    BackwardDx {
        x: &'a CudaView<'a, f32>,
        w: &'a CudaView<'a, f32>,
        g: &'a CudaView<'a, f32>,
        dx: &'a mut CudaViewMut<'a, f32>,
        stats: &'a mut CudaSlice<f32>,
        rows: u32,
        d: u32,
        eps: f32,
        rms: bool,
    },
    /// `rownorm_bwd_partials(x, g, stats, pw, pb, rows, d)`.
    BackwardPartials {
        x: &'a CudaView<'a, f32>,
        g: &'a CudaView<'a, f32>,
        stats: &'a CudaSlice<f32>,
        pw: &'a mut CudaSlice<f32>,
        pb: &'a mut CudaSlice<f32>,
        rows: u32,
        d: u32,
    },
    /// `softmax_fwd(x, y, rows, d, log)` (`softmax.cu`).
    Softmax {
        x: &'a CudaView<'a, f32>,
        y: &'a mut CudaSlice<f32>,
        rows: u32,
        d: u32,
        log: bool,
    },
    /// `softmax_bwd(y, g, dx, rows, d, log)` (`softmax.cu`).
    SoftmaxBackward {
        y: &'a CudaView<'a, f32>,
        g: &'a CudaView<'a, f32>,
        dx: &'a mut CudaSlice<f32>,
        rows: u32,
        d: u32,
        log: bool,
    },
    /// `rownorm_bwd_sum(pw, pb, dwdb, blocks, d)`.
    BackwardSum {
        pw: &'a CudaSlice<f32>,
        pb: &'a CudaSlice<f32>,
        dwdb: &'a mut CudaViewMut<'a, f32>,
        blocks: u32,
        d: u32,
    },
}

/// The arguments of each kernel of `act.cu`, in its parameter order; the
/// lengths are checked against `n` before launching.
pub(crate) enum PointwiseArgs<'a> {
    /// `swiglu_fwd(g, u, y, n)`.
    SwigluForward {
        g: &'a CudaView<'a, f32>,
        u: &'a CudaView<'a, f32>,
        y: &'a mut CudaSlice<f32>,
        n: u64,
    },
    /// `swiglu_bwd(g, u, dy, dgu, n)`.
    SwigluBackward {
        g: &'a CudaView<'a, f32>,
        u: &'a CudaView<'a, f32>,
        dy: &'a CudaView<'a, f32>,
        dgu: &'a mut CudaSlice<f32>,
        n: u64,
    },
    /// `act_fwd(x, y, n, act)`.
    ActForward {
        x: &'a CudaView<'a, f32>,
        y: &'a mut CudaSlice<f32>,
        n: u64,
        act: i32,
    },
    /// `rope_f32(x, cos, sin, y, rows, t, d, interleaved, sign)`.
    Rope {
        x: &'a CudaView<'a, f32>,
        cos: &'a CudaView<'a, f32>,
        sin: &'a CudaView<'a, f32>,
        y: &'a mut CudaSlice<f32>,
        rows: u64,
        t: u32,
        d: u32,
        interleaved: bool,
        sign: f32,
    },
    /// `act_bwd(x, dy, dx, n, act)`.
    ActBackward {
        x: &'a CudaView<'a, f32>,
        dy: &'a CudaView<'a, f32>,
        dx: &'a mut CudaSlice<f32>,
        n: u64,
        act: i32,
    },
}

/// The arguments of each kernel of `loss.cu`, in its parameter order.
pub(crate) enum LossArgs<'a> {
    /// `xent_rows(x, t, lse, loss, rows, c)`.
    Rows {
        x: &'a CudaView<'a, f32>,
        t: &'a CudaView<'a, u32>,
        lse: &'a mut CudaSlice<f32>,
        loss: &'a mut CudaSlice<f32>,
        rows: u32,
        c: u32,
    },
    /// `xent_mean(loss, t, mean, count, rows)`.
    Mean {
        loss: &'a CudaSlice<f32>,
        t: &'a CudaView<'a, u32>,
        mean: &'a mut CudaSlice<f32>,
        count: &'a mut CudaSlice<f32>,
        rows: u32,
    },
    /// `xent_grad(x, t, lse, dy, count, dx, rows, c)`.
    Grad {
        x: &'a CudaView<'a, f32>,
        t: &'a CudaView<'a, u32>,
        lse: &'a CudaSlice<f32>,
        dy: &'a CudaView<'a, f32>,
        count: &'a CudaSlice<f32>,
        dx: &'a mut CudaSlice<f32>,
        rows: u32,
        c: u32,
    },
}

/// Warps per block of the tiled kernels (`FA_WARPS`).
pub(crate) const FLASH_WARPS: u32 = 4;

/// `struct FlashDims` of `attention.cu`, passed by value.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct FlashDims {
    pub b: u32,
    pub h: u32,
    pub kvh: u32,
    pub t: u32,
    pub s: u32,
    pub d: u32,
    pub causal: u32,
    pub offset: u32,
    pub scale: f32,
    pub has_bias: u32,
    pub window: u32,
    pub pad0: u32,
    pub qs: [u64; 3],
    pub ks: [u64; 3],
    pub vs: [u64; 3],
    pub bs: [u64; 4],
}

const _: () = assert!(std::mem::size_of::<FlashDims>() == 152);

impl FlashDims {
    /// Elements of q, the output and their gradients.
    pub(crate) fn q_elems(&self) -> usize {
        self.q_rows() * self.d as usize
    }

    /// Query rows over all heads (the log-sum-exps).
    pub(crate) fn q_rows(&self) -> usize {
        (self.b * self.h) as usize * self.t as usize
    }

    /// Elements of k, v and their gradients.
    pub(crate) fn kv_elems(&self) -> usize {
        (self.b * self.kvh) as usize * self.s as usize * self.d as usize
    }
}

/// The arguments of each kernel of `attention.cu`, in its parameter order.
pub(crate) enum FlashArgs<'a, T> {
    /// `flash_fwd_*(q, k, v, bias, o, lse, dims)`.
    Forward {
        q: &'a CudaView<'a, T>,
        k: &'a CudaView<'a, T>,
        v: &'a CudaView<'a, T>,
        bias: &'a CudaView<'a, f32>,
        o: &'a mut CudaSlice<T>,
        lse: &'a mut CudaSlice<f32>,
        dims: &'a FlashDims,
        tiles: u32,
    },
    /// `flash_delta_*(o, g, delta, rows, d)`.
    Delta {
        o: &'a CudaView<'a, T>,
        g: &'a CudaView<'a, T>,
        delta: &'a mut CudaSlice<f32>,
        dims: &'a FlashDims,
    },
    /// `flash_dq_*(q, k, v, bias, g, lse, delta, dq, dims)`.
    Dq {
        ins: &'a BackwardInputs<'a, T>,
        dq: &'a mut CudaSlice<T>,
        dims: &'a FlashDims,
        tiles: u32,
    },
    /// `flash_dkdv_*(q, k, v, bias, g, lse, delta, dk, dv, dims)`.
    Dkdv {
        ins: &'a BackwardInputs<'a, T>,
        dk: &'a mut CudaSlice<T>,
        dv: &'a mut CudaSlice<T>,
        dims: &'a FlashDims,
        tiles: u32,
    },
}

/// What both backward kernels read, in their parameter order: q, k, v, the
/// bias, the output gradient `g`, the log-sum-exps and the row dots.
pub(crate) struct BackwardInputs<'a, T> {
    pub q: CudaView<'a, T>,
    pub k: CudaView<'a, T>,
    pub v: CudaView<'a, T>,
    pub bias: CudaView<'a, f32>,
    pub g: CudaView<'a, T>,
    pub lse: CudaView<'a, f32>,
    pub delta: CudaSlice<f32>,
}

/// Rows of `x` the few-row product off the 4-bit codes takes (`GEMV_ROWS`
/// in `quant.cu`), and output rows (warps) per block (`GEMV_WARPS`).
pub(crate) const GEMV_ROWS: usize = 8;
/// See [`GEMV_ROWS`].
pub(crate) const GEMV_WARPS: u32 = 8;

/// `struct QuantCodes` of `quant.cu`, passed by value: the 4-bit type's
/// code book and bitsandbytes' 8-bit dynamic map.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(crate) struct QuantCodes {
    pub codes: [f32; 16],
    pub map: [f32; 256],
}

const _: () = assert!(std::mem::size_of::<QuantCodes>() == 1088);

/// `struct QuantDims` of `quant.cu`, passed by value: the weight, the tile
/// a launch writes (rows `r0..r0 + rows`, columns `k0..k0 + cols`), and how
/// its values are made.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct QuantDims {
    pub out: u64,
    pub inp: u64,
    pub r0: u64,
    pub k0: u64,
    pub rows: u32,
    pub cols: u32,
    pub blocksize: u32,
    /// Block maxima per nested maximum; 0 for f32 maxima.
    pub nested_per: u32,
    pub offset: f32,
    /// The dtype quantized from: 0 f32, 1 bf16, 2 f16.
    pub store: u32,
    /// Rows of `x` (`gemv4_*`).
    pub n: u32,
    pub pad: u32,
}

const _: () = assert!(std::mem::size_of::<QuantDims>() == 64);

/// The block maxima of a 4-bit weight as the kernels read them: f32
/// maxima, or 8-bit codes of them with the nested f32 maxima (the pointer
/// the other form would use is never read: any live view fills it).
pub(crate) enum QuantScales<'a> {
    F32(&'a CudaView<'a, f32>),
    Nested {
        codes: &'a CudaView<'a, u8>,
        nested: &'a CudaView<'a, f32>,
    },
}

/// The arguments of each kernel of `quant.cu`, in its parameter order;
/// `T` is the output's (and `x`'s) element type.
pub(crate) enum QuantArgs<'a, T> {
    /// `dequant4_*(packed, absmax, absmax_codes, nested, dims, codes, dst)`.
    Dequant4 {
        packed: &'a CudaView<'a, u8>,
        scales: QuantScales<'a>,
        dims: &'a QuantDims,
        codes: &'a QuantCodes,
        dst: &'a mut CudaSlice<T>,
    },
    /// `dequant8_*(codes, row_max, dims, dst)`.
    Dequant8 {
        codes: &'a CudaView<'a, u8>,
        row_max: &'a CudaView<'a, f32>,
        dims: &'a QuantDims,
        dst: &'a mut CudaSlice<T>,
    },
    /// `gemv4_*(x, packed, absmax, absmax_codes, nested, dims, codes, y)`.
    Gemv4 {
        x: &'a CudaView<'a, T>,
        packed: &'a CudaView<'a, u8>,
        scales: QuantScales<'a>,
        dims: &'a QuantDims,
        codes: &'a QuantCodes,
        y: &'a mut CudaSlice<T>,
    },
}
