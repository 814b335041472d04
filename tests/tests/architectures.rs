//! The newer architectures through the training programs: FSDP wrapping each
//! one's decoder layer class at two ranks gives the one-process losses, and
//! a mixture of experts with `output_router_logits` trains on transformers'
//! loss plus its load-balancing term (refused by name where a recomputed
//! layer would lose that term's gradient).

use std::path::{Path, PathBuf};
use std::process::Command;

use accel_tests::{parse_run, run_program};

const WORKER: &str = env!("CARGO_BIN_EXE_finetune_hf_worker");
const LAUNCH: &str = env!("CARGO_BIN_EXE_accel_launch");

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures/hf")
        .join(name)
}

fn reference(name: &str) -> serde_json::Value {
    let text = std::fs::read_to_string(fixture(name).join("reference.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// The fixture's reference ids as a `--data-ids` file.
fn ids_file(dir: &Path, name: &str) -> PathBuf {
    let path = dir.join(format!("{name}-ids.json"));
    std::fs::write(&path, reference(name)["input_ids"].to_string()).unwrap();
    path
}

fn fsdp_config(dir: &Path, class: &str) -> PathBuf {
    let path = dir.join(format!("fsdp-{class}.yaml"));
    std::fs::write(
        &path,
        format!(
            "compute_environment: LOCAL_MACHINE\ndistributed_type: FSDP\nmixed_precision: 'no'\n\
             num_machines: 1\nnum_processes: 2\nmachine_rank: 0\nuse_cpu: true\nfsdp_config:\n  \
             fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP\n  fsdp_sharding_strategy: FULL_SHARD\n  \
             fsdp_transformer_layer_cls_to_wrap: {class}\n"
        ),
    )
    .unwrap();
    path
}

fn losses(cmd: Command) -> Vec<f64> {
    let (ok, out, err) = run_program(cmd, None);
    assert!(ok, "{err}\n{out}");
    parse_run(&out).1
}

#[test]
fn fsdp_by_each_decoder_layer_class_gives_the_one_process_losses() {
    let tmp = tempfile::tempdir().unwrap();
    for (name, class) in [
        ("qwen3", "Qwen3DecoderLayer"),
        ("gemma2", "Gemma2DecoderLayer"),
        ("gemma3", "Gemma3DecoderLayer"),
        ("phi3", "Phi3DecoderLayer"),
        ("mixtral", "MixtralDecoderLayer"),
        ("qwen3_moe", "Qwen3MoeDecoderLayer"),
    ] {
        let ids = ids_file(tmp.path(), name);
        let args = |cmd: &mut Command| {
            cmd.arg("--model")
                .arg(fixture(name))
                .arg("--data-ids")
                .arg(&ids);
            cmd.args(["--steps", "3", "--lr", "1e-2", "--json"]);
        };
        let mut one = Command::new(WORKER);
        args(&mut one);
        let one = losses(one);
        // The first loss is transformers' (labels = input ids).
        let want = reference(name)["loss"].as_f64().unwrap();
        assert!((one[0] - want).abs() < 1e-4, "{name}: {} vs {want}", one[0]);
        assert!(one[2] < one[0], "{name}: {one:?}");
        let mut two = Command::new(LAUNCH);
        two.arg("launch")
            .arg("--config_file")
            .arg(fsdp_config(tmp.path(), class))
            .arg(WORKER);
        args(&mut two);
        let two = losses(two);
        // Reductions in another order: a few ulps of the loss apart.
        for (a, b) in one.iter().zip(&two) {
            assert!((a - b).abs() < 5e-5, "{name}: {one:?} vs {two:?}");
        }
    }
}

/// A copy of fixture `name` with `output_router_logits: true`.
fn with_router_loss(dir: &Path, name: &str) -> PathBuf {
    let out = dir.join(format!("{name}-aux"));
    std::fs::create_dir_all(&out).unwrap();
    std::fs::copy(
        fixture(name).join("model.safetensors"),
        out.join("model.safetensors"),
    )
    .unwrap();
    let text = std::fs::read_to_string(fixture(name).join("config.json")).unwrap();
    let mut cfg: serde_json::Value = serde_json::from_str(&text).unwrap();
    cfg["output_router_logits"] = true.into();
    cfg["router_aux_loss_coef"] = reference(name)["router_aux_loss_coef"].clone();
    std::fs::write(out.join("config.json"), cfg.to_string()).unwrap();
    out
}

#[test]
fn the_router_loss_trains_with_transformers_value_and_is_refused_under_fsdp() {
    let tmp = tempfile::tempdir().unwrap();
    for (name, class) in [
        ("mixtral", "MixtralDecoderLayer"),
        ("qwen3_moe", "Qwen3MoeDecoderLayer"),
    ] {
        let model = with_router_loss(tmp.path(), name);
        let ids = ids_file(tmp.path(), name);
        let mut one = Command::new(WORKER);
        one.arg("--model").arg(&model).arg("--data-ids").arg(&ids);
        one.args(["--steps", "3", "--lr", "1e-2", "--json"]);
        let one = losses(one);
        let want = reference(name)["loss_with_aux"].as_f64().unwrap();
        assert!((one[0] - want).abs() < 1e-4, "{name}: {} vs {want}", one[0]);
        assert!(one[2] < one[0], "{name}: {one:?}");
        let mut two = Command::new(LAUNCH);
        two.arg("launch")
            .arg("--config_file")
            .arg(fsdp_config(tmp.path(), class))
            .arg(WORKER)
            .arg("--model")
            .arg(&model)
            .arg("--data-ids")
            .arg(&ids)
            .args(["--steps", "1", "--json"]);
        let (ok, out, err) = run_program(two, None);
        assert!(!ok, "{name}: FSDP with the router loss ran:\n{out}");
        assert!(err.contains("output_router_logits"), "{name}: {err}");
    }
}
