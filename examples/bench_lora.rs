//! LoRA fine-tuning against a full fine-tune and against transformers +
//! PEFT, on `bench_bigmodel`'s 0.5 B-parameter Llama checkpoint: steps/s,
//! losses, peak RSS and trainable parameters of each, as one JSON object.
//!
//! ```text
//! cargo run --release --example bench_lora -- --json [--model DIR] [--steps N]
//!     [--seq-len T] [--batch B] [--mixed-precision bf16|no] [--no-python] [--qlora]
//! ```
//! Without `--model`, the checkpoint is `target/bench_llama_2gb`, written by
//! `scripts/bench_bigmodel_torch.py write` when absent (needs `pip install
//! torch transformers`).
//!
//! Three sides, each in a process of its own (peak RSS is per process), in
//! this order, with the page cache warm (as written for the default
//! `--mixed-precision bf16`; with `no` every side is fp32, PEFT's model
//! loaded in float32):
//! - `accel_rs_lora`: [`Accelerator::prepare_lora`], r 8, alpha 16 on
//!   q_proj,v_proj, bf16 mixed precision (the frozen base held in bf16
//!   alone, the adapters with fp32 masters), AdamW lr 1e-4;
//! - `accel_rs_full`: the whole model trained ([`Accelerator::prepare_pretrained`]),
//!   bf16 mixed precision, the same AdamW;
//! - `peft`: `scripts/bench_lora_peft.py`, the model loaded in bfloat16 and
//!   wrapped by `get_peft_model` with the same LoRA settings (adapters in
//!   fp32), `torch.optim.AdamW` over the trainable parameters, as many
//!   threads as cores (`pip install torch transformers peft`).
//!
//! With `--qlora`, two more (Accelerate's `BnbQuantizationConfig` / QLoRA):
//! - `accel_rs_qlora`: [`Accelerator::prepare_lora_quantized`], the base
//!   quantized to 4-bit NF4 with double quantization as it loads, compute
//!   dtype bfloat16 (float32 with `--mixed-precision no`), the same adapters;
//! - `peft_qlora`: the PEFT script with `--load-in-4bit` (bitsandbytes' same
//!   settings; `pip install bitsandbytes`).
//!
//! Every side trains on the same `B x T` token ids, `(i * 7 + j * 13) % vocab`
//! at row i, position j: one untimed warm-up step (its loss is `first_loss`),
//! then `--steps` timed ones (steps/s over them; `last_loss` is the last
//! step's). Without Python, or with `--no-python`, `peft` is null and its
//! `peft_skipped` says why.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use accel_core::bigmodel::lora::{LoraConfig, LoraTargets};
use accel_core::bigmodel::quant::{
    is_quant_part, quant_state_name, BnbQuantizationConfig, QuantType,
};
use accel_core::models::{AutoModel, ModelConfig};
use accel_core::optim::{AdamW, AdamWConfig};
use accel_core::{Accelerator, AcceleratorConfig, PrecisionType};
use accel_examples::bench_proc::{run_side, script_checkpoint, status_kib};
use anyhow::{bail, Context, Result};
use candle_core::{DType, Tensor};
use clap::{Parser, ValueEnum};
use serde_json::{json, Value};

