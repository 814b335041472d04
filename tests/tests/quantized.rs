//! Quantized bases against transformers + bitsandbytes (`tests/fixtures/quant`,
//! made by `scripts/make_quant_model_fixtures.py`): a full-precision Llama
//! loaded in 4 bits (each type and double-quantization setting) or 8 bits,
//! the folders transformers saved quantized, and a PEFT adapter on the 4-bit
//! base, each giving the reference logits.

use std::path::{Path, PathBuf};

use accel_core::bigmodel::quant::{BnbQuantizationConfig, QuantType};
use accel_core::models::AutoModel;
use candle_core::{DType, Device, Tensor};
use serde_json::Value;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures/quant")
        .join(name)
}

fn reference(dir: &Path) -> Value {
    let text = std::fs::read_to_string(dir.join("reference.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn rows(v: &Value) -> Vec<Vec<f32>> {
    serde_json::from_value(v.clone()).unwrap()
}

fn ids(r: &Value) -> Tensor {
    let ids: Vec<Vec<u32>> = serde_json::from_value(r["input_ids"].clone()).unwrap();
    Tensor::new(ids, &Device::Cpu).unwrap()
}

fn logits(model: &AutoModel, ids: &Tensor) -> Vec<Vec<f32>> {
    model
        .forward(ids)
        .unwrap()
        .get(0)
        .unwrap()
        .to_vec2()
        .unwrap()
}

fn max_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    a.iter()
        .flatten()
        .zip(b.iter().flatten())
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

fn four_bit(qt: QuantType, dq: bool, compute: DType) -> BnbQuantizationConfig {
    BnbQuantizationConfig {
        bnb_4bit_use_double_quant: dq,
        bnb_4bit_compute_dtype: compute,
        ..BnbQuantizationConfig::four_bit(qt)
    }
}

#[test]
fn four_bit_loading_gives_bitsandbytes_logits_for_every_setting() {
    let dir = fixture("llama");
    let r = reference(&dir);
    let ids = ids(&r);
    let fp32 = rows(&r["fp32"]);
    for qt in [QuantType::Nf4, QuantType::Fp4] {
        for dq in [false, true] {
            let key = format!("4bit_{}_{}", qt.name(), if dq { "dq" } else { "plain" });
            let q = four_bit(qt, dq, DType::F32);
            let model =
                AutoModel::load_quantized(&dir, Some(&q), None, DType::F32, &Device::Cpu).unwrap();
            let got = logits(&model, &ids);
            let want = rows(&r[&key]);
            let d = max_diff(&got, &want);
            assert!(d < 1e-3, "{key}: max |ours - bitsandbytes| = {d}");
            // The quantization itself moved the logits far more than that.
            assert!(max_diff(&want, &fp32) > 10.0 * d.max(1e-4), "{key}");
        }
    }
    // bf16 compute: bitsandbytes casts inputs and the dequantized weight to
    // bf16 and multiplies there; ours the same operands, f32 sums in another order.
    let q = four_bit(QuantType::Nf4, true, DType::BF16);
    let model = AutoModel::load_quantized(&dir, Some(&q), None, DType::F32, &Device::Cpu).unwrap();
    let d = max_diff(&logits(&model, &ids), &rows(&r["4bit_nf4_dq_bf16"]));
    assert!(d < 2e-2, "nf4 bf16 compute: {d}");
}

/// LLM.int8 quantizes activations too; ours multiplies the int8 weight in
/// the input's precision, which must be no further from fp32 than it (by
/// the mean and the root mean square of the logits' errors; one largest
/// error over 768 logits is too noisy a measure: there the two are within
/// 12% of each other either way).
#[test]
fn eight_bit_loading_is_no_further_from_fp32_than_llm_int8() {
    let dir = fixture("llama");
    let r = reference(&dir);
    let ids = ids(&r);
    let q = BnbQuantizationConfig::eight_bit();
    let model = AutoModel::load_quantized(&dir, Some(&q), None, DType::F32, &Device::Cpu).unwrap();
    let fp32 = rows(&r["fp32"]);
    let errors = |l: &[Vec<f32>]| -> (f64, f64) {
        let d: Vec<f64> = l
            .iter()
            .flatten()
            .zip(fp32.iter().flatten())
            .map(|(a, b)| f64::from(a - b))
            .collect();
        let n = d.len() as f64;
        (
            d.iter().map(|v| v.abs()).sum::<f64>() / n,
            (d.iter().map(|v| v * v).sum::<f64>() / n).sqrt(),
        )
    };
    let ours = errors(&logits(&model, &ids));
    let theirs = errors(&rows(&r["8bit"]));
    assert!(ours.0 > 0.0, "the weights are quantized");
    assert!(
        ours.0 <= theirs.0 && ours.1 <= theirs.1,
        "ours {ours:?}, bitsandbytes {theirs:?}"
    );
}

#[test]
fn folders_transformers_saved_quantized_load_without_flags() {
    for name in ["llama-nf4-dq", "llama-8bit"] {
        let dir = fixture(name);
        let r = reference(&dir);
        let model = AutoModel::load(&dir, DType::F32, &Device::Cpu).unwrap();
        let got = logits(&model, &ids(&r));
        let want = rows(&r["logits"]);
        let d = max_diff(&got, &want);
        // 8 bits: bitsandbytes quantizes the activations as well (see above).
        let tol = if name.ends_with("8bit") { 5e-2 } else { 1e-3 };
        assert!(d < tol, "{name}: {d}");
        let e = AutoModel::load_quantized(
            &dir,
            Some(&BnbQuantizationConfig::eight_bit()),
            None,
            DType::F32,
            &Device::Cpu,
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("already quantized"), "{e}");
    }
}

/// PEFT's adapter on the 4-bit base runs unmerged, with PEFT's logits.
#[test]
fn a_peft_adapter_on_the_four_bit_base_gives_peft_s_logits() {
    let adapter = fixture("qlora-adapter");
    let r = reference(&adapter);
    let q = four_bit(QuantType::Nf4, true, DType::F32);
    let model = AutoModel::load_quantized(
        fixture("llama"),
        Some(&q),
        Some(&adapter),
        DType::F32,
        &Device::Cpu,
    )
    .unwrap();
    let d = max_diff(&logits(&model, &ids(&r)), &rows(&r["logits"]));
    assert!(d < 1e-3, "{d}");
    // On the folder saved quantized, the same.
    let model = AutoModel::load_with_adapter(
        fixture("llama-nf4-dq"),
        Some(&adapter),
        DType::F32,
        &Device::Cpu,
    )
    .unwrap();
    let d = max_diff(&logits(&model, &ids(&r)), &rows(&r["logits"]));
    assert!(d < 1e-3, "saved base: {d}");
}

const WORKER: &str = env!("CARGO_BIN_EXE_finetune_hf_worker");
const LAUNCH: &str = env!("CARGO_BIN_EXE_accel_launch");

/// The 4-bit fixture with a tokenizer and a JSON Lines file in a temp dir.
fn qlora_model() -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(fixture("llama").join(f), dir.path().join(f)).unwrap();
    }
    let tok = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/hf/llama/tokenizer.json");
    std::fs::copy(tok, dir.path().join("tokenizer.json")).unwrap();
    let words = [
        "the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "to", "it",
    ];
    let lines: Vec<String> = (0..48)
        .map(|i| {
            let text: Vec<&str> = (0..20)
                .map(|j| words[(i * 7 + j * 3) % words.len()])
                .collect();
            serde_json::json!({ "text": text.join(" ") }).to_string()
        })
        .collect();
    std::fs::write(dir.path().join("train.jsonl"), lines.join("\n")).unwrap();
    let path = dir.path().to_path_buf();
    (dir, path)
}

