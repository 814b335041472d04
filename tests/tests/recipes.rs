//! Python recipes at 2 CPU ranks. `TrainingArguments::deepspeed`: the
//! Trainer guide's ZeRO-2 and ZeRO-3-with-offload files (with `"auto"`
//! values) train with the losses of the native FSDP settings they map onto,
//! and the file's own optimizer and DeepSpeed schedule give DeepSpeed's
//! learning rates; `accel launch` runs an `accelerate config` DEEPSPEED
//! file. `fsdp=True` with a transformers `fsdp_config.json` trains as the
//! Accelerate FSDP file of the same settings.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::{json, Value};

const WORKER: &str = env!("CARGO_BIN_EXE_trainer_worker");
const LAUNCH: &str = env!("CARGO_BIN_EXE_accel_launch");

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/deepspeed")
}

/// Eight sequences of the test Llama's vocabulary.
fn ids(dir: &Path) -> PathBuf {
    accel_tests::llama_ids_file(dir)
}

/// The worker at 2 ranks under `accel launch`; its JSON line.
fn two_ranks(dir: &Path, name: &str, extra: &[&str]) -> Value {
    launched(dir, name, &["--num_processes", "2", "--cpu"], extra)
}

/// The worker under `accel launch` with `launch_flags`; its JSON line.
fn launched(dir: &Path, name: &str, launch_flags: &[&str], extra: &[&str]) -> Value {
    let out = dir.join(name);
    let mut cmd = Command::new(LAUNCH);
    cmd.arg("launch")
        .args(launch_flags)
        .arg(WORKER)
        .arg(accel_tests::hf_fixture("llama"))
        .arg(ids(dir))
        .arg(&out)
        .arg("6")
        .args(extra);
    let (ok, stdout, stderr) = accel_tests::run_program(cmd, None);
    assert!(ok, "{name}: {stderr}\n{stdout}");
    // The launcher prefixes each line with its rank.
    let line = stdout
        .lines()
        .rev()
        .find_map(|l| l.find('{').map(|i| &l[i..]))
        .unwrap_or_else(|| panic!("{stdout}"));
    let mut v: Value = serde_json::from_str(line).unwrap();
    v["stderr"] = stderr.into();
    v
}

