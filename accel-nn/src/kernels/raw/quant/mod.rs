//! 4-bit codes to values and products, vectorised: AVX-512 (sixteen values
//! a permute, the code book in one register) or AVX2 (eight values, the
//! book in two), chosen by the caller as a [`Simd`] so that a benchmark or a
//! test can run either on a CPU that has both. Every entry point checks the
//! slices it is given and then calls the kernels of `avx512.rs` / `avx2.rs`;
//! the scalar loops here finish what the vector steps leave and serve CPUs
//! with neither.

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;

/// The instructions the 4-bit kernels use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Simd {
    Avx512,
    /// AVX2 with FMA.
    Avx2,
    /// Plain loops (what the compiler makes of them for the baseline CPU).
    Scalar,
}

impl Simd {
    /// Whether this CPU runs it.
    pub(crate) fn available(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            static AVX512: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
            static AVX2: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
            match self {
                Simd::Avx512 => {
                    *AVX512.get_or_init(|| std::arch::is_x86_feature_detected!("avx512f"))
                }
                Simd::Avx2 => *AVX2.get_or_init(|| {
                    std::arch::is_x86_feature_detected!("avx2")
                        && std::arch::is_x86_feature_detected!("fma")
                }),
                Simd::Scalar => true,
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            self == Simd::Scalar
        }
    }

    /// The widest this CPU runs.
    #[cfg(test)]
    pub(crate) fn best() -> Simd {
        [Simd::Avx512, Simd::Avx2]
            .into_iter()
            .find(|s| s.available())
            .unwrap_or(Simd::Scalar)
    }

    /// Bytes the vector step of the expanding kernels takes at a time.
    fn step(self) -> usize {
        match self {
            Simd::Scalar => usize::MAX,
            _ => 8,
        }
    }
}

/// The arguments of the kernels' `dot_rows`: as [`dot_4bit`]'s, and the
/// first input row.
#[cfg(target_arch = "x86_64")]
type DotArgs<'a> = (
    *const u8,
    *const f32,
    &'a [f32; 16],
    (*const f32, *const f32),
    (usize, usize, usize, usize),
    usize,
    bool,
    *mut f32,
);

/// `v` rounded to bf16 (to nearest even) as its 16 bits.
#[inline(always)]
fn bf16_bits(v: f32) -> u32 {
    let b = v.to_bits();
    (b.wrapping_add(0x7fff + ((b >> 16) & 1))) >> 16
}

/// The vector kernels' share of `len` items taken `step` at a time (none
/// when `simd` is not available here, so a caller's choice never reaches
/// instructions the CPU lacks).
fn vector_part(simd: Simd, len: usize, step: usize) -> usize {
    if simd == Simd::Scalar || !simd.available() {
        0
    } else {
        len / step * step
    }
}

/// `out[2i] = codes[bytes[i] >> 4] * s`, `out[2i + 1] = codes[bytes[i] & 15] * s`,
/// each rounded to bf16 (to nearest even) when `round_bf16`.
///
/// # Panics
/// When `out` is not twice as long as `bytes`.
pub(crate) fn span_f32(
    simd: Simd,
    bytes: &[u8],
    codes: &[f32; 16],
    (s, round_bf16): (f32, bool),
    out: &mut [f32],
) {
    assert_eq!(out.len(), 2 * bytes.len(), "span_f32: output length");
    let done = vector_part(simd, bytes.len(), simd.step());
    #[cfg(target_arch = "x86_64")]
    // SAFETY: the instructions are present (`vector_part` checked); the
    // kernels read `bytes[..done]` 8 bytes at a time and write
    // `out[..2 * done]`, inside both slices (lengths asserted).
    unsafe {
        match simd {
            Simd::Avx512 if done > 0 => avx512::span_f32(
                bytes.as_ptr(),
                done,
                codes,
                (s, round_bf16),
                out.as_mut_ptr(),
            ),
            Simd::Avx2 if done > 0 => avx2::span_f32(
                bytes.as_ptr(),
                done,
                codes,
                (s, round_bf16),
                out.as_mut_ptr(),
            ),
            _ => {}
        }
    }
    let round = |v: f32| {
        if round_bf16 {
            f32::from_bits(bf16_bits(v) << 16)
        } else {
            v
        }
    };
    for (o, &b) in out[2 * done..].chunks_exact_mut(2).zip(&bytes[done..]) {
        o[0] = round(codes[(b >> 4) as usize] * s);
        o[1] = round(codes[(b & 15) as usize] * s);
    }
}

/// Whether [`dot_4bit`] runs with `simd` here (else the caller dequantizes
/// slabs).
pub(crate) fn dot_available(simd: Simd) -> bool {
    simd != Simd::Scalar && simd.available()
}

