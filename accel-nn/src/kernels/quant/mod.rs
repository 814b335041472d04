//! Products through a frozen quantized weight (bitsandbytes' 4-bit blocks or
//! LLM.int8 rows) without ever holding it dequantized: `x W^T` for the
//! forward and `dy W` for the input's gradient.
//!
//! Why tiles: a 4-bit weight is an eighth of its f32 bytes, and the point of
//! loading it so is that the full-precision matrix never exists. Each task
//! dequantizes a tile of `W` (64 rows by at most 512 columns, 128 KiB of
//! f32, in L2) and multiplies it with gemm before the next; a task owns its
//! rows of the (transposed) output, so every element is summed by one task
//! in a fixed order and the result does not depend on the thread count.
//! For a handful of rows (decoding) the product runs straight off the codes
//! (`skinny`), reading the weight's bytes once.

mod bf16_products;
mod dequant;
mod op;
mod path;
mod skinny;

use half::{bf16, f16};

pub(crate) use op::{quantized_linear, QuantTensors};
pub use path::{quant_path, with_quant_path, QuantPath};

use super::raw::quant::Simd;
use super::raw::{gemm, par, MatRef};

/// Rows of `W` a task dequantizes at a time.
const TILE_ROWS: usize = 64;
/// Columns of `W` per tile.
const TILE_COLS: usize = 512;
/// Columns of `W` per task of the input's gradient.
const BACK_COLS: usize = 256;
/// Rows of `W` per tile of the input's gradient (a tile is 256 KiB of f32).
const BACK_ROWS: usize = 256;
/// Up to this many rows of `x` the forward reads the codes directly.
const SKINNY_ROWS: usize = 8;

/// The block maxima of a 4-bit weight.
#[derive(Clone, Copy)]
pub(crate) enum Scales<'a> {
    /// One f32 per block.
    F32(&'a [f32]),
    /// Double quantization: 8-bit codes of the maxima minus `offset`, and
    /// the maximum of each 256 of them.
    Nested {
        codes: &'a [u8],
        nested: &'a [f32],
        offset: f32,
    },
}

impl Scales<'_> {
    /// The maxima of blocks `b0..b0 + out.len()` (the match and the code
    /// book's lookup hoisted out of the loop).
    pub(crate) fn fill(&self, b0: usize, out: &mut [f32]) {
        match *self {
            Self::F32(s) => out.copy_from_slice(&s[b0..b0 + out.len()]),
            Self::Nested {
                codes,
                nested,
                offset,
            } => {
                let map = dynamic_map();
                let per = accel_bigmodel::quant::NESTED_BLOCKSIZE;
                for (i, o) in out.iter_mut().enumerate() {
                    let b = b0 + i;
                    *o = map[codes[b] as usize] * nested[b / per] + offset;
                }
            }
        }
    }
}

/// bitsandbytes' 8-bit dynamic map, built once.
fn dynamic_map() -> &'static [f32; 256] {
    static MAP: std::sync::OnceLock<[f32; 256]> = std::sync::OnceLock::new();
    MAP.get_or_init(accel_bigmodel::quant::dynamic_map)
}

/// The dtype a weight was quantized from: bitsandbytes dequantizes to it
/// (rounding `code * absmax`) before casting to the compute dtype.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Store {
    F32,
    Bf16,
    F16,
}

impl Store {
    #[inline(always)]
    fn round(self, v: f32) -> f32 {
        match self {
            Self::F32 => v,
            Self::Bf16 => bf16::from_f32(v).to_f32(),
            Self::F16 => f16::from_f32(v).to_f32(),
        }
    }
}

/// A quantized weight `[out, inp]` over host slices.
#[derive(Clone, Copy)]
pub(crate) enum QuantRef<'a> {
    /// 4-bit codes, two a byte (the first of a pair in the high nibble),
    /// over the flattened weight in blocks of `blocksize`; values rounded to
    /// `store` (the dtype quantized from), then to `compute` (the dtype the
    /// products take, as bitsandbytes casts the dequantized weight to it).
    FourBit {
        packed: &'a [u8],
        scales: Scales<'a>,
        codes: &'a [f32; 16],
        blocksize: usize,
        store: Store,
        compute: Store,
        /// The instructions the products take (the caller's
        /// [`QuantPath`], read once on its thread).
        simd: Simd,
        out: usize,
        inp: usize,
    },
    /// int8 codes (as bytes) per row, and each row's maximum; values
    /// rounded to `compute`.
    EightBit {
        codes: &'a [u8],
        row_max: &'a [f32],
        compute: Store,
        out: usize,
        inp: usize,
    },
}

