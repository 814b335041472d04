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

#[cfg(test)]
mod tests {
    use super::*;

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
