//! The `finetune_hf` program on the tiny transformers-written Llama: its first
//! loss is transformers' own, and one process, two ranks under `accel launch`
//! and an FSDP config file print the same losses.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

const WORKER: &str = env!("CARGO_BIN_EXE_finetune_hf_worker");
const LAUNCH: &str = env!("CARGO_BIN_EXE_accel_launch");

use accel_tests::{hf_fixture as fixture, hf_reference as reference};

fn run_with(cmd: Command, precision: Option<&str>) -> (bool, String, String) {
    accel_tests::run_program(cmd, precision)
}

fn run(cmd: Command) -> (bool, String, String) {
    run_with(cmd, None)
}

fn parse(stdout: &str) -> (Value, Vec<f64>) {
    accel_tests::parse_run(stdout)
}

/// A data file with `ids` in `dir`.
fn data(dir: &Path, ids: &Value) -> PathBuf {
    let path = dir.join("ids.json");
    std::fs::write(&path, ids.to_string()).unwrap();
    path
}

/// The batch of the reference's two sequences and two more.
fn four_sequences() -> Value {
    let mut ids = reference("llama")["input_ids"].as_array().unwrap().clone();
    ids.push(serde_json::json!([1, 9, 33, 7, 81, 2, 45]));
    ids.push(serde_json::json!([5, 5, 70, 127, 0, 64, 11]));
    Value::Array(ids)
}

fn flags(model: &Path, data: &Path, extra: &[&str]) -> Vec<String> {
    let mut v: Vec<String> = vec![
        "--model".into(),
        model.display().to_string(),
        "--data-ids".into(),
        data.display().to_string(),
        "--steps".into(),
        "4".into(),
        "--lr".into(),
        "1e-2".into(),
        "--json".into(),
    ];
    v.extend(extra.iter().map(|s| s.to_string()));
    v
}

fn one_process(model: &Path, data: &Path, extra: &[&str]) -> (Value, Vec<f64>) {
    let mut cmd = Command::new(WORKER);
    cmd.args(flags(model, data, extra));
    let (ok, out, err) = run(cmd);
    assert!(ok, "finetune_hf failed: {err}");
    parse(&out)
}

fn launched(launch_flags: &[&str], model: &Path, data: &Path) -> (Value, Vec<f64>) {
    let mut cmd = Command::new(LAUNCH);
    cmd.arg("launch")
        .args(launch_flags)
        .arg(WORKER)
        .args(flags(model, data, &[]));
    let (ok, out, err) = run(cmd);
    assert!(ok, "accel launch failed: {err}\n{out}");
    parse(&out)
}

fn assert_close(a: &[f64], b: &[f64], tol: f64, what: &str) {
    assert_eq!(a.len(), b.len(), "{what}");
    for (k, (x, y)) in a.iter().zip(b).enumerate() {
        assert!((x - y).abs() < tol, "{what}: step {}: {x} vs {y}", k + 1);
    }
}

#[test]
fn the_first_loss_is_transformers_and_the_loss_falls() {
    let tmp = tempfile::tempdir().unwrap();
    let r = reference("llama");
    let ids = data(tmp.path(), &r["input_ids"]);
    let (setup, losses) = one_process(&fixture("llama"), &ids, &[]);
    assert_eq!(setup["distributed"], "NO");
    assert_eq!(setup["mixed_precision"], "no");
    assert_eq!(setup["world_size"], 1);
    assert!(setup["sharding"].is_null(), "{setup}");
    let want = r["loss"].as_f64().unwrap();
    assert!(
        (losses[0] - want).abs() < 1e-4,
        "first loss {} vs transformers' {want}",
        losses[0]
    );
    assert_eq!(losses.len(), 4);
    assert!(losses[3] < losses[0], "{losses:?}");
}

#[test]
fn two_ranks_under_accel_launch_give_the_one_process_losses() {
    let tmp = tempfile::tempdir().unwrap();
    let ids = data(tmp.path(), &four_sequences());
    let model = fixture("llama");
    let (_, one) = one_process(&model, &ids, &[]);
    let (setup, two) = launched(&["--num_processes", "2", "--cpu"], &model, &ids);
    assert_eq!(setup["distributed"], "MULTI_CPU");
    assert_eq!(setup["world_size"], 2);
    assert!(setup["sharding"].is_null(), "{setup}");
    assert_close(&one, &two, 1e-5, "MULTI_CPU at 2 ranks vs 1 process");
}

