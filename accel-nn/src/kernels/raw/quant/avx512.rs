//! The 4-bit kernels in AVX-512: sixteen values per permute, the table of
//! code values held in one register (bitsandbytes' CPU kernels do the same).
//! The safe entry points, with the checks that make these calls sound, are
//! in `mod.rs`.

use super::DotArgs;

/// Rounds sixteen f32 values to bf16 (to nearest even, as `half` does for
/// finite values: bits + 0x7fff + the kept lowest bit) and returns the bits
/// with the low half cleared, which read as f32 are the rounded values.
#[inline(always)]
unsafe fn round_bits(v: core::arch::x86_64::__m512) -> core::arch::x86_64::__m512i {
    use core::arch::x86_64::*;
    let b = _mm512_castps_si512(v);
    let lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
    let r = _mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7fff)), lsb);
    _mm512_and_si512(r, _mm512_set1_epi32(-65536))
}

/// Eight bytes at `p` as their sixteen values `codes[c] * s`, in the
/// weight's element order (high nibble first).
#[inline(always)]
unsafe fn values(
    p: *const u8,
    lut: core::arch::x86_64::__m512,
    scale: core::arch::x86_64::__m512,
) -> core::arch::x86_64::__m512 {
    use core::arch::x86_64::*;
    let low = _mm_set1_epi8(0x0f);
    let raw = _mm_loadl_epi64(p.cast());
    let hi = _mm_and_si128(_mm_srli_epi16(raw, 4), low);
    let lo = _mm_and_si128(raw, low);
    // hi0 lo0 hi1 lo1 ...: the element order of the flattened weight.
    let idx = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(hi, lo));
    _mm512_mul_ps(_mm512_permutexvar_ps(idx, lut), scale)
}

/// `len` bytes (a multiple of 8) expanded to `2 * len` values, each
/// `codes[c] * s`, rounded to bf16 when `round_bf16`.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn span_f32(
    bytes: *const u8,
    len: usize,
    codes: &[f32; 16],
    (s, round_bf16): (f32, bool),
    out: *mut f32,
) {
    use core::arch::x86_64::*;
    let lut = _mm512_loadu_ps(codes.as_ptr());
    let scale = _mm512_set1_ps(s);
    for i in (0..len).step_by(8) {
        let mut v = values(bytes.add(i), lut, scale);
        if round_bf16 {
            v = _mm512_castsi512_ps(round_bits(v));
        }
        _mm512_storeu_ps(out.add(2 * i), v);
    }
}

/// [`super::dot_4bit`]'s products, `m` input rows four, two or one at a
/// time.
#[target_feature(enable = "avx512f")]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn dot_4bit(
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

/// [`dot_4bit`] for input rows `j0..j0 + MT`; returns `MT`.
///
/// # Safety
/// As [`dot_4bit`], with `j0 + MT <= m`.
#[inline(always)]
unsafe fn dot_rows<const MT: usize>(
    (codes, scales, lut, (x_even, x_odd), (rows, m, inp, blocksize), j0, round_bf16, yt): DotArgs,
) -> usize {
    use core::arch::x86_64::*;
    let lut = _mm512_loadu_ps(lut.as_ptr());
    let low = _mm512_set1_epi32(15);
    let half = inp / 2;
    let blocks = inp / blocksize;
    let round = |v: __m512| -> __m512 { _mm512_castsi512_ps(round_bits(v)) };
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

/// `len` bytes (a multiple of 8) as `len` pairs of bf16 values, the even
/// element in the low half.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn span_pairs(
    bytes: *const u8,
    len: usize,
    codes: &[f32; 16],
    s: f32,
    out: *mut u32,
) {
    use core::arch::x86_64::*;
    let lut = _mm512_loadu_ps(codes.as_ptr());
    let scale = _mm512_set1_ps(s);
    for i in (0..len).step_by(8) {
        let v = values(bytes.add(i), lut, scale);
        // The upper halves narrowed to 16 bits: lanes 2i and 2i + 1 make pair i.
        let r = _mm512_srli_epi32(round_bits(v), 16);
        _mm256_storeu_si256(out.add(i).cast(), _mm512_cvtepi32_epi16(r));
    }
}

/// `len` (a multiple of 16) values of two rows rounded to bf16 and paired.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn pair_rows(lo: *const f32, hi: *const f32, len: usize, out: *mut u32) {
    use core::arch::x86_64::*;
    for i in (0..len).step_by(16) {
        let l = round_bits(_mm512_loadu_ps(lo.add(i)));
        let h = round_bits(_mm512_loadu_ps(hi.add(i)));
        let p = _mm512_or_si512(_mm512_srli_epi32(l, 16), h);
        _mm512_storeu_si512(out.add(i).cast(), p);
    }
}
