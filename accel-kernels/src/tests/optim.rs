//! Fused AdamW and SGD against straightforward scalar references.

use candle_core::{DType, Device, Tensor, Var};

use super::{bits, on_pool, randn, tf32, vals, SEQUENTIAL, TINY_PARALLEL};
use crate::optim::{adamw_step_with, sgd_step_with};
use crate::{adamw_step, fallback, sgd_step, AdamWParams, Error, SgdParams};

/// PyTorch's single-tensor AdamW, written out sequentially in f32 with the
/// scalar factors computed in f64.
fn ref_adamw(p: &mut [f32], m: &mut [f32], v: &mut [f32], g: &[f32], step: u64, hp: &AdamWParams) {
    let t = step as f64;
    let step_size = (hp.lr / (1.0 - hp.beta1.powf(t))) as f32;
    let bc2_sqrt = (1.0 - hp.beta2.powf(t)).sqrt() as f32;
    let w = (1.0 - hp.beta1) as f32;
    for i in 0..p.len() {
        if hp.weight_decay != 0.0 {
            p[i] *= (1.0 - hp.lr * hp.weight_decay) as f32;
        }
        m[i] = if w.abs() < 0.5 {
            m[i] + w * (g[i] - m[i])
        } else {
            g[i] - (g[i] - m[i]) * (1.0 - w)
        };
        v[i] = v[i] * hp.beta2 as f32 + (1.0 - hp.beta2) as f32 * g[i] * g[i];
        let denom = v[i].sqrt() / bc2_sqrt + hp.eps as f32;
        p[i] -= step_size * m[i] / denom;
    }
}

/// The textbook AdamW update in f64 (bias-corrected moments).
fn textbook_adamw(
    p: &mut [f64],
    m: &mut [f64],
    v: &mut [f64],
    g: &[f32],
    step: u64,
    hp: &AdamWParams,
) {
    for i in 0..p.len() {
        let g = g[i] as f64;
        p[i] -= hp.lr * hp.weight_decay * p[i];
        m[i] = hp.beta1 * m[i] + (1.0 - hp.beta1) * g;
        v[i] = hp.beta2 * v[i] + (1.0 - hp.beta2) * g * g;
        let m_hat = m[i] / (1.0 - hp.beta1.powi(step as i32));
        let v_hat = v[i] / (1.0 - hp.beta2.powi(step as i32));
        p[i] -= hp.lr * m_hat / (v_hat.sqrt() + hp.eps);
    }
}

const SIZES: [&[usize]; 4] = [&[100_003], &[7, 13], &[1], &[0]];

/// Fresh (params, exp_avg, exp_avg_sq) tensors for `SIZES`.
fn state() -> (Vec<Tensor>, Vec<Tensor>, Vec<Tensor>) {
    let p = SIZES
        .iter()
        .enumerate()
        .map(|(i, s)| tf32(&randn(s.iter().product(), 100 + i as u64, 1.0), s));
    let z = |s: &&[usize]| Tensor::zeros(*s, DType::F32, &Device::Cpu).unwrap();
    (
        p.collect(),
        SIZES.iter().map(z).collect(),
        SIZES.iter().map(z).collect(),
    )
}

/// Gradients for step `step`, converted to `dtype`.
fn grads(step: u64, dtype: DType) -> Vec<Tensor> {
    let g = SIZES
        .iter()
        .enumerate()
        .map(|(i, s)| tf32(&randn(s.iter().product(), step * 10 + i as u64, 0.1), s));
    g.map(|t| t.to_dtype(dtype).unwrap()).collect()
}

/// Runs `steps` AdamW steps fused and by reference; asserts bit equality.
fn check_adamw(hp: &AdamWParams, grad_dtype: DType, steps: u64) {
    let (p, m, v) = state();
    let mut rp: Vec<Vec<f32>> = p.iter().map(vals).collect();
    let mut rm: Vec<Vec<f32>> = m.iter().map(vals).collect();
    let mut rv = rm.clone();
    for step in 1..=steps {
        let g = grads(step, grad_dtype);
        adamw_step(&p, &g, &m, &v, step, hp).unwrap();
        for i in 0..p.len() {
            ref_adamw(&mut rp[i], &mut rm[i], &mut rv[i], &vals(&g[i]), step, hp);
            let to_bits = |x: &Vec<f32>| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&p[i]), to_bits(&rp[i]), "param {i} step {step}");
            assert_eq!(bits(&m[i]), to_bits(&rm[i]), "exp_avg {i} step {step}");
            assert_eq!(bits(&v[i]), to_bits(&rv[i]), "exp_avg_sq {i} step {step}");
        }
    }
}

#[test]
fn adamw_matches_sequential_f32_reference_bitwise() {
    let hp = AdamWParams {
        lr: 1e-3,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.01,
    };
    check_adamw(&hp, DType::F32, 5);
    check_adamw(
        &AdamWParams {
            weight_decay: 0.0,
            ..hp
        },
        DType::F32,
        3,
    );
}

