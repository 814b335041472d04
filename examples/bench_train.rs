//! Training throughput through the Accelerator versus raw candle loops, on
//! the MLP (784-512-512-10, batch 64) and the GPT (vocab 4096, d 256, 4
//! layers, 4 heads, seq 128, batch 8), all AdamW, measured side by side.
//!
//! Three loops run the same model code on the same batches:
//! - `raw_candle`: `loss.backward()` + `candle_nn::AdamW::step` (what a candle user writes);
//! - `raw_fused`: `loss.backward()` + the fused `accel_kernels::adamw_step`;
//! - `accelerator`: `Accelerator::accumulate` / `backward` / prepared optimizer.
//!
//! `overhead_pct` compares `accelerator` with `raw_fused` (same optimizer
//! maths), so it measures only what the Accelerator adds. Rounds alternate
//! between loops so machine noise hits each alike; the median round is reported.
//!
//! ```text
//! cargo run --release --example bench_train -- --json
//! ```

use std::time::Instant;

use accel_core::optim::{AdamW, AdamWConfig};
use accel_core::{Accelerator, AcceleratorConfig, PrecisionType};
use accel_examples::mnist_like::synthetic_classification;
use accel_examples::text::synthetic_tokens;
use accel_examples::{Gpt, GptConfig, Mlp};
use anyhow::Result;
use candle_core::{DType, Device, Tensor, Var};
use candle_nn::{Optimizer, VarBuilder, VarMap};
use clap::Parser;

#[derive(Parser, Debug)]
struct Args {
    /// Print only the JSON object.
    #[arg(long)]
    json: bool,
    /// Alternating rounds per loop.
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// Which workloads: mlp, gpt or all.
    #[arg(long, default_value = "all")]
    only: String,
    /// Precision of the Accelerator loop (no, bf16, fp16).
    #[arg(long, default_value = "no")]
    mixed_precision: PrecisionType,
}

fn main() -> Result<()> {
    let args = Args::parse();
    let mut out = serde_json::Map::new();
    if args.only == "all" || args.only == "mlp" {
        out.insert("mlp_784_512_512_10_b64".into(), bench(&args, Kind::Mlp)?);
    }
    if args.only == "all" || args.only == "gpt" {
        out.insert(
            "gpt_v4096_d256_l4_h4_t128_b8".into(),
            bench(&args, Kind::Gpt)?,
        );
    }
    out.insert("threads".into(), rayon_threads().into());
    let json = serde_json::Value::Object(out);
    if args.json {
        println!("{json}");
    } else {
        println!("{}", serde_json::to_string_pretty(&json)?);
    }
    Ok(())
}

fn rayon_threads() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
}

#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Mlp,
    Gpt,
}

/// Builds the model with `vb` and returns a closure computing the loss of batch `i`.
/// The loss of batch `i` of a workload.
type LossFn = Box<dyn Fn(usize) -> Result<Tensor>>;

fn build(kind: Kind, vb: VarBuilder, dtype: DType) -> Result<LossFn> {
    let dev = Device::Cpu;
    match kind {
        Kind::Mlp => {
            let model = Mlp::new(&[784, 512, 512, 10], vb)?;
            let (x, y) = synthetic_classification(64 * 8, 784, 10, 7);
            let x = Tensor::from_vec(x, (8, 64, 784), &dev)?.to_dtype(dtype)?;
            let y = Tensor::from_vec(y, (8, 64), &dev)?;
            let f = move |i: usize| -> Result<Tensor> {
                let k = i % 8;
                Ok(model.loss(&x.get(k)?, &y.get(k)?)?)
            };
            Ok(Box::new(f))
        }
        Kind::Gpt => {
            let cfg = GptConfig::bench();
            let model = Gpt::new(cfg, vb)?;
            let toks = synthetic_tokens(4 * 8 * 129, cfg.vocab_size, 11);
            let t = Tensor::from_vec(toks, (4, 8, 129), &dev)?;
            let x = t.narrow(2, 0, 128)?.contiguous()?;
            let y = t.narrow(2, 1, 128)?.contiguous()?;
            let f = move |i: usize| -> Result<Tensor> {
                let k = i % 4;
                Ok(model.loss(&x.get(k)?, &y.get(k)?)?)
            };
            Ok(Box::new(f))
        }
    }
}

/// A loop that runs `n` optimizer steps and returns steps per second.
type Loop = Box<dyn FnMut(usize) -> Result<f64>>;

/// The model in f32 with candle's own initialisation, for the raw loops.
fn raw_model(kind: Kind) -> Result<(VarMap, LossFn)> {
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let loss = build(kind, vb, DType::F32)?;
    Ok((varmap, loss))
}

