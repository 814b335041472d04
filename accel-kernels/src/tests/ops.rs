//! Unscale, non-finite checks, norms and the other in-place list ops.

use candle_core::{DType, Device, Tensor};

use super::{bits, on_pool, randn, tf32, vals, SEQUENTIAL, TINY_PARALLEL};
use crate::cpu::{self, Plan};
use crate::slices::with_float_slices;
use crate::{
    add_in_place, clamp_in_place, fallback, has_non_finite, max_abs, scale_in_place,
    sum_of_squares, unscale_and_check,
};

/// A mixed-dtype gradient list with `n` elements per tensor.
fn mixed(n: usize, seed: u64) -> Vec<Tensor> {
    [DType::F32, DType::BF16, DType::F16]
        .iter()
        .enumerate()
        .map(|(i, &d)| {
            tf32(&randn(n, seed + i as u64, 100.0), &[n])
                .to_dtype(d)
                .unwrap()
        })
        .collect()
}

/// Deep copies, so two code paths can run on the same data.
fn deep(ts: &[Tensor]) -> Vec<Tensor> {
    ts.iter().map(|t| t.copy().unwrap()).collect()
}

#[test]
fn unscale_scales_every_dtype_and_rounds_once() {
    let ts = mixed(1000, 1);
    let want: Vec<Vec<u32>> = ts
        .iter()
        .map(|t| {
            let s = Tensor::new((1.0f64 / 3.0) as f32, &Device::Cpu).unwrap();
            bits(
                &t.to_dtype(DType::F32)
                    .unwrap()
                    .broadcast_mul(&s)
                    .unwrap()
                    .to_dtype(t.dtype())
                    .unwrap(),
            )
        })
        .collect();
    assert!(!unscale_and_check(&ts, (1.0f64 / 3.0) as f32).unwrap());
    for (t, w) in ts.iter().zip(&want) {
        assert_eq!(&bits(t), w, "{:?}", t.dtype());
    }
}

#[test]
fn unscale_reports_inf_and_nan_but_scales_everything() {
    for bad in [f32::INFINITY, f32::NEG_INFINITY, f32::NAN] {
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let big = tf32(&vec![2.0; 100_000], &[100_000]);
            let mut v = vec![4.0f32; 70_000];
            v[69_999] = bad;
            let odd = tf32(&v, &[70_000]).to_dtype(dtype).unwrap();
            let ts = [big, odd];
            assert!(unscale_and_check(&ts, 0.5).unwrap(), "{bad} in {dtype:?}");
            assert!(vals(&ts[0]).iter().all(|&x| x == 1.0));
            assert!(vals(&ts[1])[..69_999].iter().all(|&x| x == 2.0));
            assert!(has_non_finite(&ts).unwrap());
        }
    }
    // PyTorch tests the value before scaling: a finite value that overflows
    // when scaled is not reported.
    let t = tf32(&[3.0e38], &[1]);
    assert!(!unscale_and_check(std::slice::from_ref(&t), 10.0).unwrap());
    assert_eq!(vals(&t), [f32::INFINITY]);
    // inv_scale 1 still checks.
    assert!(unscale_and_check(&[tf32(&[f32::NAN], &[1])], 1.0).unwrap());
}

#[test]
fn has_non_finite_sees_every_dtype() {
    let ts = mixed(50_000, 3);
    assert!(!has_non_finite(&ts).unwrap());
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        for bad in [f32::INFINITY, f32::NAN] {
            let t = tf32(&[1.0, bad, 2.0], &[3]).to_dtype(dtype).unwrap();
            assert!(has_non_finite(&[ts[0].clone(), t]).unwrap());
        }
    }
    // f16 max is finite; 65520 rounds to inf on conversion.
    let t = tf32(&[65504.0], &[1]).to_dtype(DType::F16).unwrap();
    assert!(!has_non_finite(&[t]).unwrap());
}