const QLORA: [&str; 11] = [
    "--load-in-4bit",
    "--bnb-4bit-quant-type",
    "nf4",
    "--bnb-4bit-use-double-quant",
    "--bnb-4bit-compute-dtype",
    "float32",
    "--lora-r",
    "8",
    "--lora-alpha",
    "16",
    "--json",
];

/// `finetune_hf`'s QLoRA command line: PEFT's parameter counts, a falling
/// loss, a PEFT adapter folder whose logits on the 4-bit base move away
/// from the base's, and the checkpoint left as it was.
#[test]
fn qlora_trains_peft_s_adapters_on_the_four_bit_base() {
    let (_tmp, dir) = qlora_model();
    let before = std::fs::read(dir.join("model.safetensors")).unwrap();
    let out = dir.join("out");
    let mut cmd = std::process::Command::new(WORKER);
    cmd.arg("--model")
        .arg(&dir)
        .arg("--data")
        .arg(dir.join("train.jsonl"));
    cmd.args([
        "--seq-len",
        "32",
        "--steps",
        "20",
        "--lr",
        "1e-2",
        "--lora-target",
        "q_proj,v_proj",
    ]);
    cmd.args(QLORA).arg("--output-dir").arg(&out);
    let (ok, stdout, stderr) = accel_tests::run_program(cmd, None);
    assert!(ok, "{stderr}");
    let (setup, losses) = accel_tests::parse_run(&stdout);
    let peft = reference(&fixture("qlora-adapter"));
    assert_eq!(
        setup["trainable_parameters"],
        peft["trainable_parameters_r8"]
    );
    assert_eq!(setup["all_parameters"], peft["all_parameters_r8"]);
    assert_eq!(losses.len(), 20);
    assert!(losses[19] < 0.9 * losses[0], "{losses:?}");
    assert_eq!(
        before,
        std::fs::read(dir.join("model.safetensors")).unwrap()
    );
    let q = four_bit(QuantType::Nf4, true, DType::F32);
    let r = reference(&fixture("llama"));
    let base = logits(
        &AutoModel::load_quantized(&dir, Some(&q), None, DType::F32, &Device::Cpu).unwrap(),
        &ids(&r),
    );
    assert!(max_diff(&base, &rows(&r["4bit_nf4_dq"])) < 1e-3);
    let tuned =
        AutoModel::load_quantized(&dir, Some(&q), Some(&out), DType::F32, &Device::Cpu).unwrap();
    assert!(
        max_diff(&logits(&tuned, &ids(&r)), &base) > 1e-2,
        "the adapter changed nothing"
    );
}

