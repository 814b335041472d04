//! The workspace's patched candle-nn (`vendor/candle-nn`): its fused ops,
//! which upstream cuts the graph at, now have a backward. Each is checked
//! with [`check_op`] against candle-nn's own composed (`*_slow`) form:
//! values, gradients against the composed op's autograd, both against
//! central differences, and half precision. The rotary ones also get the
//! gradients of their `cos`/`sin` tables, including a table longer than the
//! sequence and a per-batch (3D) table. On CUDA, the same gradients are
//! compared with the CPU's (an ignored test, run by `scripts/gpu_check.sh`).

use candle_core::{DType, Device, Result, Tensor, Var, D};
use candle_nn::{ops, rotary_emb};

use super::testing::{assert_close, check_op, randn};

#[test]
fn softmax_last_dim_differentiates_as_the_composed_softmax() -> Result<()> {
    check_op(
        &[vec![2, 3, 17]],
        1,
        &|x| ops::softmax_last_dim(&x[0]),
        &|x| ops::softmax(&x[0], D::Minus1),
    )
}

#[test]
fn rms_norm_differentiates_as_rms_norm_slow() -> Result<()> {
    for (k, shape) in [vec![2, 3, 16], vec![5, 33]].into_iter().enumerate() {
        let d = shape[shape.len() - 1];
        check_op(
            &[shape, vec![d]],
            10 + k as u64,
            &|x| ops::rms_norm(&x[0], &x[1], 1e-5),
            &|x| ops::rms_norm_slow(&x[0], &x[1], 1e-5),
        )?;
    }
    Ok(())
}

#[test]
fn layer_norm_differentiates_as_layer_norm_slow() -> Result<()> {
    for (k, shape) in [vec![2, 3, 16], vec![5, 33]].into_iter().enumerate() {
        let d = shape[shape.len() - 1];
        check_op(
            &[shape, vec![d], vec![d]],
            20 + k as u64,
            &|x| ops::layer_norm(&x[0], &x[1], &x[2], 1e-5),
            &|x| ops::layer_norm_slow(&x[0], &x[1], &x[2], 1e-5),
        )?;
    }
    Ok(())
}

/// The modules candle-transformers builds (`candle_nn::LayerNorm`, `RmsNorm`)
/// take the fused path and now pass gradients to their input and weights.
#[test]
fn candle_nn_norm_modules_give_every_weight_a_gradient() -> Result<()> {
    use candle_core::Module;
    let x = Var::from_tensor(&randn(&[2, 3, 8], 40, 1.0)?)?;
    let (w, b) = (
        Var::from_tensor(&randn(&[8], 41, 1.0)?)?,
        Var::from_tensor(&randn(&[8], 42, 1.0)?)?,
    );
    let ln = candle_nn::LayerNorm::new(w.as_tensor().clone(), b.as_tensor().clone(), 1e-5);
    let rms = candle_nn::RmsNorm::new(w.as_tensor().clone(), 1e-5);
    let y = (ln.forward(x.as_tensor())? + rms.forward(x.as_tensor())?)?;
    let grads = (y.sqr()?.sum_all()?).backward()?;
    for (name, v) in [("x", &x), ("weight", &w), ("bias", &b)] {
        let g = grads
            .get(v.as_tensor())
            .unwrap_or_else(|| panic!("{name} got no gradient"));
        assert!(g.abs()?.sum_all()?.to_scalar::<f32>()? > 0.0, "{name}");
    }
    Ok(())
}