fn losses(v: &Value) -> Vec<f64> {
    v["losses"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect()
}

fn assert_close(a: &[f64], b: &[f64], tol: f64, what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: {a:?} vs {b:?}");
    for (k, (x, y)) in a.iter().zip(b).enumerate() {
        assert!((x - y).abs() <= tol, "{what}: step {}: {x} vs {y}", k + 1);
    }
}

/// A guide file without its `optimizer` and `scheduler` sections (the
/// Trainer's AdamW and schedule then run, as in transformers).
fn without_optimizer(dir: &Path, file: &str) -> String {
    let mut c: Value =
        serde_json::from_str(&std::fs::read_to_string(fixtures().join(file)).unwrap()).unwrap();
    let m = c.as_object_mut().unwrap();
    m.remove("optimizer");
    m.remove("scheduler");
    let path = dir.join(file);
    std::fs::write(&path, c.to_string()).unwrap();
    path.display().to_string()
}

#[test]
fn zero_2_and_zero_3_offload_files_train_as_the_native_strategies() {
    let tmp = tempfile::tempdir().unwrap();
    let cases = [
        ("ds_zero2.json", "shard_grad_op offload", "SHARD_GRAD_OP"),
        ("ds_zero3_offload.json", "full_shard offload", "FULL_SHARD"),
    ];
    for (file, words, strategy) in cases {
        let ds = without_optimizer(tmp.path(), file);
        let native = two_ranks(
            tmp.path(),
            &format!("native-{strategy}"),
            &["--fsdp", words],
        );
        let mapped = two_ranks(tmp.path(), &format!("ds-{strategy}"), &["--deepspeed", &ds]);
        assert_eq!(mapped["sharding"], strategy, "{file}: {mapped}");
        assert_eq!(mapped["offload"], true, "{file}");
        assert_eq!(native["sharding"], strategy);
        assert_close(&losses(&mapped), &losses(&native), 1e-6, file);
        // What ZeRO-2/3 promise: each rank keeps (and steps, and holds
        // optimizer state for) about half of the parameters.
        let (pieces, full) = (
            mapped["pieces"].as_u64().unwrap(),
            mapped["full"].as_u64().unwrap(),
        );
        assert!(
            pieces * 2 >= full && pieces * 2 <= full + 256,
            "{file}: rank 0 holds {pieces} of {full} parameters"
        );
        assert!(
            losses(&mapped)[5] < losses(&mapped)[0],
            "{file}: {:?}",
            losses(&mapped)
        );
        // What has no effect here is said, key by key.
        let err = mapped["stderr"].as_str().unwrap();
        assert!(
            err.contains("`zero_optimization.overlap_comm` has no effect"),
            "{err}"
        );
    }
}

#[test]
fn the_files_optimizer_and_schedule_are_deepspeeds() {
    let tmp = tempfile::tempdir().unwrap();
    let file = fixtures()
        .join("ds_zero3_offload.json")
        .display()
        .to_string();
    let v = two_ranks(tmp.path(), "guide", &["--deepspeed", &file, "--save"]);
    let (l, lrs) = (losses(&v), v["lrs"].as_array().unwrap());
    assert!(l[5] < l[0], "{l:?}");
    // WarmupLR from 0 to the learning rate over max(1, warmup_steps = 2)
    // steps, log-shaped, DeepSpeed stepping after each optimizer step: the
    // first two steps at the minimum, then the maximum.
    // Logged after each step: the rate the next step takes.
    let got: Vec<f64> = lrs.iter().map(|x| x.as_f64().unwrap()).collect();
    assert_close(
        &got,
        &[0.0, 1e-2, 1e-2, 1e-2, 1e-2, 1e-2],
        1e-12,
        "learning rates",
    );
    // stage3_gather_16bit_weights_on_model_save: fp32 run, fp32 weights
    // (the run's compute dtype), as DeepSpeed writes them.
    assert!(tmp.path().join("guide/model/model.safetensors").is_file());
}

#[test]
fn a_contradicting_value_names_every_mismatch_and_fsdp_with_deepspeed_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let mut c: Value =
        serde_json::from_str(&std::fs::read_to_string(fixtures().join("ds_zero2.json")).unwrap())
            .unwrap();
    c["optimizer"]["params"]["lr"] = json!(1e-4);
    c["gradient_accumulation_steps"] = json!(4);
    let path = tmp.path().join("bad.json");
    std::fs::write(&path, c.to_string()).unwrap();
    let mut cmd = Command::new(WORKER);
    cmd.arg(accel_tests::hf_fixture("llama"))
        .arg(ids(tmp.path()))
        .arg(tmp.path().join("bad"))
        .arg("2")
        .args(["--deepspeed", path.to_str().unwrap()]);
    let (ok, _, err) = accel_tests::run_program(cmd, None);
    assert!(!ok);
    assert!(
        err.contains("- ds gradient_accumulation_steps=4 vs hf gradient_accumulation_steps=2")
            && err.contains("- ds optimizer.params.lr=0.0001 vs hf learning_rate=0.01")
            && err.contains("bad.json"),
        "{err}"
    );
    let mut cmd = Command::new(WORKER);
    cmd.arg(accel_tests::hf_fixture("llama"))
        .arg(ids(tmp.path()))
        .arg(tmp.path().join("both"))
        .arg("2")
        .args([
            "--deepspeed",
            fixtures().join("ds_zero2.json").to_str().unwrap(),
            "--fsdp",
            "full_shard",
        ]);
    let (ok, _, err) = accel_tests::run_program(cmd, None);
    assert!(!ok && err.contains("fsdp"), "{err}");
}

