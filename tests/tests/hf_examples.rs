//! The `hf_logits` and `generate` programs (their command lines are fixed:
//! scripts outside the repository call them) on the tiny transformers-written
//! checkpoints of `tests/fixtures/hf/`: logits within 1e-4 of transformers',
//! plain, planned under `--max-memory` (printing the map Accelerate plans) and
//! from a `--device-map` file; greedy tokens equal transformers'; bad input
//! exits non-zero naming the flag or the file.

use std::path::Path;
use std::process::Command;

use accel_core::bigmodel::DeviceMap;
use serde_json::Value;

const HF_LOGITS: &str = env!("CARGO_BIN_EXE_hf_logits_worker");
const GENERATE: &str = env!("CARGO_BIN_EXE_generate_worker");
const DECODERS: [&str; 11] = [
    "llama",
    "llama3",
    "mistral",
    "qwen2",
    "gpt2",
    "qwen3",
    "gemma2",
    "gemma3",
    "phi3",
    "mixtral",
    "qwen3_moe",
];
const ALL: [&str; 12] = [
    "llama",
    "llama3",
    "mistral",
    "qwen2",
    "gpt2",
    "bert",
    "qwen3",
    "gemma2",
    "gemma3",
    "phi3",
    "mixtral",
    "qwen3_moe",
];
const TOL: f32 = 1e-4;

use accel_tests::{hf_fixture as fixture, hf_reference as reference};

// As the example programs do: weights are mapped from checkpoint files, so
// these tests check the mapped path end to end.
#[global_allocator]
static ALLOC: accel_core::bigmodel::MappedAlloc = accel_core::bigmodel::MappedAlloc::system();

fn ids(v: &Value) -> String {
    let ids: Vec<u32> = serde_json::from_value(v.clone()).unwrap();
    ids.iter().map(u32::to_string).collect::<Vec<_>>().join(",")
}

/// Runs `prog` with `args`: (success, stdout, stderr).
fn exec(prog: &str, args: &[String]) -> (bool, String, String) {
    let out = Command::new(prog).args(args).output().unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The one JSON line a successful run prints.
fn ok(prog: &str, args: &[String]) -> String {
    let (success, out, err) = exec(prog, args);
    assert!(success, "{prog} {args:?} failed: {err}");
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 1, "one JSON line expected: {out}");
    lines[0].to_string()
}

/// The stderr of a run that must fail (and print nothing on stdout).
fn fails(prog: &str, args: &[String]) -> String {
    let (success, out, err) = exec(prog, args);
    assert!(!success, "{prog} {args:?} succeeded: {out}");
    assert!(out.is_empty(), "output on failure: {out}");
    err
}

fn strings(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

/// `hf_logits`' output; [`DeviceMap`] keeps the printed order (a
/// `serde_json::Value` would sort the keys).
#[derive(serde::Deserialize)]
struct Logits {
    logits: Vec<Vec<f32>>,
    device_map: DeviceMap,
}

fn pairs(map: &DeviceMap) -> Vec<(String, String)> {
    map.iter()
        .map(|(k, p)| (k.to_string(), p.to_string()))
        .collect()
}

/// transformers' output rows for `hf_logits`: the logits, or BERT's last
/// hidden state; BERT's rows with padding are left out (`hf_logits` passes
/// no attention mask).
fn rows(name: &str) -> Vec<(String, Value)> {
    let r = reference(name);
    let key = if name == "bert" {
        "last_hidden_state"
    } else {
        "logits"
    };
    let inputs = r["input_ids"].as_array().unwrap();
    (0..inputs.len())
        .filter(|&i| {
            r.get("attention_mask")
                .is_none_or(|m| m[i].as_array().unwrap().iter().all(|x| x == 1))
        })
        .map(|i| (ids(&inputs[i]), r[key][i].clone()))
        .collect()
}

fn hf_logits(model: &Path, input_ids: &str, extra: &[String]) -> Logits {
    let mut args = strings(&[
        "--model",
        &model.display().to_string(),
        "--input-ids",
        input_ids,
    ]);
    args.extend_from_slice(extra);
    serde_json::from_str(&ok(HF_LOGITS, &args)).unwrap()
}

fn assert_close(got: &[Vec<f32>], want: &Value, what: &str) {
    let want: Vec<Vec<f32>> = serde_json::from_value(want.clone()).unwrap();
    assert_eq!(got.len(), want.len(), "{what}: positions");
    let d = got
        .iter()
        .flatten()
        .zip(want.iter().flatten())
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f32::max);
    assert_eq!(got[0].len(), want[0].len(), "{what}: width");
    assert!(d < TOL, "{what}: differs from transformers by {d}");
}