#[test]
fn norms_match_f64_references_and_do_not_depend_on_threads() {
    let ts = mixed(123_457, 5);
    let mut want_sq = 0f64;
    let mut want_max = 0f64;
    for t in &ts {
        for v in vals(t) {
            want_sq += v as f64 * v as f64;
            want_max = want_max.max(v.abs() as f64);
        }
    }
    let got = sum_of_squares(&ts).unwrap();
    assert!(
        (got - want_sq).abs() <= want_sq * 1e-12,
        "{got} vs {want_sq}"
    );
    assert_eq!(max_abs(&ts).unwrap(), want_max);

    let refs: Vec<&Tensor> = ts.iter().collect();
    let run = |plan: Plan| {
        with_float_slices(&refs, "t", |s| Ok(cpu::norm::sum_of_squares(s, plan))).unwrap()
    };
    let seq_same_chunks = Plan {
        min_parallel: usize::MAX,
        ..TINY_PARALLEL
    };
    let par = on_pool(|| run(TINY_PARALLEL));
    assert_eq!(
        par.to_bits(),
        run(seq_same_chunks).to_bits(),
        "parallel == sequential, bitwise"
    );
    assert!((run(SEQUENTIAL) - par).abs() <= want_sq * 1e-12);
    assert_eq!(
        sum_of_squares(&ts).unwrap().to_bits(),
        on_pool(|| sum_of_squares(&ts).unwrap()).to_bits()
    );
}

#[test]
fn max_abs_propagates_nan_and_handles_negative_extremes() {
    let t = tf32(&[1.0, -7.5, 3.0], &[3]);
    assert_eq!(max_abs(std::slice::from_ref(&t)).unwrap(), 7.5);
    assert!(max_abs(&[t.clone(), tf32(&[f32::NAN], &[1])])
        .unwrap()
        .is_nan());
    assert_eq!(
        max_abs(&[tf32(&[f32::NEG_INFINITY], &[1])]).unwrap(),
        f64::INFINITY
    );
    assert_eq!(max_abs(&[]).unwrap(), 0.0);
    assert_eq!(sum_of_squares(&[]).unwrap(), 0.0);
}

#[test]
fn scale_clamp_and_add_in_place() {
    let ts = mixed(40_000, 7);
    let want: Vec<Vec<u32>> = ts
        .iter()
        .map(|t| {
            let x = t.to_dtype(DType::F32).unwrap();
            bits(
                &x.broadcast_mul(&Tensor::new(0.25f32, &Device::Cpu).unwrap())
                    .unwrap()
                    .to_dtype(t.dtype())
                    .unwrap(),
            )
        })
        .collect();
    scale_in_place(&ts, 0.25).unwrap();
    for (t, w) in ts.iter().zip(&want) {
        assert_eq!(&bits(t), w);
    }

    let c = tf32(&[-3.0, -1.0, 0.5, 2.0, f32::NAN, f32::INFINITY], &[6]);
    clamp_in_place(std::slice::from_ref(&c), -1.0, 1.0).unwrap();
    let got = vals(&c);
    assert_eq!(&got[..4], [-1.0, -1.0, 0.5, 1.0]);
    assert!(got[4].is_nan());
    assert_eq!(got[5], 1.0);
    let c = tf32(&[-3.0, 5.0], &[2]);
    clamp_in_place(std::slice::from_ref(&c), 2.0, 1.0).unwrap();
    assert_eq!(vals(&c), [1.0, 1.0], "lo > hi gives hi, like torch.clamp");

    let acc = [tf32(&vec![1.0; 70_000], &[70_000]), tf32(&[0.0; 3], &[3])];
    let src = [
        tf32(&vec![0.5; 70_000], &[70_000])
            .to_dtype(DType::BF16)
            .unwrap(),
        tf32(&[1.0, 2.0, 3.0], &[3]).to_dtype(DType::F16).unwrap(),
    ];
    add_in_place(&acc, &src).unwrap();
    add_in_place(&acc, &src).unwrap();
    assert!(vals(&acc[0]).iter().all(|&x| x == 2.0));
    assert_eq!(vals(&acc[1]), [2.0, 4.0, 6.0]);
    let e = add_in_place(&[src[1].clone()], &[acc[1].clone()]).unwrap_err();
    assert!(matches!(e, crate::Error::DTypeMismatch { .. }), "{e}");
}

