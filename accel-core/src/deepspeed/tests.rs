//! Against transformers' `HfTrainerDeepSpeedConfig` and DeepSpeed's own
//! schedules (tests/fixtures/deepspeed/reference.json, written by
//! scripts/make_deepspeed_fixtures.py).

use serde_json::{json, Value};

use super::*;
use crate::precision::PrecisionType;

fn fixtures() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/deepspeed")
}

fn reference() -> Value {
    let text = std::fs::read_to_string(fixtures().join("reference.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// The TrainingArguments of the reference's `args`.
fn args(a: &Value) -> TrainingArguments {
    let mut t = TrainingArguments::new("out");
    t.per_device_train_batch_size = a["per_device_train_batch_size"].as_u64().unwrap() as usize;
    t.gradient_accumulation_steps = a["gradient_accumulation_steps"].as_u64().unwrap() as usize;
    t.max_grad_norm = a["max_grad_norm"].as_f64().unwrap();
    t.learning_rate = a["learning_rate"].as_f64().unwrap();
    t.adam_beta1 = a["adam_beta1"].as_f64().unwrap();
    t.adam_beta2 = a["adam_beta2"].as_f64().unwrap();
    t.adam_epsilon = a["adam_epsilon"].as_f64().unwrap();
    t.weight_decay = a["weight_decay"].as_f64().unwrap();
    t.fp16 = a["fp16"].as_bool().unwrap();
    t.bf16 = a["bf16"].as_bool().unwrap();
    t.warmup_steps = a["warmup_steps"].as_u64().unwrap();
    t
}

/// JSON equality with numbers as numbers.
fn assert_same(got: &Value, want: &Value, at: &str) {
    match (got, want) {
        (Value::Object(g), Value::Object(w)) => {
            let (gk, wk): (Vec<_>, Vec<_>) = (g.keys().collect(), w.keys().collect());
            assert_eq!(gk, wk, "keys at {at}");
            for (k, v) in w {
                assert_same(&g[k], v, &format!("{at}.{k}"));
            }
        }
        _ => assert!(same(got, want), "{at}: {got} vs transformers' {want}"),
    }
}

fn filled(case: &str, file: &str) -> (DeepSpeedConfig, Result<()>) {
    let r = &reference()["fills"][case];
    let a = args(&r["args"]);
    let mut c = DeepSpeedConfig::from_path(fixtures().join(file)).unwrap();
    if case == "mismatch" {
        let v = c.config.as_object_mut().unwrap();
        v["optimizer"]["params"]["lr"] = json!(1e-4);
        v["gradient_accumulation_steps"] = json!(4);
        v["train_micro_batch_size_per_gpu"] = json!(2);
    }
    c.fill_from_args(&a, r["args"]["world_size"].as_u64().unwrap() as usize);
    let steps = r["num_training_steps"].as_u64().unwrap();
    let hidden = r["hidden_size"].as_u64().map(|h| h as usize);
    let done = c.finalize(&a, hidden, steps);
    (c, done)
}

#[test]
fn auto_values_are_filled_as_transformers_fills_them() {
    for (case, file) in [
        ("zero2", "ds_zero2.json"),
        ("zero3_offload", "ds_zero3_offload.json"),
    ] {
        let (c, done) = filled(case, file);
        done.unwrap();
        assert_same(c.as_json(), &reference()["fills"][case]["config"], case);
    }
}

#[test]
fn contradicting_values_are_one_error_in_transformers_words() {
    let (_, done) = filled("mismatch", "ds_zero2.json");
    let err = done.unwrap_err().to_string();
    let want = reference()["fills"]["mismatch"]["error"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(err.contains(&want), "{err}\nwant:\n{want}");
    assert!(err.contains("ds_zero2.json"), "{err}");
}

#[test]
fn the_guides_configs_map_onto_zero_strategies_and_offload() {
    let (c, _) = filled("zero2", "ds_zero2.json");
    let p = c.plan().unwrap();
    assert_eq!(p.zero_stage, 2);
    assert_eq!(
        p.sharding_strategy(),
        Some(accel_dist::fsdp::ShardingStrategy::ShardGradOp)
    );
    assert!(p.offload_optimizer && !p.offload_param);
    assert_eq!(p.precision, Some(PrecisionType::No));
    assert_eq!(p.gradient_clipping, Some(0.5));
    assert_eq!(
        (
            p.micro_batch_size,
            p.gradient_accumulation_steps,
            p.train_batch_size
        ),
        (Some(2), Some(2), Some(8))
    );
    let Some(DeepSpeedOptimizer::AdamW(o)) = p.optimizer else {
        panic!("{:?}", p.optimizer)
    };
    assert_eq!(
        (o.lr, o.beta2, o.eps, o.weight_decay),
        (3e-3, 0.95, 1e-7, 0.01)
    );
    // Bucket sizes and the like are named at start-up, not dropped.
    for key in [
        "steps_per_print",
        "zero_optimization.overlap_comm",
        "zero_optimization.allgather_bucket_size",
    ] {
        assert!(
            p.notices.iter().any(|n| n.contains(&format!("`{key}`"))),
            "{key}: {:?}",
            p.notices
        );
    }
    // fp16 is off: its loss-scale settings act nowhere, so are not listed.
    assert!(
        !p.notices.iter().any(|n| n.contains("fp16")),
        "{:?}",
        p.notices
    );
    let (c, _) = filled("zero3_offload", "ds_zero3_offload.json");
    let p = c.plan().unwrap();
    assert_eq!(
        p.sharding_strategy(),
        Some(accel_dist::fsdp::ShardingStrategy::FullShard)
    );
    assert!(p.offload_optimizer && p.offload_param && p.save_16bit_model);
    // No bf16 section: the arguments' precision applies (Accelerate adds the section).
    assert_eq!(p.precision, Some(PrecisionType::No));
}

#[test]
fn deepspeeds_schedules_give_deepspeeds_rates_at_every_step() {
    let r = reference();
    let kinds = [
        ("warmup_log", "WarmupLR"),
        ("warmup_linear", "WarmupLR"),
        ("warmup_decay", "WarmupDecayLR"),
        ("warmup_cosine", "WarmupCosineLR"),
    ];
    for (case, kind) in kinds {
        let s = &r["schedules"][case];
        let c = DeepSpeedConfig::from_value(
            json!({"scheduler": {"type": kind, "params": s["params"]}}),
        )
        .unwrap();
        let base = s["base_lr"].as_f64().unwrap();
        let d = c.scheduler(base).unwrap().unwrap();
        let lr0 = d.base_lr.unwrap_or(base);
        for (step, want) in s["lrs"].as_array().unwrap().iter().enumerate() {
            let got = lr0 * d.schedule.factor(step as u64);
            let want = want.as_f64().unwrap();
            assert!(
                (got - want).abs() <= 1e-12 * want.abs().max(1e-3),
                "{case} step {step}: {got} vs {want}"
            );
        }
    }
}

#[test]
fn what_cannot_run_here_is_refused_by_name_and_unknown_keys_are_listed() {
    let refused = [
        (
            json!({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}}),
            "offload_param.device",
        ),
        (
            json!({"zero_optimization": {"stage": 4}}),
            "zero_optimization.stage",
        ),
        (
            json!({"optimizer": {"type": "OneBitAdam"}}),
            "optimizer.type",
        ),
        (json!({"scheduler": {"type": "OneCycle"}}), "scheduler.type"),
        (
            json!({"optimizer": {"type": "Adam", "params": {"adam_w_mode": false, "weight_decay": 0.1}}}),
            "adam_w_mode",
        ),
        (
            json!({"bf16": {"enabled": true}, "fp16": {"enabled": true}}),
            "bf16.enabled",
        ),
        (json!({"gradient_clipping": "auto"}), "gradient_clipping"),
        (
            json!({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}),
            "offload_param",
        ),
    ];
    for (config, key) in refused {
        let err = DeepSpeedConfig::from_value(config.clone())
            .unwrap()
            .plan()
            .unwrap_err()
            .to_string();
        assert!(err.contains(key), "{config}: {err}");
    }
    let p = DeepSpeedConfig::from_value(json!({
        "zero_optimisation": {"stage": 2},
        "zero_optimization": {"stage": 2, "zero_quantized_weights": true},
        "fp16": {"enabled": true, "hysteresis": 2, "initial_scale_power": 12},
    }))
    .unwrap()
    .plan()
    .unwrap();
    assert!(
        p.notices
            .iter()
            .any(|n| n.contains("`zero_optimisation`") && n.contains("not a DeepSpeed key")),
        "{:?}",
        p.notices
    );
    assert!(
        p.notices
            .iter()
            .any(|n| n.contains("zero_quantized_weights")),
        "{:?}",
        p.notices
    );
    assert!(
        p.notices.iter().any(|n| n.contains("`fp16.hysteresis`")),
        "{:?}",
        p.notices
    );
    assert_eq!(p.precision, Some(PrecisionType::Fp16));
    assert_eq!(p.scaler.unwrap().init_scale, 4096.0);
}

#[test]
fn python_prints_values_as_transformers_message_does() {
    assert_eq!(python(&json!(1e-4)), "0.0001");
    assert_eq!(python(&json!(3e-5)), "3e-05");
    assert_eq!(python(&json!(1.0)), "1.0");
    assert_eq!(python(&json!([0.9, 0.999])), "[0.9, 0.999]");
    assert_eq!(python(&json!(true)), "True");
    assert_eq!(python(&json!(4)), "4");
}