#[test]
fn adamw_small_beta1_takes_the_other_lerp_branch() {
    let hp = AdamWParams {
        lr: 3e-2,
        beta1: 0.3,
        beta2: 0.9,
        eps: 1e-6,
        weight_decay: 0.1,
    };
    check_adamw(&hp, DType::F32, 3);
}

#[test]
fn adamw_widens_half_gradients_exactly() {
    check_adamw(&AdamWParams::default(), DType::BF16, 3);
    check_adamw(&AdamWParams::default(), DType::F16, 3);
}

#[test]
fn adamw_is_close_to_textbook_f64() {
    let hp = AdamWParams {
        lr: 1e-2,
        weight_decay: 0.05,
        ..AdamWParams::default()
    };
    let (p, m, v) = state();
    let mut tp: Vec<Vec<f64>> = p
        .iter()
        .map(|t| vals(t).iter().map(|&x| x as f64).collect())
        .collect();
    let mut tm: Vec<Vec<f64>> = tp.iter().map(|x| vec![0.0; x.len()]).collect();
    let mut tv = tm.clone();
    for step in 1..=10 {
        let g = grads(step, DType::F32);
        adamw_step(&p, &g, &m, &v, step, &hp).unwrap();
        for i in 0..p.len() {
            textbook_adamw(&mut tp[i], &mut tm[i], &mut tv[i], &vals(&g[i]), step, &hp);
        }
    }
    for (t, want) in p.iter().zip(&tp) {
        for (got, want) in vals(t).iter().zip(want) {
            assert!(
                (*got as f64 - want).abs() <= 1e-5 * (1.0 + want.abs()),
                "{got} vs {want}"
            );
        }
    }
}

#[test]
fn adamw_parallel_chunking_equals_sequential_bitwise() {
    let hp = AdamWParams {
        weight_decay: 0.1,
        ..AdamWParams::default()
    };
    let (pa, ma, va) = state();
    let (pb, mb, vb) = state();
    for step in 1..=3 {
        let g = grads(step, DType::BF16);
        on_pool(|| adamw_step_with(&pa, &g, &ma, &va, step, &hp, TINY_PARALLEL)).unwrap();
        adamw_step_with(&pb, &g, &mb, &vb, step, &hp, SEQUENTIAL).unwrap();
    }
    for (a, b) in pa
        .iter()
        .chain(&ma)
        .chain(&va)
        .zip(pb.iter().chain(&mb).chain(&vb))
    {
        assert_eq!(bits(a), bits(b));
    }
}

#[test]
fn adamw_updates_vars_in_place_over_many_parameters() {
    // More parameters than one lock group (MAX_LOCKED / 3).
    let n = 300;
    let vars: Vec<Var> = (0..n)
        .map(|i| Var::from_tensor(&tf32(&[1.0 + i as f32; 4], &[4])).unwrap())
        .collect();
    let params: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let g: Vec<Tensor> = (0..n).map(|_| tf32(&[0.5; 4], &[4])).collect();
    let zeros = || {
        (0..n)
            .map(|_| Tensor::zeros(4, DType::F32, &Device::Cpu).unwrap())
            .collect::<Vec<_>>()
    };
    let (m, v) = (zeros(), zeros());
    let hp = AdamWParams {
        lr: 0.1,
        weight_decay: 0.0,
        ..AdamWParams::default()
    };
    adamw_step(&params, &g, &m, &v, 1, &hp).unwrap();
    for (i, var) in vars.iter().enumerate() {
        // First step with a constant gradient moves every weight by ~lr.
        let got = vals(var.as_tensor())[0];
        assert!(
            (got - (1.0 + i as f32 - 0.1)).abs() < 1e-5,
            "var {i}: {got}"
        );
        assert!((vals(&m[i])[0] - 0.05).abs() < 1e-7);
    }
}

#[test]
fn adamw_fallback_matches_fused_path_on_cpu() {
    let hp = AdamWParams {
        weight_decay: 0.02,
        ..AdamWParams::default()
    };
    let (pa, ma, va) = state();
    let (pb, mb, vb) = state();
    for step in 1..=3 {
        let g = grads(step, DType::F16);
        adamw_step(&pa, &g, &ma, &va, step, &hp).unwrap();
        let s = crate::hyperparams::AdamWScalars::new(&hp, step);
        fallback::adamw(&pb, &g, &mb, &vb, &s).unwrap();
    }
    for (a, b) in pa
        .iter()
        .chain(&ma)
        .chain(&va)
        .zip(pb.iter().chain(&mb).chain(&vb))
    {
        assert_eq!(bits(a), bits(b));
    }
}

