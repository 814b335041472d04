//! The single-process Accelerator: mixed precision, loss scaling, gradient
//! accumulation, clipping, seeding, checkpoints and bad checkpoint input.

use accel_core::data::{DataLoader, DataLoaderConfig, TensorDataset};
use accel_core::optim::{transformers_no_decay, AdamW, AdamWConfig, Sgd, SgdConfig};
use accel_core::{
    Accelerator, AcceleratorConfig, GradScalerConfig, GradientAccumulationPlugin, PrecisionType,
};
use candle_core::{DType, Device, Tensor};
use candle_nn::{Module, VarMap};

fn acc(config: AcceleratorConfig) -> Accelerator {
    Accelerator::new(config.with_device(Device::Cpu)).unwrap()
}

fn weights(m: &accel_core::PreparedModel) -> Vec<Vec<u32>> {
    m.master_weights()
        .into_iter()
        .map(|(_, t)| {
            t.flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap()
                .iter()
                .map(|x| x.to_bits())
                .collect()
        })
        .collect()
}

/// An fp16 Accelerator; `init_scale` replaces PyTorch's 65536 when given.
fn fp16(init_scale: Option<f64>) -> Accelerator {
    let mut config = AcceleratorConfig::default()
        .with_seed(1)
        .with_mixed_precision(PrecisionType::Fp16);
    if let Some(init_scale) = init_scale {
        config = config.with_scaler(GradScalerConfig {
            init_scale,
            ..Default::default()
        });
    }
    acc(config)
}

/// One f16 input row.
fn f16_row(values: &[f32]) -> Tensor {
    Tensor::new(values, &Device::Cpu)
        .unwrap()
        .unsqueeze(0)
        .unwrap()
        .to_dtype(DType::F16)
        .unwrap()
}

/// Back-propagates `sum(lin(x))` in f32, so d loss / d weight = x.
fn backward_sum(a: &mut Accelerator, lin: &candle_nn::Linear, x: &Tensor) {
    let loss = lin
        .forward(x)
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap()
        .sum_all()
        .unwrap();
    a.backward(&loss).unwrap();
}

fn sgd(lr: f64) -> Sgd {
    Sgd::new(SgdConfig {
        lr,
        ..Default::default()
    })
}

#[test]
fn fp16_step_with_inf_or_nan_gradients_is_skipped_and_backs_off_the_scale() {
    for bad in [f32::INFINITY, f32::NAN] {
        // A scale small enough that only the injected value can overflow.
        let mut a = fp16(Some(1024.0));
        let vm = VarMap::new();
        let lin = candle_nn::linear(3, 1, a.var_builder(&vm)).unwrap();
        let model = a.prepare_model(&vm).unwrap();
        let mut opt = a.prepare_optimizer(&model, AdamW::new(AdamWConfig::default()));
        let before = weights(&model);
        backward_sum(&mut a, &lin, &f16_row(&[1.0, bad, 2.0]));
        opt.step().unwrap();
        opt.zero_grad();
        assert!(opt.step_was_skipped(), "{bad}: step not skipped");
        assert_eq!(weights(&model), before, "{bad}: weights changed");
        assert_eq!(a.loss_scale(), Some(512.0));

        // A finite step afterwards goes through at the reduced scale.
        backward_sum(&mut a, &lin, &f16_row(&[1.0, 0.5, 2.0]));
        opt.step().unwrap();
        assert!(!opt.step_was_skipped());
        assert_ne!(weights(&model), before);
        assert_eq!(a.loss_scale(), Some(512.0));
    }
}

#[test]
fn fp16_first_step_at_the_default_scale_overflows_and_backs_off_as_in_pytorch() {
    // The output gradient of a sum is 1; times 65536 it exceeds f16's max (65504).
    let mut a = fp16(None);
    let vm = VarMap::new();
    let lin = candle_nn::linear_no_bias(2, 1, a.var_builder(&vm)).unwrap();
    let model = a.prepare_model(&vm).unwrap();
    let mut opt = a.prepare_optimizer(&model, sgd(1.0));
    for (expect_skip, scale_after) in [(true, 32768.0), (false, 32768.0)] {
        backward_sum(&mut a, &lin, &f16_row(&[0.25, -0.5]));
        opt.step().unwrap();
        opt.zero_grad();
        assert_eq!(opt.step_was_skipped(), expect_skip);
        assert_eq!(a.loss_scale(), Some(scale_after));
    }
}

