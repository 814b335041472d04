//! The linear layer's forward for few rows (a prompt, a small batch): accel-nn's
//! `ops::linear` against candle's `matmul` with the transposed weight (the same
//! product, `x @ w^T`, on the same tensors), alternating in one process. One
//! JSON object: per shape and row count, GFLOP/s of each side's median time.
//!
//! ```text
//! cargo run --release --example bench_linear -- [--rows 1,16,32,64,128,256] [--reps 9] [--dtype f32|bf16]
//! ```
//! The default shapes are the linear layers of `bench_bigmodel`'s Llama
//! (hidden 1536, intermediate 4096, 4 KV heads of 128, vocab 32000): `k x
//! out` = 1536 x 1536 (q, o), 1536 x 512 (k, v), 1536 x 4096 (gate, up),
//! 4096 x 1536 (down), 1536 x 32000 (head). Up to 256 rows, accel-nn's
//! forward is `accel-nn/src/kernels/skinny`, which reads the weight where it
//! lies; candle's gemm repacks it on every call.

use std::time::Instant;

use accel_core::nn::ops::{bf16_path, linear, with_bf16_path, Bf16Path};
use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use clap::Parser;
use serde_json::json;

#[derive(Parser, Debug)]
struct Args {
    /// Row counts of `x`, comma-separated.
    #[arg(long, value_delimiter = ',', default_values_t = [1, 16, 32, 64, 128, 256])]
    rows: Vec<usize>,
    /// Timed calls per side; figures are medians.
    #[arg(long, default_value_t = 9)]
    reps: usize,
    /// `k x out` shapes, as `KxOUT` comma-separated (default: the Llama's).
    #[arg(long, value_delimiter = ',')]
    shapes: Vec<String>,
    /// `f32`, or `bf16` (both sides on bf16 tensors: accel-nn's products on
    /// AMX tiles or AVX-512 BF16 where the CPU has them).
    #[arg(long, default_value = "f32")]
    dtype: String,
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

fn parse_shape(s: &str) -> Result<(usize, usize)> {
    let (k, out) = s
        .split_once('x')
        .ok_or_else(|| anyhow::anyhow!("--shapes: {s:?} is not KxOUT"))?;
    let number = |v: &str| {
        v.parse::<usize>()
            .map_err(|e| anyhow::anyhow!("--shapes: {s:?}: {v:?} is not a size ({e})"))
    };
    Ok((number(k)?, number(out)?))
}

fn main() -> Result<()> {
    accel_core::init_logging();
    let args = Args::parse();
    anyhow::ensure!(args.reps > 0, "--reps must be at least 1");
    let shapes = if args.shapes.is_empty() {
        vec![
            (1536, 1536),
            (1536, 512),
            (1536, 4096),
            (4096, 1536),
            (1536, 32000),
        ]
    } else {
        args.shapes
            .iter()
            .map(|s| parse_shape(s))
            .collect::<Result<_>>()?
    };
    let dtype = match args.dtype.as_str() {
        "f32" => DType::F32,
        "bf16" => DType::BF16,
        other => anyhow::bail!("--dtype: {other:?} is neither f32 nor bf16"),
    };
    let dev = Device::Cpu;
    let mut results = Vec::new();
    for (k, out) in shapes {
        let w = Tensor::randn(0f32, 0.02, (out, k), &dev)?.to_dtype(dtype)?;
        for &m in &args.rows {
            let x = Tensor::randn(0f32, 1.0, (m, k), &dev)?.to_dtype(dtype)?;
            // Agreement first: the two sides compute the same product.
            let (a, b) = (linear(&x, &w, None, None)?, x.matmul(&w.t()?)?);
            let diff = (&a.to_dtype(DType::F32)? - &b.to_dtype(DType::F32)?)?
                .abs()?
                .max_all()?
                .to_scalar::<f32>()?;
            let (mut ours, mut candle) = (Vec::new(), Vec::new());
            // Two untimed pairs first: the first calls of a process pay for
            // the thread pool's start and the allocator's first pages.
            for _ in 0..2 {
                std::hint::black_box(linear(&x, &w, None, None)?);
                std::hint::black_box(x.matmul(&w.t()?)?);
            }
            for _ in 0..args.reps {
                let t = Instant::now();
                std::hint::black_box(linear(&x, &w, None, None)?);
                ours.push(t.elapsed().as_secs_f64());
                let t = Instant::now();
                std::hint::black_box(x.matmul(&w.t()?)?);
                candle.push(t.elapsed().as_secs_f64());
            }
            let flops = 2.0 * (m * k * out) as f64;
            let (ours, candle) = (median(ours), median(candle));
            let paths = if dtype == DType::BF16 {
                bf16_paths(&x, &w, args.reps, flops)?
            } else {
                serde_json::Value::Null
            };
            results.push(json!({
                "k": k,
                "out": out,
                "rows": m,
                "accel_nn_gflops": (flops / ours / 1e8).round() / 10.0,
                "candle_gflops": (flops / candle / 1e8).round() / 10.0,
                "speedup": (candle / ours * 100.0).round() / 100.0,
                "max_abs_diff": diff,
                "bf16_paths": paths,
            }));
        }
    }
    let default = bf16_path().name();
    let (mut won, mut cases) = (0, 0);
    for r in &results {
        if let Some(f) = r["bf16_paths"]["fastest_forward_backward"].as_str() {
            cases += 1;
            won += usize::from(f == default);
        }
    }
    println!(
        "{}",
        json!({
            "reps": args.reps,
            "dtype": args.dtype,
            "cpu": cpu_name(),
            "bf16_default_path": default,
            "bf16_default_fastest_cases": format!("{won}/{cases}"),
            "results": results,
        })
    );
    Ok(())
}

/// Each bf16 path this CPU has, timed on the same tensors, alternating:
/// the forward, and the forward with the input gradient through the frozen
/// weight (a LoRA step's product), with the fastest of each named.
fn bf16_paths(x: &Tensor, w: &Tensor, reps: usize, flops: f64) -> Result<serde_json::Value> {
    let paths: Vec<Bf16Path> = Bf16Path::ALL
        .into_iter()
        .filter(|p| p.available())
        .collect();
    let var = candle_core::Var::from_tensor(x)?;
    let fwd = || -> Result<()> {
        std::hint::black_box(linear(x, w, None, None)?);
        Ok(())
    };
    let fwd_bwd = || -> Result<()> {
        let loss = linear(var.as_tensor(), w, None, None)?.sum_all()?;
        std::hint::black_box(loss.backward()?);
        Ok(())
    };
    let mut times = vec![(Vec::new(), Vec::new()); paths.len()];
    for rep in 0..reps + 1 {
        for (i, &p) in paths.iter().enumerate() {
            let t = Instant::now();
            with_bf16_path(p, fwd)??;
            let f = t.elapsed().as_secs_f64();
            let t = Instant::now();
            with_bf16_path(p, fwd_bwd)??;
            let fb = t.elapsed().as_secs_f64();
            // The first round warms each path up, untimed.
            if rep > 0 {
                times[i].0.push(f);
                times[i].1.push(fb);
            }
        }
    }
    let medians: Vec<(f64, f64)> = times
        .into_iter()
        .map(|(f, fb)| (median(f), median(fb)))
        .collect();
    let fastest = |pick: fn(&(f64, f64)) -> f64| {
        paths[medians
            .iter()
            .enumerate()
            .min_by(|a, b| pick(a.1).total_cmp(&pick(b.1)))
            .map_or(0, |(i, _)| i)]
        .name()
    };
    let gflops = |flops: f64, t: f64| (flops / t / 1e8).round() / 10.0;
    Ok(json!({
        "paths": paths.iter().zip(&medians).map(|(p, (f, fb))| json!({
            "path": p.name(),
            "forward_gflops": gflops(flops, *f),
            "forward_backward_gflops": gflops(2.0 * flops, *fb),
        })).collect::<Vec<_>>(),
        "fastest_forward": fastest(|m| m.0),
        "fastest_forward_backward": fastest(|m| m.1),
    }))
}

/// The CPU's model name from `/proc/cpuinfo` (Linux), for the record.
fn cpu_name() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|t| {
            t.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|s| s.trim().to_string())
        })
        .unwrap_or_else(|| "unknown".into())
}
