//! Each vector form against the scalar definition, on every instruction set
//! this CPU has (an AVX-512 machine checks the AVX2 kernels too).

use super::*;

fn each_simd() -> impl Iterator<Item = Simd> {
    [Simd::Avx512, Simd::Avx2, Simd::Scalar]
        .into_iter()
        .filter(|s| s.available())
}

fn bf16(v: f32) -> u32 {
    u32::from(half::bf16::from_f32(v).to_bits())
}

#[test]
fn pairs_are_the_values_rounded_to_bf16_and_paired() {
    let codes: [f32; 16] = std::array::from_fn(|i| i as f32 * 0.3137 - 2.0);
    let bytes: Vec<u8> = (0..=255u8).chain(0..5).collect();
    for simd in each_simd() {
        let mut out = vec![0u32; bytes.len()];
        span_pairs(simd, &bytes, &codes, 0.731, &mut out);
        for (i, &b) in bytes.iter().enumerate() {
            let want = bf16(codes[(b >> 4) as usize] * 0.731)
                | (bf16(codes[(b & 15) as usize] * 0.731) << 16);
            assert_eq!(out[i], want, "{simd:?} byte {i}");
        }
    }
}

#[test]
fn paired_rows_are_their_values_rounded_to_bf16() {
    let lo: Vec<f32> = (0..37).map(|i| i as f32 * 0.0137 - 0.2).collect();
    let hi: Vec<f32> = (0..37).map(|i| i as f32 * -0.0291 + 1.1).collect();
    for simd in each_simd() {
        let mut out = vec![0u32; 37];
        pair_rows(simd, &lo, &hi, &mut out);
        for j in 0..37 {
            assert_eq!(out[j], bf16(lo[j]) | (bf16(hi[j]) << 16), "{simd:?} {j}");
        }
    }
}

#[test]
fn every_code_pair_expands_as_the_scalar_loop_does() {
    // Values that are ties in bf16 (the low half 0x8000) round to even.
    let mut codes: [f32; 16] = std::array::from_fn(|i| i as f32 * 0.25 - 2.0);
    codes[3] = f32::from_bits(0x3f80_8000);
    codes[12] = f32::from_bits(0x3f81_8000);
    let bytes: Vec<u8> = (0..=255u8).chain(0..7).collect();
    for simd in each_simd() {
        for round_bf16 in [false, true] {
            let mut out = vec![0f32; 2 * bytes.len()];
            span_f32(simd, &bytes, &codes, (1.5, round_bf16), &mut out);
            let want = |c: u8| {
                let v = codes[c as usize] * 1.5;
                if round_bf16 {
                    half::bf16::from_f32(v).to_f32()
                } else {
                    v
                }
            };
            for (i, &b) in bytes.iter().enumerate() {
                let what = format!("{simd:?} round {round_bf16} byte {i}");
                assert_eq!(out[2 * i].to_bits(), want(b >> 4).to_bits(), "{what} high");
                assert_eq!(
                    out[2 * i + 1].to_bits(),
                    want(b & 15).to_bits(),
                    "{what} low"
                );
            }
        }
    }
}

#[test]
fn products_off_the_codes_equal_the_sums_of_the_values() {
    let codes: [f32; 16] = std::array::from_fn(|i| (i as f32 - 7.5) * 0.131);
    let (rows, inp, blocksize) = (5, 192, 64);
    let half = inp / 2;
    let packed: Vec<u8> = (0..rows * half).map(|i| (i * 37 % 251) as u8).collect();
    let scales: Vec<f32> = (0..rows * inp / blocksize)
        .map(|b| 0.5 + b as f32 * 0.07)
        .collect();
    for simd in each_simd().filter(|&s| dot_available(s)) {
        // One, two, three and five input rows: every unrolled count.
        for m in [1, 2, 3, 5] {
            let x: Vec<f32> = (0..m * inp).map(|i| (i % 29) as f32 * 0.1 - 1.3).collect();
            let even: Vec<f32> = x.iter().step_by(2).copied().collect();
            let odd: Vec<f32> = x.iter().skip(1).step_by(2).copied().collect();
            for round_bf16 in [false, true] {
                let mut yt = vec![0f32; rows * m];
                let shape = (rows, m, inp, blocksize);
                dot_4bit(
                    simd,
                    &packed,
                    &scales,
                    &codes,
                    (&even, &odd),
                    shape,
                    round_bf16,
                    &mut yt,
                );
                for r in 0..rows {
                    for j in 0..m {
                        let mut want = 0f64;
                        for k in 0..inp {
                            let byte = packed[r * half + k / 2];
                            let c = if k % 2 == 0 { byte >> 4 } else { byte & 15 };
                            let mut v =
                                codes[c as usize] * scales[r * inp / blocksize + k / blocksize];
                            if round_bf16 {
                                v = half::bf16::from_f32(v).to_f32();
                            }
                            want += v as f64 * x[j * inp + k] as f64;
                        }
                        let got = yt[r * m + j] as f64;
                        assert!(
                            (got - want).abs() <= 1e-4 * (1.0 + want.abs()),
                            "{simd:?} m {m} round {round_bf16} row {r} input {j}: {got} vs {want}"
                        );
                    }
                }
            }
        }
    }
}
