//! Quantized bases on the CPU, as one JSON object: the linear layers of
//! `bench_bigmodel`'s 0.5 B Llama through a 4-bit NF4 weight against the
//! same weight in bf16 (accel-nn) and against candle's quantized `QMatMul`
//! (Q4_0, the GGUF 4-bit type) on the same shapes, and greedy decoding of the
//! whole model in 4-bit NF4 against bf16.
//!
//! ```text
//! cargo run --release --example bench_quant -- --json [--model DIR] [--reps 9]
//!     [--rows 1,128] [--new-tokens 16] [--no-decode]
//! ```
//! Without `--model`, the checkpoint is `target/bench_llama_2gb`, written by
//! `scripts/bench_bigmodel_torch.py write` when absent.
//!
//! `linear`: per `k x out` shape (hidden 1536, intermediate 4096, 4 KV heads
//! of 128) and row count, the median seconds of `x W^T` (and, past one row,
//! of the input's gradient `dy W`, what QLoRA's backward computes through a
//! frozen weight) for: `nf4`, accel-nn's quantized linear (double
//! quantization, bf16 inputs; products dequantize tiles of the codes);
//! `bf16`, accel-nn's linear on the weight in bf16; `candle_q4_0`, candle's
//! `QMatMul` on the same weight quantized to Q4_0 (forward only, f32
//! inputs, as candle's quantized models run). All sides alternate in one
//! process on the same random weight. Where this CPU has narrower 4-bit
//! paths than its default (`quant_path`), `nf4_avx2` / `nf4_portable` time
//! them too, beside `bf16_f32_path` (bf16 products in f32): what a CPU
//! without AVX-512 runs, measured here.
//!
//! `decode`: tokens/s of greedy generation with a KV cache, `--new-tokens`
//! after an 8-token prompt, the model loaded in bf16 and in 4-bit NF4
//! (double quantization, compute dtype float32), each in a process of its
//! own, with its peak RSS.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use accel_core::bigmodel::quant::{BnbQuantizationConfig, QuantType, QuantizeOnLoad};
use accel_core::bigmodel::CheckpointSource;
use accel_core::models::AutoModel;
use accel_core::nn::layers::{linear_no_bias, Linear, QuantSpec};
use accel_core::nn::ops::{quant_path, with_bf16_path, with_quant_path, Bf16Path, QuantPath};
use accel_examples::bench_proc::{run_side, script_checkpoint, status_kib};
use anyhow::{bail, Context, Result};
use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{DType, Device, Module, Tensor, Var};
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
    /// Timed calls per side and case; figures are medians.
    #[arg(long, default_value_t = 9)]
    reps: usize,
    /// Row counts of `x` for the linear layers.
    #[arg(long, value_delimiter = ',', default_values_t = [1, 128])]
    rows: Vec<usize>,
    /// Tokens generated per decoding side.
    #[arg(long, default_value_t = 16)]
    new_tokens: usize,
    /// Skip the decoding sides.
    #[arg(long)]
    no_decode: bool,
    /// Internal: run one decoding side in this process and print its JSON.
    #[arg(long, hide = true, value_enum)]
    child: Option<Decode>,
}

/// The decoding sides.
#[derive(Debug, Clone, Copy, PartialEq, ValueEnum)]
enum Decode {
    Bf16,
    Nf4,
}

const WRITE_SCRIPT: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../scripts/bench_bigmodel_torch.py"
);

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

fn round(x: f64, digits: i32) -> f64 {
    let f = 10f64.powi(digits);
    (x * f).round() / f
}

/// Median seconds of `f` over `reps` calls after two untimed ones.
fn time(reps: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    f()?;
    f()?;
    let mut ts = Vec::with_capacity(reps);
    for _ in 0..reps {
        let t = Instant::now();
        f()?;
        ts.push(t.elapsed().as_secs_f64());
    }
    Ok(median(ts))
}