/// QLoRA at two ranks prints the one-process losses: data-parallel, and
/// under FSDP with the 4-bit base sharded (each rank keeps half of the packed
/// codes and block maxima, gathered per decoder layer as it runs).
#[test]
fn qlora_at_two_ranks_gives_the_one_rank_losses() {
    let (_tmp, dir) = qlora_model();
    let data = dir.join("ids.json");
    let batch = serde_json::json!([[1, 40, 212, 7, 9, 30], [3, 5, 8, 13, 21, 34]]);
    std::fs::write(&data, batch.to_string()).unwrap();
    let args = |cmd: &mut std::process::Command| {
        cmd.arg("--model").arg(&dir).arg("--data-ids").arg(&data);
        cmd.args(["--steps", "4", "--lr", "1e-2"]).args(QLORA);
    };
    let mut one = std::process::Command::new(WORKER);
    args(&mut one);
    let (ok, out, err) = accel_tests::run_program(one, None);
    assert!(ok, "{err}");
    let (single_setup, single) = accel_tests::parse_run(&out);
    assert!(single[3] < single[0]);
    let fsdp = dir.join("fsdp.yaml");
    std::fs::write(
        &fsdp,
        "compute_environment: LOCAL_MACHINE\ndistributed_type: FSDP\nmixed_precision: 'no'\n\
         num_machines: 1\nnum_processes: 2\nmachine_rank: 0\nuse_cpu: true\nfsdp_config:\n  \
         fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP\n  fsdp_sharding_strategy: FULL_SHARD\n  \
         fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer\n",
    )
    .unwrap();
    let fsdp = fsdp.display().to_string();
    let mut bytes = vec![];
    for launch in [
        vec!["--num_processes", "2", "--cpu"],
        vec!["--config_file", &fsdp],
        vec!["--config_file", &fsdp, "--num_processes", "1"],
    ] {
        let mut cmd = std::process::Command::new(LAUNCH);
        cmd.arg("launch").args(&launch).arg(WORKER);
        args(&mut cmd);
        let (ok, out, err) = accel_tests::run_program(cmd, None);
        assert!(ok, "{launch:?}: {err}\n{out}");
        let (setup, losses) = accel_tests::parse_run(&out);
        assert_eq!(
            setup["all_parameters"], single_setup["all_parameters"],
            "{launch:?}"
        );
        assert_eq!(
            setup["trainable_parameters"], single_setup["trainable_parameters"],
            "{launch:?}"
        );
        for (a, b) in single.iter().zip(&losses) {
            assert!((a - b).abs() < 1e-5, "{launch:?}: {single:?} vs {losses:?}");
        }
        if let Some(b) = setup["sharding"]["quantized_bytes_per_rank"].as_u64() {
            bytes.push((setup["world_size"].as_u64().unwrap(), b));
        }
    }
    // One rank holds every packed byte; each of two, half of them (chunks
    // round up per tensor, a few bytes each).
    let [(2, half), (1, whole)] = bytes[..] else {
        panic!("{bytes:?}")
    };
    assert!(whole > 10_000, "{whole}");
    assert!(
        half >= whole / 2 && half < whole / 2 + 1_000,
        "{half} of {whole}"
    );
}