/// Accelerate takes no unitless size string, so a byte budget goes in as KB,
/// a hair over so that the float product truncates to the same byte count.
fn kb(bytes: u64) -> String {
    format!("{}.{:03}0001KB", bytes / 1000, bytes % 1000)
}

#[test]
fn hf_logits_plain_gives_transformers_logits() {
    for name in ALL {
        for (input, want) in rows(name) {
            let out = hf_logits(&fixture(name), &input, &[]);
            assert_close(&out.logits, &want, &format!("{name} [{input}] plain"));
            assert_eq!(pairs(&out.device_map), [(String::new(), "cpu".to_string())]);
        }
    }
}

#[test]
fn hf_logits_under_max_memory_prints_accelerates_map_and_the_same_logits() {
    for name in ALL {
        let r = reference(name);
        let (input, want) = rows(name).remove(0);
        for case in r["device_maps"].as_array().unwrap() {
            let cpu = case["max_memory"]["cpu"].as_u64().unwrap();
            let disk = case["max_memory"]["disk"].as_u64().unwrap();
            let offload = tempfile::tempdir().unwrap();
            let extra = strings(&[
                "--max-memory",
                &format!("cpu={},disk={}", kb(cpu), kb(disk)),
                "--offload-folder",
                &offload.path().display().to_string(),
            ]);
            let out = hf_logits(&fixture(name), &input, &extra);
            let how = format!("{name} with cpu={cpu}");
            let accelerate: Vec<(String, String)> =
                serde_json::from_value(case["device_map"].clone()).unwrap();
            assert_eq!(
                pairs(&out.device_map),
                accelerate,
                "{how}: printed map (left) vs Accelerate's"
            );
            assert_close(&out.logits, &want, &how);
        }
    }
}

/// Each fixture's last planned map, written as Python writes a device map
/// file, gives the same logits and is printed back in its order.
#[test]
fn hf_logits_takes_a_device_map_file() {
    for name in ALL {
        let r = reference(name);
        let (input, want) = rows(name).remove(0);
        let cases = r["device_maps"].as_array().unwrap();
        let map: Vec<(String, String)> =
            serde_json::from_value(cases[cases.len() - 1]["device_map"].clone()).unwrap();
        let body: Vec<String> = map
            .iter()
            .map(|(k, p)| format!("{}: {}", Value::from(k.as_str()), Value::from(p.as_str())))
            .collect();
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("device_map.json");
        std::fs::write(&file, format!("{{{}}}", body.join(", "))).unwrap();
        let extra = strings(&[
            "--device-map",
            &file.display().to_string(),
            "--offload-folder",
            &dir.path().join("offload").display().to_string(),
        ]);
        let out = hf_logits(&fixture(name), &input, &extra);
        assert_eq!(
            pairs(&out.device_map),
            map,
            "{name}: printed map vs the file's"
        );
        assert_close(&out.logits, &want, &format!("{name} --device-map"));
    }
}

fn generate(name: &str, extra: &[String]) -> Value {
    let g = &reference(name)["generate"];
    let mut args = strings(&[
        "--model",
        &fixture(name).display().to_string(),
        "--prompt-ids",
        &ids(&g["prompt_ids"]),
        "--max-new-tokens",
        &g["max_new_tokens"].to_string(),
    ]);
    args.extend_from_slice(extra);
    serde_json::from_str(&ok(GENERATE, &args)).unwrap()
}

/// The fixture's tokens (generated with `eos_token_id=None`) cut after the
/// first end-of-sequence token among the new ones, as transformers stops.
fn until_eos(name: &str) -> Vec<u64> {
    let g = &reference(name)["generate"];
    let tokens: Vec<u64> = serde_json::from_value(g["tokens"].clone()).unwrap();
    let prompt = g["prompt_ids"].as_array().unwrap().len();
    let cfg: Value =
        serde_json::from_str(&std::fs::read_to_string(fixture(name).join("config.json")).unwrap())
            .unwrap();
    let eos: Vec<u64> = match &cfg["eos_token_id"] {
        Value::Null => vec![],
        Value::Array(a) => a.iter().map(|v| v.as_u64().unwrap()).collect(),
        v => vec![v.as_u64().unwrap()],
    };
    let end = tokens[prompt..]
        .iter()
        .position(|t| eos.contains(t))
        .map_or(tokens.len(), |i| prompt + i + 1);
    tokens[..end].to_vec()
}