/// A linear layer `[out, k]` quantized to NF4 (double quantization) from `w`.
fn nf4_layer(dir: &Path, w: &Tensor) -> Result<Linear> {
    let path = dir.join("w.safetensors");
    candle_core::safetensors::save(
        &[("m.weight".to_string(), w.to_dtype(DType::F32)?)]
            .into_iter()
            .collect(),
        &path,
    )?;
    let config = BnbQuantizationConfig {
        bnb_4bit_use_double_quant: true,
        bnb_4bit_compute_dtype: DType::BF16,
        ..BnbQuantizationConfig::four_bit(QuantType::Nf4)
    };
    let spec = QuantSpec::new(config.clone());
    let source = CheckpointSource::open(&path)?.with_quantization(QuantizeOnLoad::new(config)?)?;
    let vb = candle_nn::VarBuilder::from_backend(Box::new(source), DType::BF16, Device::Cpu);
    let (out, k) = w.dims2()?;
    let layer =
        accel_core::nn::layers::linear_b_with(k, out, false, vb.pp("m"), None, Some(&spec))?;
    anyhow::ensure!(layer.quantized().is_some(), "the layer was not quantized");
    Ok(layer)
}

/// The 4-bit paths this CPU has besides its default, widest first.
fn narrower_paths() -> impl Iterator<Item = QuantPath> {
    QuantPath::ALL
        .into_iter()
        .filter(|p| p.available() && *p != quant_path())
}

/// The `linear` section: every shape and row count.
fn linear_section(args: &Args) -> Result<Value> {
    let dev = Device::Cpu;
    let tmp = tempfile::tempdir()?;
    let mut results = vec![];
    for (k, out) in [(1536, 1536), (1536, 512), (1536, 4096), (4096, 1536)] {
        let w = Tensor::randn(0f32, 0.02, (out, k), &dev)?;
        let nf4 = nf4_layer(tmp.path(), &w)?;
        let bf16 = linear_no_bias(
            k,
            out,
            candle_nn::VarBuilder::from_tensors(
                [("weight".to_string(), w.to_dtype(DType::BF16)?)]
                    .into_iter()
                    .collect(),
                DType::BF16,
                &dev,
            ),
        )?;
        let q4 = QMatMul::from_qtensor(QTensor::quantize(&w, GgmlDType::Q4_0)?)?;
        for &m in &args.rows {
            let x = Tensor::randn(0f32, 1.0, (m, k), &dev)?;
            let xb = Var::from_tensor(&x.to_dtype(DType::BF16)?)?;
            let fwd = |l: &Linear| -> Result<()> {
                std::hint::black_box(l.forward(&xb)?);
                Ok(())
            };
            let mut row = json!({
                "k": k,
                "out": out,
                "rows": m,
                "forward_s": {
                    "nf4": time(args.reps, || fwd(&nf4))?,
                    "bf16": time(args.reps, || fwd(&bf16))?,
                    "candle_q4_0": time(args.reps, || {
                        std::hint::black_box(q4.forward(&x)?);
                        Ok(())
                    })?,
                },
            });
            // What a CPU without AVX-512 runs: the 4-bit kernels' AVX2
            // form, bf16 products in f32 (gemm still picks its own kernels).
            for path in narrower_paths() {
                let t = with_quant_path(path, || time(args.reps, || fwd(&nf4)))??;
                row["forward_s"][format!("nf4_{}", path.name())] = json!(t);
            }
            if narrower_paths().next().is_some() {
                let t = with_bf16_path(Bf16Path::F32, || time(args.reps, || fwd(&bf16)))??;
                row["forward_s"]["bf16_f32_path"] = json!(t);
            }
            if m > 1 {
                let g = Tensor::randn(0f32, 1.0, (m, out), &dev)?.to_dtype(DType::BF16)?;
                let bwd = |l: &Linear| -> Result<()> {
                    let y = l.forward(&xb)?;
                    let grads = (y * &g)?.sum_all()?.backward()?;
                    std::hint::black_box(grads.get(xb.as_tensor()).context("no dx")?);
                    Ok(())
                };
                row["forward_and_input_grad_s"] = json!({
                    "nf4": time(args.reps, || bwd(&nf4))?,
                    "bf16": time(args.reps, || bwd(&bf16))?,
                });
                for path in narrower_paths() {
                    let t = with_quant_path(path, || time(args.reps, || bwd(&nf4)))??;
                    row["forward_and_input_grad_s"][format!("nf4_{}", path.name())] = json!(t);
                }
                if narrower_paths().next().is_some() {
                    let t = with_bf16_path(Bf16Path::F32, || time(args.reps, || bwd(&bf16)))??;
                    row["forward_and_input_grad_s"]["bf16_f32_path"] = json!(t);
                }
            }
            let f = &row["forward_s"];
            let (n, b, c) = (
                f["nf4"].as_f64().unwrap_or(0.0),
                f["bf16"].as_f64().unwrap_or(0.0),
                f["candle_q4_0"].as_f64().unwrap_or(0.0),
            );
            row["nf4_vs_bf16_forward"] = json!(round(b / n, 3));
            row["nf4_vs_candle_q4_0_forward"] = json!(round(c / n, 3));
            if let Some(t) = row.get("forward_and_input_grad_s").cloned() {
                let (n, b) = (
                    t["nf4"].as_f64().unwrap_or(0.0),
                    t["bf16"].as_f64().unwrap_or(0.0),
                );
                row["nf4_vs_bf16_forward_and_input_grad"] = json!(round(b / n, 3));
            }
            results.push(row);
        }
    }
    Ok(json!(results))
}

