//! The tiled products against the weight dequantized whole and multiplied
//! in f64, for every kind of weight and both forms of the forward.

use accel_bigmodel::quant::{
    quantize_int8_weight, NestedAbsmax, Packed4bit, QuantType, NESTED_BLOCKSIZE,
};
use candle_core::DType;

use super::*;

/// Every instruction set of the 4-bit kernels this CPU has.
fn each_simd() -> impl Iterator<Item = Simd> {
    [Simd::Avx512, Simd::Avx2, Simd::Scalar]
        .into_iter()
        .filter(|s| s.available())
}

fn data(n: usize, seed: u32) -> Vec<f32> {
    (0..n)
        .map(|i| {
            ((i as u32).wrapping_mul(2654435761).wrapping_add(seed) % 2001) as f32 / 1000.0 - 1.0
        })
        .collect()
}

/// Owned parts of a quantized weight, and a view of them.
#[derive(Clone)]
enum Owned {
    Four(Packed4bit, Store),
    Eight(Vec<u8>, Vec<f32>),
}

impl Owned {
    fn four(out: usize, inp: usize, qt: QuantType, dq: bool, store: DType) -> Self {
        let w = data(out * inp, 7);
        Self::Four(
            Packed4bit::quantize(&w, &[out, inp], store, qt, dq),
            Store::of(store),
        )
    }

    fn eight(out: usize, inp: usize) -> Self {
        let q = quantize_int8_weight(&data(out * inp, 9), inp);
        Self::Eight(q.codes.iter().map(|&c| c as u8).collect(), q.row_max)
    }

    fn view(&self) -> QuantRef<'_> {
        self.view_with(Simd::best())
    }

    fn view_with(&self, simd: Simd) -> QuantRef<'_> {
        match self {
            Self::Four(p, store) => QuantRef::FourBit {
                packed: &p.packed,
                scales: match &p.nested {
                    None => Scales::F32(&p.absmax),
                    Some(NestedAbsmax {
                        codes,
                        absmax,
                        offset,
                    }) => Scales::Nested {
                        codes,
                        nested: absmax,
                        offset: *offset,
                    },
                },
                codes: p.state.quant_type.codes(),
                blocksize: p.state.blocksize,
                store: *store,
                compute: Store::F32,
                simd,
                out: p.state.shape[0],
                inp: p.state.shape[1],
            },
            Self::Eight(codes, row_max) => QuantRef::EightBit {
                codes,
                row_max,
                compute: Store::F32,
                out: row_max.len(),
                inp: codes.len() / row_max.len().max(1),
            },
        }
    }

    /// bitsandbytes' own dequantization (accel-bigmodel's, checked against
    /// its fixtures), rounded to the store dtype.
    fn reference(&self) -> Vec<f32> {
        match self {
            Self::Four(p, store) => p.dequantize().into_iter().map(|v| store.round(v)).collect(),
            Self::Eight(codes, row_max) => {
                let inp = codes.len() / row_max.len();
                let codes: Vec<i8> = codes.iter().map(|&c| c as i8).collect();
                accel_bigmodel::quant::int8_dequant(&codes, row_max, inp)
            }
        }
    }
}

fn weights() -> Vec<(String, Owned)> {
    let mut all = vec![];
    // Rows past a tile; columns past a tile and not a multiple of the block
    // size (blocks then straddle rows); an odd element count.
    for (out, inp) in [(70, 600), (9, 33), (130, 128), (3, 7)] {
        for qt in [QuantType::Nf4, QuantType::Fp4] {
            for dq in [false, true] {
                all.push((
                    format!("{out}x{inp} {} dq={dq}", qt.name()),
                    Owned::four(out, inp, qt, dq, DType::F32),
                ));
            }
        }
        all.push((
            format!("{out}x{inp} nf4 bf16"),
            Owned::four(out, inp, QuantType::Nf4, true, DType::BF16),
        ));
        all.push((format!("{out}x{inp} int8"), Owned::eight(out, inp)));
    }
    all
}

