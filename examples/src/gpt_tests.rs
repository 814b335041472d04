//! Tests of [`Gpt`](super::Gpt); a separate file keeps `gpt.rs` short.

use super::*;
use candle_nn::{Optimizer, VarMap};

fn tiny() -> GptConfig {
    GptConfig {
        vocab_size: 11,
        n_embd: 16,
        n_layer: 2,
        n_head: 2,
        block_size: 8,
    }
}

/// A model with seeded initial weights, so every assertion on values is
/// deterministic (candle's own CPU initialisation cannot be seeded).
fn build(cfg: GptConfig, dtype: DType) -> Result<(VarMap, Gpt)> {
    use accel_core::{Accelerator, AcceleratorConfig, PrecisionType};
    let precision = match dtype {
        DType::BF16 => PrecisionType::Bf16,
        DType::F16 => PrecisionType::Fp16,
        _ => PrecisionType::No,
    };
    let config = AcceleratorConfig::default()
        .with_seed(7)
        .with_mixed_precision(precision)
        .with_device(Device::Cpu);
    let acc = Accelerator::new(config).map_err(|e| candle_core::Error::Msg(e.to_string()))?;
    let map = VarMap::new();
    let gpt = Gpt::new(cfg, acc.var_builder(&map))?;
    Ok((map, gpt))
}

fn ids(data: &[u32], b: usize, t: usize) -> Result<Tensor> {
    Tensor::from_slice(data, (b, t), &Device::Cpu)
}

#[test]
fn presets_have_the_documented_shapes() {
    let b = GptConfig::bench();
    assert_eq!(
        (b.vocab_size, b.n_embd, b.n_layer, b.n_head, b.block_size),
        (4096, 256, 4, 4, 128)
    );
    assert_eq!(b.head_dim(), 64);
    assert_eq!(b.num_params(), 4_240_896);
    // transformers' GPT2LMHeadModel (gpt2) has 124,439,808 parameters.
    let g = GptConfig::gpt2_124m();
    assert_eq!(g.num_params(), 124_439_808);
    assert_eq!(g.head_dim(), 64);
    let c = GptConfig::char_small(65);
    assert_eq!(
        (c.vocab_size, c.n_embd, c.n_layer, c.n_head, c.block_size),
        (65, 128, 4, 4, 64)
    );
}