#[test]
fn fp16_gradients_are_unscaled_before_the_step() {
    // SGD lr=1: w_new = w - grad, so the update shows the unscaled gradient exactly.
    let mut a = fp16(Some(1024.0));
    let vm = VarMap::new();
    let lin = candle_nn::linear_no_bias(2, 1, a.var_builder(&vm)).unwrap();
    let model = a.prepare_model(&vm).unwrap();
    let mut opt = a.prepare_optimizer(&model, sgd(1.0));
    let flat = |m: &accel_core::PreparedModel| {
        m.master_weights()[0]
            .1
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
    };
    let w0 = flat(&model);
    backward_sum(&mut a, &lin, &f16_row(&[0.25, -0.5]));
    opt.step().unwrap();
    assert!(!opt.step_was_skipped());
    assert_eq!(flat(&model), vec![w0[0] - 0.25, w0[1] + 0.5]);
}

#[test]
fn bf16_model_weights_are_the_rounded_fp32_masters_after_each_step() {
    let mut a = acc(AcceleratorConfig::default()
        .with_seed(3)
        .with_mixed_precision(PrecisionType::Bf16));
    let vm = VarMap::new();
    let lin = candle_nn::linear(8, 4, a.var_builder(&vm)).unwrap();
    let model = a.prepare_model(&vm).unwrap();
    let mut opt = a.prepare_optimizer(
        &model,
        AdamW::new(AdamWConfig {
            lr: 0.01,
            ..Default::default()
        }),
    );
    let x = Tensor::ones((2, 8), DType::BF16, &Device::Cpu).unwrap();
    for _ in 0..3 {
        let loss = lin
            .forward(&x)
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap()
            .sqr()
            .unwrap()
            .mean_all()
            .unwrap();
        a.backward(&loss).unwrap();
        opt.step().unwrap();
        opt.zero_grad();
    }
    let data = vm.data().lock().unwrap();
    for (name, master) in model.master_weights() {
        assert_eq!(master.dtype(), DType::F32);
        let live = data[&name].as_tensor();
        assert_eq!(live.dtype(), DType::BF16);
        let want = master
            .to_dtype(DType::BF16)
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap();
        let got = live.to_dtype(DType::F32).unwrap();
        assert_eq!(
            got.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            want.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            "{name}"
        );
    }
}

#[test]
fn prepare_optimizer_passes_names_so_biases_skip_weight_decay() {
    let mut a = acc(AcceleratorConfig::default().with_seed(5));
    let vm = VarMap::new();
    let lin = candle_nn::linear(4, 3, a.var_builder(&vm)).unwrap();
    let model = a.prepare_model(&vm).unwrap();
    let (lr, wd) = (0.1, 2.0);
    let mut opt = a.prepare_optimizer(
        &model,
        AdamW::new(AdamWConfig {
            lr,
            weight_decay: wd,
            ..Default::default()
        })
        .with_no_decay(transformers_no_decay),
    );
    let before: Vec<(String, Vec<f32>)> = model
        .master_weights()
        .into_iter()
        .map(|(n, t)| (n, t.flatten_all().unwrap().to_vec1().unwrap()))
        .collect();
    // With a zero input the weight's gradient is 0, so Adam leaves it alone and
    // only decoupled decay moves it; the bias (gradient 2) must step exactly as
    // AdamW without weight decay.
    let x = Tensor::zeros((2, 4), DType::F32, &Device::Cpu).unwrap();
    backward_sum(&mut a, &lin, &x);
    opt.step().unwrap();
    let after: Vec<(String, Vec<f32>)> = model
        .master_weights()
        .into_iter()
        .map(|(n, t)| (n, t.flatten_all().unwrap().to_vec1().unwrap()))
        .collect();
    assert_eq!(before[0].0, "bias");
    let bias = Tensor::new(before[0].1.as_slice(), &Device::Cpu).unwrap();
    let mut plain = AdamW::new(AdamWConfig {
        lr,
        weight_decay: 0.0,
        ..Default::default()
    });
    let grad = Tensor::full(2f32, 3, &Device::Cpu).unwrap();
    accel_core::optim::Optimizer::step(&mut plain, std::slice::from_ref(&bias), &[grad], &[0])
        .unwrap();
    assert_eq!(after[0].1, bias.to_vec1::<f32>().unwrap());
    assert_eq!(after[1].0, "weight");
    let decayed: Vec<f32> = before[1]
        .1
        .iter()
        .map(|v| v * (1.0 - lr * wd) as f32)
        .collect();
    assert_eq!(after[1].1, decayed);
}