/// An Accelerate config file for 2 CPU ranks under FSDP FULL_SHARD, each
/// `class` block a unit.
fn fsdp_config(dir: &Path, class: &str) -> String {
    let config = dir.join("default_config.yaml");
    std::fs::write(
        &config,
        format!(
            "compute_environment: LOCAL_MACHINE\n\
             distributed_type: FSDP\n\
             mixed_precision: 'no'\n\
             num_machines: 1\n\
             num_processes: 2\n\
             machine_rank: 0\n\
             use_cpu: true\n\
             fsdp_config:\n  \
               fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP\n  \
               fsdp_sharding_strategy: FULL_SHARD\n  \
               fsdp_transformer_layer_cls_to_wrap: {class}\n  \
               fsdp_state_dict_type: FULL_STATE_DICT\n"
        ),
    )
    .unwrap();
    config.display().to_string()
}

#[test]
fn an_fsdp_config_file_shards_each_decoder_layer_and_gives_the_one_process_losses() {
    let tmp = tempfile::tempdir().unwrap();
    let ids = data(tmp.path(), &four_sequences());
    let model = fixture("llama");
    let config = fsdp_config(tmp.path(), "LlamaDecoderLayer");
    let (_, one) = one_process(&model, &ids, &[]);
    let (setup, sharded) = launched(&["--config_file", &config], &model, &ids);
    assert_eq!(setup["distributed"], "FSDP");
    assert_eq!(setup["world_size"], 2);
    assert_eq!(setup["sharding"]["strategy"], "FULL_SHARD", "{setup}");
    // The fixture's two LlamaDecoderLayers.
    assert_eq!(setup["sharding"]["units"], 2, "{setup}");
    assert_close(
        &one,
        &sharded,
        1e-5,
        "FSDP FULL_SHARD at 2 ranks vs 1 process",
    );
}

/// GPT-2 (tied head, `Conv1D` weights stored transposed) too: transformers'
/// first loss, and the same losses plain, at 2 ranks and sharded by `GPT2Block`.
#[test]
fn gpt2_starts_at_transformers_loss_and_trains_the_same_every_way() {
    let tmp = tempfile::tempdir().unwrap();
    let model = fixture("gpt2");
    let r = reference("gpt2");
    let ref_ids = data(tmp.path(), &r["input_ids"]);
    let (_, losses) = one_process(&model, &ref_ids, &[]);
    let want = r["loss"].as_f64().unwrap();
    assert!((losses[0] - want).abs() < 1e-4, "{} vs {want}", losses[0]);
    assert!(losses[3] < losses[0], "{losses:?}");

    let ids = data(tmp.path(), &four_sequences());
    let (_, one) = one_process(&model, &ids, &[]);
    let (_, two) = launched(&["--num_processes", "2", "--cpu"], &model, &ids);
    assert_close(&one, &two, 1e-5, "GPT-2 MULTI_CPU at 2 ranks vs 1 process");
    let config = fsdp_config(tmp.path(), "GPT2Block");
    let (setup, sharded) = launched(&["--config_file", &config], &model, &ids);
    assert_eq!(setup["sharding"]["units"], 2, "{setup}");
    assert_close(&one, &sharded, 1e-5, "GPT-2 FSDP at 2 ranks vs 1 process");
}

#[test]
fn bf16_starts_from_the_checkpoint_within_bf16_tolerance_and_the_flag_beats_the_launcher() {
    let tmp = tempfile::tempdir().unwrap();
    let ids = data(tmp.path(), &reference("llama")["input_ids"]);
    let model = fixture("llama");
    let (_, fp32) = one_process(&model, &ids, &[]);
    let (setup, bf16) = one_process(&model, &ids, &["--mixed-precision", "bf16"]);
    assert_eq!(setup["mixed_precision"], "bf16");
    // bf16 keeps 8 bits of mantissa: about 0.4% per rounding, far less on average.
    assert!(
        (bf16[0] - fp32[0]).abs() < 0.02 * fp32[0],
        "bf16 {} vs fp32 {}",
        bf16[0],
        fp32[0]
    );
    assert!(bf16[0] != fp32[0], "bf16 computed in fp32?");
    // The launcher's precision applies when the flag is absent; the flag wins.
    let with_env = |extra: &[&str]| {
        let mut cmd = Command::new(WORKER);
        cmd.args(flags(&model, &ids, extra));
        let (ok, out, err) = run_with(cmd, Some("bf16"));
        assert!(ok, "{err}");
        parse(&out).0["mixed_precision"].clone()
    };
    assert_eq!(with_env(&[]), "bf16");
    assert_eq!(with_env(&["--mixed-precision", "no"]), "no");
}

