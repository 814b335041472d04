//! Resuming from a checkpoint in a new process continues training bit for bit,
//! including mid-epoch and mid-schedule, in fp32, bf16 and fp16.

use std::path::Path;
use std::process::Command;

use serde_json::Value;

fn worker(dir: &Path, args: &[&str]) -> Value {
    let out = Command::new(env!("CARGO_BIN_EXE_train_worker"))
        .arg("--dir")
        .arg(dir)
        .args(args)
        .output()
        .expect("worker starts");
    assert!(
        out.status.success(),
        "worker {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8(out.stdout).unwrap();
    serde_json::from_str(stdout.lines().last().unwrap()).unwrap()
}

fn check_resume_is_bitwise(precision: &str) {
    let straight_dir = tempfile::tempdir().unwrap();
    let straight = worker(
        straight_dir.path(),
        &["--steps", "12", "--mixed-precision", precision],
    );

    let split_dir = tempfile::tempdir().unwrap();
    let first = worker(
        split_dir.path(),
        &["--steps", "5", "--save", "--mixed-precision", precision],
    );
    // 5 steps of 2 micro-batches stop inside the first epoch (19 batches).
    assert_eq!(first["epoch"], 0);
    assert_eq!(first["position"], 10);
    let second = worker(
        split_dir.path(),
        &["--steps", "12", "--resume", "--mixed-precision", precision],
    );

    let mut losses = first["losses"].as_array().unwrap().clone();
    losses.extend(second["losses"].as_array().unwrap().iter().cloned());
    assert_eq!(
        &Value::Array(losses),
        &straight["losses"],
        "{precision}: losses differ after resume"
    );
    assert_eq!(
        second["weights"], straight["weights"],
        "{precision}: final weights differ after resume"
    );
    assert_eq!(second["epoch"], straight["epoch"]);
    assert!(
        straight["epoch"].as_u64().unwrap() >= 1,
        "the run must cross an epoch boundary"
    );
}

#[test]
fn resume_in_a_new_process_is_bitwise_in_fp32() {
    check_resume_is_bitwise("no");
}

#[test]
fn resume_in_a_new_process_is_bitwise_in_bf16() {
    check_resume_is_bitwise("bf16");
}

#[test]
fn resume_in_a_new_process_is_bitwise_in_fp16() {
    check_resume_is_bitwise("fp16");
}