#[test]
fn two_accumulated_micro_batches_equal_one_double_batch() {
    let x = Tensor::arange(0f32, 32.0, &Device::Cpu)
        .unwrap()
        .reshape((8, 4))
        .unwrap()
        .affine(0.1, -1.0)
        .unwrap();
    let run = |steps: usize, chunks: usize| {
        let mut a = acc(AcceleratorConfig::default()
            .with_seed(9)
            .with_gradient_accumulation_steps(steps));
        let vm = VarMap::new();
        let lin = candle_nn::linear(4, 2, a.var_builder(&vm)).unwrap();
        let model = a.prepare_model(&vm).unwrap();
        let mut opt = a.prepare_optimizer(&model, sgd(0.1));
        for c in 0..chunks {
            let xb = x.narrow(0, c * 8 / chunks, 8 / chunks).unwrap();
            a.accumulate(|a| {
                let loss = lin.forward(&xb)?.sqr()?.mean_all()?;
                a.backward(&loss)?;
                opt.step()?;
                opt.zero_grad();
                Ok(())
            })
            .unwrap();
        }
        model
            .master_weights()
            .into_iter()
            .map(|(_, t)| t.flatten_all().unwrap().to_vec1::<f32>().unwrap())
            .collect::<Vec<_>>()
    };
    let accumulated = run(2, 2);
    let whole = run(1, 1);
    for (a, b) in accumulated.iter().flatten().zip(whole.iter().flatten()) {
        assert!((a - b).abs() < 1e-6, "{a} vs {b}");
    }
    // The accumulation really deferred the step: one micro-batch alone changes nothing.
    let initial = run(2, 0);
    assert_eq!(run(2, 1), initial);
    assert_ne!(accumulated, initial);
}

#[test]
fn the_last_batch_of_an_epoch_forces_an_optimizer_step() {
    let mut a = acc(AcceleratorConfig::default()
        .with_seed(0)
        .with_gradient_accumulation(GradientAccumulationPlugin::with_steps(2)));
    let x = Tensor::ones((5, 2), DType::F32, &Device::Cpu).unwrap();
    let loader = a.prepare_data_loader(DataLoader::new(
        TensorDataset::new(vec![x]).unwrap(),
        DataLoaderConfig::new(1),
    ));
    let mut syncs = vec![];
    for b in loader.iter() {
        b.unwrap();
        a.accumulate(|a| {
            syncs.push(a.sync_gradients());
            Ok(())
        })
        .unwrap();
    }
    assert_eq!(syncs, vec![false, true, false, true, true]);
}

#[test]
fn clip_grad_norm_returns_the_global_norm_and_scales_to_max_norm() {
    let mut a = acc(AcceleratorConfig::default().with_seed(0));
    let vm = VarMap::new();
    let lin = candle_nn::linear_no_bias(2, 1, a.var_builder(&vm)).unwrap();
    let model = a.prepare_model(&vm).unwrap();
    // d(sum(w.x))/dw = x = [3, 4]: norm 5.
    let x = Tensor::new(&[[3f32, 4.0]], &Device::Cpu).unwrap();
    a.backward(&lin.forward(&x).unwrap().sum_all().unwrap())
        .unwrap();
    let norm = a.clip_grad_norm(&model, 1.0).unwrap();
    assert_eq!(norm, 5.0);
    let g = model.gradients()[0]
        .1
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    let coef = 1.0f32 / (5.0 + 1e-6);
    assert_eq!(g, vec![3.0 * coef, 4.0 * coef]);
    a.clip_grad_value(&model, 0.7).unwrap();
    let g = model.gradients()[0]
        .1
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    assert_eq!(g, vec![3.0 * coef, 0.7]);
}

#[test]
fn the_same_seed_gives_the_same_initial_weights() {
    let init = |seed| {
        let a = acc(AcceleratorConfig::default().with_seed(seed));
        let vm = VarMap::new();
        candle_nn::linear(16, 8, a.var_builder(&vm)).unwrap();
        let w = vm.data().lock().unwrap()["weight"]
            .as_tensor()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        w
    };
    assert_eq!(init(1), init(1));
    assert_ne!(init(1), init(2));
}

