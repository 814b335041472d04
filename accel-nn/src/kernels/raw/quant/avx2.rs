//! The 4-bit kernels in AVX2 (with FMA), for the CPUs without AVX-512
//! (AMD before Zen 4, Intel client cores): eight values per step, the
//! sixteen code values in two registers, each half looked up with one
//! permute and the right one chosen by bit 3 of the code. The safe entry
//! points, with the checks that make these calls sound, are in `mod.rs`.

use core::arch::x86_64::*;

use super::DotArgs;

/// `codes[idx]` for eight 4-bit indices: `lo` holds codes 0-7, `hi` 8-15.
#[inline(always)]
unsafe fn lookup(idx: __m256i, (lo, hi): (__m256, __m256)) -> __m256 {
    let a = _mm256_permutevar8x32_ps(lo, idx);
    let b = _mm256_permutevar8x32_ps(hi, idx);
    // Bit 3 moved to the sign bit, which is what blendv reads.
    _mm256_blendv_ps(a, b, _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28)))
}

/// The code book as the two registers [`lookup`] takes.
#[inline(always)]
unsafe fn table(codes: &[f32; 16]) -> (__m256, __m256) {
    (
        _mm256_loadu_ps(codes.as_ptr()),
        _mm256_loadu_ps(codes.as_ptr().add(8)),
    )
}

/// Eight f32 values rounded to bf16 (to nearest even, as `half` does for
/// finite values), as bits with the low half cleared.
#[inline(always)]
unsafe fn round_bits(v: __m256) -> __m256i {
    let b = _mm256_castps_si256(v);
    let lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
    let r = _mm256_add_epi32(_mm256_add_epi32(b, _mm256_set1_epi32(0x7fff)), lsb);
    _mm256_and_si256(r, _mm256_set1_epi32(-65536))
}

/// Eight bytes at `p` as sixteen indices in the weight's element order
/// (high nibble first), in two registers of eight.
#[inline(always)]
unsafe fn indices(p: *const u8) -> (__m256i, __m256i) {
    let low = _mm_set1_epi8(0x0f);
    let raw = _mm_loadl_epi64(p.cast());
    let hi = _mm_and_si128(_mm_srli_epi16(raw, 4), low);
    let lo = _mm_and_si128(raw, low);
    let both = _mm_unpacklo_epi8(hi, lo);
    (
        _mm256_cvtepu8_epi32(both),
        _mm256_cvtepu8_epi32(_mm_srli_si128(both, 8)),
    )
}

/// `len` bytes (a multiple of 8) expanded to `2 * len` values, each
/// `codes[c] * s`, rounded to bf16 when `round_bf16`.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn span_f32(
    bytes: *const u8,
    len: usize,
    codes: &[f32; 16],
    (s, round_bf16): (f32, bool),
    out: *mut f32,
) {
    let lut = table(codes);
    let scale = _mm256_set1_ps(s);
    for i in (0..len).step_by(8) {
        let (a, b) = indices(bytes.add(i));
        let mut va = _mm256_mul_ps(lookup(a, lut), scale);
        let mut vb = _mm256_mul_ps(lookup(b, lut), scale);
        if round_bf16 {
            va = _mm256_castsi256_ps(round_bits(va));
            vb = _mm256_castsi256_ps(round_bits(vb));
        }
        _mm256_storeu_ps(out.add(2 * i), va);
        _mm256_storeu_ps(out.add(2 * i + 8), vb);
    }
}

/// Sixteen rounded values (as [`round_bits`] gives them, in two registers)
/// narrowed to their upper halves in order: eight pairs.
#[inline(always)]
unsafe fn narrow(a: __m256i, b: __m256i) -> __m256i {
    let packed = _mm256_packus_epi32(_mm256_srli_epi32(a, 16), _mm256_srli_epi32(b, 16));
    // packus interleaves the 128-bit lanes (a0-3 b0-3 a4-7 b4-7): reorder.
    _mm256_permute4x64_epi64(packed, 0b11_01_10_00)
}

/// `len` bytes (a multiple of 8) as `len` pairs of bf16 values, the even
/// element in the low half.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn span_pairs(
    bytes: *const u8,
    len: usize,
    codes: &[f32; 16],
    s: f32,
    out: *mut u32,
) {
    let lut = table(codes);
    let scale = _mm256_set1_ps(s);
    for i in (0..len).step_by(8) {
        let (a, b) = indices(bytes.add(i));
        let va = round_bits(_mm256_mul_ps(lookup(a, lut), scale));
        let vb = round_bits(_mm256_mul_ps(lookup(b, lut), scale));
        _mm256_storeu_si256(out.add(i).cast(), narrow(va, vb));
    }
}

