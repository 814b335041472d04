//! `cast_tensors` / `cast_into` against candle's `to_dtype`, bit for bit.

use candle_core::{DType, Device, Tensor};
use half::{bf16, f16};

use super::{bits, randn, tf32, vals};
use crate::{cast_into, cast_tensors, Error};

const HALVES: [DType; 2] = [DType::BF16, DType::F16];

/// Every 16-bit pattern as a tensor of `dtype`.
fn all_patterns(dtype: DType) -> Tensor {
    let dev = Device::Cpu;
    match dtype {
        DType::BF16 => Tensor::from_vec(
            (0..=u16::MAX).map(bf16::from_bits).collect::<Vec<_>>(),
            65536,
            &dev,
        ),
        _ => Tensor::from_vec(
            (0..=u16::MAX).map(f16::from_bits).collect::<Vec<_>>(),
            65536,
            &dev,
        ),
    }
    .unwrap()
}

/// Asserts both entry points agree with `to_dtype` bit for bit.
fn check(src: &Tensor, dtype: DType) {
    let want = bits(&src.to_dtype(dtype).unwrap());
    let got = cast_tensors(std::slice::from_ref(src), dtype).unwrap();
    assert_eq!(got[0].dtype(), dtype);
    assert_eq!(got[0].dims(), src.dims());
    let dst = Tensor::zeros(src.shape(), dtype, &Device::Cpu).unwrap();
    cast_into(std::slice::from_ref(src), std::slice::from_ref(&dst)).unwrap();
    for (name, got) in [("cast_tensors", bits(&got[0])), ("cast_into", bits(&dst))] {
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(
                g,
                w,
                "{name} {:?}->{dtype:?} element {i}: got {g:#x}, want {w:#x}",
                src.dtype()
            );
        }
    }
}

#[test]
fn every_half_pattern_widens_like_to_dtype() {
    for h in HALVES {
        check(&all_patterns(h), DType::F32);
    }
}

#[test]
fn every_half_pattern_converts_to_the_other_half_like_to_dtype() {
    check(&all_patterns(DType::BF16), DType::F16);
    check(&all_patterns(DType::F16), DType::BF16);
}

/// f32 bit patterns chosen for the corners of both narrowings.
fn edge_f32() -> Vec<f32> {
    let from_bits: &[u32] = &[
        0x0000_0000,
        0x8000_0000, // ±0
        0x0000_0001,
        0x8000_0001,
        0x007F_FFFF,
        0x0080_0000, // f32 subnormals, min normal
        0x7F7F_FFFF,
        0xFF7F_FFFF,
        0x7F80_0000,
        0xFF80_0000, // ±max, ±inf
        0x7FC0_0000,
        0xFFC0_0000,
        0x7F80_0001,
        0xFF80_0001, // quiet / signalling NaN
        0x7FA0_0000,
        0x7F81_2345,
        0x7FFF_FFFF,
        0xFFC0_0001,
        0x7FC0_FFFF, // NaN payloads
        0x3F80_8000,
        0x3F81_8000,
        0x3F80_8001,
        0x3F80_7FFF, // bf16 ties and near-ties
        0xBF80_8000,
        0xBF81_8000,
        0x7F7F_8000,
        0x7F7F_7FFF, // negative ties, tie at max -> inf
        0x0000_8000,
        0x0001_8000,
        0x0040_8000, // ties among subnormals
        0x3F80_1000,
        0x3F80_3000,
        0x3F80_0FFF,
        0x3F80_1001, // f16 ties at 1 + 2^-11
    ];
    let mut v: Vec<f32> = from_bits.iter().map(|b| f32::from_bits(*b)).collect();
    v.extend([
        65504.0,
        65519.99,
        65520.0,
        65536.0,
        1e5,
        -1e5,
        -65520.0, // f16 max, overflow to inf
        6.103_515_6e-5,
        6.0e-5,
        5.960_464_5e-8,
        2.980_232_2e-8,
        4.470_348_4e-8,
        1.0e-8, // f16 subnormals
        1.0,
        -1.0,
        0.1,
        -0.1,
        3.0e38,
        1.0e-38,
        std::f32::consts::PI,
    ]);
    v
}

#[test]
fn edge_f32_values_narrow_like_to_dtype() {
    let v = edge_f32();
    for h in HALVES {
        check(&tf32(&v, &[v.len()]), h);
    }
}

