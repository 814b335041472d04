//! Tests of [`super`]: the bf16 products against the f32 gemm.

use super::*;
use crate::kernels::raw::gemm_new;

fn data(n: usize, seed: u32) -> Vec<f32> {
    (0..n)
        .map(|i| {
            let v = ((i as u32).wrapping_mul(2654435761).wrapping_add(seed) % 2000) as f32;
            half::bf16::from_f32(v / 1000.0 - 1.0).to_f32()
        })
        .collect()
}

#[test]
fn rounding_is_to_nearest_even_like_half() {
    // Ties: 1 + 2^-8 rounds down to 1.0 (even), 1 + 3 * 2^-8 up.
    let ties = [f32::from_bits(0x3f80_8000), f32::from_bits(0x3f81_8000)];
    assert_eq!((bf16_bits(ties[0]), bf16_bits(ties[1])), (0x3f80, 0x3f82));
    for x in [
        1.0f32,
        -2.5,
        ties[0],
        ties[1],
        3.0e38,
        1e-40,
        f32::INFINITY,
        -0.0,
    ] {
        let want = half::bf16::from_f32(x).to_bits();
        assert_eq!(bf16_bits(x), want, "{x}");
    }
    assert!(half::bf16::from_bits(bf16_bits(f32::NAN)).is_nan());
}

#[test]
fn products_match_the_f32_gemm_on_bf16_values_in_every_layout() {
    if !available() {
        // Nothing to multiply here; the ops must then keep to the f32
        // gemm (their own tests check the results).
        assert!(!bf16_products(DType::BF16, DType::BF16));
        return;
    }
    // Ragged shapes: rows past a task and a tile, columns past a panel,
    // k odd and past a block.
    for (m, n, k) in [
        (1, 1, 1),
        (15, 33, 7),
        (57, 65, 513),
        (100, 40, 1030),
        (3, 300, 2),
    ] {
        let (x, y) = (data(m * k, 1), data(k * n, 2));
        // a row-major or transposed, b row-major or transposed.
        let xt: Vec<f32> = (0..k * m).map(|t| x[(t % m) * k + t / m]).collect();
        let yt: Vec<f32> = (0..n * k).map(|t| y[(t % k) * n + t / k]).collect();
        let want = gemm_new(
            (m, n, k),
            MatRef::rows(&x, 0, k),
            MatRef::rows(&y, 0, n),
            true,
        );
        for (a, b) in [
            (MatRef::rows(&x, 0, k), MatRef::rows(&y, 0, n)),
            (MatRef::rows_t(&xt, 0, m), MatRef::rows_t(&yt, 0, k)),
        ] {
            let mut outs = vec![gemm_new_bf16((m, n, k), a, b)];
            if bf16_tile_available() {
                // The AVX-512 kernel also where AMX takes the products.
                outs.push(avx512_new((m, n, k), a, b));
            }
            for (g, w) in outs.iter().flatten().zip(want.iter().cycle()) {
                // Exact products, f32 sums in another order.
                assert!(
                    (g - w).abs() <= 1e-5 * (k as f32).sqrt() * w.abs().max(1.0),
                    "{m} {n} {k}: {g} vs {w}"
                );
            }
        }
    }
}