#[test]
fn generate_prompt_ids_gives_transformers_greedy_tokens() {
    for name in DECODERS {
        let g = &reference(name)["generate"];
        let out = generate(name, &strings(&["--ignore-eos"]));
        assert_eq!(out["tokens"], g["tokens"], "{name} --ignore-eos");
        let prompt = g["prompt_ids"].as_array().unwrap().len();
        assert_eq!(
            out["new_tokens"].as_array().unwrap()[..],
            g["tokens"].as_array().unwrap()[prompt..]
        );
        let out = generate(name, &[]);
        assert_eq!(
            out["tokens"],
            serde_json::json!(until_eos(name)),
            "{name} stopping at eos"
        );
    }
}

#[test]
fn generate_under_max_memory_gives_the_same_tokens() {
    for name in DECODERS {
        let r = reference(name);
        for case in r["device_maps"].as_array().unwrap() {
            let cpu = case["max_memory"]["cpu"].as_u64().unwrap();
            let offload = tempfile::tempdir().unwrap();
            let extra = strings(&[
                "--max-memory",
                &format!("cpu={},disk=1GB", kb(cpu)),
                "--offload-folder",
                &offload.path().display().to_string(),
                "--ignore-eos",
            ]);
            let out = generate(name, &extra);
            assert_eq!(
                out["tokens"], r["generate"]["tokens"],
                "{name} with cpu={cpu}"
            );
        }
    }
}

#[test]
fn generate_encodes_a_text_prompt_with_tokenizer_json() {
    let t = &reference("llama")["tokenizer"];
    let args = strings(&[
        "--model",
        &fixture("llama").display().to_string(),
        "--prompt",
        t["prompt"].as_str().unwrap(),
        "--max-new-tokens",
        "3",
        "--ignore-eos",
    ]);
    let out: Value = serde_json::from_str(&ok(GENERATE, &args)).unwrap();
    let prompt = t["prompt_ids"].as_array().unwrap();
    assert_eq!(
        out["tokens"].as_array().unwrap()[..prompt.len()],
        prompt[..]
    );
    assert_eq!(out["new_tokens"].as_array().unwrap().len(), 3);
    assert!(out["text"].is_string(), "{out}");
}

#[test]
fn bad_input_exits_non_zero_naming_the_flag_or_file() {
    let llama = fixture("llama").display().to_string();
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("no_such_model").display().to_string();
    let cases: Vec<(&str, Vec<String>, Vec<String>)> = vec![
        (
            HF_LOGITS,
            strings(&["--model", &missing, "--input-ids", "1,2"]),
            vec![missing.clone()],
        ),
        (
            GENERATE,
            strings(&[
                "--model",
                &missing,
                "--prompt-ids",
                "1",
                "--max-new-tokens",
                "1",
            ]),
            vec![missing.clone()],
        ),
        (
            HF_LOGITS,
            strings(&["--model", &llama, "--input-ids", "1,x,3"]),
            strings(&["--input-ids", "\"x\""]),
        ),
        (
            HF_LOGITS,
            strings(&["--model", &llama, "--input-ids", "1,128"]),
            strings(&["--input-ids", "128", "vocab_size"]),
        ),
        (
            GENERATE,
            strings(&[
                "--model",
                &llama,
                "--prompt-ids",
                "99999",
                "--max-new-tokens",
                "1",
            ]),
            strings(&["--prompt-ids", "99999"]),
        ),
        (
            HF_LOGITS,
            strings(&["--model", &llama, "--input-ids", ""]),
            strings(&["--input-ids"]),
        ),
        (
            GENERATE,
            strings(&[
                "--model",
                &llama,
                "--prompt-ids",
                "1;2",
                "--max-new-tokens",
                "1",
            ]),
            strings(&["--prompt-ids", "1;2"]),
        ),
        (
            HF_LOGITS,
            strings(&[
                "--model",
                &llama,
                "--input-ids",
                "1",
                "--device-map",
                &missing,
            ]),
            vec![missing.clone()],
        ),
        (
            HF_LOGITS,
            strings(&["--model", &llama, "--input-ids", "1", "--max-memory", "cpu"]),
            strings(&["--max-memory", "cpu"]),
        ),
        (
            GENERATE,
            strings(&[
                "--model",
                &fixture("gpt2").display().to_string(),
                "--prompt",
                "hi",
                "--max-new-tokens",
                "1",
            ]),
            strings(&["--prompt", "tokenizer.json"]),
        ),
    ];
    for (prog, args, named) in cases {
        let err = fails(prog, &args);
        for n in named {
            assert!(
                err.contains(&n),
                "{prog} {args:?}: stderr does not name {n}: {err}"
            );
        }
    }
}