#[test]
fn sampled_f32_bit_patterns_narrow_like_to_dtype() {
    // Every 4099th pattern plus low bits that exercise rounding: ~2M values
    // covering all exponents, both signs and NaN space.
    let v: Vec<f32> = (0..(1u64 << 32))
        .step_by(4099)
        .flat_map(|b| [b as u32, b as u32 ^ 0x8000, b as u32 | 0x1000])
        .map(f32::from_bits)
        .collect();
    let t = tf32(&v, &[v.len()]);
    for h in HALVES {
        check(&t, h);
    }
}

#[test]
fn large_mixed_lists_convert_in_one_pass() {
    let sizes = [200_000usize, 5, 0, 70_001, 1];
    let src: Vec<Tensor> = sizes
        .iter()
        .enumerate()
        .map(|(i, &n)| tf32(&randn(n, i as u64, 1e3), &[n]))
        .collect();
    for h in HALVES {
        let got = cast_tensors(&src, h).unwrap();
        let dst: Vec<Tensor> = sizes
            .iter()
            .map(|&n| Tensor::zeros(n, h, &Device::Cpu).unwrap())
            .collect();
        cast_into(&src, &dst).unwrap();
        for i in 0..src.len() {
            let want = bits(&src[i].to_dtype(h).unwrap());
            assert_eq!(bits(&got[i]), want, "cast_tensors tensor {i}");
            assert_eq!(bits(&dst[i]), want, "cast_into tensor {i}");
        }
        // And back up: exact widening.
        let up = cast_tensors(&got, DType::F32).unwrap();
        for i in 0..src.len() {
            assert_eq!(bits(&up[i]), bits(&got[i].to_dtype(DType::F32).unwrap()));
        }
    }
}

#[test]
fn same_dtype_is_a_clone_and_strided_sources_work() {
    let t = tf32(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3]);
    let out = cast_tensors(std::slice::from_ref(&t), DType::F32).unwrap();
    assert_eq!(out[0].id(), t.id(), "same dtype returns the tensor itself");
    let tt = t.t().unwrap();
    let out = cast_tensors(std::slice::from_ref(&tt), DType::BF16).unwrap();
    assert_eq!(bits(&out[0]), bits(&tt.to_dtype(DType::BF16).unwrap()));
    let dst = Tensor::zeros((3, 2), DType::F16, &Device::Cpu).unwrap();
    cast_into(std::slice::from_ref(&tt), std::slice::from_ref(&dst)).unwrap();
    assert_eq!(bits(&dst), bits(&tt.to_dtype(DType::F16).unwrap()));
}

#[test]
fn cast_into_writes_existing_storage() {
    let dst = Tensor::zeros(3, DType::BF16, &Device::Cpu).unwrap();
    let alias = dst.clone();
    cast_into(&[tf32(&[1.5, -2.0, 0.25], &[3])], &[dst]).unwrap();
    assert_eq!(vals(&alias), [1.5, -2.0, 0.25]);
}

#[test]
fn cast_errors_name_the_problem() {
    let a = tf32(&[1.0, 2.0], &[2]);
    let b = Tensor::zeros(3, DType::BF16, &Device::Cpu).unwrap();
    let e = cast_into(&[a.clone(), a.clone()], &[b.clone(), b.clone()]).unwrap_err();
    assert!(matches!(e, Error::ShapeMismatch { index: 0, .. }), "{e}");
    let e = cast_into(std::slice::from_ref(&a), &[]).unwrap_err();
    assert!(
        matches!(
            e,
            Error::LengthMismatch {
                left: 1,
                right: 0,
                ..
            }
        ),
        "{e}"
    );
    let e = cast_tensors(std::slice::from_ref(&a), DType::U8).unwrap_err();
    assert!(
        matches!(
            e,
            Error::UnsupportedDType {
                dtype: DType::U8,
                ..
            }
        ),
        "{e}"
    );
    let ints = Tensor::new(&[1u32, 2], &Device::Cpu).unwrap();
    let e = cast_into(&[ints], std::slice::from_ref(&a)).unwrap_err();
    assert!(
        matches!(
            e,
            Error::UnsupportedDType {
                dtype: DType::U32,
                ..
            }
        ),
        "{e}"
    );
    let m = Tensor::zeros((2, 2), DType::F32, &Device::Cpu)
        .unwrap()
        .t()
        .unwrap();
    let e = cast_into(
        &[Tensor::zeros((2, 2), DType::F32, &Device::Cpu).unwrap()],
        &[m],
    )
    .unwrap_err();
    assert!(
        matches!(e, Error::RequiresContiguous { index: 0, .. }),
        "{e}"
    );
    assert_eq!(e.to_string(), format!("{e:?}"), "Debug is Display");
    assert!(cast_tensors(&[], DType::F16).unwrap().is_empty());
    cast_into(&[], &[]).unwrap();
}
