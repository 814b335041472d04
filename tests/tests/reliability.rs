//! Promises that only hold across real processes: the launcher's precision
//! reaches the program, ranks share one shuffle, `sync_each_batch` reduces
//! every micro-batch, FSDP refuses a plain model, and a failed save stops
//! every rank at once.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use accel_cli::config_file::ClusterConfig;
use accel_cli::LaunchArgs;
use accel_core::dist::launch::{plan, run, LaunchConfig, RunOptions};
use serde_json::Value;

const WORKER: &str = env!("CARGO_BIN_EXE_rel_worker");

fn launch(mut config: LaunchConfig, out: &Path, args: &[&str]) {
    config.args = ["--out", &out.display().to_string()]
        .iter()
        .chain(args)
        .map(Into::into)
        .collect();
    config.timeout = Some(Duration::from_secs(60));
    run(&plan(&config).unwrap(), &RunOptions::default()).unwrap();
}

fn ranks(config: LaunchConfig, out: &Path, args: &[&str]) -> Vec<Value> {
    let world = config.num_processes;
    launch(config, out, args);
    (0..world)
        .map(|r| {
            let path = out.join(format!("rank{r}.json"));
            let text = std::fs::read_to_string(&path)
                .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            serde_json::from_str(&text).unwrap()
        })
        .collect()
}

/// What `accelerate config default --mixed_precision bf16` writes (JSON).
fn python_json_config(dir: &Path) -> PathBuf {
    let path = dir.join("default_config.yaml");
    let config = serde_json::json!({
        "compute_environment": "LOCAL_MACHINE", "debug": false, "distributed_type": "NO",
        "downcast_bf16": false, "enable_cpu_affinity": false, "fsdp_config": {},
        "machine_rank": 0, "main_training_function": "main", "mixed_precision": "bf16",
        "num_machines": 1, "num_processes": 1, "rdzv_backend": "static",
        "same_network": false, "tpu_use_cluster": false, "tpu_use_sudo": false, "use_cpu": true
    });
    std::fs::write(&path, serde_json::to_string_pretty(&config).unwrap()).unwrap();
    path
}