/// `accel launch` with the file `accelerate config` writes for DeepSpeed
/// (ZeRO `stage`, no offload) runs `finetune_hf` (the Accelerator, not the
/// Trainer) with the losses of the FSDP file of the same strategy.
#[test]
fn an_accelerate_deepspeed_file_launches_as_the_fsdp_strategy_of_its_stage() {
    let tmp = tempfile::tempdir().unwrap();
    let ids = ids(tmp.path());
    let model = accel_tests::hf_fixture("llama");
    for (stage, strategy) in [(2, "SHARD_GRAD_OP"), (3, "FULL_SHARD")] {
        let ds = tmp.path().join(format!("ds{stage}.yaml"));
        std::fs::write(
            &ds,
            format!(
                "compute_environment: LOCAL_MACHINE\ndebug: false\ndeepspeed_config:\n  gradient_accumulation_steps: 1\n  offload_optimizer_device: none\n  offload_param_device: none\n  zero3_init_flag: false\n  zero_stage: {stage}\ndistributed_type: DEEPSPEED\ndowncast_bf16: 'no'\nmachine_rank: 0\nmain_training_function: main\nmixed_precision: 'no'\nnum_machines: 1\nnum_processes: 2\nrdzv_backend: static\nsame_network: true\ntpu_env: []\ntpu_use_cluster: false\ntpu_use_sudo: false\nuse_cpu: true\n"
            ),
        )
        .unwrap();
        let fsdp = tmp.path().join(format!("fsdp{stage}.yaml"));
        std::fs::write(
            &fsdp,
            format!(
                "compute_environment: LOCAL_MACHINE\ndistributed_type: FSDP\nmixed_precision: 'no'\nnum_machines: 1\nnum_processes: 2\nmachine_rank: 0\nuse_cpu: true\nfsdp_config:\n  fsdp_auto_wrap_policy: NO_WRAP\n  fsdp_sharding_strategy: {strategy}\n"
            ),
        )
        .unwrap();
        let run = |config: &Path| {
            let mut cmd = Command::new(LAUNCH);
            cmd.args(["launch", "--config_file"])
                .arg(config)
                .arg(env!("CARGO_BIN_EXE_finetune_hf_worker"))
                .arg("--model")
                .arg(&model)
                .arg("--data-ids")
                .arg(&ids)
                .args(["--steps", "4", "--lr", "1e-2", "--json"]);
            let (ok, out, err) = accel_tests::run_program(cmd, None);
            assert!(ok, "{}: {err}\n{out}", config.display());
            accel_tests::parse_run(&out)
        };
        let (setup, mapped) = run(&ds);
        let (_, native) = run(&fsdp);
        assert_eq!(setup["sharding"]["strategy"], strategy, "{setup}");
        // Gathered a decoder layer at a time, as DeepSpeed gathers module by module.
        assert_eq!(setup["sharding"]["units"], 2, "{setup}");
        assert_close(
            &mapped,
            &native,
            1e-6,
            &format!("ZeRO-{stage} file vs FSDP {strategy}"),
        );
    }
}

/// `fsdp=True` with a transformers `fsdp_config.json` (`fsdp_`-prefixed
/// keys, FSDP2's `reshard_after_forward: false`) trains as the Accelerate
/// config file of the same settings (SHARD_GRAD_OP, each LlamaDecoderLayer
/// a unit).
#[test]
fn a_transformers_fsdp_config_file_trains_as_the_accelerate_file() {
    let tmp = tempfile::tempdir().unwrap();
    let json = tmp.path().join("fsdp_config.json");
    std::fs::write(
        &json,
        r#"{"fsdp_transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"], "fsdp_reshard_after_forward": false, "fsdp_state_dict_type": "FULL_STATE_DICT", "fsdp_cpu_ram_efficient_loading": true}"#,
    )
    .unwrap();
    let yaml = tmp.path().join("fsdp.yaml");
    std::fs::write(
        &yaml,
        "compute_environment: LOCAL_MACHINE\ndistributed_type: FSDP\nmixed_precision: 'no'\nnum_machines: 1\nnum_processes: 2\nmachine_rank: 0\nuse_cpu: true\nfsdp_config:\n  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP\n  fsdp_sharding_strategy: SHARD_GRAD_OP\n  fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer\n  fsdp_state_dict_type: FULL_STATE_DICT\n",
    )
    .unwrap();
    let from_json = two_ranks(
        tmp.path(),
        "json",
        &["--fsdp", "true", "--fsdp-config", json.to_str().unwrap()],
    );
    let from_yaml = launched(
        tmp.path(),
        "yaml",
        &["--config_file", yaml.to_str().unwrap()],
        &[],
    );
    assert_eq!(from_json["sharding"], "SHARD_GRAD_OP");
    assert_eq!(from_yaml["sharding"], "SHARD_GRAD_OP");
    assert_close(
        &losses(&from_json),
        &losses(&from_yaml),
        1e-6,
        "fsdp_config.json vs the Accelerate file",
    );
}

