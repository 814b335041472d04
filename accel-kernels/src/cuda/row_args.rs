//! What the row kernels of `rownorm.cu` and `softmax.cu` take: their arguments and the row
//! blocking their weight gradients share with the host. Both `rows.rs`
//! (which builds the arguments) and `launch.rs` (which checks and launches
//! them) read these, so they live apart from either.

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
