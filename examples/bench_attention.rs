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
//!
//! `--device cuda` (a build `--features cuda`) times GPT-2 small's shape
//! instead, b 8, 12 heads, head dim 64, bf16, at 1024 and 4096 tokens, in
//! this process: accel-nn's CUDA kernels (`ops::cuda_flash_attention`), the
//! composed ops (up to `--reference-max`, 2048 by default there: they hold
//! the `[b, h, t, t]` scores), and torch's SDPA on the same GPU (its flash
//! kernel). `tflops` counts the causal forward and backward as
//! flash-attention's benchmark does (3.5 times the forward's
//! `2 * 2 * b * h * t * t * d / 2`); `peak_mib` is the memory pool's (or
//! torch's) high-water mark over the timed calls, inputs included.

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
    /// `cpu`, or `cuda` (GPT-2 small's shape in bf16; see above).
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Print only the JSON object.
    #[arg(long)]
    json: bool,
    /// Sequence lengths (default 1024,4096,8192,16384 on CPU, 1024,4096 on CUDA).
    #[arg(long, value_delimiter = ',')]
    seq_lens: Option<Vec<usize>>,
    /// Timed calls per length (the best is reported), after one warm-up.
    #[arg(long, default_value_t = 2)]
    reps: usize,
    /// Longest length the reference kernel (composed ops on CUDA) runs at
    /// (default 8192 on CPU, 2048 on CUDA).
    #[arg(long)]
    reference_max: Option<usize>,
    /// Skip the torch side.
    #[arg(long)]
    no_python: bool,
    /// Also time the tiled kernel with a causal sliding window of this many
    /// keys (Mistral's, Gemma's local layers) at each length, against the
    /// full causal mask.
    #[arg(long)]
    window: Option<usize>,
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

/// One length in this process (the kernel was chosen by `ACCEL_ATTENTION`),
/// within a sliding window when given.
fn child(t: usize, reps: usize, window: Option<usize>) -> Result<Value> {
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
    let mask = match window {
        Some(window) => AttentionMask::SlidingWindow {
            offset: 0,
            window,
            bias: None,
        },
        None => AttentionMask::Causal { offset: 0 },
    };
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
        "window": window,
    }))
}