#[test]
fn bert_and_bad_data_files_are_refused_with_the_file_named() {
    let tmp = tempfile::tempdir().unwrap();
    let ids = data(tmp.path(), &reference("llama")["input_ids"]);
    let mut cmd = Command::new(WORKER);
    cmd.args(flags(&fixture("bert"), &ids, &[]));
    let (ok, _, err) = run(cmd);
    assert!(!ok);
    assert!(err.contains("bert") && err.contains("causal"), "{err}");

    let ragged = tmp.path().join("ragged.json");
    std::fs::write(&ragged, "[[1, 2, 3], [4, 5]]").unwrap();
    let too_big = tmp.path().join("too_big.json");
    std::fs::write(&too_big, "[[1, 2, 128]]").unwrap();
    for (file, want) in [(&ragged, "ragged"), (&too_big, "vocab_size 128")] {
        let mut cmd = Command::new(WORKER);
        cmd.args(flags(&fixture("llama"), file, &[]));
        let (ok, _, err) = run(cmd);
        assert!(!ok);
        let name = file.file_name().unwrap().to_str().unwrap();
        assert!(err.contains(name) && err.contains(want), "{err}");
    }
}

/// An HF folder as the Trainer's model (`HfLm`): after `load_checkpoint`,
/// or built by `Trainer::from_pretrained`, its evaluation loss on the
/// reference ids is transformers', and a few steps of training lower it.
#[test]
fn the_trainer_fine_tunes_an_hf_folder_from_its_weights() {
    use accel_core::data::TensorDataset;
    use accel_core::models::ModelConfig;
    use accel_core::trainer::{Trainer, TrainingArguments};
    use accel_examples::hf::HfLm;
    use candle_core::{Device, Tensor};

    let tmp = tempfile::tempdir().unwrap();
    for (name, from_pretrained) in [("llama", false), ("gpt2", false), ("llama", true)] {
        let dir = fixture(name);
        let r = reference(name);
        let rows: Vec<Vec<u32>> = serde_json::from_value(r["input_ids"].clone()).unwrap();
        let ids =
            Tensor::from_vec(rows.concat(), (rows.len(), rows[0].len()), &Device::Cpu).unwrap();
        let data = || TensorDataset::new(vec![ids.clone()]).unwrap();
        let out = tmp.path().join(format!("{name}-{from_pretrained}"));
        let mut args = TrainingArguments::new(out)
            .with_max_steps(5)
            .with_batch_size(2)
            .with_learning_rate(1e-2);
        args.use_cpu = true;
        args.disable_tqdm = true;
        args.report_to = vec![];
        args.weight_decay = 0.0;
        let cfg = ModelConfig::from_path(&dir).unwrap();
        let build = |vb| HfLm::new(&cfg, vb);
        let mut trainer = if from_pretrained {
            Trainer::from_pretrained(args, &dir, build, data(), Some(data())).unwrap()
        } else {
            let trainer = Trainer::new(args, build, data(), Some(data())).unwrap();
            trainer.parameters().load_checkpoint(&dir).unwrap();
            trainer
        };
        let before = trainer.evaluate().unwrap()["eval_loss"];
        let want = r["loss"].as_f64().unwrap();
        assert!(
            (before - want).abs() < 1e-4,
            "{name} (from_pretrained {from_pretrained}): {before} vs transformers' {want}"
        );
        trainer.train().unwrap();
        let after = trainer.evaluate().unwrap()["eval_loss"];
        assert!(after < before - 0.1, "{name}: {before} -> {after}");
    }
}

