//! 4-bit codes to f32 with AVX-512: sixteen values per permute, the table of
//! code values held in one register (bitsandbytes' CPU kernels do the same).

/// Whether [`span_f32`] runs its AVX-512 form here.
pub(crate) fn span_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static AVAILABLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *AVAILABLE.get_or_init(|| std::arch::is_x86_feature_detected!("avx512f"))
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// `out[2i] = codes[bytes[i] >> 4] * s`, `out[2i + 1] = codes[bytes[i] & 15] * s`.
///
/// # Panics
/// When `out` is not twice as long as `bytes`.
pub(crate) fn span_f32(bytes: &[u8], codes: &[f32; 16], s: f32, out: &mut [f32]) {
    assert_eq!(out.len(), 2 * bytes.len(), "span_f32: output length");
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if span_available() {
        done = bytes.len() / 8 * 8;
        // SAFETY: AVX-512F is present (checked); the kernel reads
        // `bytes[..done]` 8 bytes at a time and writes `out[..2 * done]`
        // 16 floats at a time, both inside the slices (lengths asserted).
        unsafe { span_avx512(bytes.as_ptr(), done, codes, s, out.as_mut_ptr()) };
    }
    for (o, &b) in out[2 * done..].chunks_exact_mut(2).zip(&bytes[done..]) {
        o[0] = codes[(b >> 4) as usize] * s;
        o[1] = codes[(b & 15) as usize] * s;
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn span_avx512(bytes: *const u8, len: usize, codes: &[f32; 16], s: f32, out: *mut f32) {
    use core::arch::x86_64::*;
    let lut = _mm512_loadu_ps(codes.as_ptr());
    let scale = _mm512_set1_ps(s);
    let low = _mm_set1_epi8(0x0f);
    for i in (0..len).step_by(8) {
        let raw = _mm_loadl_epi64(bytes.add(i).cast());
        let hi = _mm_and_si128(_mm_srli_epi16(raw, 4), low);
        let lo = _mm_and_si128(raw, low);
        // hi0 lo0 hi1 lo1 ...: the element order of the flattened weight.
        let idx = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(hi, lo));
        let v = _mm512_mul_ps(_mm512_permutexvar_ps(idx, lut), scale);
        _mm512_storeu_ps(out.add(2 * i), v);
    }
}

/// Whether [`dot_4bit`] runs its AVX-512 form here (else the caller
/// dequantizes slabs).
pub(crate) fn dot_available() -> bool {
    span_available()
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
/// Without AVX-512 ([`dot_available`]); when a slice is shorter than its
/// shape says, or `blocksize` is not a multiple of 32 dividing `inp`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn dot_4bit(
    codes: &[u8],
    scales: &[f32],
    lut: &[f32; 16],
    (x_even, x_odd): (&[f32], &[f32]),
    (rows, m, inp, blocksize): (usize, usize, usize, usize),
    round_bf16: bool,
    yt: &mut [f32],
) {
    assert!(dot_available(), "dot_4bit: this CPU lacks AVX-512");
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
    // SAFETY: AVX-512F is present (checked);
    // the kernel reads `codes[..rows * half]`, `scales[..rows * blocks]`,
    // `x_even`/`x_odd[..m * half]` and writes `yt[..rows * m]`, all checked
    // above; it reads 16 bytes of codes at offsets that are multiples of 16
    // below `half` (a block of 32 or more values is 16 or more bytes).
    unsafe {
        dot_4bit_avx512(
            codes.as_ptr(),
            scales.as_ptr(),
            lut,
            (x_even.as_ptr(), x_odd.as_ptr()),
            (rows, m, inp, blocksize),
            round_bf16,
            yt.as_mut_ptr(),
        )
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[allow(clippy::too_many_arguments)]
unsafe fn dot_4bit_avx512(
    codes: *const u8,
    scales: *const f32,
    lut: &[f32; 16],
    x: (*const f32, *const f32),
    (rows, m, inp, blocksize): (usize, usize, usize, usize),
    round_bf16: bool,
    yt: *mut f32,
) {
    // Input rows four, two, then one at a time, each count its own
    // unrolled kernel so that the accumulators stay in registers.
    let mut j0 = 0;
    while j0 < m {
        let shape = (rows, m, inp, blocksize);
        let args = (codes, scales, lut, x, shape, j0, round_bf16, yt);
        j0 += match m - j0 {
            1 => dot_rows::<1>(args),
            2 | 3 => dot_rows::<2>(args),
            _ => dot_rows::<4>(args),
        };
    }
}

/// The arguments of [`dot_rows`]: as [`dot_4bit`]'s, and the first input row.
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

/// [`dot_4bit_avx512`] for input rows `j0..j0 + MT`; returns `MT`.
///
/// # Safety
/// As [`dot_4bit_avx512`], with `j0 + MT <= m`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn dot_rows<const MT: usize>(
    (codes, scales, lut, (x_even, x_odd), (rows, m, inp, blocksize), j0, round_bf16, yt): DotArgs,
) -> usize {
    use core::arch::x86_64::*;
    let lut = _mm512_loadu_ps(lut.as_ptr());
    let low = _mm512_set1_epi32(15);
    let half = inp / 2;
    let blocks = inp / blocksize;
    // Rounds 16 values to bf16 (to nearest even, as `half` does for
    // finite values: bits + 0x7fff + the kept lowest bit, truncated) and
    // back to f32.
    let round = |v: __m512| -> __m512 {
        let b = _mm512_castps_si512(v);
        let lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
        let r = _mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7fff)), lsb);
        _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32(-65536)))
    };
    let xe: [*const f32; MT] = core::array::from_fn(|j| x_even.add((j0 + j) * half));
    let xo: [*const f32; MT] = core::array::from_fn(|j| x_odd.add((j0 + j) * half));
    for r in 0..rows {
        let row = codes.add(r * half);
        let mut total = [_mm512_setzero_ps(); MT];
        for b in 0..blocks {
            let s = _mm512_set1_ps(*scales.add(r * blocks + b));
            // Two accumulators a row (even and odd elements) per 16-byte
            // chunk parity: four independent FMA chains for one row.
            let mut acc = [[_mm512_setzero_ps(); 4]; MT];
            let (q0, q1) = (b * blocksize / 2, (b + 1) * blocksize / 2);
            let mut q = q0;
            while q < q1 {
                for slot in [0, 2] {
                    if q >= q1 {
                        break;
                    }
                    let idx = _mm512_cvtepu8_epi32(_mm_loadu_si128(row.add(q).cast()));
                    let mut hi = _mm512_permutexvar_ps(_mm512_srli_epi32(idx, 4), lut);
                    let mut lo = _mm512_permutexvar_ps(_mm512_and_si512(idx, low), lut);
                    if round_bf16 {
                        hi = round(_mm512_mul_ps(hi, s));
                        lo = round(_mm512_mul_ps(lo, s));
                    }
                    for j in 0..MT {
                        let e = _mm512_loadu_ps(xe[j].add(q));
                        let o = _mm512_loadu_ps(xo[j].add(q));
                        acc[j][slot] = _mm512_fmadd_ps(hi, e, acc[j][slot]);
                        acc[j][slot + 1] = _mm512_fmadd_ps(lo, o, acc[j][slot + 1]);
                    }
                    q += 16;
                }
            }
            for j in 0..MT {
                let a = &acc[j];
                let sum = _mm512_add_ps(_mm512_add_ps(a[0], a[1]), _mm512_add_ps(a[2], a[3]));
                total[j] = if round_bf16 {
                    // Already scaled values: the block's sum adds in.
                    _mm512_add_ps(total[j], sum)
                } else {
                    _mm512_fmadd_ps(sum, s, total[j])
                };
            }
        }
        for (j, t) in total.iter().enumerate() {
            *yt.add(r * m + j0 + j) = _mm512_reduce_add_ps(*t);
        }
    }
    MT
}