/// One decoding side in this process.
fn decode_child(side: Decode, dir: &Path, args: &Args) -> Result<Value> {
    let t = Instant::now();
    let model = match side {
        Decode::Bf16 => AutoModel::load(dir, DType::BF16, &Device::Cpu)?,
        Decode::Nf4 => {
            let q = BnbQuantizationConfig {
                bnb_4bit_use_double_quant: true,
                ..BnbQuantizationConfig::four_bit(QuantType::Nf4)
            };
            AutoModel::load_quantized(dir, Some(&q), None, DType::F32, &Device::Cpu)?
        }
    };
    let load_s = t.elapsed().as_secs_f64();
    let prompt: Vec<u32> = (0..8).map(|i| (i * 37 + 11) % 32000).collect();
    // A warm-up generation of two tokens (the thread pool, first pages).
    model.generate(&prompt, 2, &[])?;
    let t = Instant::now();
    let out = model.generate(&prompt, args.new_tokens, &[])?;
    let s = t.elapsed().as_secs_f64();
    Ok(json!({
        "tokens_per_s": round(args.new_tokens as f64 / s, 3),
        "new_tokens": out.len() - prompt.len(),
        "load_s": round(load_s, 2),
        "peak_rss_mib": round(status_kib("VmHWM:") as f64 / 1024.0, 1),
    }))
}

fn decode_side(side: Decode, dir: &Path, args: &Args) -> Result<Value> {
    let mut cmd = Command::new(std::env::current_exe()?);
    cmd.arg("--model").arg(dir);
    cmd.arg("--new-tokens").arg(args.new_tokens.to_string());
    cmd.arg("--child").arg(match side {
        Decode::Bf16 => "bf16",
        Decode::Nf4 => "nf4",
    });
    run_side(&mut cmd, &format!("decode {side:?}"))
}

fn main() -> Result<()> {
    accel_core::init_logging();
    let args = Args::parse();
    if args.reps == 0 {
        bail!("--reps must be at least 1");
    }
    let dir = match &args.model {
        Some(d) => d.clone(),
        None => script_checkpoint(
            "bench_llama_2gb",
            "model.safetensors.index.json",
            WRITE_SCRIPT,
            "torch transformers",
        )?,
    };
    if let Some(side) = args.child {
        println!("{}", decode_child(side, &dir, &args)?);
        return Ok(());
    }
    let linear = linear_section(&args)?;
    let decode = if args.no_decode {
        Value::Null
    } else {
        let (bf16, nf4) = (
            decode_side(Decode::Bf16, &dir, &args)?,
            decode_side(Decode::Nf4, &dir, &args)?,
        );
        let ratio = match (nf4["tokens_per_s"].as_f64(), bf16["tokens_per_s"].as_f64()) {
            (Some(a), Some(b)) if b > 0.0 => json!(round(a / b, 3)),
            _ => Value::Null,
        };
        json!({ "bf16": bf16, "nf4": nf4, "nf4_vs_bf16_tokens_per_s": ratio })
    };
    let out = json!({
        "model": dir.display().to_string(),
        "cores": std::thread::available_parallelism().map_or(0, |n| n.get()),
        "reps": args.reps,
        "quant_path": quant_path().name(),
        "bf16_path": accel_core::nn::ops::bf16_path().name(),
        "linear": linear,
        "decode": decode,
    });
    if args.json {
        println!("{out}");
    } else {
        println!("{}", serde_json::to_string_pretty(&out)?);
    }
    Ok(())
}