/// A quantized base without adapters, both widths at once, and bad values
/// are refused by name.
#[test]
fn bad_quantization_flags_are_named() {
    let (_tmp, dir) = qlora_model();
    let data = dir.join("train.jsonl");
    for (extra, want) in [
        (vec!["--load-in-4bit"], "--lora-r"),
        (
            vec!["--load-in-4bit", "--load-in-8bit", "--lora-r", "4"],
            "--load-in-8bit",
        ),
        (
            vec![
                "--load-in-4bit",
                "--bnb-4bit-quant-type",
                "int4",
                "--lora-r",
                "4",
            ],
            "--bnb-4bit-quant-type",
        ),
        (
            vec![
                "--load-in-4bit",
                "--bnb-4bit-compute-dtype",
                "int8",
                "--lora-r",
                "4",
            ],
            "--bnb-4bit-compute-dtype",
        ),
        (
            vec!["--bnb-4bit-use-double-quant", "--lora-r", "4"],
            "--load-in-4bit",
        ),
    ] {
        let mut cmd = std::process::Command::new(WORKER);
        cmd.arg("--model")
            .arg(&dir)
            .arg("--data")
            .arg(&data)
            .args(["--steps", "1"])
            .args(&extra);
        let (ok, _, err) = accel_tests::run_program(cmd, None);
        assert!(!ok && err.contains(want), "{extra:?}: {err}");
    }
}