/// `accel launch --config_file F <worker> ARGS`, through the launcher's own plan.
fn launch_with_file(file: &Path, out: &Path, args: &[&str]) -> Value {
    let mut argv: Vec<String> = vec![WORKER.into(), "--out".into(), out.display().to_string()];
    argv.extend(args.iter().map(|s| s.to_string()));
    let launch_args = LaunchArgs {
        config_file: Some(file.to_path_buf()),
        command: argv.into_iter().map(Into::into).collect(),
        ..Default::default()
    };
    let cluster: Option<ClusterConfig> = launch_args.load_config_file().unwrap();
    let config = launch_args.to_config(cluster.as_ref()).unwrap();
    run(&plan(&config).unwrap(), &RunOptions::default()).unwrap();
    let text = std::fs::read_to_string(out.join("rank0.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

#[test]
fn the_launchers_precision_reaches_a_program_unless_it_chooses_one() {
    let tmp = tempfile::tempdir().unwrap();
    let file = python_json_config(tmp.path());
    let got = launch_with_file(&file, &tmp.path().join("a"), &["--mode", "precision"]);
    assert_eq!(got["precision"], "bf16", "{got}");
    assert_eq!(got["dtype"], "BF16", "{got}");
    // An explicit argument wins, `no` included (Accelerate's precedence).
    let got = launch_with_file(
        &file,
        &tmp.path().join("b"),
        &["--mode", "precision", "--mixed-precision", "no"],
    );
    assert_eq!(got["precision"], "no", "{got}");
}

fn every_sample_once_per_epoch(world: usize) {
    let tmp = tempfile::tempdir().unwrap();
    let samples = 24;
    let got = ranks(
        LaunchConfig::local(world, WORKER),
        tmp.path(),
        &["--mode", "coverage", "--samples", &samples.to_string()],
    );
    for epoch in 0..2 {
        let mut seen: Vec<u64> = got
            .iter()
            .flat_map(|r| r["epochs"][epoch].as_array().unwrap().clone())
            .map(|v| v.as_u64().unwrap())
            .collect();
        seen.sort_unstable();
        let want: Vec<u64> = (0..samples as u64).collect();
        assert_eq!(seen, want, "epoch {epoch} at {world} ranks: {got:?}");
    }
}

#[test]
fn unseeded_shuffling_shows_every_sample_once_per_epoch_at_2_ranks() {
    every_sample_once_per_epoch(2);
}

#[test]
fn unseeded_shuffling_shows_every_sample_once_per_epoch_at_3_ranks() {
    every_sample_once_per_epoch(3);
}

fn weights(v: &Value) -> BTreeMap<String, Vec<f32>> {
    v["weights"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(k, bits)| {
            let w = bits
                .as_array()
                .unwrap()
                .iter()
                .map(|b| f32::from_bits(b.as_u64().unwrap() as u32))
                .collect();
            (k.clone(), w)
        })
        .collect()
}

#[test]
fn sync_each_batch_reduces_every_micro_batch_and_trains_the_same() {
    let tmp = tempfile::tempdir().unwrap();
    let run_with = |sync: bool| {
        let out = tmp.path().join(format!("sync{sync}"));
        let mut args = vec!["--mode", "accumulate", "--steps", "3"];
        if sync {
            args.push("--sync-each-batch");
        }
        ranks(LaunchConfig::local(2, WORKER), &out, &args)
    };
    let (plain, each) = (run_with(false), run_with(true));
    // After the first (non-sync) micro-batch the gradients are already the
    // average on every rank with sync_each_batch, and each rank's own without.
    assert_eq!(each[0]["first_grads_equal"], true, "{}", each[0]);
    assert_eq!(plain[0]["first_grads_equal"], false, "{}", plain[0]);
    let (a, b) = (weights(&plain[0]), weights(&each[0]));
    assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>());
    let mut worst = 0f32;
    for (name, wa) in &a {
        for (x, y) in wa.iter().zip(&b[name]) {
            worst = worst.max((x - y).abs());
        }
    }
    assert!(worst < 1e-4, "largest weight difference {worst}");
    // Both ranks end with the same weights.
    assert_eq!(weights(&each[0]), weights(&each[1]));
}

#[test]
fn a_plain_model_under_an_fsdp_launch_is_refused_naming_the_key() {
    let tmp = tempfile::tempdir().unwrap();
    let mut config = LaunchConfig::local(2, WORKER);
    config.extra_env = accel_cli::config_file::FsdpFileConfig::default().launch_env();
    let got = ranks(config, tmp.path(), &["--mode", "plain-model"]);
    for r in &got {
        assert_eq!(r["ok"], false, "{r}");
        let e = r["error"].as_str().unwrap();
        assert!(
            e.contains("distributed_type: FSDP") && e.contains("prepare_fsdp_model"),
            "{e}"
        );
    }
    // Without FSDP the same program runs as DDP.
    let got = ranks(
        LaunchConfig::local(2, WORKER),
        &tmp.path().join("ddp"),
        &["--mode", "plain-model"],
    );
    assert!(got.iter().all(|r| r["ok"] == true), "{got:?}");
}

#[test]
fn a_failed_save_on_the_main_process_stops_every_rank_at_once() {
    let tmp = tempfile::tempdir().unwrap();
    let mut config = LaunchConfig::local(2, WORKER);
    // Before the fix the other rank waited for this long, then failed.
    config.timeout = Some(Duration::from_secs(60));
    let got = ranks(config, tmp.path(), &["--mode", "failed-save"]);
    let e0 = got[0]["error"].as_str().expect("rank 0 fails");
    assert!(e0.contains("checkpoint_1"), "{e0}");
    let e1 = got[1]["error"].as_str().expect("rank 1 fails too");
    assert!(e1.contains("rank 0") && e1.contains("checkpoint_1"), "{e1}");
    for r in &got {
        assert!(r["seconds"].as_f64().unwrap() < 10.0, "{r}");
        assert_eq!(r["reload_error"], Value::Null, "{r}");
        assert_eq!(r["first"], true, "{r}");
    }
}

#[test]
fn synchronize_rng_states_gives_every_rank_rank_0s_state() {
    let tmp = tempfile::tempdir().unwrap();
    let got = ranks(
        LaunchConfig::local(2, WORKER),
        tmp.path(),
        &["--mode", "rng-sync"],
    );
    assert_ne!(got[0]["before"], got[1]["before"], "{got:?}");
    for r in &got {
        assert_eq!(r["after"], got[0]["before"], "{got:?}");
        assert_eq!(r["seed"], 5);
    }
}

/// A layer the forward bypasses gets no gradient: named after the first
/// backward, a warning in one process, an error at every rank of two (as
/// PyTorch's DDP) unless `find_unused_parameters` accepts it; a frozen
/// layer is neither reported nor changed.
#[test]
fn a_bypassed_layer_is_named_and_an_error_at_2_ranks_unless_accepted_or_frozen() {
    let tmp = tempfile::tempdir().unwrap();
    let run = |world: usize, dir: &str, flags: &[&str]| {
        let args: Vec<&str> = ["--mode", "unused"].iter().chain(flags).copied().collect();
        ranks(
            LaunchConfig::local(world, WORKER),
            &tmp.path().join(dir),
            &args,
        )
    };
    let skipped = serde_json::json!(["skipped.bias", "skipped.weight"]);
    // One process: a warning, training goes on, the layer is untouched.
    let got = run(1, "single", &[]);
    assert_eq!(got[0]["ok"], true, "{}", got[0]);
    assert_eq!(got[0]["unreached"], skipped);
    assert_eq!(got[0]["skipped_unchanged"], true);
    // Two ranks: every rank stops at the first backward, naming the parameters.
    for (r, v) in run(2, "strict", &[]).iter().enumerate() {
        assert_eq!(v["ok"], false, "{v}");
        assert_eq!(v["step"], 0, "{v}");
        let e = v["error"].as_str().unwrap();
        assert!(
            e.contains(&format!("rank {r}"))
                && e.contains("2 trainable parameter(s)")
                && e.contains("skipped.bias, skipped.weight")
                && e.contains("find_unused_parameters"),
            "{e}"
        );
    }
    // The bypassed layer's output reaches the loss through an op without a
    // backward: the report names the op that cut the graph.
    for (r, v) in run(2, "cut", &["--cut"]).iter().enumerate() {
        assert_eq!(v["ok"], false, "{v}");
        let e = v["error"].as_str().unwrap();
        assert!(
            e.contains(&format!("rank {r}"))
                && e.contains("skipped.bias, skipped.weight")
                && e.contains("cut by ops without a backward")
                && e.contains("`rel-worker-cut` (1 time)"),
            "{e}"
        );
    }
    // A loss that depends on no parameter of the model: after 4 backwards
    // that reach none of it, every parameter is named.
    for (r, v) in run(2, "detached", &["--detached"]).iter().enumerate() {
        assert_eq!(v["ok"], false, "{v}");
        assert_eq!(v["step"], 3, "{v}");
        let e = v["error"].as_str().unwrap();
        assert!(
            e.contains(&format!("rank {r}"))
                && e.contains("4 trainable parameter(s)")
                && e.contains("none of which reached the model")
                && e.contains("skipped.bias, skipped.weight, used.bias, used.weight"),
            "{e}"
        );
    }
    // Accepted: every step runs. The layer no rank uses keeps no gradient,
    // so AdamW's weight decay leaves it alone (PyTorch's DDP leaves its
    // `grad` None); the layer only rank 0 uses is averaged and stepped
    // alike at both ranks.
    let got = run(2, "accepted", &["--find-unused"]);
    for v in &got {
        assert_eq!(v["ok"], true, "{v}");
        assert_eq!(v["skipped_unchanged"], true, "{v}");
    }
    assert_eq!(got[0]["unreached"], skipped);
    let half_too =
        serde_json::json!(["half.bias", "half.weight", "skipped.bias", "skipped.weight"]);
    assert_eq!(got[1]["unreached"], half_too);
    assert!(got[0]["half"].is_array(), "{}", got[0]);
    assert_eq!(got[0]["half"], got[1]["half"]);
    // Frozen on purpose: no report, no error, the weights stay as they were.
    for v in run(2, "frozen", &["--freeze-skipped"]) {
        assert_eq!(v["ok"], true, "{v}");
        assert_eq!(v["unreached"], serde_json::json!([]));
        assert_eq!(v["skipped_unchanged"], true, "{v}");
    }
}