fn raw_candle(kind: Kind) -> Result<Loop> {
    let (varmap, loss) = raw_model(kind)?;
    let mut opt = candle_nn::AdamW::new(varmap.all_vars(), candle_nn::ParamsAdamW::default())?;
    let mut i = 0;
    Ok(Box::new(move |n| {
        let t = Instant::now();
        for _ in 0..n {
            opt.backward_step(&loss(i)?)?;
            i += 1;
        }
        Ok(n as f64 / t.elapsed().as_secs_f64())
    }))
}

fn raw_fused(kind: Kind) -> Result<Loop> {
    let (varmap, loss) = raw_model(kind)?;
    let vars: Vec<Var> = varmap.all_vars();
    let zeros = |v: &Var| Tensor::zeros(v.shape(), DType::F32, &Device::Cpu);
    let ms = vars
        .iter()
        .map(zeros)
        .collect::<candle_core::Result<Vec<_>>>()?;
    let vs = vars
        .iter()
        .map(zeros)
        .collect::<candle_core::Result<Vec<_>>>()?;
    let params: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let hp = accel_core::kernels::AdamWParams {
        lr: 1e-3,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.01,
    };
    let (mut i, mut step) = (0, 0u64);
    Ok(Box::new(move |n| {
        let t = Instant::now();
        for _ in 0..n {
            let grads = loss(i)?.backward()?;
            let g: Vec<Tensor> = params
                .iter()
                .map(|p| {
                    grads
                        .get(p)
                        .expect("every parameter has a gradient")
                        .clone()
                })
                .collect();
            step += 1;
            accel_core::kernels::adamw_step(&params, &g, &ms, &vs, step, &hp)?;
            i += 1;
        }
        Ok(n as f64 / t.elapsed().as_secs_f64())
    }))
}

fn accelerated(kind: Kind, precision: PrecisionType) -> Result<Loop> {
    let mut acc = Accelerator::new(
        AcceleratorConfig::default()
            .with_seed(0)
            .with_mixed_precision(precision)
            .with_device(Device::Cpu),
    )?;
    let varmap = VarMap::new();
    let loss = build(kind, acc.var_builder(&varmap), acc.compute_dtype())?;
    let model = acc.prepare_model(&varmap)?;
    let mut opt = acc.prepare_optimizer(&model, AdamW::new(AdamWConfig::default()));
    let mut i = 0;
    Ok(Box::new(move |n| {
        let t = Instant::now();
        for _ in 0..n {
            acc.accumulate(|acc| {
                acc.backward(&loss(i).map_err(|e| accel_core::Error::Usage(e.to_string()))?)?;
                opt.step()?;
                opt.zero_grad();
                Ok(())
            })?;
            i += 1;
        }
        Ok(n as f64 / t.elapsed().as_secs_f64())
    }))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn bench(args: &Args, kind: Kind) -> Result<serde_json::Value> {
    let steps = match kind {
        Kind::Mlp => 60,
        Kind::Gpt => 3,
    };
    let mut loops: Vec<(&str, Loop)> = vec![
        ("raw_candle", raw_candle(kind)?),
        ("raw_fused", raw_fused(kind)?),
        ("accelerator", accelerated(kind, PrecisionType::No)?),
    ];
    if args.mixed_precision != PrecisionType::No {
        loops.push((
            "accelerator_mixed",
            accelerated(kind, args.mixed_precision)?,
        ));
    }
    // Warm-up: first steps allocate and fault in pages.
    for (_, l) in loops.iter_mut() {
        l(2)?;
    }
    let mut rates: Vec<Vec<f64>> = vec![vec![]; loops.len()];
    for _ in 0..args.rounds {
        for (k, (_, l)) in loops.iter_mut().enumerate() {
            rates[k].push(l(steps)?);
        }
    }
    let mut obj = serde_json::Map::new();
    let mut med = std::collections::HashMap::new();
    for ((name, _), r) in loops.iter().zip(rates) {
        let m = median(r.clone());
        med.insert(*name, m);
        obj.insert(
            format!("{name}_steps_per_s"),
            serde_json::json!((m * 100.0).round() / 100.0),
        );
    }
    let overhead = (med["raw_fused"] / med["accelerator"] - 1.0) * 100.0;
    obj.insert(
        "overhead_pct".into(),
        serde_json::json!((overhead * 100.0).round() / 100.0),
    );
    obj.insert(
        "speedup_vs_raw_candle".into(),
        serde_json::json!((med["accelerator"] / med["raw_candle"] * 100.0).round() / 100.0),
    );
    if args.mixed_precision != PrecisionType::No {
        obj.insert(
            "mixed_precision".into(),
            args.mixed_precision.to_string().into(),
        );
    }
    Ok(serde_json::Value::Object(obj))
}
