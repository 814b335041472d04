//! Causal attention forward + backward on the CPU: accel-nn's tiled kernel
//! (the default), its reference kernel (the whole probabilities kept), and
//! torch's `F.scaled_dot_product_attention` on the same machine in the same
//! run. b 1, 8 query heads over 4 kv heads, head dim 64, fp32.
//!
//! ```text
//! cargo run --release --example bench_attention -- --device cpu --json [--seq-lens 1024,4096] [--no-python]
//! ```
//!
//! Each (side, length) runs in a process of its own, so `peak_rss_mib` is
//! that length's alone; `op_peak_mib` is the growth of the peak RSS over
//! the RSS just before the first call (inputs included), which is what the
//! kernel's buffers cost. `seconds` is the best of `--reps` calls after one
//! warm-up. The reference kernel is skipped past `--reference-max` tokens
//! (at 16384 its probabilities alone are 8 GiB).

use std::process::Command;
use std::time::Instant;

use accel_core::nn::ops::{self, AttentionMask};
use accel_examples::bench_proc::{run_side, status_kib};
use anyhow::{bail, Context, Result};
use candle_core::{Device, Tensor, Var};
use clap::Parser;
use serde_json::{json, Value};

#[derive(Parser, Debug)]
struct Args {
    /// Only `cpu`: the CUDA flash kernel is the GPU issue's.
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Print only the JSON object.
    #[arg(long)]
    json: bool,
    /// Sequence lengths.
    #[arg(long, value_delimiter = ',', default_value = "1024,4096,8192,16384")]
    seq_lens: Vec<usize>,
    /// Timed calls per length (the best is reported), after one warm-up.
    #[arg(long, default_value_t = 2)]
    reps: usize,
    /// Longest length the reference kernel runs at.
    #[arg(long, default_value_t = 8192)]
    reference_max: usize,
    /// Skip the torch side.
    #[arg(long)]
    no_python: bool,
    /// Internal: run one accel-rs length with this kernel and print its JSON.
    #[arg(long, hide = true)]
    child: Option<String>,
}

const SCRIPT: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../scripts/bench_attention_torch.py"
);
const H: usize = 8;
const KVH: usize = 4;
const D: usize = 64;

/// One length in this process (the kernel was chosen by `ACCEL_ATTENTION`).
fn child(t: usize, reps: usize) -> Result<Value> {
    let dev = Device::Cpu;
    let var = |h: usize, seed: f64| -> Result<Var> {
        let x = Tensor::arange(0u32, (h * t * D) as u32, &dev)?
            .to_dtype(candle_core::DType::F32)?
            .affine(0.618_034, seed)?
            .sin()?
            .reshape((1, h, t, D))?;
        Ok(Var::from_tensor(&x)?)
    };
    let (q, k, v) = (var(H, 0.0)?, var(KVH, 1.0)?, var(KVH, 2.0)?);
    let g = Tensor::ones((1, H, t, D), candle_core::DType::F32, &dev)?;
    let mask = AttentionMask::Causal { offset: 0 };
    let scale = 1.0 / (D as f64).sqrt();
    let before = status_kib("VmRSS");
    let step = || -> Result<()> {
        let y = ops::scaled_dot_product_attention(&q, &k, &v, &mask, scale)?;
        let grads = (y * &g)?.sum_all()?.backward()?;
        anyhow::ensure!(grads.get(q.as_tensor()).is_some(), "no gradient for q");
        Ok(())
    };
    step()?;
    let mut best = f64::INFINITY;
    for _ in 0..reps {
        let start = Instant::now();
        step()?;
        best = best.min(start.elapsed().as_secs_f64());
    }
    let peak = status_kib("VmHWM");
    Ok(json!({
        "t": t,
        "seconds": best,
        "peak_rss_mib": peak as f64 / 1024.0,
        "op_peak_mib": peak.saturating_sub(before) as f64 / 1024.0,
        "kernel": ops::attention_kernel()?.name(),
    }))
}

fn main() -> Result<()> {
    accel_core::init_logging();
    let args = Args::parse();
    if args.device != "cpu" {
        bail!(
            "--device {}: this benchmark times the CPU kernels; the CUDA flash kernel is not \
             written yet",
            args.device
        );
    }
    if let Some(spec) = &args.child {
        let t: usize = spec.parse().context("--child takes a sequence length")?;
        println!("{}", child(t, args.reps)?);
        return Ok(());
    }
    let threads = accel_core::kernels::par::threads();
    let mut rows = vec![];
    for &t in &args.seq_lens {
        let accel = |kernel: &str| -> Result<Value> {
            let mut cmd = Command::new(std::env::current_exe()?);
            cmd.args(["--child", &t.to_string(), "--reps", &args.reps.to_string()])
                .env("ACCEL_ATTENTION", kernel);
            run_side(&mut cmd, &format!("accel-rs {kernel} at t = {t}"))
        };
        let tiled = accel("tiled")?;
        let reference = if t <= args.reference_max {
            accel("reference")?
        } else {
            Value::Null
        };
        let torch = if args.no_python {
            Value::Null
        } else {
            let mut cmd = Command::new("python3");
            cmd.arg(SCRIPT).arg(t.to_string()).args([
                "--threads",
                &threads.to_string(),
                "--reps",
                &args.reps.to_string(),
            ]);
            run_side(&mut cmd, &format!("torch ({SCRIPT}) at t = {t}"))?
        };
        let ratio = |a: &Value, b: &Value, key: &str| match (a[key].as_f64(), b[key].as_f64()) {
            (Some(x), Some(y)) if x > 0.0 => json!(y / x),
            _ => Value::Null,
        };
        let row = json!({
            "t": t,
            "tiled": tiled,
            "reference": reference,
            "torch": torch,
            "tiled_speed_vs_torch": ratio(&tiled, &torch, "seconds"),
            "tiled_speed_vs_reference": ratio(&tiled, &reference, "seconds"),
            "tiled_peak_rss_vs_torch": ratio(&torch, &tiled, "peak_rss_mib"),
        });
        if !args.json {
            eprintln!("{row}");
        }
        rows.push(row);
    }
    let growth = |from: usize, to: usize| -> Value {
        let at = |t: usize| {
            rows.iter()
                .find(|r| r["t"] == t)
                .and_then(|r| r["tiled"]["op_peak_mib"].as_f64())
        };
        match (at(from), at(to)) {
            (Some(a), Some(b)) if a > 0.0 => json!(b / a),
            _ => Value::Null,
        }
    };
    let out = json!({
        "bench": "attention_causal_fwd_bwd",
        "shape": {"b": 1, "heads": H, "kv_heads": KVH, "head_dim": D, "dtype": "f32"},
        "threads": threads,
        "rows": rows,
        "tiled_op_peak_growth_4096_to_16384": growth(4096, 16384),
    });
    println!("{out}");
    Ok(())
}
