//! The AMX gemm against a reference in every layout, shape and thread count.

use super::*;

fn values(len: usize, seed: u32) -> Vec<f32> {
    (0..len)
        .map(|i| {
            let v = ((i as u32).wrapping_mul(2654435761).wrapping_add(seed) % 2000) as f32;
            bf16::from_f32(v / 1000.0 - 1.0).to_f32()
        })
        .collect()
}

/// The f64 product of the operands as bf16 values.
fn reference(m: usize, n: usize, k: usize, a: &HalfRef, b: &HalfRef) -> Vec<f64> {
    let f = |bits: u16| f64::from(bf16::from_bits(bits).to_f32());
    let mut c = vec![0f64; m * n];
    for i in 0..m {
        for j in 0..n {
            c[i * n + j] = (0..k).map(|kk| f(a.bits(i, kk)) * f(b.bits(kk, j))).sum();
        }
    }
    c
}

#[test]
fn products_match_a_reference_in_every_layout_and_shape() {
    if !available() {
        eprintln!("skipped: no AMX on this CPU or OS");
        return;
    }
    // Ragged rows, columns and k; row- and column-split (m < n) calls;
    // in-place bf16 rows and packed f32 or transposed operands.
    for (m, n, k) in [
        (1, 1, 1),
        (32, 32, 32),
        (70, 33, 96),
        (33, 100, 50),
        (64, 40, 33),
    ] {
        let (x, y) = (values(m * k, 1), values(k * n, 2));
        let (xb, yb): (Vec<bf16>, Vec<bf16>) = (
            x.iter().map(|&v| bf16::from_f32(v)).collect(),
            y.iter().map(|&v| bf16::from_f32(v)).collect(),
        );
        let xt: Vec<f32> = (0..k * m).map(|t| x[(t % m) * k + t / m]).collect();
        let yt: Vec<f32> = (0..n * k).map(|t| y[(t % k) * n + t / k]).collect();
        let lhs = [
            HalfRef::new(Values::Bf16(&xb), 0, (k, 1)),
            HalfRef::new(Values::F32(&x), 0, (k, 1)),
            HalfRef::new(Values::F32(&xt), 0, (1, m)),
        ];
        let rhs = [
            HalfRef::new(Values::Bf16(&yb), 0, (n, 1)),
            HalfRef::new(Values::F32(&yt), 0, (1, k)),
        ];
        let want = reference(m, n, k, &lhs[0], &rhs[0]);
        for a in &lhs {
            for b in &rhs {
                // Row-major with a padded row, and column-major.
                for (out, len) in [
                    (
                        OutLayout {
                            off: 1,
                            rs: n + 2,
                            cs: 1,
                        },
                        1 + m * (n + 2),
                    ),
                    (
                        OutLayout {
                            off: 0,
                            rs: 1,
                            cs: m,
                        },
                        m * n,
                    ),
                ] {
                    let mut c = vec![1f32; len];
                    gemm((m, n, k), *a, *b, &mut c, out, true);
                    for i in 0..m {
                        for j in 0..n {
                            let got = f64::from(c[out.off + i * out.rs + j * out.cs]);
                            let w = want[i * n + j] + 1.0;
                            assert!(
                                (got - w).abs() <= 1e-5 * w.abs().max(1.0),
                                "{m} {n} {k} ({i}, {j}): {got} vs {w}"
                            );
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn a_thread_count_does_not_change_a_single_bit() {
    if !available() {
        eprintln!("skipped: no AMX on this CPU or OS");
        return;
    }
    // Row-split, and column-split with `b` streamed (blocks of `k` that
    // differ with the thread count), adding to ragged output blocks.
    for (m, n, k) in [(96, 200, 320), (40, 2050, 600)] {
        let (x, y) = (values(m * k, 3), values(k * n, 4));
        let run = |threads| {
            par::with_threads(threads, || {
                let mut c = values(m * n, 5);
                let out = OutLayout {
                    off: 0,
                    rs: n,
                    cs: 1,
                };
                let (a, b) = (
                    HalfRef::new(Values::F32(&x), 0, (k, 1)),
                    HalfRef::new(Values::F32(&y), 0, (n, 1)),
                );
                gemm((m, n, k), a, b, &mut c, out, true);
                c
            })
        };
        assert!(run(1) == run(2), "{m} {n} {k}");
    }
}

#[test]
#[should_panic(expected = "neither row- nor column-major")]
fn an_output_whose_slots_could_overlap_is_refused() {
    // The layout is checked before the CPU, so this runs anywhere.
    let x = [0f32; 4];
    let mut c = [0f32; 4];
    let a = HalfRef::new(Values::F32(&x), 0, (2, 1));
    gemm(
        (2, 2, 2),
        a,
        a,
        &mut c,
        OutLayout {
            off: 0,
            rs: 1,
            cs: 1,
        },
        false,
    );
}