#[test]
fn tiles_dequantize_exactly_as_bitsandbytes() {
    for ((name, w), simd) in weights()
        .into_iter()
        .flat_map(|w| each_simd().map(move |s| (w.clone(), s)))
    {
        let name = format!("{name} {simd:?}");
        let v = w.view_with(simd);
        v.check().unwrap();
        let got = dequantize(&v);
        let want = w.reference();
        assert_eq!(got.len(), want.len(), "{name}");
        for (i, (a, b)) in got.iter().zip(&want).enumerate() {
            assert!(a == b, "{name}: element {i}: {a} vs {b}");
        }
        // A tile at an odd offset inside the weight.
        let (out, inp) = v.dims();
        if out > 2 && inp > 3 {
            let (r0, rows, k0, kc) = (1, out - 2, 3, inp - 3);
            let mut t = vec![0f32; rows * kc];
            dequant::tile(&v, (r0, rows), (k0, kc), &mut t, kc);
            for r in 0..rows {
                for c in 0..kc {
                    assert!(
                        t[r * kc + c] == want[(r0 + r) * inp + k0 + c],
                        "{name} tile"
                    );
                }
            }
        }
    }
}

#[test]
fn nested_scales_are_the_maxima_bitsandbytes_dequantizes() {
    let absmax = data(700, 3).into_iter().map(f32::abs).collect::<Vec<_>>();
    let n = NestedAbsmax::quantize(&absmax);
    assert_eq!(n.absmax.len(), 700usize.div_ceil(NESTED_BLOCKSIZE));
    let s = Scales::Nested {
        codes: &n.codes,
        nested: &n.absmax,
        offset: n.offset,
    };
    let want = n.dequantize();
    for (b, w) in want.iter().enumerate() {
        assert_eq!(dequant::scale(&s, b).to_bits(), w.to_bits(), "block {b}");
    }
}

/// `x W^T` and `dy W` for few rows (the skinny form) and many (tiles),
/// against f64 products on the dequantized weight.
#[test]
fn products_match_the_dequantized_weight() {
    for ((name, w), simd) in weights()
        .into_iter()
        .flat_map(|w| each_simd().map(move |s| (w.clone(), s)))
    {
        let name = format!("{name} {simd:?}");
        let v = w.view_with(simd);
        let (out, inp) = v.dims();
        let dense = w.reference();
        // Decoding straight off the codes, slabs for the skinny kernels, and
        // (past their rows) tiles for gemm.
        for n in [1, 5, SKINNY_ROWS + 3, 70, 300] {
            let x = data(n * inp, 11);
            let y = forward(&x, n, &v);
            let dy = data(n * out, 13);
            let dx = backward_input(&dy, n, &v);
            for i in 0..n {
                for o in 0..out {
                    let want: f64 = (0..inp)
                        .map(|k| f64::from(x[i * inp + k]) * f64::from(dense[o * inp + k]))
                        .sum();
                    let got = y[i * out + o];
                    assert!(
                        (f64::from(got) - want).abs() <= 1e-5 * (inp as f64).sqrt().max(1.0),
                        "{name}, {n} rows: y[{i}, {o}] = {got}, want {want}"
                    );
                }
                for k in 0..inp {
                    let want: f64 = (0..out)
                        .map(|o| f64::from(dy[i * out + o]) * f64::from(dense[o * inp + k]))
                        .sum();
                    let got = dx[i * inp + k];
                    assert!(
                        (f64::from(got) - want).abs() <= 1e-5 * (out as f64).sqrt().max(1.0),
                        "{name}, {n} rows: dx[{i}, {k}] = {got}, want {want}"
                    );
                }
            }
        }
    }
}

#[test]
fn results_have_the_same_bits_for_any_thread_count() {
    let w = Owned::four(200, 1100, QuantType::Nf4, true, DType::F32);
    let v = w.view();
    let (n, (out, inp)) = (40, v.dims());
    let (x, dy) = (data(n * inp, 1), data(n * out, 2));
    let run = || {
        (
            forward(&x, n, &v),
            backward_input(&dy, n, &v),
            forward(&x[..3 * inp], 3, &v),
        )
    };
    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    let one = par::with_threads(1, run);
    for threads in [2, 3] {
        let many = par::with_threads(threads, run);
        assert_eq!(bits(&one.0), bits(&many.0), "forward, {threads} threads");
        assert_eq!(bits(&one.1), bits(&many.1), "backward, {threads} threads");
        assert_eq!(bits(&one.2), bits(&many.2), "skinny, {threads} threads");
    }
}