impl QuantRef<'_> {
    /// `(out, inp)`.
    pub(crate) fn dims(&self) -> (usize, usize) {
        match *self {
            Self::FourBit { out, inp, .. } | Self::EightBit { out, inp, .. } => (out, inp),
        }
    }

    /// Checks that the slices hold the whole weight (a corrupt state is an
    /// error here, never an out-of-bounds read later).
    pub(crate) fn check(&self) -> Result<(), String> {
        let (out, inp) = self.dims();
        let n = out * inp;
        match *self {
            Self::FourBit {
                packed,
                scales,
                blocksize,
                ..
            } => {
                let blocks = n.div_ceil(blocksize);
                if packed.len() < n.div_ceil(2) {
                    return Err(format!("{} packed bytes for {n} values", packed.len()));
                }
                match scales {
                    Scales::F32(s) if s.len() < blocks => {
                        Err(format!("{} block maxima for {blocks} blocks", s.len()))
                    }
                    Scales::Nested { codes, nested, .. }
                        if codes.len() < blocks
                            || nested.len()
                                < blocks.div_ceil(accel_bigmodel::quant::NESTED_BLOCKSIZE) =>
                    {
                        Err(format!(
                            "{} block codes and {} nested maxima for {blocks} blocks",
                            codes.len(),
                            nested.len()
                        ))
                    }
                    _ => Ok(()),
                }
            }
            Self::EightBit { codes, row_max, .. } => {
                if codes.len() < n || row_max.len() < out {
                    Err(format!(
                        "{} codes and {} row maxima for [{out}, {inp}]",
                        codes.len(),
                        row_max.len()
                    ))
                } else {
                    Ok(())
                }
            }
        }
    }
}

/// `y [n, out] = x [n, inp] @ W^T`.
pub(crate) fn forward(x: &[f32], n: usize, w: &QuantRef) -> Vec<f32> {
    let (out, inp) = w.dims();
    if n <= SKINNY_ROWS {
        return skinny::x_wt(x, n, w);
    }
    if n <= super::skinny::MAX_ROWS {
        // Slabs of W dequantized into L2 for the skinny kernels, which read
        // them as they lie (gemm would pack each tile again).
        return skinny::slabs(x, n, w);
    }
    // yT [out, n]: a task owns TILE_ROWS rows of it (rows of W).
    let yt = par::new_vec(out * n, TILE_ROWS * n, |t, yt| {
        let o0 = t * TILE_ROWS;
        let rows = yt.len() / n;
        let mut buf = vec![0f32; rows * TILE_COLS.min(inp)];
        for k0 in (0..inp).step_by(TILE_COLS) {
            let kc = TILE_COLS.min(inp - k0);
            dequant::tile(w, (o0, rows), (k0, kc), &mut buf, kc);
            gemm(
                (rows, n, kc),
                yt,
                0,
                n,
                k0 > 0,
                MatRef::rows(&buf, 0, kc),
                MatRef::rows_t(x, k0, inp),
                1.0,
                false,
            );
        }
    });
    transpose(&yt, out, n)
}

/// `dx [n, inp] = dy [n, out] @ W`.
pub(crate) fn backward_input(dy: &[f32], n: usize, w: &QuantRef) -> Vec<f32> {
    let (out, inp) = w.dims();
    // dxT [inp, n]: a task owns BACK_COLS rows of it (columns of W), and
    // adds BACK_ROWS rows of W at a time into them: narrow enough that a
    // hidden size of 1536 makes 6 tasks (3 would leave one of 2 cores idle
    // half the time), deep enough that gemm's sums are not 64 terms long.
    // dy^T once, so that gemm packs its panels from rows as they lie: read
    // as a transposed view, every tile of every task gathered it again
    // (gemm's packing was 44% of an fp32 QLoRA step's CPU time, against 34%
    // in its microkernel; this took the backward from 0.98-1.19 s to
    // 0.77-0.94 s a step on a 2-core Zen 4, losses bitwise the same).
    let dyt = transpose(dy, n, out);
    let dxt = par::new_vec(inp * n, BACK_COLS * n, |t, dxt| {
        let k0 = t * BACK_COLS;
        let kc = dxt.len() / n;
        let mut buf = vec![0f32; BACK_ROWS.min(out) * kc];
        for o0 in (0..out).step_by(BACK_ROWS) {
            let rows = BACK_ROWS.min(out - o0);
            dequant::tile(w, (o0, rows), (k0, kc), &mut buf, kc);
            gemm(
                (kc, n, rows),
                dxt,
                0,
                n,
                o0 > 0,
                MatRef::rows_t(&buf, 0, kc),
                MatRef::rows(&dyt, o0 * n, n),
                1.0,
                false,
            );
        }
    });
    transpose(&dxt, inp, n)
}

/// The whole weight dequantized, row-major `[out, inp]` (for merging an
/// adapter, exporting, and the reference the tests compare with), rounded
/// as the view says.
pub(crate) fn dequantize(w: &QuantRef) -> Vec<f32> {
    let (out, inp) = w.dims();
    par::new_vec(out * inp, TILE_ROWS * inp.max(1), |t, rows| {
        let n = rows.len() / inp.max(1);
        dequant::tile(w, (t * TILE_ROWS, n), (0, inp), rows, inp);
    })
}

/// `m [rows, cols]` transposed, in parallel over blocks of output rows.
fn transpose(m: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    if rows == 0 || cols == 0 {
        return Vec::new();
    }
    const BLOCK: usize = 64;
    par::new_vec(rows * cols, BLOCK * rows, |t, out| {
        let c0 = t * BLOCK;
        let nc = out.len() / rows;
        for r0 in (0..rows).step_by(BLOCK) {
            for r in r0..(r0 + BLOCK).min(rows) {
                let src = &m[r * cols + c0..][..nc];
                for (c, &v) in src.iter().enumerate() {
                    out[c * rows + r] = v;
                }
            }
        }
    })
}

#[cfg(test)]
mod tests;
