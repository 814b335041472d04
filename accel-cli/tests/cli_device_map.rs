//! `accel device-map` reproduces every reference planning case of
//! accel-bigmodel/tests/data/device_map_cases.json (Accelerate's `infer_auto_device_map`
//! on each case) through the command line.

use std::path::Path;
use std::process::Command;

use serde_json::Value;

fn spec() -> Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../accel-bigmodel/tests/data/device_map_cases.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "the reference cases must be present at {}: {e}",
            path.display()
        )
    });
    serde_json::from_str(&text).unwrap()
}

/// The CLI flags equivalent to a case's planner arguments.
fn flags(args: &Value) -> Vec<String> {
    let mut out = vec![];
    let mem: Vec<String> = args["max_memory"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(k, v)| match v {
            Value::String(s) => format!("{k}={s}"),
            other => format!("{k}={other}"),
        })
        .collect();
    out.push(format!("--max-memory={}", mem.join(",")));
    for class in args["no_split_module_classes"]
        .as_array()
        .into_iter()
        .flatten()
    {
        out.push(format!("--no-split={}", class.as_str().unwrap()));
    }
    if let Some(d) = args["dtype"].as_str() {
        out.push(format!("--dtype={d}"));
    }
    for (name, d) in args["special_dtypes"].as_object().into_iter().flatten() {
        out.push(format!("--special-dtype={name}={}", d.as_str().unwrap()));
    }
    for (key, flag) in [
        ("offload_buffers", "--offload-buffers"),
        ("fallback_allocation", "--fallback-allocation"),
    ] {
        if args[key] == true {
            out.push(flag.into());
        }
    }
    if args["clean_result"] == false {
        out.push("--no-clean".into());
    }
    out
}

#[test]
fn every_reference_case_plans_identically_through_the_cli() {
    let dir = tempfile::tempdir().unwrap();
    let cases = spec();
    let cases = cases.as_object().unwrap();
    assert!(!cases.is_empty());
    for (name, case) in cases {
        if case["expected"]["device_map"].is_null() {
            continue; // a case whose reference call raised; the library tests cover those
        }
        let tree = dir.path().join(format!("{name}.json"));
        std::fs::write(&tree, case["model_tree"].to_string()).unwrap();
        let out = Command::new(env!("CARGO_BIN_EXE_accel"))
            .arg("device-map")
            .arg("--model-tree")
            .arg(&tree)
            .args(flags(&case["args"]))
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{name}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let got: Value = serde_json::from_slice(&out.stdout).unwrap();
        let want = &case["expected"];
        assert_eq!(got["device_map"], want["device_map"], "{name}: device_map");
        assert_eq!(
            got["module_sizes"], want["module_sizes"],
            "{name}: module_sizes"
        );
        assert_eq!(got["max_layer"], want["max_layer"], "{name}: max_layer");
        assert_eq!(got["warnings"], want["warnings"], "{name}: warnings");
    }
}

#[test]
fn a_missing_model_tree_file_is_named_in_the_error() {
    let out = Command::new(env!("CARGO_BIN_EXE_accel"))
        .args([
            "device-map",
            "--model-tree",
            "/nonexistent/tree.json",
            "--max-memory",
            "cpu=1GB",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("/nonexistent/tree.json"), "{err}");
}

/// Runs `accel ARGS PATH`, asserts success and parses its JSON output.
fn accel_json(args: &[&str], path: &Path) -> Value {
    let out = Command::new(env!("CARGO_BIN_EXE_accel"))
        .args(args)
        .arg(path)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn plans_and_estimates_straight_from_checkpoint_headers() {
    use candle_core::{DType, Device, Tensor};
    let dir = tempfile::tempdir().unwrap();
    let mut tensors = std::collections::BTreeMap::new();
    for (name, rows) in [
        ("embed.weight", 100usize),
        ("layers.0.weight", 50),
        ("layers.1.weight", 50),
    ] {
        tensors.insert(
            name.to_string(),
            Tensor::zeros((rows, 10), DType::F32, &Device::Cpu).unwrap(),
        );
    }
    accel_core::checkpoint::write_safetensors(dir.path().join("model.safetensors"), &tensors, None)
        .unwrap();

    let got = accel_json(
        &[
            "device-map",
            "--max-memory=0=4500,cpu=100000",
            "--checkpoint",
        ],
        dir.path(),
    );
    assert_eq!(got["module_sizes"][""], 8000);
    assert_eq!(got["max_layer"]["size"], 4000);
    // GPU 0 holds the 4000-byte embedding only when no layer must be reserved
    // beside it: 4000 + 2000 (largest remaining layer) > 4500, so all goes to cpu.
    assert_eq!(got["device_map"], serde_json::json!({"": "cpu"}));

    let rows = accel_json(&["estimate-memory", "--json", "--checkpoint"], dir.path());
    assert_eq!(rows[0]["dtype"], "float32");
    assert_eq!(rows[0]["total_size"], 8000.0);
    assert_eq!(rows[0]["largest_layer"], 4000.0);
    assert_eq!(rows[0]["training_peak"], 32000.0);
    assert_eq!(rows[3]["dtype"], "int4");
    assert_eq!(rows[3]["training_peak"], Value::Null);
}

/// For a Hugging Face folder, `--checkpoint` plans over the model's own tree:
/// every planning case transformers + Accelerate ran on the fixtures (their
/// `reference.json`) gives Accelerate's map, with `model.embed_tokens` on the
/// CPU first and each decoder layer whole, where the headers alone put
/// `lm_head` first and split layers.
#[test]
fn a_hugging_face_folder_is_planned_as_accelerate_plans_the_transformers_model() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/hf");
    for name in ["llama", "llama3", "mistral", "qwen2", "gpt2", "bert"] {
        let folder = root.join(name);
        let text = std::fs::read_to_string(folder.join("reference.json")).unwrap();
        let reference: Value = serde_json::from_str(&text).unwrap();
        for case in reference["device_maps"].as_array().unwrap() {
            let mut args: Vec<String> = vec!["device-map".into()];
            args.extend(flags(case));
            args.push("--checkpoint".into());
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            let got = accel_json(&args, &folder);
            let want: Vec<(String, String)> =
                serde_json::from_value(case["device_map"].clone()).unwrap();
            let want: serde_json::Map<String, Value> =
                want.into_iter().map(|(k, v)| (k, Value::from(v))).collect();
            assert_eq!(got["device_map"], Value::Object(want), "{name}: {case}");
        }
    }
}

/// A folder whose `config.json` names no architecture accel-models builds is
/// still planned, from the headers, with a notice naming the file and why.
#[test]
fn an_unknown_architecture_is_planned_from_the_headers_with_a_notice() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/hf/llama");
    let dir = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(&src).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, dir.path().join(path.file_name().unwrap())).unwrap();
    }
    let config = dir.path().join("config.json");
    let text = std::fs::read_to_string(&config).unwrap();
    std::fs::write(&config, text.replace("\"llama\"", "\"t5\"")).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_accel"))
        .args([
            "device-map",
            "--max-memory=cpu=53568,disk=1000000000",
            "--checkpoint",
        ])
        .arg(dir.path())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains("config.json") && stderr.contains("t5"),
        "{stderr}"
    );
    assert!(
        stderr.contains("planning from the safetensors headers"),
        "{stderr}"
    );
    let got: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(got["device_map"].as_object().is_some_and(|m| !m.is_empty()));
}