#[test]
fn a_truncated_weight_is_refused_before_any_read() {
    let w = Owned::four(8, 64, QuantType::Nf4, false, DType::F32);
    let QuantRef::FourBit {
        packed,
        scales,
        codes,
        ..
    } = w.view()
    else {
        unreachable!()
    };
    let short = QuantRef::FourBit {
        packed: &packed[..100],
        scales,
        codes,
        blocksize: 64,
        store: Store::F32,
        compute: Store::F32,
        simd: Simd::Scalar,
        out: 8,
        inp: 64,
    };
    assert!(short.check().unwrap_err().contains("100 packed bytes"));
}

/// bf16 products: the weight and the input rounded to bf16, summed in f32,
/// against f64 products on the same rounded values; thread-count free.
#[test]
fn bf16_products_multiply_the_bf16_rounded_weight() {
    if !bf16_products::available() {
        return; // the op keeps to the f32 products on this CPU (tested above)
    }
    let round = |v: f32| half::bf16::from_f32(v).to_f32();
    for (name, w) in weights() {
        let v = w.view();
        let (out, inp) = v.dims();
        let dense: Vec<f32> = w.reference().into_iter().map(round).collect();
        let n = 37;
        let x: Vec<f32> = data(n * inp, 21).into_iter().map(round).collect();
        let dy: Vec<f32> = data(n * out, 22).into_iter().map(round).collect();
        let (y, dx) = (
            bf16_products::forward(&x, n, &v),
            bf16_products::backward_input(&dy, n, &v),
        );
        let tol = |k: usize| 1e-5 * (k as f64).sqrt().max(1.0) * 4.0;
        for i in 0..n {
            for o in 0..out {
                let want: f64 = (0..inp)
                    .map(|k| f64::from(x[i * inp + k]) * f64::from(dense[o * inp + k]))
                    .sum();
                let got = f64::from(y[i * out + o]);
                assert!(
                    (got - want).abs() <= tol(inp),
                    "{name}: y[{i}, {o}] {got} vs {want}"
                );
            }
            for k in 0..inp {
                let want: f64 = (0..out)
                    .map(|o| f64::from(dy[i * out + o]) * f64::from(dense[o * inp + k]))
                    .sum();
                let got = f64::from(dx[i * inp + k]);
                assert!(
                    (got - want).abs() <= tol(out),
                    "{name}: dx[{i}, {k}] {got} vs {want}"
                );
            }
        }
    }
    let w = Owned::four(200, 1100, QuantType::Nf4, true, DType::F32);
    let v = w.view();
    let x = data(40 * 1100, 5);
    let run = || bf16_products::forward(&x, 40, &v);
    let bits = |v: Vec<f32>| v.into_iter().map(f32::to_bits).collect::<Vec<_>>();
    assert_eq!(
        bits(par::with_threads(1, run)),
        bits(par::with_threads(3, run))
    );
}

/// Decoding straight off the codes with a bf16 compute dtype multiplies the
/// weight rounded to bf16, as the tiles do.
#[test]
fn fused_decoding_rounds_the_weight_to_the_compute_dtype() {
    let round = |v: f32| half::bf16::from_f32(v).to_f32();
    for (store, simd) in [DType::F32, DType::BF16]
        .into_iter()
        .flat_map(|d| each_simd().map(move |s| (d, s)))
    {
        let w = Owned::four(130, 256, QuantType::Nf4, true, store);
        let QuantRef::FourBit {
            packed,
            scales,
            codes,
            blocksize,
            store,
            out,
            inp,
            ..
        } = w.view()
        else {
            unreachable!()
        };
        let v = QuantRef::FourBit {
            packed,
            scales,
            codes,
            blocksize,
            store,
            compute: Store::Bf16,
            simd,
            out,
            inp,
        };
        let dense: Vec<f32> = w.reference().into_iter().map(round).collect();
        // The tiles the larger products multiply: the same rounded values, bit for bit.
        let tiles = dequantize(&v);
        for (i, (a, b)) in tiles.iter().zip(&dense).enumerate() {
            assert_eq!(a.to_bits(), b.to_bits(), "{store:?} {simd:?} element {i}");
        }
        for n in [1, 3] {
            let x = data(n * inp, 31);
            let y = forward(&x, n, &v);
            for i in 0..n {
                for o in 0..out {
                    let want: f64 = (0..inp)
                        .map(|k| f64::from(x[i * inp + k]) * f64::from(dense[o * inp + k]))
                        .sum();
                    let got = f64::from(y[i * out + o]);
                    assert!(
                        (got - want).abs() <= 1e-4,
                        "{store:?} {simd:?} {n}: {got} vs {want}"
                    );
                }
            }
        }
    }
}