/// `accel quantize` writes what transformers saves for the same model:
/// every tensor byte-equal (4-bit nf4 with double quantization, and 8-bit
/// with its int8 weights typed I8), and the same `quantization_config`.
#[test]
fn accel_quantize_writes_transformers_folders_byte_for_byte() {
    use accel_core::bigmodel::safetensors::MmapFile;
    let tmp = tempfile::tempdir().unwrap();
    for (flags, theirs) in [
        (
            vec![
                "--load-in-4bit",
                "--bnb-4bit-quant-type",
                "nf4",
                "--bnb-4bit-use-double-quant",
            ],
            "llama-nf4-dq",
        ),
        (vec!["--load-in-8bit"], "llama-8bit"),
    ] {
        let out = tmp.path().join(theirs);
        let mut argv = vec!["accel", "quantize", "--model"];
        let model = fixture("llama").display().to_string();
        let out_s = out.display().to_string();
        argv.extend([model.as_str(), "--out", out_s.as_str()]);
        argv.extend(flags);
        let cli = <accel_cli::Cli as clap::Parser>::try_parse_from(argv).unwrap();
        let accel_cli::Command::Quantize(args) = cli.command else {
            unreachable!()
        };
        accel_cli::quantize(&args).unwrap();
        let ours = MmapFile::open(out.join("model.safetensors")).unwrap();
        let want = MmapFile::open(fixture(theirs).join("model.safetensors")).unwrap();
        let names = |f: &MmapFile| {
            let mut n: Vec<String> = f.header().tensors().keys().cloned().collect();
            n.sort();
            n
        };
        assert_eq!(names(&ours), names(&want), "{theirs}");
        for name in names(&want) {
            let (a, b) = (
                ours.header().get(&name).unwrap(),
                want.header().get(&name).unwrap(),
            );
            assert_eq!(
                (&a.dtype, &a.shape),
                (&b.dtype, &b.shape),
                "{theirs}: {name}"
            );
            assert!(
                ours.bytes(&name) == want.bytes(&name),
                "{theirs}: {name} differs"
            );
        }
        let cfg = |d: &Path| -> Value {
            serde_json::from_str(&std::fs::read_to_string(d.join("config.json")).unwrap()).unwrap()
        };
        assert_eq!(
            cfg(&out)["quantization_config"],
            cfg(&fixture(theirs))["quantization_config"]
        );
    }
}

/// `accel merge-lora` onto a 4-bit base: the weights dequantized with the
/// update added, written in the compute dtype without quantization_config,
/// with PEFT's logits of the adapter on that base.
#[test]
fn merge_lora_onto_a_four_bit_base_writes_the_dequantized_merged_model() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("merged");
    accel_core::model::merge_lora(
        &fixture("llama-nf4-dq"),
        &fixture("qlora-adapter"),
        &out,
        "5GB",
    )
    .unwrap();
    let cfg: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
    assert!(cfg.get("quantization_config").is_none());
    assert_eq!(cfg["dtype"], "float32");
    let r = reference(&fixture("qlora-adapter"));
    let merged = AutoModel::load(&out, DType::F32, &Device::Cpu).unwrap();
    let d = max_diff(&logits(&merged, &ids(&r)), &rows(&r["logits"]));
    assert!(d < 1e-3, "{d}");
}

/// A saved 4-bit folder whose parts disagree with its weight is refused,
/// naming the tensor.
#[test]
fn a_damaged_quantized_folder_names_the_tensor() {
    use accel_core::checkpoint::{read_safetensors, write_safetensors};
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    for f in ["config.json", "generation_config.json"] {
        std::fs::copy(fixture("llama-nf4-dq").join(f), dir.join(f)).unwrap();
    }
    let mut t = read_safetensors(
        fixture("llama-nf4-dq").join("model.safetensors"),
        &Device::Cpu,
    )
    .unwrap();
    let name = "model.layers.1.mlp.up_proj.weight.absmax";
    let short = t[name].narrow(0, 0, 100).unwrap();
    t.insert(name.to_string(), short);
    write_safetensors(dir.join("model.safetensors"), &t, None).unwrap();
    let e = AutoModel::load(dir, DType::F32, &Device::Cpu)
        .unwrap_err()
        .to_string();
    assert!(e.contains(name), "{e}");
}