/// `yt[r * m + j] = sum_k W[r, k] x[j, k]` for the rows of one slab of a
/// 4-bit weight, straight off its codes: `codes` holds `rows` rows of
/// `inp / 2` bytes (two codes a byte, the even element in the high nibble),
/// `scales` each row's `inp / blocksize` block maxima, `x_even` and `x_odd`
/// the `m` input rows' even and odd elements (`inp / 2` each, row after
/// row). Each value is `codes[c] * scale`, rounded to bf16 first when
/// `round_bf16` (a bf16 compute dtype); the sums are f32, block by block.
///
/// # Panics
/// Without the instructions ([`dot_available`]); when a slice is shorter
/// than its shape says, or `blocksize` is not a multiple of 32 dividing `inp`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn dot_4bit(
    simd: Simd,
    codes: &[u8],
    scales: &[f32],
    lut: &[f32; 16],
    (x_even, x_odd): (&[f32], &[f32]),
    (rows, m, inp, blocksize): (usize, usize, usize, usize),
    round_bf16: bool,
    yt: &mut [f32],
) {
    assert!(dot_available(simd), "dot_4bit: this CPU lacks {simd:?}");
    assert!(
        blocksize % 32 == 0 && inp % blocksize == 0,
        "dot_4bit: block size {blocksize} and row length {inp}"
    );
    let half = inp / 2;
    assert!(
        codes.len() >= rows * half
            && scales.len() >= rows * (inp / blocksize)
            && x_even.len() >= m * half
            && x_odd.len() >= m * half
            && yt.len() >= rows * m,
        "dot_4bit: a slice is short for {rows} rows x {inp} and {m} inputs"
    );
    #[cfg(target_arch = "x86_64")]
    {
        let args = (
            codes.as_ptr(),
            scales.as_ptr(),
            lut,
            (x_even.as_ptr(), x_odd.as_ptr()),
            (rows, m, inp, blocksize),
            round_bf16,
            yt.as_mut_ptr(),
        );
        // SAFETY: the instructions are present (asserted); the kernels read
        // `codes[..rows * half]`, `scales[..rows * blocks]`,
        // `x_even`/`x_odd[..m * half]` and write `yt[..rows * m]`, all
        // checked above; they read 8 or 16 bytes of codes at offsets that
        // are multiples of 16 below `half` (a block of 32 or more values is
        // 16 or more bytes).
        unsafe {
            match simd {
                Simd::Avx512 => {
                    avx512::dot_4bit(args.0, args.1, args.2, args.3, args.4, args.5, args.6)
                }
                Simd::Avx2 => {
                    avx2::dot_4bit(args.0, args.1, args.2, args.3, args.4, args.5, args.6)
                }
                Simd::Scalar => unreachable!("asserted above"),
            }
        }
    }
}

/// `out[i] = pair(codes[bytes[i] >> 4] * s, codes[bytes[i] & 15] * s)`: each
/// byte's two values rounded to bf16 (to nearest even) and packed as the bf16
/// products' pair (the even element in the low half), what a packed panel
/// of the weight holds.
///
/// # Panics
/// When `out` is not as long as `bytes`.
pub(crate) fn span_pairs(simd: Simd, bytes: &[u8], codes: &[f32; 16], s: f32, out: &mut [u32]) {
    assert_eq!(out.len(), bytes.len(), "span_pairs: output length");
    let done = vector_part(simd, bytes.len(), simd.step());
    #[cfg(target_arch = "x86_64")]
    // SAFETY: the instructions are present (`vector_part` checked); the
    // kernels read `bytes[..done]` 8 bytes at a time and write `out[..done]`
    // 8 u32 at a time, inside both slices (lengths asserted).
    unsafe {
        match simd {
            Simd::Avx512 if done > 0 => {
                avx512::span_pairs(bytes.as_ptr(), done, codes, s, out.as_mut_ptr())
            }
            Simd::Avx2 if done > 0 => {
                avx2::span_pairs(bytes.as_ptr(), done, codes, s, out.as_mut_ptr())
            }
            _ => {}
        }
    }
    for (o, &b) in out[done..].iter_mut().zip(&bytes[done..]) {
        let (lo, hi) = (codes[(b >> 4) as usize] * s, codes[(b & 15) as usize] * s);
        *o = bf16_bits(lo) | (bf16_bits(hi) << 16);
    }
}

/// `out[j] = pair(lo[j], hi[j])`: two rows' values rounded to bf16 (to
/// nearest even) and interleaved as the bf16 products' pairs, what a panel
/// of consecutive rows holds.
///
/// # Panics
/// When the three slices differ in length.
pub(crate) fn pair_rows(simd: Simd, lo: &[f32], hi: &[f32], out: &mut [u32]) {
    assert!(
        lo.len() == out.len() && hi.len() == out.len(),
        "pair_rows: lengths"
    );
    let step = if simd == Simd::Avx512 { 16 } else { 8 };
    let done = vector_part(simd, out.len(), step);
    #[cfg(target_arch = "x86_64")]
    // SAFETY: the instructions are present (`vector_part` checked); `step`
    // values of each slice are read and `step` u32 written per step, below
    // `done <= len` (asserted).
    unsafe {
        match simd {
            Simd::Avx512 if done > 0 => {
                avx512::pair_rows(lo.as_ptr(), hi.as_ptr(), done, out.as_mut_ptr())
            }
            Simd::Avx2 if done > 0 => {
                avx2::pair_rows(lo.as_ptr(), hi.as_ptr(), done, out.as_mut_ptr())
            }
            _ => {}
        }
    }
    for ((o, &l), &h) in out[done..].iter_mut().zip(&lo[done..]).zip(&hi[done..]) {
        *o = bf16_bits(l) | (bf16_bits(h) << 16);
    }
}

#[cfg(test)]
mod tests;
