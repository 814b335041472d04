//! TrainingArguments: transformers' defaults and names, and the settings
//! they hand the Accelerator.

use super::*;

#[test]
fn defaults_follow_transformers() {
    let a = TrainingArguments::default();
    assert_eq!(a.learning_rate, 5e-5);
    assert_eq!(a.max_grad_norm, 1.0);
    assert_eq!(a.max_steps, -1);
    assert_eq!(a.num_train_epochs, 3.0);
    assert_eq!(a.per_device_train_batch_size, 8);
    assert_eq!(a.lr_scheduler_type, SchedulerType::Linear);
    assert_eq!(a.seed, 42);
}

#[test]
fn steps_come_from_epochs_unless_max_steps_is_positive() {
    let mut a = TrainingArguments::new("out");
    a.num_train_epochs = 2.5;
    assert_eq!(a.num_training_steps(4), 10);
    a.max_steps = 7;
    assert_eq!(a.num_training_steps(4), 7);
}

#[test]
fn warmup_ratio_rounds_up_and_warmup_steps_win() {
    let mut a = TrainingArguments::new("out");
    a.warmup_ratio = 0.1;
    assert_eq!(a.num_warmup_steps(15), 2);
    a.warmup_steps = 5;
    assert_eq!(a.num_warmup_steps(15), 5);
    a.lr_scheduler_type = SchedulerType::Cosine;
    assert_eq!(
        a.schedule(15),
        Schedule::Cosine {
            warmup: 5,
            total: 15
        }
    );
}

#[test]
fn precision_flags_override_and_conflict() {
    let mut a = TrainingArguments::new("out");
    a.bf16 = true;
    assert_eq!(a.precision().unwrap(), Some(PrecisionType::Bf16));
    a.fp16 = true;
    assert!(a.validate().is_err());
}

#[test]
fn unset_precision_is_left_to_the_launcher_and_an_explicit_one_is_kept() {
    let dir = tempfile::tempdir().unwrap();
    let mut a = TrainingArguments::new(dir.path());
    // None: Accelerator::new takes ACCELERATE_MIXED_PRECISION, then `no`.
    assert_eq!(a.accelerator_config().unwrap().mixed_precision, None);
    a.mixed_precision = Some(PrecisionType::No);
    let c = a.accelerator_config().unwrap();
    assert_eq!(c.mixed_precision, Some(PrecisionType::No));
    assert_eq!(
        crate::config::resolve_precision(c.mixed_precision, Some("bf16")).unwrap(),
        PrecisionType::No
    );
    a.mixed_precision = None;
    a.bf16 = true;
    let c = a.accelerator_config().unwrap();
    assert_eq!(c.mixed_precision, Some(PrecisionType::Bf16));
}

#[test]
fn names_parse_as_in_transformers() {
    assert_eq!(
        "constant_with_warmup".parse::<SchedulerType>().unwrap(),
        SchedulerType::ConstantWithWarmup
    );
    assert_eq!(
        "epoch".parse::<IntervalStrategy>().unwrap(),
        IntervalStrategy::Epoch
    );
    assert!("sometimes".parse::<IntervalStrategy>().is_err());
}

#[test]
fn ddp_settings_reach_the_accelerator_config() {
    let dir = tempfile::tempdir().unwrap();
    let mut a = TrainingArguments::new(dir.path());
    let c = a.accelerator_config().unwrap();
    assert_eq!(c.ddp, DdpConfig::default());
    a.ddp_bucket_cap_mb = Some(4.5);
    a.ddp_comm_hook = CommHook::Bf16;
    let c = a.accelerator_config().unwrap();
    assert_eq!(c.ddp.bucket_cap_mb, 4.5);
    assert_eq!(c.ddp.comm_hook, CommHook::Bf16);
    a.ddp_bucket_cap_mb = Some(0.0);
    assert!(a.accelerator_config().is_err());
}

#[test]
fn old_serialized_arguments_still_load() {
    let mut v = serde_json::to_value(TrainingArguments::default()).unwrap();
    let m = v.as_object_mut().unwrap();
    m.remove("ddp_bucket_cap_mb");
    m.remove("ddp_comm_hook");
    let a: TrainingArguments = serde_json::from_value(v).unwrap();
    assert_eq!(a, TrainingArguments::default());
}