#[derive(Parser, Debug)]
struct Args {
    /// The checkpoint folder [default: target/bench_llama_2gb, written when absent].
    #[arg(long)]
    model: Option<PathBuf>,
    /// Print only the JSON object, on one line.
    #[arg(long)]
    json: bool,
    /// Timed steps per side, after one untimed warm-up step.
    #[arg(long, default_value_t = 3)]
    steps: usize,
    /// Tokens per sequence.
    #[arg(long, default_value_t = 128)]
    seq_len: usize,
    /// Sequences per step.
    #[arg(long, default_value_t = 1)]
    batch: usize,
    /// Skip the transformers + PEFT side.
    #[arg(long)]
    no_python: bool,
    /// `bf16` (the base held in bf16; PEFT loads it in bfloat16) or `no`
    /// (everything fp32 on both sides: no AMX or bf16 products anywhere).
    #[arg(long, default_value = "bf16")]
    mixed_precision: PrecisionType,
    /// Skip the full fine-tune (a model whose AdamW state does not fit).
    #[arg(long)]
    no_full: bool,
    /// LoRA's rank on every side (alpha stays 16).
    #[arg(long, default_value_t = 8)]
    lora_r: usize,
    /// Recompute each decoder layer in backward on every side (transformers'
    /// `gradient_checkpointing_enable()`).
    #[arg(long)]
    gradient_checkpointing: bool,
    /// Also run QLoRA: the base loaded in 4-bit NF4 with double quantization
    /// (compute dtype bfloat16 under `--mixed-precision bf16`, else float32),
    /// ours (`accel_rs_qlora`) and transformers + PEFT + bitsandbytes
    /// (`peft_qlora`), with the same LoRA settings.
    #[arg(long)]
    qlora: bool,
    /// Internal: run one accel-rs side in this process and print its JSON.
    #[arg(long, hide = true, value_enum)]
    child: Option<Side>,
}

/// The accel-rs sides.
#[derive(Debug, Clone, Copy, PartialEq, ValueEnum)]
enum Side {
    Lora,
    Full,
    Qlora,
}

impl Side {
    fn name(self) -> &'static str {
        match self {
            Side::Lora => "accel_rs_lora",
            Side::Full => "accel_rs_full",
            Side::Qlora => "accel_rs_qlora",
        }
    }
}

/// The LoRA settings every side uses (PEFT's names).
const LORA_ALPHA: f64 = 16.0;
const LORA_TARGETS: &str = "q_proj,v_proj";
const LR: f64 = 1e-4;

const PEFT_SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/bench_lora_peft.py");
const WRITE_SCRIPT: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../scripts/bench_bigmodel_torch.py"
);

/// Resets the process's VmHWM to its current resident set (Linux 4.0 and
/// later), so the next reading is the peak of what follows; false where the
/// kernel refuses.
fn reset_peak_rss() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

fn round(x: f64, digits: i32) -> f64 {
    let f = 10f64.powi(digits);
    (x * f).round() / f
}

/// The token ids every side trains on: `(i * 7 + j * 13) % vocab`.
fn token_ids(batch: usize, seq_len: usize, vocab: usize) -> Vec<u32> {
    (0..batch)
        .flat_map(|i| (0..seq_len).map(move |j| ((i * 7 + j * 13) % vocab) as u32))
        .collect()
}

/// The architecture of `cfg` on `vb`, its error boxed in accel-core's
/// (accel-models' own is large to return by value).
fn build(cfg: &ModelConfig, vb: candle_nn::VarBuilder) -> accel_core::Result<AutoModel> {
    Ok(AutoModel::new(cfg, vb)?)
}

