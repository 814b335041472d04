//! A Mixtral-shaped mixture-of-experts layer, forward + backward (every
//! expert's weights, the router and the input get gradients), on the CPU:
//! accel-nn's `SparseMoe` (tokens grouped by expert with one permutation,
//! one product per expert, one `index_add` back) against transformers'
//! `MixtralSparseMoeBlock` on the same shape and threads, each side in a
//! process of its own. fp32.
//!
//! ```text
//! cargo run --release --example bench_moe -- [--experts 8] [--top-k 2] [--hidden 1024] [--ffn 3584] [--tokens 1024] [--reps 3] [--no-python]
//! ```

use std::process::Command;
use std::time::Instant;

use accel_core::nn::layers::{ExpertNames, SparseMoe};
use accel_examples::bench_proc::{run_side, status_kib};
use anyhow::{Context, Result};
use candle_core::{DType, Device, Tensor, Var};
use candle_nn::{VarBuilder, VarMap};
use clap::Parser;
use serde_json::{json, Value};

#[derive(Parser, Debug)]
struct Args {
    /// Experts in the layer.
    #[arg(long, default_value_t = 8)]
    experts: usize,
    /// Experts per token.
    #[arg(long, default_value_t = 2)]
    top_k: usize,
    /// Hidden size.
    #[arg(long, default_value_t = 1024)]
    hidden: usize,
    /// One expert's MLP width.
    #[arg(long, default_value_t = 3584)]
    ffn: usize,
    /// Tokens in the batch.
    #[arg(long, default_value_t = 1024)]
    tokens: usize,
    /// Timed steps (the best is reported), after one warm-up.
    #[arg(long, default_value_t = 3)]
    reps: usize,
    /// Skip the transformers side.
    #[arg(long)]
    no_python: bool,
    /// Internal: run the accel-rs side and print its JSON.
    #[arg(long, hide = true)]
    child: bool,
}

const SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/bench_moe_torch.py");

fn child(a: &Args) -> Result<Value> {
    let dev = Device::Cpu;
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &dev);
    let moe = SparseMoe::new(
        a.hidden,
        a.ffn,
        (a.experts, a.top_k, true),
        ExpertNames::Mixtral,
        vb,
        None,
        None,
    )?;
    // N(0, 0.02) weights, as the torch side draws them.
    for var in varmap.all_vars() {
        var.set(&Tensor::randn(0f32, 0.02, var.shape(), &dev)?)?;
    }
    let x = Var::from_tensor(&Tensor::randn(0f32, 1.0, (1, a.tokens, a.hidden), &dev)?)?;
    let vars = varmap.all_vars();
    let step = || -> Result<()> {
        let grads = moe
            .forward_with_stats(x.as_tensor())?
            .0
            .sum_all()?
            .backward()?;
        anyhow::ensure!(grads.get(x.as_tensor()).is_some(), "no input gradient");
        anyhow::ensure!(
            vars.iter().all(|v| grads.get(v.as_tensor()).is_some()),
            "a weight got no gradient"
        );
        Ok(())
    };
    step()?;
    let mut best = f64::INFINITY;
    for _ in 0..a.reps {
        let t = Instant::now();
        step()?;
        best = best.min(t.elapsed().as_secs_f64());
    }
    Ok(json!({
        "seconds": best,
        "peak_rss_mib": status_kib("VmHWM") as f64 / 1024.0,
    }))
}

fn main() -> Result<()> {
    accel_core::init_logging();
    let a = Args::parse();
    if a.child {
        println!("{}", child(&a)?);
        return Ok(());
    }
    let shape = [
        ("--experts", a.experts),
        ("--top-k", a.top_k),
        ("--hidden", a.hidden),
        ("--ffn", a.ffn),
        ("--tokens", a.tokens),
        ("--reps", a.reps),
    ];
    let mut ours = Command::new(std::env::current_exe()?);
    ours.arg("--child");
    for (k, v) in shape {
        ours.args([k, &v.to_string()]);
    }
    let ours = run_side(&mut ours, "accel-rs")?;
    let threads = accel_core::kernels::par::threads();
    let torch = if a.no_python {
        Value::Null
    } else {
        let mut cmd = Command::new("python3");
        cmd.arg(SCRIPT).args(["--threads", &threads.to_string()]);
        for (k, v) in shape {
            cmd.args([k, &v.to_string()]);
        }
        run_side(&mut cmd, "transformers").context("pip install torch transformers")?
    };
    let speedup = match (ours["seconds"].as_f64(), torch["seconds"].as_f64()) {
        (Some(o), Some(t)) if o > 0.0 => json!(t / o),
        _ => Value::Null,
    };
    println!(
        "{}",
        json!({
            "bench": "moe_layer_fwd_bwd",
            "shape": {"experts": a.experts, "top_k": a.top_k, "hidden": a.hidden,
                      "ffn": a.ffn, "tokens": a.tokens, "dtype": "f32"},
            "threads": threads,
            "accel_rs": ours,
            "transformers": torch,
            "speedup_vs_transformers": speedup,
        })
    );
    Ok(())
}