/// `len` (a multiple of 8) values of two rows rounded to bf16 and paired.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn pair_rows(lo: *const f32, hi: *const f32, len: usize, out: *mut u32) {
    for i in (0..len).step_by(8) {
        let l = round_bits(_mm256_loadu_ps(lo.add(i)));
        let h = round_bits(_mm256_loadu_ps(hi.add(i)));
        let p = _mm256_or_si256(_mm256_srli_epi32(l, 16), h);
        _mm256_storeu_si256(out.add(i).cast(), p);
    }
}

/// [`super::dot_4bit`]'s products, `m` input rows two or one at a time
/// (sixteen registers hold two rows' four accumulators, the code book and
/// the temporaries).
#[target_feature(enable = "avx2,fma")]
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
    let mut j0 = 0;
    while j0 < m {
        let shape = (rows, m, inp, blocksize);
        let args = (codes, scales, lut, x, shape, j0, round_bf16, yt);
        j0 += match m - j0 {
            1 => dot_rows::<1>(args),
            _ => dot_rows::<2>(args),
        };
    }
}

/// The sum of eight lanes.
#[inline(always)]
unsafe fn reduce(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)))
}

/// [`dot_4bit`] for input rows `j0..j0 + MT`; returns `MT`.
///
/// # Safety
/// As [`dot_4bit`], with `j0 + MT <= m`.
#[inline(always)]
unsafe fn dot_rows<const MT: usize>(
    (codes, scales, lut, (x_even, x_odd), (rows, m, inp, blocksize), j0, round_bf16, yt): DotArgs,
) -> usize {
    let lut = table(lut);
    let low = _mm256_set1_epi32(15);
    let half = inp / 2;
    let blocks = inp / blocksize;
    let xe: [*const f32; MT] = core::array::from_fn(|j| x_even.add((j0 + j) * half));
    let xo: [*const f32; MT] = core::array::from_fn(|j| x_odd.add((j0 + j) * half));
    for r in 0..rows {
        let row = codes.add(r * half);
        let mut total = [_mm256_setzero_ps(); MT];
        for b in 0..blocks {
            let s = _mm256_set1_ps(*scales.add(r * blocks + b));
            // Even and odd elements of two 8-byte steps: four FMA chains a row.
            let mut acc = [[_mm256_setzero_ps(); 4]; MT];
            let (q0, q1) = (b * blocksize / 2, (b + 1) * blocksize / 2);
            // A block of 32 or more values is a multiple of 16 bytes.
            for q in (q0..q1).step_by(16) {
                for (slot, step) in [(0, 0), (2, 8)] {
                    let idx = _mm256_cvtepu8_epi32(_mm_loadl_epi64(row.add(q + step).cast()));
                    let mut hi = lookup(_mm256_srli_epi32(idx, 4), lut);
                    let mut lo = lookup(_mm256_and_si256(idx, low), lut);
                    if round_bf16 {
                        hi = _mm256_castsi256_ps(round_bits(_mm256_mul_ps(hi, s)));
                        lo = _mm256_castsi256_ps(round_bits(_mm256_mul_ps(lo, s)));
                    }
                    for j in 0..MT {
                        let e = _mm256_loadu_ps(xe[j].add(q + step));
                        let o = _mm256_loadu_ps(xo[j].add(q + step));
                        acc[j][slot] = _mm256_fmadd_ps(hi, e, acc[j][slot]);
                        acc[j][slot + 1] = _mm256_fmadd_ps(lo, o, acc[j][slot + 1]);
                    }
                }
            }
            for j in 0..MT {
                let a = &acc[j];
                let sum = _mm256_add_ps(_mm256_add_ps(a[0], a[1]), _mm256_add_ps(a[2], a[3]));
                total[j] = if round_bf16 {
                    // Already scaled values: the block's sum adds in.
                    _mm256_add_ps(total[j], sum)
                } else {
                    _mm256_fmadd_ps(sum, s, total[j])
                };
            }
        }
        for (j, t) in total.iter().enumerate() {
            *yt.add(r * m + j0 + j) = reduce(*t);
        }
    }
    MT
}