/// A composed rotary embedding for `(b, h, t, d)` inputs (`thd`: `(b, t, h,
/// d)`) and 2D or 3D tables of at least `t` rows: the reference for all
/// three fused forms, tables included.
fn rope_composed(
    x: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    interleaved: bool,
    thd: bool,
) -> Result<Tensor> {
    let x = if thd { x.transpose(1, 2)? } else { x.clone() };
    let (b, _, t, d) = x.dims4()?;
    let table = |c: &Tensor| -> Result<Tensor> {
        let c = c.narrow(c.rank() - 2, 0, t)?;
        let c = if c.rank() == 2 { c.unsqueeze(0)? } else { c };
        c.broadcast_as((b, t, d / 2))?.unsqueeze(1)
    };
    let (c, s) = (table(cos)?, table(sin)?);
    let y = if interleaved {
        let xs = x.reshape((b, (), t, d / 2, 2))?;
        let (x0, x1) = (
            xs.narrow(4, 0, 1)?.squeeze(4)?,
            xs.narrow(4, 1, 1)?.squeeze(4)?,
        );
        let y0 = (x0.broadcast_mul(&c)? - x1.broadcast_mul(&s)?)?;
        let y1 = (x0.broadcast_mul(&s)? + x1.broadcast_mul(&c)?)?;
        Tensor::stack(&[y0, y1], 4)?.flatten_from(3)?
    } else {
        let (x1, x2) = (x.narrow(3, 0, d / 2)?, x.narrow(3, d / 2, d / 2)?);
        let y1 = (x1.broadcast_mul(&c)? - x2.broadcast_mul(&s)?)?;
        let y2 = (x1.broadcast_mul(&s)? + x2.broadcast_mul(&c)?)?;
        Tensor::cat(&[y1, y2], 3)?
    };
    if thd {
        y.transpose(1, 2)?.contiguous()
    } else {
        Ok(y)
    }
}

#[test]
fn rope_rope_i_and_rope_thd_differentiate_in_x_cos_and_sin() -> Result<()> {
    type Fused = fn(&Tensor, &Tensor, &Tensor) -> Result<Tensor>;
    let forms: [(&str, Fused, bool, bool); 3] = [
        ("rope", rotary_emb::rope, false, false),
        ("rope_i", rotary_emb::rope_i, true, false),
        ("rope_thd", rotary_emb::rope_thd, false, true),
    ];
    // (b, h, t, d), table rows, 3D table.
    let cases = [
        (2, 3, 5, 8, 5, false),
        (1, 2, 4, 6, 7, false),
        (2, 2, 3, 4, 3, true),
    ];
    for (k, (name, fused, interleaved, thd)) in forms.into_iter().enumerate() {
        for (c, &(b, h, t, d, rows, per_batch)) in cases.iter().enumerate() {
            let x = if thd {
                vec![b, t, h, d]
            } else {
                vec![b, h, t, d]
            };
            let table = if per_batch {
                vec![b, rows, d / 2]
            } else {
                vec![rows, d / 2]
            };
            let seed = 100 + 10 * k as u64 + c as u64;
            let composed = |x: &[Tensor]| rope_composed(&x[0], &x[1], &x[2], interleaved, thd);
            check_op(
                &[x, table.clone(), table],
                seed,
                &|x| fused(&x[0], &x[1], &x[2]),
                &composed,
            )
            .map_err(|e| e.context(format!("{name}, case {c}")))?;
        }
    }
    Ok(())
}

/// A table that is a constant (the usual case) costs no gradient and gets none.
#[test]
fn rope_computes_no_gradient_for_constant_tables() -> Result<()> {
    let x = Var::from_tensor(&randn(&[1, 2, 3, 4], 7, 1.0)?)?;
    let angles = randn(&[3, 2], 8, 1.0)?;
    let (cos, sin) = (angles.cos()?, angles.sin()?);
    let y = rotary_emb::rope(x.as_tensor(), &cos, &sin)?;
    let grads = y.sqr()?.sum_all()?.backward()?;
    // A rotation keeps lengths: d(sum y^2)/dx = 2x.
    let gx = grads.get(x.as_tensor()).expect("x has a gradient");
    assert_close(gx, &(x.as_tensor() * 2.0)?, 1e-6, "rope dx")?;
    assert!(grads.get(&cos).is_none() && grads.get(&sin).is_none());
    Ok(())
}