#[test]
fn bad_checkpoints_give_errors_naming_the_file_and_tensor() {
    let dir = tempfile::tempdir().unwrap();
    let make = || {
        let mut a = acc(AcceleratorConfig::default().with_seed(0));
        let vm = VarMap::new();
        candle_nn::linear(4, 2, a.var_builder(&vm).pp("fc")).unwrap();
        let model = a.prepare_model(&vm).unwrap();
        a.prepare_optimizer(&model, AdamW::new(AdamWConfig::default()));
        a
    };
    let ckpt = dir.path().join("ckpt");
    make().save_state(Some(&ckpt)).unwrap();
    make().load_state(Some(&ckpt)).unwrap();

    // A missing folder.
    let err = make()
        .load_state(Some(&dir.path().join("nope")))
        .unwrap_err()
        .to_string();
    assert!(err.contains("nope"), "{err}");

    // A truncated model file.
    let model_file = ckpt.join("model.safetensors");
    let bytes = std::fs::read(&model_file).unwrap();
    std::fs::write(&model_file, &bytes[..bytes.len() - 5]).unwrap();
    let err = make().load_state(Some(&ckpt)).unwrap_err().to_string();
    assert!(err.contains("model.safetensors"), "{err}");
    std::fs::write(&model_file, &bytes).unwrap();

    // A model of another shape.
    let mut other = acc(AcceleratorConfig::default().with_seed(0));
    let vm = VarMap::new();
    candle_nn::linear(4, 3, other.var_builder(&vm).pp("fc")).unwrap();
    other.prepare_model(&vm).unwrap();
    let err = other.load_state(Some(&ckpt)).unwrap_err().to_string();
    assert!(
        err.contains("`fc.") && err.contains("model.safetensors") && err.contains("[3]"),
        "{err}"
    );

    // A missing optimizer file.
    std::fs::remove_file(ckpt.join("optimizer.safetensors")).ok();
    std::fs::remove_file(ckpt.join("optimizer.json")).unwrap();
    let err = make().load_state(Some(&ckpt)).unwrap_err().to_string();
    assert!(err.contains("optimizer"), "{err}");
}

#[test]
fn save_model_shards_like_transformers() {
    let mut a = acc(AcceleratorConfig::default().with_seed(0));
    let vm = VarMap::new();
    let vb = a.var_builder(&vm);
    candle_nn::linear(64, 64, vb.pp("a")).unwrap(); // 16384 + 256 bytes
    candle_nn::linear(64, 64, vb.pp("b")).unwrap();
    let model = a.prepare_model(&vm).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let files = a.save_model(&model, dir.path(), "20KB").unwrap();
    let names: Vec<String> = files
        .iter()
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    assert!(
        names.contains(&"model-00001-of-00002.safetensors".to_string()),
        "{names:?}"
    );
    let index: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.path().join("model.safetensors.index.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(index["metadata"]["total_size"], 2 * (64 * 64 * 4 + 64 * 4));
    assert_eq!(
        index["weight_map"]["a.bias"],
        "model-00001-of-00002.safetensors"
    );
    assert_eq!(
        index["weight_map"]["b.weight"],
        "model-00002-of-00002.safetensors"
    );

    // Unsharded when it fits.
    let dir = tempfile::tempdir().unwrap();
    let files = a.save_model(&model, dir.path(), "10GB").unwrap();
    assert_eq!(files, vec![dir.path().join("model.safetensors")]);
}

#[test]
fn trackers_record_logged_values() {
    let dir = tempfile::tempdir().unwrap();
    let mut a = acc(AcceleratorConfig::default()
        .with_project(accel_core::ProjectConfiguration {
            project_dir: dir.path().to_path_buf(),
            ..Default::default()
        })
        .with_log_with(["jsonl", "tensorboard"]));
    a.init_trackers("run", &serde_json::json!({"lr": 0.1}))
        .unwrap();
    a.log([("loss", 0.5f64)], Some(3)).unwrap();
    a.end_training().unwrap();
    let text = std::fs::read_to_string(dir.path().join("run/metrics.jsonl")).unwrap();
    let line: serde_json::Value = serde_json::from_str(text.lines().next().unwrap()).unwrap();
    assert_eq!(line["step"], 3);
    assert!(text.contains("0.5"), "{text}");
    let events = std::fs::read_dir(dir.path().join("run"))
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| {
            e.file_name()
                .to_string_lossy()
                .starts_with("events.out.tfevents")
        })
        .count();
    assert_eq!(events, 1);
}