#[test]
fn gpt_forward_gives_one_logit_vector_per_position() -> Result<()> {
    let (_, gpt) = build(tiny(), DType::F32)?;
    let idx = ids(&[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 2, 5)?;
    assert_eq!(gpt.forward(&idx)?.dims(), &[2, 5, 11]);
    let too_long = Tensor::zeros((1, 9), DType::U32, &Device::Cpu)?;
    assert!(gpt.forward(&too_long).is_err());
    Ok(())
}

#[test]
fn gpt_parameters_use_hf_names_and_the_lm_head_is_the_token_embedding() -> Result<()> {
    let cfg = tiny();
    let (map, gpt) = build(cfg, DType::F32)?;
    let mut names: Vec<String> = map.data().lock().unwrap().keys().cloned().collect();
    names.sort();
    let mut expected = vec!["wte.weight", "wpe.weight", "ln_f.weight", "ln_f.bias"]
        .into_iter()
        .map(String::from)
        .collect::<Vec<_>>();
    for i in 0..cfg.n_layer {
        for p in [
            "ln_1",
            "attn.c_attn",
            "attn.c_proj",
            "ln_2",
            "mlp.c_fc",
            "mlp.c_proj",
        ] {
            expected.push(format!("h.{i}.{p}.weight"));
            expected.push(format!("h.{i}.{p}.bias"));
        }
    }
    expected.sort();
    assert_eq!(
        names, expected,
        "one tensor for wte and the lm_head, no lm_head.weight"
    );
    let total: usize = map.all_vars().iter().map(|v| v.elem_count()).sum();
    assert_eq!(total, cfg.num_params());
    let dims = |n: &str| map.data().lock().unwrap()[n].dims().to_vec();
    assert_eq!(
        dims("h.0.attn.c_attn.weight"),
        vec![48, 16],
        "[out, in] layout"
    );
    assert_eq!(dims("h.1.mlp.c_proj.weight"), vec![16, 64]);

    // Zeroing the one embedding tensor zeroes every logit, so the lm_head
    // really reads that same tensor.
    map.data().lock().unwrap()["wte.weight"].set(&Tensor::zeros(
        (11, 16),
        DType::F32,
        &Device::Cpu,
    )?)?;
    let logits = gpt.forward(&ids(&[1, 2, 3], 1, 3)?)?;
    assert_eq!(logits.abs()?.max_all()?.to_scalar::<f32>()?, 0.0);
    Ok(())
}

#[test]
fn changing_a_future_token_leaves_earlier_logits_exactly_unchanged() -> Result<()> {
    for fused in [true, false] {
        let (_, mut gpt) = build(tiny(), DType::F32)?;
        gpt.set_fused_kernels(fused);
        let a = gpt.forward(&ids(&[3, 1, 4, 1, 5, 9, 2, 6], 1, 8)?)?;
        let b = gpt.forward(&ids(&[3, 1, 4, 1, 5, 7, 7, 7], 1, 8)?)?;
        let (a, b) = (
            a.squeeze(0)?.to_vec2::<f32>()?,
            b.squeeze(0)?.to_vec2::<f32>()?,
        );
        assert_eq!(a[..5], b[..5], "fused={fused}: positions before the change");
        assert_ne!(a[5], b[5], "fused={fused}: the changed position itself");
    }
    Ok(())
}

/// Loss and gradients of a tiny model on a fixed batch, with either path.
fn loss_and_grads(map: &VarMap, gpt: &Gpt) -> Result<(f32, Vec<(String, Tensor)>)> {
    let x = ids(&[1, 2, 3, 4, 5, 6, 7, 8, 0, 9, 8, 7, 6, 5, 4, 3], 2, 8)?;
    let y = ids(&[2, 3, 4, 5, 6, 7, 8, 9, 9, 8, 7, 6, 5, 4, 3, 2], 2, 8)?;
    let loss = gpt.loss(&x, &y)?;
    assert_eq!(loss.dtype(), DType::F32, "loss computed in f32");
    let grads = loss.backward()?;
    let mut out = Vec::new();
    for (name, var) in map.data().lock().unwrap().iter() {
        let g = grads
            .get(var.as_tensor())
            .unwrap_or_else(|| panic!("no gradient for {name}"));
        out.push((name.clone(), g.to_dtype(DType::F32)?));
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    Ok((loss.to_scalar::<f32>()?, out))
}

#[test]
fn gpt_forward_backward_runs_with_loss_near_ln_vocab_and_a_gradient_for_every_parameter(
) -> Result<()> {
    for fused in [true, false] {
        let (map, mut gpt) = build(tiny(), DType::F32)?;
        gpt.set_fused_kernels(fused);
        let (loss, grads) = loss_and_grads(&map, &gpt)?;
        assert!(
            (loss - (11f32).ln()).abs() < 0.05,
            "fused={fused}: loss {loss}"
        );
        assert_eq!(grads.len(), 4 + 12 * 2);
        for (name, g) in &grads {
            let norm = g.sqr()?.sum_all()?.to_scalar::<f32>()?;
            assert!(
                norm.is_finite() && norm > 0.0,
                "fused={fused}: {name} grad norm {norm}"
            );
        }
    }
    Ok(())
}

#[test]
fn fused_kernels_match_composed_candle_ops_in_loss_and_gradients() -> Result<()> {
    let (map, mut gpt) = build(tiny(), DType::F32)?;
    // Larger weights than the init so activations leave the linear regime.
    for var in map.all_vars() {
        var.set(&(var.as_tensor() * 10.0)?)?;
    }
    let (fused_loss, fused) = loss_and_grads(&map, &gpt)?;
    gpt.set_fused_kernels(false);
    let (loss, composed) = loss_and_grads(&map, &gpt)?;
    assert!(
        (fused_loss - loss).abs() < 1e-4 * loss,
        "{fused_loss} vs {loss}"
    );
    for ((name, a), (_, b)) in fused.iter().zip(&composed) {
        let err = (a - b)?.abs()?.max_all()?.to_scalar::<f32>()?;
        let scale = b.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(
            err <= 1e-3 * scale + 1e-6,
            "{name}: max diff {err}, max |grad| {scale}"
        );
    }
    Ok(())
}

#[test]
fn gpt_trains_in_bf16_and_f16_with_an_f32_loss() -> Result<()> {
    for dtype in [DType::BF16, DType::F16] {
        for fused in [true, false] {
            let (map, mut gpt) = build(tiny(), dtype)?;
            gpt.set_fused_kernels(fused);
            assert_eq!(gpt.forward(&ids(&[1, 2], 1, 2)?)?.dtype(), dtype);
            let (loss, grads) = loss_and_grads(&map, &gpt)?;
            assert!(
                (loss - (11f32).ln()).abs() < 0.1,
                "{dtype:?} fused={fused}: loss {loss}"
            );
            assert_eq!(grads.len(), 28);
            for (name, g) in &grads {
                let finite = g
                    .flatten_all()?
                    .to_vec1::<f32>()?
                    .iter()
                    .all(|v| v.is_finite());
                assert!(
                    finite,
                    "{dtype:?} fused={fused}: {name} has a non-finite gradient"
                );
            }
        }
    }
    Ok(())
}

#[test]
fn adamw_steps_lower_the_loss_on_a_repeated_batch() -> Result<()> {
    let (map, gpt) = build(tiny(), DType::F32)?;
    let x = ids(&[1, 2, 3, 4, 5, 6, 7, 8], 1, 8)?;
    let y = ids(&[2, 3, 4, 5, 6, 7, 8, 9], 1, 8)?;
    let params = candle_nn::ParamsAdamW {
        lr: 1e-2,
        ..Default::default()
    };
    let mut opt = candle_nn::AdamW::new(map.all_vars(), params)?;
    let first = gpt.loss(&x, &y)?.to_scalar::<f32>()?;
    for _ in 0..20 {
        opt.backward_step(&gpt.loss(&x, &y)?)?;
    }
    let last = gpt.loss(&x, &y)?.to_scalar::<f32>()?;
    assert!(last < 0.5 * first, "loss went from {first} to {last}");
    Ok(())
}

#[test]
fn generate_extends_the_prompt_greedily_and_deterministically() -> Result<()> {
    let (_, gpt) = build(tiny(), DType::F32)?;
    let mut rng = SplitMix64::new(0);
    // Longer than block_size, so the context window has to slide.
    let out = gpt.generate(&[1, 2, 3], 10, 0.0, &mut rng)?;
    assert_eq!(out.len(), 13);
    assert_eq!(&out[..3], &[1, 2, 3]);
    assert!(out.iter().all(|&t| t < 11));
    assert_eq!(out, gpt.generate(&[1, 2, 3], 10, 0.0, &mut rng)?);
    let a = gpt.generate(&[1], 5, 1.0, &mut SplitMix64::new(5))?;
    assert_eq!(a, gpt.generate(&[1], 5, 1.0, &mut SplitMix64::new(5))?);
    Ok(())
}