/// The fused ops' gradients on a CUDA device against the same ops' on the
/// CPU (checked above), in f32 and bf16.
#[test]
#[ignore = "needs a CUDA GPU (run scripts/gpu_check.sh)"]
fn cuda_candle_nn_backward_matches_the_cpu() -> Result<()> {
    let gpu = accel_kernels::cuda_device(0)
        .unwrap_or_else(|e| panic!("needs a CUDA device (build with --features cuda): {e}"));
    type Case = (
        &'static str,
        Vec<Vec<usize>>,
        Box<dyn Fn(&[Tensor]) -> Result<Tensor>>,
    );
    let cases: Vec<Case> = vec![
        (
            "softmax_last_dim",
            vec![vec![3, 5, 70]],
            Box::new(|x| ops::softmax_last_dim(&x[0])),
        ),
        (
            "rms_norm",
            vec![vec![130, 96], vec![96]],
            Box::new(|x| ops::rms_norm(&x[0], &x[1], 1e-6)),
        ),
        (
            "layer_norm",
            vec![vec![130, 96], vec![96], vec![96]],
            Box::new(|x| ops::layer_norm(&x[0], &x[1], &x[2], 1e-5)),
        ),
        (
            "rope",
            vec![vec![2, 3, 9, 16], vec![12, 8], vec![12, 8]],
            Box::new(|x| rotary_emb::rope(&x[0], &x[1], &x[2])),
        ),
        (
            "rope_i",
            vec![vec![2, 3, 9, 16], vec![9, 8], vec![9, 8]],
            Box::new(|x| rotary_emb::rope_i(&x[0], &x[1], &x[2])),
        ),
        (
            "rope_thd",
            vec![vec![2, 9, 3, 16], vec![2, 9, 8], vec![2, 9, 8]],
            Box::new(|x| rotary_emb::rope_thd(&x[0], &x[1], &x[2])),
        ),
    ];
    for (k, (name, shapes, op)) in cases.into_iter().enumerate() {
        for (dtype, tol) in [(DType::F32, 1e-5), (DType::BF16, 2e-2)] {
            let xs = shapes
                .iter()
                .enumerate()
                .map(|(i, s)| randn(s, 1000 + 10 * k as u64 + i as u64, 1.0)?.to_dtype(dtype))
                .collect::<Result<Vec<_>>>()?;
            let run = |dev: &Device| -> Result<(Tensor, Vec<Tensor>)> {
                let vars = xs
                    .iter()
                    .map(|x| Var::from_tensor(&x.to_device(dev)?))
                    .collect::<Result<Vec<_>>>()?;
                let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
                let y = op(&ts)?;
                let w = randn(y.dims(), 7, 1.0)?.to_dtype(dtype)?.to_device(dev)?;
                let grads = (y.to_dtype(DType::F32)? * w.to_dtype(DType::F32)?)?
                    .sum_all()?
                    .backward()?;
                let gs = ts
                    .iter()
                    .map(|t| {
                        grads
                            .get(t)
                            .expect("every input has a gradient")
                            .to_device(&Device::Cpu)
                    })
                    .collect::<Result<Vec<_>>>()?;
                Ok((y.to_device(&Device::Cpu)?, gs))
            };
            let (y_cpu, g_cpu) = run(&Device::Cpu)?;
            let (y_gpu, g_gpu) = run(&gpu)?;
            assert_close(&y_gpu, &y_cpu, tol, &format!("{name} {dtype:?} value"))?;
            for (i, (a, b)) in g_gpu.iter().zip(&g_cpu).enumerate() {
                assert_eq!(a.dtype(), dtype, "{name} gradient {i} dtype");
                assert_close(a, b, 2.0 * tol, &format!("{name} {dtype:?} gradient {i}"))?;
            }
        }
    }
    Ok(())
}

/// `attention::flash_attn` on tensors a backward can reach takes the
/// composed ops (its CPU kernels would cut the graph): the same values as
/// the kernels on the same numbers, for every mask kind, soft-capping,
/// grouped-query heads and batches of one and two; and gradients that
/// match central differences.
#[test]
fn flash_attn_differentiates_and_equals_the_cpu_kernels() -> Result<()> {
    use candle_nn::attention::{flash_attn, AttnMask};
    let (s, kv_s, d) = (5usize, 7usize, 8usize);
    let mask = randn(&[s, kv_s], 60, 1.0)?;
    let cases: Vec<(usize, usize, usize, AttnMask, Option<f32>)> = vec![
        (1, 4, 2, AttnMask::None, None),
        (1, 4, 4, AttnMask::Causal { kv_offset: 2 }, None),
        (1, 2, 1, AttnMask::Mask(mask), Some(5.0)),
        (2, 4, 2, AttnMask::Causal { kv_offset: 2 }, None),
        (2, 2, 2, AttnMask::None, None),
    ];
    for (c, (b, h, h_kv, mask, softcap)) in cases.into_iter().enumerate() {
        let shapes = [
            vec![b, s, h, d],
            vec![b, kv_s, h_kv, d],
            vec![b, kv_s, h_kv, d],
        ];
        let xs = shapes
            .iter()
            .enumerate()
            .map(|(i, sh)| randn(sh, 70 + 10 * c as u64 + i as u64, 1.0))
            .collect::<Result<Vec<_>>>()?;
        let attn = |x: &[Tensor]| {
            flash_attn::<f32>(&x[0], &x[1], &x[2], 0.35, mask.clone(), None, softcap)
        };
        let kernel = attn(&xs)?;
        let vars = xs
            .iter()
            .map(Var::from_tensor)
            .collect::<Result<Vec<_>>>()?;
        let tracked: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
        assert_close(
            &attn(&tracked)?,
            &kernel,
            1e-5,
            &format!("case {c}: composed vs kernel"),
        )?;
        // Through variables every call takes the composed path, whatever
        // the dtype (the kernels are f32/f16 only at batch 2).
        let differentiable = |x: &[Tensor]| -> Result<Tensor> {
            let vars = x.iter().map(Var::from_tensor).collect::<Result<Vec<_>>>()?;
            let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
            attn(&ts)
        };
        check_op(&shapes, 80 + c as u64, &differentiable, &differentiable)?;
    }
    Ok(())
}