/// One accel-rs side, in this process: prepare, a warm-up step, the timed
/// steps; its figures as JSON.
fn child(side: Side, dir: &Path, args: &Args) -> Result<Value> {
    let mut cfg = ModelConfig::from_path(dir)
        .with_context(|| format!("{}: reading config.json", dir.display()))?;
    let ModelConfig::Llama(llama) = &cfg else {
        bail!(
            "{}: bench_lora needs a llama-architecture checkpoint (q_proj, v_proj)",
            dir.display()
        );
    };
    let vocab = llama.vocab_size;
    let lora = match side {
        Side::Lora | Side::Qlora => {
            let targets = LoraTargets::parse(LORA_TARGETS).map_err(anyhow::Error::msg)?;
            let mut config = LoraConfig::new(args.lora_r, targets);
            config.alpha = LORA_ALPHA;
            Some(cfg.set_lora(config))
        }
        Side::Full => None,
    };
    let quantize = match side {
        Side::Qlora => {
            cfg.set_quantization(BnbQuantizationConfig {
                bnb_4bit_use_double_quant: true,
                bnb_4bit_compute_dtype: match args.mixed_precision {
                    PrecisionType::No => DType::F32,
                    _ => DType::BF16,
                },
                ..BnbQuantizationConfig::four_bit(QuantType::Nf4)
            });
            cfg.quantize_on_load()?
        }
        _ => None,
    };
    let mut acc = Accelerator::new(AcceleratorConfig {
        mixed_precision: Some(args.mixed_precision),
        seed: Some(0),
        ..Default::default()
    })?;
    let loading = || format!("loading the weights of {}", dir.display());
    let t = Instant::now();
    let (model, params) = match &lora {
        Some(spec) => {
            let prepared = acc
                .prepare_lora_quantized(dir, spec, quantize, |vb| build(&cfg, vb))
                .with_context(loading)?;
            spec.set_training(true);
            prepared
        }
        None => acc
            .prepare_pretrained(dir, |vb| build(&cfg, vb))
            .with_context(loading)?,
    };
    if args.gradient_checkpointing {
        accel_core::nn::block::apply_activation_checkpointing(&model, &[model.layer_class()])?;
    }
    let load_s = t.elapsed().as_secs_f64();
    let (rss_after_load, hwm_after_load) = (status_kib("VmRSS:"), status_kib("VmHWM:"));
    let train_peak_known = reset_peak_rss();
    let mut opt = acc.prepare_optimizer(
        &params,
        AdamW::new(AdamWConfig {
            lr: LR,
            weight_decay: 0.0,
            ..Default::default()
        }),
    );
    let frozen: std::collections::HashSet<String> =
        params.frozen_parameters().into_iter().collect();
    let (mut trainable, mut all) = (0, 0);
    let names: std::collections::HashSet<String> = params.names().into_iter().collect();
    for (name, t) in params.master_weights() {
        if is_quant_part(&name) {
            continue;
        }
        // Packed 4-bit codes, two a byte: counted as the weight's elements, as PEFT does.
        let packed = names.contains(&format!("{name}.{}", quant_state_name(QuantType::Nf4)));
        let n = t.elem_count() * if packed { 2 } else { 1 };
        all += n;
        if !frozen.contains(&name) {
            trainable += n;
        }
    }
    let ids = Tensor::from_vec(
        token_ids(args.batch, args.seq_len, vocab),
        (args.batch, args.seq_len),
        acc.device(),
    )?;
    // The parameters with a gradient after the first backward: the adapters
    // alone for LoRA (a frozen base that got one would show here).
    let mut grad_elements = None;
    // One step: its loss and the seconds of its forward, backward and
    // optimizer step (the forward ends with the loss read out).
    let mut step = || -> Result<(f64, [f64; 3])> {
        let t = Instant::now();
        let loss = model.loss(&ids, &ids)?;
        let value = loss.to_dtype(DType::F64)?.to_scalar::<f64>()?;
        let forward = t.elapsed().as_secs_f64();
        acc.backward(&loss)?;
        let backward = t.elapsed().as_secs_f64() - forward;
        if grad_elements.is_none() {
            let grads = params.gradients();
            grad_elements = Some(grads.iter().map(|(_, g)| g.elem_count()).sum::<usize>());
        }
        let t = Instant::now();
        opt.step()?;
        opt.zero_grad();
        Ok((value, [forward, backward, t.elapsed().as_secs_f64()]))
    };
    let (first_loss, _) = step()?;
    let mut last_loss = first_loss;
    let (mut times, mut phases) = (Vec::with_capacity(args.steps), [0f64; 3]);
    for _ in 0..args.steps {
        let t = Instant::now();
        let (loss, p) = step()?;
        times.push(t.elapsed().as_secs_f64());
        last_loss = loss;
        phases.iter_mut().zip(p).for_each(|(a, x)| *a += x);
    }
    let total: f64 = times.iter().sum();
    let hwm = status_kib("VmHWM:");
    let mib = |kib: u64| json!(round(kib as f64 / 1024.0, 1));
    let mean = |x: f64| json!(round(x / times.len().max(1) as f64, 3));
    Ok(json!({
        "steps_per_s": if times.is_empty() { Value::Null } else { json!(round(times.len() as f64 / total, 4)) },
        "step_s": times.iter().map(|&s| round(s, 3)).collect::<Vec<_>>(),
        "phase_s": {
            "forward": mean(phases[0]),
            "backward": mean(phases[1]),
            "optimizer": mean(phases[2]),
        },
        "first_loss": first_loss,
        "last_loss": last_loss,
        "peak_rss_mib": mib(hwm.max(hwm_after_load)),
        // Loading maps the checkpoint's shards: their pages count in the
        // resident set while a shard is read, so the load has a peak of its own.
        "peak_rss_load_mib": mib(hwm_after_load),
        "peak_rss_train_mib": if train_peak_known { mib(hwm) } else { Value::Null },
        "rss_after_load_mib": mib(rss_after_load),
        "load_s": round(load_s, 3),
        "trainable_parameters": trainable,
        "all_parameters": all,
        "gradient_elements": grad_elements,
    }))
}