#[test]
fn kernels_split_anywhere_without_changing_results() {
    let ts = mixed(10_001, 9);
    let (a, b) = (deep(&ts), deep(&ts));
    let ra: Vec<&Tensor> = a.iter().collect();
    let rb: Vec<&Tensor> = b.iter().collect();
    let fa = on_pool(|| {
        crate::slices::with_float_slices_mut(&ra, "t", |s| {
            Ok(cpu::unscale::unscale_and_check(s, 0.3, TINY_PARALLEL))
        })
    })
    .unwrap();
    let fb = crate::slices::with_float_slices_mut(&rb, "t", |s| {
        Ok(cpu::unscale::unscale_and_check(s, 0.3, SEQUENTIAL))
    })
    .unwrap();
    assert_eq!(fa, fb);
    for (x, y) in a.iter().zip(&b) {
        assert_eq!(bits(x), bits(y));
    }
}

#[test]
fn fallback_matches_fused_path_on_cpu() {
    let ts = mixed(5_000, 11);
    let (a, b) = (deep(&ts), deep(&ts));
    assert_eq!(
        unscale_and_check(&a, 0.125).unwrap(),
        fallback::unscale_and_check(&b, 0.125).unwrap()
    );
    for (x, y) in a.iter().zip(&b) {
        assert_eq!(bits(x), bits(y));
    }
    scale_in_place(&a, 3.0).unwrap();
    fallback::scale(&b, 3.0).unwrap();
    clamp_in_place(&a, -20.0, 20.0).unwrap();
    fallback::clamp(&b, -20.0, 20.0).unwrap();
    for (x, y) in a.iter().zip(&b) {
        assert_eq!(bits(x), bits(y));
    }
    assert_eq!(
        has_non_finite(&a).unwrap(),
        fallback::has_non_finite(&b).unwrap()
    );
    let (s1, s2) = (
        sum_of_squares(&a).unwrap(),
        fallback::sum_of_squares(&b).unwrap(),
    );
    assert!((s1 - s2).abs() <= s1 * 1e-12);
    assert_eq!(max_abs(&a).unwrap(), fallback::max_abs(&b).unwrap());
    let nan = [tf32(&[1.0, f32::NAN], &[2])];
    assert!(fallback::max_abs(&nan).unwrap().is_nan());
    assert!(fallback::has_non_finite(&nan).unwrap());

    let dst_a = [tf32(&[1.0; 5_000], &[5_000])];
    let dst_b = deep(&dst_a);
    add_in_place(&dst_a, &a[1..2]).unwrap();
    fallback::add(&dst_b, &b[1..2]).unwrap();
    assert_eq!(bits(&dst_a[0]), bits(&dst_b[0]));

    let cast_a = [Tensor::zeros(5_000, DType::BF16, &Device::Cpu).unwrap()];
    let cast_b = deep(&cast_a);
    crate::cast_into(&a[..1], &cast_a).unwrap();
    fallback::cast_into(&b[..1], &cast_b).unwrap();
    assert_eq!(bits(&cast_a[0]), bits(&cast_b[0]));
}

#[test]
fn empty_lists_and_tensors_are_no_ops() {
    let empty = Tensor::zeros((0, 4), DType::BF16, &Device::Cpu).unwrap();
    assert!(!unscale_and_check(&[], 2.0).unwrap());
    assert!(!unscale_and_check(std::slice::from_ref(&empty), 2.0).unwrap());
    assert!(!has_non_finite(std::slice::from_ref(&empty)).unwrap());
    scale_in_place(std::slice::from_ref(&empty), 2.0).unwrap();
    assert_eq!(sum_of_squares(std::slice::from_ref(&empty)).unwrap(), 0.0);
    fallback::scale(std::slice::from_ref(&empty), 2.0).unwrap();
    assert_eq!(fallback::max_abs(&[empty]).unwrap(), 0.0);
}