#[test]
fn adamw_rejects_bad_arguments() {
    let (p, m, v) = state();
    let g = grads(1, DType::F32);
    let hp = AdamWParams::default();
    let e = adamw_step(&p, &g, &m, &v, 0, &hp).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument { .. }), "{e}");
    let e = adamw_step(&p, &g[..2], &m, &v, 1, &hp).unwrap_err();
    assert!(
        matches!(
            e,
            Error::LengthMismatch {
                left: 2,
                right: 4,
                ..
            }
        ),
        "{e}"
    );
    let mut bad = m.clone();
    bad[1] = Tensor::zeros((13, 7), DType::F32, &Device::Cpu).unwrap();
    let e = adamw_step(&p, &g, &bad, &v, 1, &hp).unwrap_err();
    assert!(matches!(e, Error::ShapeMismatch { index: 1, .. }), "{e}");
    let mut bad = p.clone();
    bad[2] = bad[2].to_dtype(DType::BF16).unwrap();
    let e = adamw_step(&bad, &g, &m, &v, 1, &hp).unwrap_err();
    assert!(
        matches!(
            e,
            Error::DTypeMismatch {
                index: 2,
                expected: DType::F32,
                ..
            }
        ),
        "{e}"
    );
    let before = vals(&p[0]);
    let mut bad = p.clone();
    bad[1] = Tensor::zeros((13, 7), DType::F32, &Device::Cpu)
        .unwrap()
        .t()
        .unwrap();
    let e = adamw_step(&bad, &g, &m, &v, 1, &hp).unwrap_err();
    assert!(
        matches!(e, Error::RequiresContiguous { index: 1, .. }),
        "{e}"
    );
    assert_eq!(vals(&p[0]), before, "a rejected call writes nothing");
}

/// PyTorch SGD for one tensor, sequential f32.
fn ref_sgd(p: &mut [f32], buf: &mut [f32], g: &[f32], step: u64, hp: &SgdParams) {
    for i in 0..p.len() {
        let mut d = g[i];
        if hp.weight_decay != 0.0 {
            d += hp.weight_decay as f32 * p[i];
        }
        if hp.momentum != 0.0 {
            let mom = hp.momentum as f32;
            buf[i] = if step == 1 {
                d
            } else {
                buf[i] * mom + (1.0 - hp.dampening) as f32 * d
            };
            d = if hp.nesterov {
                d + mom * buf[i]
            } else {
                buf[i]
            };
        }
        p[i] -= hp.lr as f32 * d;
    }
}

#[test]
fn sgd_matches_reference_and_fallback_bitwise() {
    let cases = [
        SgdParams {
            lr: 0.1,
            ..SgdParams::default()
        },
        SgdParams {
            lr: 0.05,
            momentum: 0.9,
            dampening: 0.1,
            weight_decay: 1e-4,
            nesterov: false,
        },
        SgdParams {
            lr: 0.05,
            momentum: 0.9,
            dampening: 0.0,
            weight_decay: 1e-2,
            nesterov: true,
        },
    ];
    for hp in &cases {
        let (p, b, _) = state();
        let (pf, bf, _) = state();
        let (p2, b2, _) = state();
        let mut rp: Vec<Vec<f32>> = p.iter().map(vals).collect();
        let mut rb: Vec<Vec<f32>> = b.iter().map(vals).collect();
        for step in 1..=4 {
            let g = grads(step, DType::BF16);
            sgd_step(&p, &g, Some(&b), step, hp).unwrap();
            on_pool(|| sgd_step_with(&p2, &g, Some(&b2), step, hp, TINY_PARALLEL)).unwrap();
            let s = crate::hyperparams::SgdScalars::new(hp, step);
            fallback::sgd(&pf, &g, (hp.momentum != 0.0).then_some(&bf[..]), &s).unwrap();
            for i in 0..p.len() {
                ref_sgd(&mut rp[i], &mut rb[i], &vals(&g[i]), step, hp);
                let want: Vec<u32> = rp[i].iter().map(|v| v.to_bits()).collect();
                assert_eq!(bits(&p[i]), want, "{hp:?} param {i} step {step}");
                assert_eq!(bits(&p2[i]), want, "parallel {hp:?} param {i} step {step}");
                assert_eq!(bits(&pf[i]), want, "fallback {hp:?} param {i} step {step}");
                if hp.momentum != 0.0 {
                    assert_eq!(
                        bits(&b[i]),
                        rb[i].iter().map(|v| v.to_bits()).collect::<Vec<_>>()
                    );
                }
            }
        }
    }
}

#[test]
fn sgd_rejects_bad_arguments() {
    let (p, b, _) = state();
    let g = grads(1, DType::F32);
    let hp = SgdParams {
        momentum: 0.9,
        ..SgdParams::default()
    };
    let e = sgd_step(&p, &g, None, 1, &hp).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument { .. }), "{e}");
    let e = sgd_step(
        &p,
        &g,
        Some(&b),
        1,
        &SgdParams {
            dampening: 0.5,
            nesterov: true,
            ..hp
        },
    )
    .unwrap_err();
    assert!(matches!(e, Error::InvalidArgument { .. }), "{e}");
    let e = sgd_step(&p, &g, Some(&b[..1]), 1, &hp).unwrap_err();
    assert!(matches!(e, Error::LengthMismatch { .. }), "{e}");
    // Without momentum the buffers are ignored.
    sgd_step(&p, &g, None, 1, &SgdParams::default()).unwrap();
}