/// Sampling as transformers' `generate` samples: the same `--seed` gives the
/// same tokens, another seed others; `--greedy` gives transformers' greedy
/// tokens even when generation_config.json asks for sampling; a bad value is
/// an error naming its flag.
#[test]
fn seeded_sampling_repeats_itself_and_flags_override_the_generation_config() {
    let name = "qwen3";
    let sample = |seed: &str| {
        generate(
            name,
            &strings(&[
                "--temperature",
                "1.5",
                "--top-k",
                "50",
                "--top-p",
                "0.95",
                "--seed",
                seed,
            ]),
        )["tokens"]
            .clone()
    };
    assert_eq!(sample("1"), sample("1"));
    assert!((2..6).any(|s| sample(&s.to_string()) != sample("1")));
    // A folder whose generation_config.json samples.
    let dir = tempfile::tempdir().unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(fixture(name).join(f), dir.path().join(f)).unwrap();
    }
    let config = r#"{"do_sample": true, "temperature": 2.0, "top_k": 100}"#;
    std::fs::write(dir.path().join("generation_config.json"), config).unwrap();
    let g = &reference(name)["generate"];
    let run = |extra: &[&str]| -> Value {
        let mut args = strings(&[
            "--model",
            &dir.path().display().to_string(),
            "--prompt-ids",
            &ids(&g["prompt_ids"]),
            "--max-new-tokens",
            &g["max_new_tokens"].to_string(),
            "--ignore-eos",
        ]);
        args.extend(strings(extra));
        serde_json::from_str(&ok(GENERATE, &args)).unwrap()
    };
    assert_eq!(run(&["--greedy"])["tokens"], g["tokens"]);
    assert!((0..4).any(|s| run(&["--seed", &s.to_string()])["tokens"] != g["tokens"]));
    let err = fails(
        GENERATE,
        &strings(&[
            "--model",
            &dir.path().display().to_string(),
            "--prompt-ids",
            "1,2",
        ])
        .into_iter()
        .chain(strings(&["--max-new-tokens", "2", "--top-p", "1.5"]))
        .collect::<Vec<_>>(),
    );
    assert!(err.contains("--top-p"), "{err}");
}

/// `--chat`: the prompt as a user message through the folder's chat
/// template with the generation prompt, the ids transformers'
/// `apply_chat_template` gives (tests/fixtures/chat).
#[test]
fn a_chat_prompt_is_rendered_with_the_folder_s_template() {
    let dir = tempfile::tempdir().unwrap();
    // Qwen3's fixture has room for the chat tokenizer's added tokens.
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(fixture("qwen3").join(f), dir.path().join(f)).unwrap();
    }
    let chat = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/chat");
    for f in [
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
    ] {
        std::fs::copy(chat.join(f), dir.path().join(f)).unwrap();
    }
    let text = std::fs::read_to_string(chat.join("reference.json")).unwrap();
    let r: Value = serde_json::from_str(&text).unwrap();
    let case = r["cases"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| {
            c["messages"].as_array().unwrap().len() == 1 && c["add_generation_prompt"] == true
        })
        .unwrap();
    let prompt = case["messages"][0]["content"].as_str().unwrap();
    let args = strings(&[
        "--model",
        &dir.path().display().to_string(),
        "--prompt",
        prompt,
        "--chat",
        "--max-new-tokens",
        "2",
    ]);
    let out: Value = serde_json::from_str(&ok(GENERATE, &args)).unwrap();
    let tokens = out["tokens"].as_array().unwrap();
    let want = case["input_ids"].as_array().unwrap();
    assert_eq!(&tokens[..want.len()], &want[..]);
}