fn rust_side(side: Side, dir: &Path, args: &Args) -> Result<Value> {
    let mut cmd = Command::new(std::env::current_exe()?);
    cmd.arg("--model").arg(dir);
    cmd.arg("--steps").arg(args.steps.to_string());
    cmd.arg("--seq-len").arg(args.seq_len.to_string());
    cmd.arg("--batch").arg(args.batch.to_string());
    cmd.arg("--mixed-precision")
        .arg(args.mixed_precision.to_string());
    cmd.arg("--lora-r").arg(args.lora_r.to_string());
    if args.gradient_checkpointing {
        cmd.arg("--gradient-checkpointing");
    }
    cmd.arg("--child").arg(match side {
        Side::Lora => "lora",
        Side::Full => "full",
        Side::Qlora => "qlora",
    });
    run_side(&mut cmd, side.name())
}

/// Why the PEFT side cannot run here, if it cannot: no `python3`, or one
/// without torch, transformers or peft.
fn python_missing() -> Option<String> {
    let probe = Command::new("python3")
        .args(["-c", "import torch, transformers, peft"])
        .output();
    match probe {
        Err(e) => Some(format!("python3 could not be started: {e}")),
        Ok(out) if !out.status.success() => {
            let err = String::from_utf8_lossy(&out.stderr);
            let last = err.lines().last().unwrap_or("").trim().to_string();
            Some(format!(
                "python3 cannot import torch, transformers and peft ({last}); \
                 pip install torch transformers peft"
            ))
        }
        Ok(_) => None,
    }
}

/// The PEFT side's JSON (QLoRA's with `qlora`), or why it has none.
fn peft_side(dir: &Path, args: &Args, qlora: bool) -> std::result::Result<Value, String> {
    if args.no_python {
        return Err("--no-python".into());
    }
    if let Some(reason) = python_missing() {
        return Err(reason);
    }
    let mut cmd = Command::new("python3");
    cmd.arg(PEFT_SCRIPT).arg(dir);
    cmd.arg("--steps").arg(args.steps.to_string());
    cmd.arg("--seq-len").arg(args.seq_len.to_string());
    cmd.arg("--batch").arg(args.batch.to_string());
    cmd.arg("--r").arg(args.lora_r.to_string());
    if args.gradient_checkpointing {
        cmd.arg("--gradient-checkpointing");
    }
    cmd.arg("--alpha").arg(LORA_ALPHA.to_string());
    cmd.arg("--targets").arg(LORA_TARGETS);
    cmd.arg("--lr").arg(LR.to_string());
    cmd.arg("--dtype").arg(match args.mixed_precision {
        PrecisionType::No => "float32",
        _ => "bfloat16",
    });
    if qlora {
        cmd.arg("--load-in-4bit");
    }
    run_side(&mut cmd, if qlora { "peft_qlora" } else { "peft" }).map_err(|e| format!("{e:#}"))
}

/// The checkpoint folder: `--model`, which must be one, or the default,
/// written by the script when absent.
fn ensure_checkpoint(model: Option<&Path>) -> Result<PathBuf> {
    if let Some(d) = model {
        if !d.join("config.json").is_file() {
            bail!(
                "--model {}: no config.json there (a Hugging Face checkpoint folder is needed)",
                d.display()
            );
        }
        return Ok(d.to_path_buf());
    }
    script_checkpoint(
        "bench_llama_2gb",
        "model.safetensors.index.json",
        WRITE_SCRIPT,
        "torch transformers",
    )
}

