//! Long-context training switches of `finetune_hf`: `--gradient-checkpointing`
//! (each decoder layer recomputed in backward; under FSDP, each unit) and the
//! attention kernel (`ACCEL_ATTENTION`), each giving the losses of the plain
//! run, with the setup line naming what ran.

use std::path::{Path, PathBuf};
use std::process::Command;

use accel_tests::{hf_fixture, parse_run, run_program};
use serde_json::Value;

const WORKER: &str = env!("CARGO_BIN_EXE_finetune_hf_worker");
const LAUNCH: &str = env!("CARGO_BIN_EXE_accel_launch");

fn ids_file(dir: &Path) -> PathBuf {
    let path = dir.join("ids.json");
    let ids = serde_json::json!([
        [1, 40, 21, 7, 99, 3, 5, 8, 13],
        [3, 5, 8, 13, 21, 34, 55, 89, 2],
        [1, 9, 33, 7, 81, 2, 45, 6, 6],
        [5, 5, 70, 127, 0, 64, 11, 12, 1]
    ]);
    std::fs::write(&path, ids.to_string()).unwrap();
    path
}

fn flags(ids: &Path, extra: &[&str]) -> Vec<String> {
    let mut v: Vec<String> = [
        "--model",
        &hf_fixture("llama").display().to_string(),
        "--data-ids",
        &ids.display().to_string(),
        "--steps",
        "4",
        "--lr",
        "1e-2",
        "--json",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    v.extend(extra.iter().map(|s| s.to_string()));
    v
}

fn one(ids: &Path, extra: &[&str], attention: Option<&str>) -> (Value, Vec<f64>) {
    let mut cmd = Command::new(WORKER);
    cmd.args(flags(ids, extra));
    match attention {
        Some(k) => cmd.env("ACCEL_ATTENTION", k),
        None => cmd.env_remove("ACCEL_ATTENTION"),
    };
    let (ok, out, err) = run_program(cmd, None);
    assert!(ok, "{extra:?}: {err}");
    parse_run(&out)
}

fn assert_close(a: &[f64], b: &[f64], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}");
    for (k, (x, y)) in a.iter().zip(b).enumerate() {
        assert!((x - y).abs() < 1e-5, "{what}: step {}: {x} vs {y}", k + 1);
    }
}

#[test]
fn checkpointing_and_either_attention_kernel_train_alike() {
    let tmp = tempfile::tempdir().unwrap();
    let ids = ids_file(tmp.path());
    let (setup, plain) = one(&ids, &[], None);
    assert_eq!(setup["attention"], "auto", "{setup}");
    assert_eq!(setup["gradient_checkpointing"], false, "{setup}");
    assert!(plain[3] < plain[0], "{plain:?}");
    let (setup, ckpt) = one(&ids, &["--gradient-checkpointing"], None);
    assert_eq!(setup["gradient_checkpointing"], true, "{setup}");
    assert_close(&plain, &ckpt, "--gradient-checkpointing");
    for kernel in ["tiled", "reference"] {
        let (setup, forced) = one(&ids, &[], Some(kernel));
        assert_eq!(setup["attention"], kernel, "{setup}");
        assert_close(&plain, &forced, &format!("ACCEL_ATTENTION={kernel}"));
    }
    let (_, lora_ckpt) = one(&ids, &["--gradient-checkpointing", "--lora-r", "4"], None);
    let (_, lora) = one(&ids, &["--lora-r", "4"], None);
    assert_close(&lora, &lora_ckpt, "LoRA with --gradient-checkpointing");
}

/// Under an FSDP config file the flag turns the plugin's activation
/// checkpointing on: the same losses as one process.
#[test]
fn checkpointing_under_fsdp_gives_the_one_process_losses() {
    let tmp = tempfile::tempdir().unwrap();
    let ids = ids_file(tmp.path());
    let (_, plain) = one(&ids, &[], None);
    let config = tmp.path().join("fsdp.yaml");
    std::fs::write(
        &config,
        "compute_environment: LOCAL_MACHINE\ndistributed_type: FSDP\nmixed_precision: 'no'\n\
         num_machines: 1\nnum_processes: 2\nmachine_rank: 0\nuse_cpu: true\nfsdp_config:\n  \
         fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP\n  fsdp_sharding_strategy: FULL_SHARD\n  \
         fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer\n",
    )
    .unwrap();
    let mut cmd = Command::new(LAUNCH);
    cmd.arg("launch")
        .arg("--config_file")
        .arg(&config)
        .arg(WORKER)
        .args(flags(&ids, &["--gradient-checkpointing"]));
    let (ok, out, err) = run_program(cmd, None);
    assert!(ok, "{err}\n{out}");
    let (setup, fsdp) = parse_run(&out);
    assert_eq!(setup["gradient_checkpointing"], true, "{setup}");
    assert_close(&plain, &fsdp, "FSDP with --gradient-checkpointing");
}