/// `out[i] = pair(codes[bytes[i] >> 4] * s, codes[bytes[i] & 15] * s)`: each
/// byte's two values rounded to bf16 (to nearest even) and packed as the bf16
/// products' pair (the even element in the low half), what a packed panel
/// of the weight holds.
///
/// # Panics
/// When `out` is not as long as `bytes`.
pub(crate) fn span_pairs(bytes: &[u8], codes: &[f32; 16], s: f32, out: &mut [u32]) {
    assert_eq!(out.len(), bytes.len(), "span_pairs: output length");
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if span_available() {
        done = bytes.len() / 8 * 8;
        // SAFETY: AVX-512F is present (checked); the kernel reads
        // `bytes[..done]` 8 bytes at a time and writes `out[..done]` 8 u32
        // at a time, inside both slices (lengths asserted).
        unsafe { span_pairs_avx512(bytes.as_ptr(), done, codes, s, out.as_mut_ptr()) };
    }
    let bits = |v: f32| -> u32 {
        let b = v.to_bits();
        (b.wrapping_add(0x7fff + ((b >> 16) & 1))) >> 16
    };
    for (o, &b) in out[done..].iter_mut().zip(&bytes[done..]) {
        let (lo, hi) = (codes[(b >> 4) as usize] * s, codes[(b & 15) as usize] * s);
        *o = bits(lo) | (bits(hi) << 16);
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn span_pairs_avx512(
    bytes: *const u8,
    len: usize,
    codes: &[f32; 16],
    s: f32,
    out: *mut u32,
) {
    use core::arch::x86_64::*;
    let lut = _mm512_loadu_ps(codes.as_ptr());
    let scale = _mm512_set1_ps(s);
    let low = _mm_set1_epi8(0x0f);
    let one = _mm512_set1_epi32(1);
    let bias = _mm512_set1_epi32(0x7fff);
    for i in (0..len).step_by(8) {
        let raw = _mm_loadl_epi64(bytes.add(i).cast());
        let hi = _mm_and_si128(_mm_srli_epi16(raw, 4), low);
        let lo = _mm_and_si128(raw, low);
        let idx = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(hi, lo));
        let v = _mm512_castps_si512(_mm512_mul_ps(_mm512_permutexvar_ps(idx, lut), scale));
        // bf16 to nearest even: bits + 0x7fff + the kept lowest bit, the
        // upper halves narrowed to 16 bits: lane 2i and 2i + 1 make pair i.
        let lsb = _mm512_and_si512(_mm512_srli_epi32(v, 16), one);
        let r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(v, bias), lsb), 16);
        _mm256_storeu_si256(out.add(i).cast(), _mm512_cvtepi32_epi16(r));
    }
}