/// A folder saved quantized dispatches as Accelerate's
/// `load_checkpoint_and_dispatch` does: planned over its module tree (the
/// packed codes sized as they are), layers left on disk read back per
/// forward, with the logits it has loaded whole.
#[test]
fn a_quantized_folder_dispatches_with_layers_on_disk() {
    use accel_core::bigmodel::{Placement, PlanOptions};
    use accel_core::nn::{DeviceMapChoice, LoadDispatchOptions};
    for name in ["llama-nf4-dq", "llama-8bit"] {
        let dir = fixture(name);
        let whole = AutoModel::load(&dir, DType::F32, &Device::Cpu).unwrap();
        let r = reference(&dir);
        let budget = vec![
            (Placement::Cpu, "150KB".into()),
            (Placement::Disk, "1GB".into()),
        ];
        let plan = PlanOptions::new(budget).with_no_split_module_classes([whole.layer_class()]);
        let opts = LoadDispatchOptions::new(DeviceMapChoice::Auto(plan));
        let (dispatched, report) = AutoModel::load_dispatched(&dir, &opts).unwrap();
        let on_disk = format!("{report:?}");
        assert!(
            on_disk.contains("(\"model.layers.1\", 'disk')"),
            "{name}: {on_disk}"
        );
        let d = max_diff(&logits(&dispatched, &ids(&r)), &logits(&whole, &ids(&r)));
        assert!(d < 1e-5, "{name}: {d}");
    }
}

/// Accelerate's `load_and_quantize_model`: a full-precision folder quantized
/// on load and dispatched with layers on disk plans as the folder saved
/// quantized plans, gives transformers + bitsandbytes' logits, keeps the
/// quantized weights it offloads in the offload folder, and without one
/// refuses disk parts by name.
#[test]
fn quantizing_on_load_dispatches_with_layers_on_disk() {
    use accel_core::bigmodel::{Placement, PlanOptions};
    use accel_core::model::load_and_quantize_model;
    use accel_core::nn::{DeviceMapChoice, LoadDispatchOptions};
    let dir = fixture("llama");
    let r = reference(&dir);
    let budget = vec![
        (Placement::Cpu, "150KB".into()),
        (Placement::Disk, "1GB".into()),
    ];
    let plan = PlanOptions::new(budget).with_no_split_module_classes(["LlamaDecoderLayer"]);
    for (q, saved, want) in [
        (
            four_bit(QuantType::Nf4, true, DType::F32),
            "llama-nf4-dq",
            "4bit_nf4_dq",
        ),
        (BnbQuantizationConfig::eight_bit(), "llama-8bit", ""),
    ] {
        let offload = tempfile::tempdir().unwrap();
        let opts = LoadDispatchOptions::new(DeviceMapChoice::Auto(plan.clone()))
            .with_offload_folder(offload.path());
        let (model, map) = load_and_quantize_model(&dir, &q, &opts).unwrap();
        let saved_plan = AutoModel::empty(fixture(saved), DType::F32)
            .unwrap()
            .plan_device_map(&plan)
            .unwrap();
        assert_eq!(map, saved_plan, "{saved}");
        assert_eq!(map.get("model.layers"), Some(Placement::Disk), "{map:?}");
        let got = logits(&model, &ids(&r));
        let whole =
            AutoModel::load_quantized(&dir, Some(&q), None, DType::F32, &Device::Cpu).unwrap();
        assert!(max_diff(&got, &logits(&whole, &ids(&r))) < 1e-6, "{saved}");
        if !want.is_empty() {
            assert!(max_diff(&got, &rows(&r[want])) < 1e-3, "{saved}");
        }
        assert!(offload.path().join("quantized/model.safetensors").is_file());
        let err = load_and_quantize_model(
            &dir,
            &q,
            &LoadDispatchOptions::new(DeviceMapChoice::Auto(plan.clone())),
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("offload_folder") && err.contains("disk"),
            "{err}"
        );
    }
}