#[test]
fn loading_an_older_checkpoint_by_path_never_makes_the_next_save_collide() {
    let dir = tempfile::tempdir().unwrap();
    let make = || {
        let mut a = acc(AcceleratorConfig::default()
            .with_seed(0)
            .with_project(accel_core::ProjectConfiguration::automatic(dir.path())));
        let vm = VarMap::new();
        candle_nn::linear(2, 2, a.var_builder(&vm)).unwrap();
        a.prepare_model(&vm).unwrap();
        a
    };
    let mut a = make();
    let first = a.save_state(None).unwrap();
    a.save_state(None).unwrap();
    let mut b = make();
    b.load_state(Some(&first)).unwrap();
    let next = b.save_state(None).unwrap();
    assert_eq!(next.file_name().unwrap(), "checkpoint_2");
}

/// A VarMap prepared before the model is built on it holds no parameter: a
/// model built later (lazily, at its first forward) would never train, so
/// preparing it is an error saying what to do.
#[test]
fn preparing_an_empty_varmap_is_an_error_naming_the_fix() {
    let mut a = acc(AcceleratorConfig::default());
    let err = a.prepare_model(&VarMap::new()).unwrap_err().to_string();
    assert!(
        err.contains("no parameters") && err.contains("var_builder"),
        "{err}"
    );
}

/// `gradient_clipping` (DeepSpeed's, which its engine applies at the step
/// without a call): the step clips the global norm first, exactly as a loop
/// that calls `clip_grad_norm` itself.
#[test]
fn gradient_clipping_clips_at_every_step_as_an_explicit_call_does() {
    // 0: no clipping, 1: the config's, 2: an explicit call.
    let run = |how: u8| {
        let mut config = AcceleratorConfig::default().with_seed(0);
        if how == 1 {
            config.gradient_clipping = Some(1.0);
        }
        let mut a = acc(config);
        let vm = VarMap::new();
        let lin = candle_nn::linear_no_bias(2, 1, a.var_builder(&vm)).unwrap();
        let model = a.prepare_model(&vm).unwrap();
        let mut opt = a.prepare_optimizer(&model, sgd(0.1));
        // d(sum(w.x))/dw = x = [3, 4]: norm 5.
        let x = Tensor::new(&[[3f32, 4.0]], &Device::Cpu).unwrap();
        a.backward(&lin.forward(&x).unwrap().sum_all().unwrap())
            .unwrap();
        if how == 2 {
            a.clip_grad_norm(&model, 1.0).unwrap();
        }
        opt.step().unwrap();
        weights(&model)
    };
    let (none, auto, explicit) = (run(0), run(1), run(2));
    assert_eq!(auto, explicit);
    assert_ne!(auto, none, "the clip did not act");
}

/// `save_16bit_model` (DeepSpeed's `stage3_gather_16bit_weights_on_model_save`
/// through `distributed_type: DEEPSPEED`): `save_model` writes the compute
/// dtype; without it, the fp32 masters.
#[test]
fn save_16bit_model_writes_the_compute_dtype() {
    let tmp = tempfile::tempdir().unwrap();
    for (sixteen, want) in [(false, DType::F32), (true, DType::BF16)] {
        let mut config = AcceleratorConfig::default()
            .with_seed(0)
            .with_mixed_precision(PrecisionType::Bf16);
        config.save_16bit_model = sixteen;
        let mut a = acc(config);
        let vm = VarMap::new();
        let _ = candle_nn::linear_no_bias(4, 3, a.var_builder(&vm)).unwrap();
        let model = a.prepare_model(&vm).unwrap();
        let dir = tmp.path().join(format!("m{sixteen}"));
        a.save_model(&model, &dir, "1GB").unwrap();
        let loaded =
            candle_core::safetensors::load(dir.join("model.safetensors"), &Device::Cpu).unwrap();
        for (name, t) in loaded {
            assert_eq!(t.dtype(), want, "{name} with save_16bit_model {sixteen}");
        }
    }
}