/// `out[j] = pair(lo[j], hi[j])`: two rows' values rounded to bf16 (to
/// nearest even) and interleaved as the bf16 products' pairs, what a panel
/// of consecutive rows holds.
///
/// # Panics
/// When the three slices differ in length.
pub(crate) fn pair_rows(lo: &[f32], hi: &[f32], out: &mut [u32]) {
    assert!(
        lo.len() == out.len() && hi.len() == out.len(),
        "pair_rows: lengths"
    );
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if span_available() {
        done = out.len() / 16 * 16;
        // SAFETY: AVX-512F is present (checked); 16 values of each slice are
        // read and 16 u32 written per step, below `done <= len` (asserted).
        unsafe { pair_rows_avx512(lo.as_ptr(), hi.as_ptr(), done, out.as_mut_ptr()) };
    }
    let bits = |v: f32| -> u32 {
        let b = v.to_bits();
        (b.wrapping_add(0x7fff + ((b >> 16) & 1))) >> 16
    };
    for ((o, &l), &h) in out[done..].iter_mut().zip(&lo[done..]).zip(&hi[done..]) {
        *o = bits(l) | (bits(h) << 16);
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn pair_rows_avx512(lo: *const f32, hi: *const f32, len: usize, out: *mut u32) {
    use core::arch::x86_64::*;
    let one = _mm512_set1_epi32(1);
    let bias = _mm512_set1_epi32(0x7fff);
    let round = |v: __m512i| {
        let lsb = _mm512_and_si512(_mm512_srli_epi32(v, 16), one);
        _mm512_add_epi32(_mm512_add_epi32(v, bias), lsb)
    };
    for i in (0..len).step_by(16) {
        let l = round(_mm512_loadu_si512(lo.add(i).cast()));
        let h = round(_mm512_loadu_si512(hi.add(i).cast()));
        let p = _mm512_or_si512(
            _mm512_srli_epi32(l, 16),
            _mm512_and_si512(h, _mm512_set1_epi32(-65536)),
        );
        _mm512_storeu_si512(out.add(i).cast(), p);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pairs_are_the_values_rounded_to_bf16_and_paired() {
        let codes: [f32; 16] = std::array::from_fn(|i| i as f32 * 0.3137 - 2.0);
        let bytes: Vec<u8> = (0..=255u8).chain(0..5).collect();
        let mut out = vec![0u32; bytes.len()];
        span_pairs(&bytes, &codes, 0.731, &mut out);
        for (i, &b) in bytes.iter().enumerate() {
            let h = |v: f32| u32::from(half::bf16::from_f32(v).to_bits());
            let want =
                h(codes[(b >> 4) as usize] * 0.731) | (h(codes[(b & 15) as usize] * 0.731) << 16);
            assert_eq!(out[i], want, "byte {i}");
        }
    }

    #[test]
    fn paired_rows_are_their_values_rounded_to_bf16() {
        let lo: Vec<f32> = (0..37).map(|i| i as f32 * 0.0137 - 0.2).collect();
        let hi: Vec<f32> = (0..37).map(|i| i as f32 * -0.0291 + 1.1).collect();
        let mut out = vec![0u32; 37];
        pair_rows(&lo, &hi, &mut out);
        let h = |v: f32| u32::from(half::bf16::from_f32(v).to_bits());
        for j in 0..37 {
            assert_eq!(out[j], h(lo[j]) | (h(hi[j]) << 16), "{j}");
        }
    }

    #[test]
    fn every_code_pair_expands_as_the_scalar_loop_does() {
        let codes: [f32; 16] = std::array::from_fn(|i| i as f32 * 0.25 - 2.0);
        let bytes: Vec<u8> = (0..=255u8).chain(0..7).collect();
        let mut out = vec![0f32; 2 * bytes.len()];
        span_f32(&bytes, &codes, 1.5, &mut out);
        for (i, &b) in bytes.iter().enumerate() {
            assert_eq!(out[2 * i], codes[(b >> 4) as usize] * 1.5, "byte {i} high");
            assert_eq!(
                out[2 * i + 1],
                codes[(b & 15) as usize] * 1.5,
                "byte {i} low"
            );
        }
    }
}