/// `--data FILE`: a JSON Lines dataset of text and prompt/completion
/// examples, packed into windows, a tenth held out. At one process and at
/// two ranks the loss falls, the held-out loss is printed, and
/// `--output-dir` writes a folder that loads with the source's config.
#[test]
fn a_jsonl_dataset_trains_at_one_and_two_ranks_and_saves_a_folder() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("train.jsonl");
    let mut lines: Vec<String> = (0..30)
        .map(|i| format!(r#"{{"text": "the quick brown fox {i} jumps over the lazy dog"}}"#))
        .collect();
    lines.extend((0..10).map(|_| r#"{"prompt": "the quick", "completion": " brown fox"}"#.into()));
    std::fs::write(&data, lines.join("\n")).unwrap();
    let model = fixture("llama");
    for world in [1usize, 2] {
        let out_dir = tmp.path().join(format!("out{world}"));
        let args: Vec<String> = [
            "--model",
            &model.display().to_string(),
            "--data",
            &data.display().to_string(),
            "--seq-len",
            "16",
            "--batch-size",
            "2",
            "--steps",
            "6",
            "--lr",
            "1e-2",
            "--eval-fraction",
            "0.1",
            "--output-dir",
            &out_dir.display().to_string(),
            "--json",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let cmd = if world == 1 {
            let mut c = Command::new(WORKER);
            c.args(&args);
            c
        } else {
            let mut c = Command::new(LAUNCH);
            c.args(["launch", "--num_processes", "2", "--cpu", WORKER])
                .args(&args);
            c
        };
        let (ok, out, err) = run(cmd);
        assert!(ok, "world {world}: {err}\n{out}");
        let lines: Vec<Value> = out
            .lines()
            .map(|l| l.strip_prefix("[rank0]: ").unwrap_or(l))
            .filter(|l| l.starts_with('{'))
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        let setup = &lines[0]["setup"];
        assert_eq!(setup["world_size"], world, "{setup}");
        // transformers: sum(p.numel() for p in
        // AutoModelForCausalLM.from_pretrained(fixture).parameters()) == 26784.
        assert_eq!(setup["all_parameters"], 26784, "{setup}");
        assert_eq!(setup["trainable_parameters"], 26784, "{setup}");
        assert_eq!(setup["tokens_per_step"], 2 * 16 * world, "{setup}");
        let (train, eval) = (
            setup["train_windows"].as_u64().unwrap(),
            setup["eval_windows"].as_u64().unwrap(),
        );
        assert!(train > 0 && eval == (train + eval).div_ceil(10), "{setup}");
        let losses: Vec<f64> = lines[1..7]
            .iter()
            .map(|l| l["loss"].as_f64().unwrap())
            .collect();
        assert!(
            losses[5] < losses[0],
            "world {world}: the loss did not fall: {losses:?}"
        );
        let eval_loss = lines[7]["eval_loss"].as_f64().unwrap();
        assert!(eval_loss.is_finite(), "{}", lines[7]);
        assert_eq!(
            std::fs::read(out_dir.join("config.json")).unwrap(),
            std::fs::read(model.join("config.json")).unwrap()
        );
        accel_core::models::AutoModel::load(
            &out_dir,
            candle_core::DType::F32,
            &candle_core::Device::Cpu,
        )
        .unwrap();
    }
}

/// The Trainer on a [`JsonlDataset`](accel_core::data::JsonlDataset)
/// (`finetune --model DIR --data FILE`): prompt/completion examples whose
/// prompts the loss ignores; the held-out loss falls, and `save_model`
/// writes a folder with the source's config and tokenizer that loads.
#[test]
fn the_trainer_trains_on_a_jsonl_dataset_and_saves_an_hf_folder() {
    use accel_core::data::{JsonlDataset, JsonlOptions};
    use accel_core::models::{AutoModel, ModelConfig, Tokenizer};
    use accel_core::trainer::{Trainer, TrainingArguments};
    use accel_examples::hf::HfLm;
    use candle_core::{DType, Device};

    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("train.jsonl");
    let lines: Vec<String> = (0..40)
        .map(|i| format!(r#"{{"prompt": "the quick {i}", "completion": " brown fox jumps"}}"#))
        .collect();
    std::fs::write(&data, lines.join("\n")).unwrap();
    let dir = fixture("llama");
    let cfg = ModelConfig::from_path(&dir).unwrap();
    let tok = Tokenizer::from_file(&dir).unwrap();
    let mut options = JsonlOptions::new(16);
    options.eos_token_id = Some(2);
    let ds = JsonlDataset::open(&data, &tok, &options, &Device::Cpu).unwrap();
    let (train, eval) = ds.split(0.2, 3).unwrap();
    let out = tmp.path().join("run");
    let mut args = TrainingArguments::new(&out)
        .with_max_steps(8)
        .with_batch_size(4)
        .with_learning_rate(1e-2);
    args.use_cpu = true;
    args.disable_tqdm = true;
    args.report_to = vec![];
    let build = |vb| HfLm::new(&cfg, vb);
    let mut trainer = Trainer::from_pretrained(args, &dir, build, train, Some(eval)).unwrap();
    let before = trainer.evaluate().unwrap()["eval_loss"];
    trainer.train().unwrap();
    let after = trainer.evaluate().unwrap()["eval_loss"];
    assert!(after < before - 0.1, "{before} -> {after}");
    let model_dir = out.join("model");
    trainer.save_model(&model_dir).unwrap();
    for f in ["config.json", "tokenizer.json"] {
        assert_eq!(
            std::fs::read(model_dir.join(f)).unwrap(),
            std::fs::read(dir.join(f)).unwrap(),
            "{f}"
        );
    }
    AutoModel::load(&model_dir, DType::F32, &Device::Cpu).unwrap();
}