#[test]
fn report_to_none_starts_no_tracker() {
    let mut a = TrainingArguments::new("out");
    a.report_to = vec!["none".into()];
    assert!(a.trackers().is_empty());
}

#[test]
fn ddp_backend_and_timeout_become_the_process_group_settings() {
    let mut a = TrainingArguments::new("out");
    assert_eq!(a.init_kwargs().unwrap(), None);
    a.ddp_timeout = Some(5.0);
    a.ddp_backend = Some("gloo".into());
    let k = a.init_kwargs().unwrap().unwrap();
    assert_eq!(k.timeout, std::time::Duration::from_secs(5));
    assert_eq!(k.backend, Some(accel_dist::Backend::Tcp));
    a.ddp_backend = Some("NCCL".into());
    assert_eq!(
        a.init_kwargs().unwrap().unwrap().backend,
        Some(accel_dist::Backend::Nccl)
    );
    a.use_cpu = true;
    assert!(a
        .init_kwargs()
        .unwrap_err()
        .to_string()
        .contains("use gloo"));
    for refused in ["mpi", "ccl", "hccl"] {
        a.ddp_backend = Some(refused.into());
        let err = a.init_kwargs().unwrap_err().to_string();
        assert!(
            err.contains("ddp_backend") && err.contains(refused),
            "{err}"
        );
    }
    a.ddp_backend = None;
    a.ddp_timeout = Some(0.0);
    assert!(a.init_kwargs().is_err());
}

#[test]
fn transformers_json_arguments_load_with_paths_bools_and_prefixed_keys() {
    let dir = tempfile::tempdir().unwrap();
    let acc = dir.path().join("accelerator_config.json");
    std::fs::write(&acc, r#"{"split_batches": true, "even_batches": false}"#).unwrap();
    let v = serde_json::json!({
        "output_dir": "out",
        "run_name": "r",
        "num_train_epochs": 1.0,
        "max_steps": 3,
        "per_device_train_batch_size": 2,
        "per_device_eval_batch_size": 2,
        "gradient_accumulation_steps": 1,
        "learning_rate": 1e-3,
        "weight_decay": 0.0,
        "adam_beta1": 0.9,
        "adam_beta2": 0.999,
        "adam_epsilon": 1e-8,
        "max_grad_norm": 1.0,
        "lr_scheduler_type": "linear",
        "warmup_steps": 0,
        "warmup_ratio": 0.0,
        "logging_steps": 1,
        "eval_strategy": "no",
        "eval_steps": null,
        "save_strategy": "no",
        "save_steps": 500,
        "save_total_limit": null,
        "seed": 1,
        "mixed_precision": null,
        "bf16": false,
        "fp16": false,
        "report_to": ["jsonl"],
        "resume_from_checkpoint": null,
        "dataloader_drop_last": false,
        "disable_tqdm": true,
        "use_cpu": true,
        "fsdp": true,
        "fsdp_config": {"fsdp_reshard_after_forward": false, "fsdp_transformer_layer_cls_to_wrap": "h.*"},
        "accelerator_config": acc.display().to_string(),
        "ddp_backend": "gloo",
        "ddp_timeout": 60,
    });
    let a: TrainingArguments = serde_json::from_value(v).unwrap();
    assert_eq!(a.fsdp, "true");
    assert!(a.accelerator_config.split_batches && !a.accelerator_config.even_batches);
    let c = a.accelerator_config().unwrap();
    let p = c.fsdp.unwrap();
    assert_eq!(
        p.sharding_strategy,
        accel_dist::fsdp::ShardingStrategy::ShardGradOp
    );
    assert!(c.split_batches);
    assert_eq!(
        c.init_kwargs.unwrap().timeout,
        std::time::Duration::from_secs(60)
    );
    // Absent, `save_on_each_node` is off (transformers' default); set, it
    // reaches the project configuration.
    assert!(!c.project.save_on_each_node);
    let each = TrainingArguments {
        save_on_each_node: true,
        ..a
    };
    assert!(each.accelerator_config().unwrap().project.save_on_each_node);
}