/// `ddp_timeout=5` at rank 0 of 2 whose peer never comes: the run fails
/// after about 5 s (not the default 30 minutes) naming the missing rank;
/// `ddp_backend` names what is not built.
#[test]
fn ddp_timeout_bounds_the_wait_for_a_missing_rank_and_names_it() {
    let tmp = tempfile::tempdir().unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut cmd = Command::new(WORKER);
    cmd.arg(accel_tests::hf_fixture("llama"))
        .arg(ids(tmp.path()))
        .arg(tmp.path().join("alone"))
        .arg("2")
        .args(["--ddp-timeout", "5"])
        .env("RANK", "0")
        .env("LOCAL_RANK", "0")
        .env("WORLD_SIZE", "2")
        .env("LOCAL_WORLD_SIZE", "2")
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", port.to_string())
        .env("ACCEL_JOB_TOKEN", "test-token")
        .env_remove("ACCEL_DIST_TIMEOUT");
    let started = std::time::Instant::now();
    let (ok, _, err) = accel_tests::run_program(cmd, None);
    let took = started.elapsed().as_secs_f64();
    assert!(!ok, "a rank alone cannot train");
    assert!(
        (4.5..60.0).contains(&took),
        "failed after {took:.1} s: {err}"
    );
    assert!(err.contains("rank 1"), "{err}");
    let mut cmd = Command::new(WORKER);
    cmd.arg(accel_tests::hf_fixture("llama"))
        .arg(ids(tmp.path()))
        .arg(tmp.path().join("mpi"))
        .arg("2")
        .args(["--ddp-backend", "mpi"]);
    let (ok, _, err) = accel_tests::run_program(cmd, None);
    assert!(
        !ok && err.contains("ddp_backend") && err.contains("mpi"),
        "{err}"
    );
}

/// `dataloader_num_workers`: batches made on background threads are the
/// batches the loop would make, so the losses are the same bit for bit, at
/// one process and at two ranks.
#[test]
fn loader_workers_change_nothing_but_when_batches_are_made() {
    let tmp = tempfile::tempdir().unwrap();
    let alone = |name: &str, extra: &[&str]| {
        let mut cmd = Command::new(WORKER);
        cmd.arg(accel_tests::hf_fixture("llama"))
            .arg(ids(tmp.path()))
            .arg(tmp.path().join(name))
            .arg("6")
            .args(extra);
        let (ok, out, err) = accel_tests::run_program(cmd, None);
        assert!(ok, "{err}");
        let line = out
            .lines()
            .rev()
            .find(|l| l.starts_with('{'))
            .unwrap()
            .to_string();
        serde_json::from_str::<Value>(&line).unwrap()
    };
    let plain = alone("w0", &[]);
    let workers = alone("w2", &["--dataloader-num-workers", "2"]);
    assert_eq!(losses(&plain), losses(&workers));
    let two = two_ranks(tmp.path(), "w2-ranks", &["--dataloader-num-workers", "2"]);
    let two_plain = two_ranks(tmp.path(), "w0-ranks", &[]);
    assert_eq!(losses(&two), losses(&two_plain));
}

/// A transformer wrap with no class named wraps the model's repeated block
/// class (the decoder layers, transformers' `_no_split_modules`): the test
/// Llama's two `LlamaDecoderLayer`s become the units.
#[test]
fn a_transformer_wrap_without_a_class_wraps_the_decoder_layers() {
    let tmp = tempfile::tempdir().unwrap();
    let yaml = tmp.path().join("fsdp.yaml");
    std::fs::write(
        &yaml,
        "compute_environment: LOCAL_MACHINE\ndistributed_type: FSDP\nmixed_precision: 'no'\nnum_machines: 1\nnum_processes: 2\nmachine_rank: 0\nuse_cpu: true\nfsdp_config:\n  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP\n  fsdp_sharding_strategy: FULL_SHARD\n",
    )
    .unwrap();
    let mut cmd = Command::new(LAUNCH);
    cmd.args(["launch", "--config_file"])
        .arg(&yaml)
        .arg(env!("CARGO_BIN_EXE_finetune_hf_worker"))
        .arg("--model")
        .arg(accel_tests::hf_fixture("llama"))
        .arg("--data-ids")
        .arg(ids(tmp.path()))
        .args(["--steps", "2", "--lr", "1e-2", "--json"]);
    let (ok, out, err) = accel_tests::run_program(cmd, None);
    assert!(ok, "{err}\n{out}");
    let (setup, _) = accel_tests::parse_run(&out);
    assert_eq!(setup["sharding"]["units"], 2, "{setup}");
}
