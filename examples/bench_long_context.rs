//! Long-context fine-tuning on the CPU: training steps of a 4-layer Llama
//! (d 512, 8 heads over 4 kv heads, vocab 32000, fp32, AdamW) on one row of
//! `T` tokens, accel-rs against torch + transformers (SDPA) on the same
//! checkpoint and token ids, each length in a process of its own so the peak
//! RSS is that length's. One JSON object.
//!
//! ```text
//! cargo run --release --example bench_long_context -- --json [--seq-lens 1024,8192] \
//!     [--checkpointing-from 16384] [--no-python] [--model DIR]
//! ```
//! Without `--model` the checkpoint is written to `target/bench_llama_4l_32k`
//! by `scripts/bench_long_context_torch.py write` (transformers' random
//! init). From `--checkpointing-from` tokens on, both sides recompute each
//! decoder layer in backward (`gradient_checkpointing_enable()`).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use accel_core::models::{AutoModel, ModelConfig};
use accel_core::nn::block::apply_activation_checkpointing;
use accel_core::optim::{AdamW, AdamWConfig};
use accel_core::{Accelerator, AcceleratorConfig};
use accel_examples::bench_proc::{run_side, script_checkpoint, status_kib};
use anyhow::Result;
use candle_core::{DType, Tensor};
use clap::Parser;
use serde_json::{json, Value};

#[derive(Parser, Debug)]
struct Args {
    /// The checkpoint folder (written by the script when absent).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Print only the JSON object.
    #[arg(long)]
    json: bool,
    /// Sequence lengths.
    #[arg(long, value_delimiter = ',', default_value = "1024,2048,4096,8192")]
    seq_lens: Vec<usize>,
    /// Recompute each decoder layer in backward from this length on.
    #[arg(long, default_value_t = 16384)]
    checkpointing_from: usize,
    /// Training steps per length; the fastest after the first is reported.
    #[arg(long, default_value_t = 2)]
    steps: usize,
    /// Skip the torch side.
    #[arg(long)]
    no_python: bool,
    /// Internal: run one accel-rs length and print its JSON.
    #[arg(long, hide = true)]
    child: Option<usize>,
}

const SCRIPT: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../scripts/bench_long_context_torch.py"
);

/// One length in this process.
fn child(dir: &Path, t: usize, checkpointing: bool, steps: usize) -> Result<Value> {
    let cfg = ModelConfig::from_path(dir)?;
    let mut acc = Accelerator::new(AcceleratorConfig {
        seed: Some(0),
        ..Default::default()
    })?;
    let (model, params) = acc.prepare_pretrained(dir, |vb| {
        AutoModel::new(&cfg, vb).map_err(accel_core::Error::from)
    })?;
    if checkpointing {
        apply_activation_checkpointing(&model, &[model.layer_class()])?;
    }
    let mut opt = acc.prepare_optimizer(
        &params,
        AdamW::new(AdamWConfig {
            lr: 1e-4,
            weight_decay: 0.0,
            ..Default::default()
        }),
    );
    let vocab = model.vocab_size() as u64;
    let ids: Vec<u32> = (0..t as u64).map(|i| (i * 7919 % vocab) as u32).collect();
    let ids = Tensor::from_vec(ids, (1, t), acc.device())?;
    let (mut first, mut best) = (None, f64::INFINITY);
    for k in 0..steps {
        let start = Instant::now();
        let loss = model.loss(&ids, &ids)?;
        acc.backward(&loss)?;
        opt.step()?;
        opt.zero_grad();
        let secs = start.elapsed().as_secs_f64();
        if k > 0 || steps == 1 {
            best = best.min(secs);
        }
        first.get_or_insert(loss.to_dtype(DType::F64)?.to_scalar::<f64>()?);
    }
    Ok(json!({
        "t": t,
        "first_loss": first,
        "seconds_per_step": best,
        "peak_rss_mib": status_kib("VmHWM") as f64 / 1024.0,
        "gradient_checkpointing": checkpointing,
        "attention": accel_core::nn::ops::attention_kernel()?.name(),
    }))
}

fn ensure_checkpoint(model: Option<PathBuf>) -> Result<PathBuf> {
    match model {
        Some(d) => Ok(d),
        None => script_checkpoint(
            "bench_llama_4l_32k",
            "config.json",
            SCRIPT,
            "torch transformers",
        ),
    }
}

fn main() -> Result<()> {
    accel_core::init_logging();
    let args = Args::parse();
    let dir = ensure_checkpoint(args.model.clone())?;
    if let Some(t) = args.child {
        let ckpt = t >= args.checkpointing_from;
        println!("{}", child(&dir, t, ckpt, args.steps)?);
        return Ok(());
    }
    let threads = accel_core::kernels::par::threads();
    let mut rows = vec![];
    for &t in &args.seq_lens {
        let ckpt = t >= args.checkpointing_from;
        let mut cmd = Command::new(std::env::current_exe()?);
        cmd.arg("--model").arg(&dir).args([
            "--child",
            &t.to_string(),
            "--steps",
            &args.steps.to_string(),
            "--checkpointing-from",
            &args.checkpointing_from.to_string(),
        ]);
        let accel = run_side(&mut cmd, &format!("accel-rs at t = {t}"))?;
        let torch = if args.no_python {
            Value::Null
        } else {
            let mut cmd = Command::new("python3");
            cmd.args([SCRIPT, "step"])
                .arg(&dir)
                .arg(t.to_string())
                .args([
                    "--threads",
                    &threads.to_string(),
                    "--steps",
                    &args.steps.to_string(),
                ]);
            if ckpt {
                cmd.arg("--checkpointing");
            }
            run_side(&mut cmd, &format!("torch at t = {t}"))?
        };
        let ratio = |key: &str| match (accel[key].as_f64(), torch[key].as_f64()) {
            (Some(a), Some(b)) if a > 0.0 => json!(b / a),
            _ => Value::Null,
        };
        let row = json!({
            "t": t,
            "accel_rs": accel,
            "torch": torch,
            "speed_vs_torch": ratio("seconds_per_step"),
            "peak_rss_vs_torch": match (accel["peak_rss_mib"].as_f64(), torch["peak_rss_mib"].as_f64()) {
                (Some(a), Some(b)) if b > 0.0 => json!(a / b),
                _ => Value::Null,
            },
        });
        if !args.json {
            eprintln!("{row}");
        }
        rows.push(row);
    }
    println!(
        "{}",
        json!({
            "bench": "long_context_finetune",
            "model": "llama 4 layers, d 512, 8 heads / 4 kv heads, vocab 32000, fp32, AdamW",
            "threads": threads,
            "rows": rows,
        })
    );
    Ok(())
}