fn main() -> Result<()> {
    accel_core::init_logging();
    let args = Args::parse();
    match args.device.as_str() {
        "cpu" => {}
        "cuda" => return cuda::bench(&args),
        other => bail!("--device {other}: `cpu` or `cuda`"),
    }
    let seq_lens = args
        .seq_lens
        .clone()
        .unwrap_or_else(|| vec![1024, 4096, 8192, 16384]);
    let reference_max = args.reference_max.unwrap_or(8192);
    if let Some(spec) = &args.child {
        let t: usize = spec.parse().context("--child takes a sequence length")?;
        println!("{}", child(t, args.reps, args.window)?);
        return Ok(());
    }
    let threads = accel_core::kernels::par::threads();
    let mut rows = vec![];
    for &t in &seq_lens {
        let side = |kernel: &str, window: Option<usize>| -> Result<Value> {
            let mut cmd = Command::new(std::env::current_exe()?);
            cmd.args(["--child", &t.to_string(), "--reps", &args.reps.to_string()])
                .env("ACCEL_ATTENTION", kernel);
            if let Some(w) = window {
                cmd.args(["--window", &w.to_string()]);
            }
            run_side(
                &mut cmd,
                &format!("accel-rs {kernel} at t = {t}, window {window:?}"),
            )
        };
        let accel = |kernel: &str| side(kernel, None);
        let tiled = accel("tiled")?;
        let sliding = match args.window {
            Some(w) => side("tiled", Some(w))?,
            None => Value::Null,
        };
        let reference = if t <= reference_max {
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
            "sliding": sliding,
            "sliding_speed_vs_full_causal": ratio(&sliding, &tiled, "seconds"),
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

/// `--device cuda`: GPT-2 small's attention in bf16, in this process.
mod cuda {
    use super::*;
    use candle_core::DType;

    const B: usize = 8;
    const HEADS: usize = 12;

    /// Best seconds of `reps` causal forward+backward calls of `f` and the
    /// pool's peak over them.
    fn time(
        dev: &Device,
        t: usize,
        reps: usize,
        f: &dyn Fn(&Tensor, &Tensor, &Tensor) -> candle_core::Result<Tensor>,
    ) -> Result<Value> {
        let var = || -> Result<Var> {
            let x = Tensor::randn(0f32, 1.0, (B, HEADS, t, D), dev)?.to_dtype(DType::BF16)?;
            Ok(Var::from_tensor(&x)?)
        };
        let (q, k, v) = (var()?, var()?, var()?);
        let g = Tensor::ones((B, HEADS, t, D), DType::BF16, dev)?;
        let step = || -> Result<()> {
            let y = f(q.as_tensor(), k.as_tensor(), v.as_tensor())?;
            let grads = (y * &g)?.sum_all()?.backward()?;
            anyhow::ensure!(grads.get(q.as_tensor()).is_some(), "no gradient for q");
            Ok(())
        };
        step()?;
        dev.synchronize()?;
        accel_core::kernels::cuda::reset_peak_memory_stats(dev)?;
        let mut best = f64::INFINITY;
        for _ in 0..reps {
            let start = Instant::now();
            step()?;
            dev.synchronize()?;
            best = best.min(start.elapsed().as_secs_f64());
        }
        let peak = accel_core::kernels::cuda::max_memory_allocated(dev)?;
        let flops = 3.5 * (4 * B * HEADS * t * t * D) as f64 / 2.0;
        Ok(json!({
            "t": t,
            "seconds": best,
            "tflops": flops / best / 1e12,
            "peak_mib": peak.map(|b| b as f64 / (1u64 << 20) as f64),
        }))
    }

    pub(super) fn bench(args: &Args) -> Result<()> {
        let dev = accel_examples::device_named("cuda")?;
        let seq_lens = args.seq_lens.clone().unwrap_or_else(|| vec![1024, 4096]);
        let composed_max = args.reference_max.unwrap_or(2048);
        let mask = AttentionMask::Causal { offset: 0 };
        let scale = 1.0 / (D as f64).sqrt();
        let reps = args.reps.max(3);
        let mut rows = vec![];
        for &t in &seq_lens {
            let flash = time(&dev, t, reps, &|q, k, v| {
                ops::cuda_flash_attention(q, k, v, &mask, scale)
            })?;
            let composed = if t <= composed_max {
                time(&dev, t, reps, &|q, k, v| {
                    ops::composed::scaled_dot_product_attention(q, k, v, &mask, scale)
                })?
            } else {
                Value::Null
            };
            let torch = if args.no_python {
                Value::Null
            } else {
                let mut cmd = Command::new("python3");
                cmd.arg(SCRIPT).arg(t.to_string()).args([
                    "--device",
                    "cuda",
                    "--reps",
                    &reps.to_string(),
                ]);
                run_side(&mut cmd, &format!("torch ({SCRIPT}) on cuda at t = {t}"))?
            };
            let ratio = |a: &Value, b: &Value| match (a["tflops"].as_f64(), b["tflops"].as_f64()) {
                (Some(x), Some(y)) if y > 0.0 => json!(x / y),
                _ => Value::Null,
            };
            let row = json!({
                "t": t,
                "flash": flash,
                "composed": composed,
                "torch": torch,
                "flash_vs_torch": ratio(&flash, &torch),
                "flash_vs_composed": ratio(&flash, &composed),
            });
            if !args.json {
                eprintln!("{row}");
            }
            rows.push(row);
        }
        let out = json!({
            "bench": "attention_causal_fwd_bwd_cuda",
            "shape": {"b": B, "heads": HEADS, "kv_heads": HEADS, "head_dim": D, "dtype": "bf16"},
            "gpu_name": accel_core::kernels::cuda::device_name(&dev)?,
            "rows": rows,
        });
        println!("{out}");
        Ok(())
    }
}