/// The patched KV caches: a tracked append returns bitwise the values an
/// untracked one returns (inference is unchanged), and a backward through
/// the result reaches every appended key and value (upstream cut it:
/// `ConcatKvCache` detached, `KvCache` and `RotatingKvCache` wrote in place).
#[test]
fn kv_caches_keep_the_graph_and_return_the_same_values() -> Result<()> {
    use candle_nn::kv_cache::{ConcatKvCache, KvCache, RotatingKvCache};
    let parts: Vec<Tensor> = (0..4)
        .map(|i| randn(&[1, 2, if i < 2 { 5 } else { 3 }, 4], 40 + i, 1.0))
        .collect::<Result<_>>()?;
    // A transposed value, as Gemma 3 hands it: not contiguous.
    let v_t = |t: &Tensor| -> Result<Tensor> { t.transpose(2, 3)?.contiguous()?.transpose(2, 3) };
    type AppendFn = dyn FnMut(&Tensor, &Tensor) -> Result<(Tensor, Tensor)>;
    type Append<'a> = &'a mut AppendFn;
    type MakeCache = Box<dyn Fn() -> Box<AppendFn>>;
    let run = |append: Append, steps: &[(Tensor, Tensor)]| -> Result<Vec<(Tensor, Tensor)>> {
        steps.iter().map(|(k, v)| append(k, &v_t(v)?)).collect()
    };
    let plain = [
        (parts[0].clone(), parts[1].clone()),
        (parts[2].clone(), parts[3].clone()),
    ];
    let vars: Vec<Var> = parts.iter().map(Var::from_tensor).collect::<Result<_>>()?;
    let tracked = [
        (vars[0].as_tensor().clone(), vars[1].as_tensor().clone()),
        (vars[2].as_tensor().clone(), vars[3].as_tensor().clone()),
    ];
    let caches: [(&str, usize, MakeCache); 3] = [
        (
            "KvCache",
            2,
            Box::new(|| {
                let mut c = KvCache::new(2, 16);
                Box::new(move |k: &Tensor, v: &Tensor| c.append(k, v))
            }),
        ),
        (
            "ConcatKvCache",
            2,
            Box::new(|| {
                let mut c = ConcatKvCache::new(2);
                Box::new(move |k: &Tensor, v: &Tensor| c.append(k, v))
            }),
        ),
        // One append (the rotating cache's tracked case): within its window.
        (
            "RotatingKvCache",
            1,
            Box::new(|| {
                let mut c = RotatingKvCache::new(2, 8);
                Box::new(move |k: &Tensor, v: &Tensor| c.append(k, v))
            }),
        ),
    ];
    for (name, steps, make) in caches {
        let a = run(&mut *make(), &plain[..steps])?;
        let b = run(&mut *make(), &tracked[..steps])?;
        let (ka, va) = a.last().unwrap();
        let (kb, vb) = b.last().unwrap();
        let bits = |t: &Tensor| t.flatten_all()?.to_vec1::<f32>();
        assert_eq!(bits(ka)?, bits(kb)?, "{name}: keys");
        assert_eq!(bits(va)?, bits(vb)?, "{name}: values");
        let grads = (kb.sum_all()? + vb.sum_all()?)?.backward()?;
        for var in &vars[..2 * steps] {
            assert!(
                grads.get(var.as_tensor()).is_some(),
                "{name}: an append lost its gradient"
            );
        }
    }
    Ok(())
}