/// `a / b` of one numeric field, rounded; null when either is missing.
fn ratio(a: &Value, b: &Value, field: &str) -> Value {
    match (a[field].as_f64(), b[field].as_f64()) {
        (Some(x), Some(y)) if y > 0.0 => json!(round(x / y, 3)),
        _ => Value::Null,
    }
}

fn main() -> Result<()> {
    accel_core::init_logging();
    let args = Args::parse();
    if args.batch == 0 || args.seq_len < 2 {
        bail!("--batch must be at least 1 and --seq-len at least 2 (a next-token loss)");
    }
    let dir = ensure_checkpoint(args.model.as_deref())?;
    if let Some(side) = args.child {
        println!("{}", child(side, &dir, &args)?);
        return Ok(());
    }
    let mut bytes = 0u64;
    for entry in std::fs::read_dir(&dir).with_context(|| format!("reading {}", dir.display()))? {
        let path = entry?.path();
        if path.extension().is_some_and(|x| x == "safetensors") {
            // Read once, so every side starts with the page cache warm.
            let mut f = std::fs::File::open(&path)
                .with_context(|| format!("opening {}", path.display()))?;
            bytes += std::io::copy(&mut f, &mut std::io::sink())?;
        }
    }
    let lora = rust_side(Side::Lora, &dir, &args)?;
    let full = if args.no_full {
        Value::Null
    } else {
        rust_side(Side::Full, &dir, &args)?
    };
    let peft = peft_side(&dir, &args, false);
    if let Err(reason) = &peft {
        if !args.no_python {
            eprintln!("bench_lora: the peft side ({PEFT_SCRIPT}) did not run: {reason}");
        }
    }
    let peft_value = peft.as_ref().cloned().unwrap_or(Value::Null);
    let mut out = json!({
        "model": dir.display().to_string(),
        "checkpoint_gb": round(bytes as f64 / 1e9, 2),
        "steps": args.steps,
        "warmup_steps": 1,
        "batch": args.batch,
        "seq_len": args.seq_len,
        "lora": { "r": args.lora_r, "alpha": LORA_ALPHA, "targets": LORA_TARGETS, "lr": LR },
        "gradient_checkpointing": args.gradient_checkpointing,
        "mixed_precision": args.mixed_precision.to_string(),
        "cores": std::thread::available_parallelism().map_or(0, |n| n.get()),
        "accel_rs_lora": lora,
        "accel_rs_full": full,
        "peft": peft_value,
        "lora_vs_full_peak_rss": ratio(&lora, &full, "peak_rss_mib"),
        "lora_vs_peft_steps_per_s": ratio(&lora, &peft_value, "steps_per_s"),
        "lora_vs_full_steps_per_s": ratio(&lora, &full, "steps_per_s"),
        "lora_vs_peft_peak_rss": ratio(&lora, &peft_value, "peak_rss_mib"),
    });
    if let Err(reason) = peft {
        out["peft_skipped"] = json!(reason);
    }
    if args.qlora {
        let qlora = rust_side(Side::Qlora, &dir, &args)?;
        let peft_q = peft_side(&dir, &args, true);
        let peft_q_value = peft_q.as_ref().cloned().unwrap_or(Value::Null);
        out["qlora"] = json!({ "quant_type": "nf4", "double_quant": true, "compute_dtype":
            if args.mixed_precision == PrecisionType::No { "float32" } else { "bfloat16" } });
        out["qlora_vs_lora_steps_per_s"] = ratio(&qlora, &lora, "steps_per_s");
        out["qlora_vs_lora_peak_rss"] = ratio(&qlora, &lora, "peak_rss_mib");
        out["qlora_vs_peft_qlora_steps_per_s"] = ratio(&qlora, &peft_q_value, "steps_per_s");
        out["qlora_vs_peft_qlora_peak_rss"] = ratio(&qlora, &peft_q_value, "peak_rss_mib");
        out["accel_rs_qlora"] = qlora;
        out["peft_qlora"] = peft_q_value;
        if let Err(reason) = peft_q {
            out["peft_qlora_skipped"] = json!(reason);
        }
    }
    if args.json {
        println!("{out}");
    } else {
        println!("{}", serde_json::to_string_pretty(&out)?);
    }
    Ok(())
}
