//! `bench_train --workload gpt2_124m`: GPT-2 small (vocabulary 50257, width
//! 768, 12 layers, 12 heads) trained at `micro_batch` x `seq_len` tokens a
//! step (8 x 1024 by default) with AdamW, side by side with PyTorch on the
//! same device in one run.
//!
//! Rows, all in the given precision (bf16 keeps fp32 master weights and
//! optimizer state, as PyTorch's autocast does):
//! - `accel_nn`: the example [`Gpt`] on accel-nn in a raw loop: backward,
//!   gradients cast to fp32, the fused `adamw_step`, masters cast back into
//!   the compute weights;
//! - `accelerator`: the same model through the Accelerator;
//! - `torch`: `scripts/bench_train_torch.py`'s GPT-2 small, eager, SDPA,
//!   `AdamW(fused=True)` on CUDA, under bf16 autocast when the precision is
//!   bf16; with `torch_compile`, also the loss under `torch.compile`.
//!
//! Rounds alternate as in the other workloads (odd rounds reversed). The
//! Accelerator row is built and warmed up first, alone, so the memory
//! pool's high-water mark over its warm-up is its own peak
//! (`peak_gpu_mem_mib`); torch's is `torch.cuda.max_memory_allocated()`
//! over its eager instance's first round, before any other instance exists.
//! `mfu` is model FLOPs per second (nanoGPT's count: 6 per parameter but
//! the position table, plus attention's 12 * layers * width * seq_len, per
//! token) over [`PEAK_BF16_FLOPS`].

use accel_core::optim::transformers_no_decay;
use accel_core::prelude::{Accelerator, AcceleratorConfig, AdamW, AdamWConfig, PrecisionType};
use anyhow::{bail, Result};
use candle_core::{Device, Tensor};
use candle_nn::{VarBuilder, VarMap};
use serde_json::{json, Map, Value};

use crate::raw_loop::{median, timed, RawAdamW, Row};
use crate::text::synthetic_tokens;
use crate::torch_worker::TorchWorker;
use crate::{Gpt, GptConfig};

/// The H100/H200 SXM dense bf16 tensor-core peak, 989 TFLOP/s, which `mfu`
/// divides by (as the GPU-speed issue defines it).
pub const PEAK_BF16_FLOPS: f64 = 989e12;

/// What `bench_train` passes down.
#[derive(Clone, Debug)]
pub struct Gpt2Options {
    /// Every row's device.
    pub device: Device,
    /// `no` or a mixed precision.
    pub precision: PrecisionType,
    /// Sequences a step.
    pub micro_batch: usize,
    /// Tokens a sequence (at most 1024).
    pub seq_len: usize,
    /// Timed rounds per row.
    pub rounds: usize,
    /// Steps per timed round.
    pub steps: usize,
    /// Adds torch's `torch.compile` row.
    pub torch_compile: bool,
}

const LR: f64 = 1e-3;
const WEIGHT_DECAY: f64 = 0.01;

/// The torch worker's arguments for these sizes.
pub fn torch_args(opts: &Gpt2Options) -> Vec<String> {
    vec![
        "--micro-batch".into(),
        opts.micro_batch.to_string(),
        "--seq-len".into(),
        opts.seq_len.to_string(),
        "--gpt2-steps".into(),
        opts.steps.to_string(),
    ]
}

/// Model FLOPs per token (nanoGPT's `estimate_mfu`).
pub fn flops_per_token(cfg: &GptConfig, seq_len: usize) -> f64 {
    let n = (cfg.num_params() - cfg.block_size * cfg.n_embd) as f64;
    6.0 * n + 12.0 * (cfg.n_layer * cfg.n_embd * seq_len) as f64
}

/// Four fixed batches of `(x, y)` token ids, `[micro_batch, seq_len]` each.
fn batches(opts: &Gpt2Options, vocab: usize) -> Result<Vec<(Tensor, Tensor)>> {
    let (b, t) = (opts.micro_batch, opts.seq_len);
    let toks = synthetic_tokens(4 * b * (t + 1), vocab, 11);
    let all = Tensor::from_vec(toks, (4, b, t + 1), &opts.device)?;
    (0..4)
        .map(|k| {
            let s = all.get(k)?;
            Ok((
                s.narrow(1, 0, t)?.contiguous()?,
                s.narrow(1, 1, t)?.contiguous()?,
            ))
        })
        .collect()
}

fn accel_nn_row(opts: &Gpt2Options) -> Result<Row> {
    let cfg = GptConfig::gpt2_124m();
    let dtype = opts.precision.compute_dtype();
    let varmap = VarMap::new();
    let mut model = Gpt::new(cfg, VarBuilder::from_varmap(&varmap, dtype, &opts.device))?;
    model.set_fused_kernels(true);
    let mut opt = RawAdamW::new(&varmap, LR, WEIGHT_DECAY)?;
    let data = batches(opts, cfg.vocab_size)?;
    Ok(timed(opts.device.clone(), move |i| {
        let (x, y) = &data[i % data.len()];
        opt.step(&model.loss(x, y)?.backward()?)
    }))
}

fn accelerator_row(opts: &Gpt2Options) -> Result<Row> {
    let mut acc = Accelerator::new(
        AcceleratorConfig::default()
            .with_seed(0)
            .with_mixed_precision(opts.precision)
            .with_device(opts.device.clone()),
    )?;
    let (mut model, params) = acc.prepare(|vb| Gpt::new(GptConfig::gpt2_124m(), vb))?;
    model.set_fused_kernels(true);
    let config = AdamWConfig {
        lr: LR,
        weight_decay: WEIGHT_DECAY,
        ..Default::default()
    };
    let mut opt = acc.prepare_optimizer(
        &params,
        AdamW::new(config).with_no_decay(transformers_no_decay),
    );
    let data = batches(opts, GptConfig::gpt2_124m().vocab_size)?;
    Ok(timed(opts.device.clone(), move |i| {
        let (x, y) = &data[i % data.len()];
        acc.try_accumulate(|acc| {
            acc.backward(&model.loss(x, y)?)?;
            opt.step()?;
            opt.zero_grad();
            Ok::<_, anyhow::Error>(())
        })?;
        Ok(())
    }))
}

fn rounded(x: f64, places: i32) -> Value {
    let f = 10f64.powi(places);
    json!((x * f).round() / f)
}

/// Peak pool memory of `device` in MiB, where the device keeps the mark.
fn peak_mib(device: &Device) -> Result<Option<f64>> {
    if device.is_cpu() {
        return Ok(None);
    }
    let peak = accel_core::kernels::cuda::max_memory_allocated(device)?;
    Ok(peak.map(|b| b as f64 / (1u64 << 20) as f64))
}

/// Runs the workload; the JSON object's keys are listed in the module
/// documentation and `bench_train`'s.
///
/// # Errors
/// A sequence longer than the model's context, a failing row, or a torch
/// worker that fails.
pub fn run(opts: &Gpt2Options, mut torch: Option<&mut TorchWorker>) -> Result<Map<String, Value>> {
    let cfg = GptConfig::gpt2_124m();
    if opts.seq_len == 0 || opts.seq_len > cfg.block_size || opts.micro_batch == 0 {
        bail!(
            "gpt2_124m: --seq-len must be 1..={} and --micro-batch at least 1 (got {} and {})",
            cfg.block_size,
            opts.seq_len,
            opts.micro_batch
        )
    }
    let mut out = Map::new();
    // The torch row compares like with like only without a GradScaler.
    let torch_precision = match opts.precision {
        PrecisionType::No => Some(""),
        PrecisionType::Bf16 => Some(" bf16"),
        PrecisionType::Fp16 => None,
    };
    if torch_precision.is_none() && torch.is_some() {
        out.insert(
            "torch_skipped".into(),
            "fp16 on torch's side needs a GradScaler, which this benchmark does not run".into(),
        );
        torch = None;
    }
    let cuda = !opts.device.is_cpu();
    if cuda {
        accel_core::kernels::cuda::reset_peak_memory_stats(&opts.device)?;
    }
    let mut rows: Vec<(&str, Row)> = vec![("accelerator", accelerator_row(opts)?)];
    rows[0].1(2)?;
    if let Some(mib) = peak_mib(&opts.device)? {
        out.insert("peak_gpu_mem_mib".into(), rounded(mib, 0));
    }
    rows.insert(0, ("accel_nn", accel_nn_row(opts)?));
    rows[0].1(2)?;
    let base = format!("gpt2_124m{}", torch_precision.unwrap_or(""));
    let mut torch_lines = vec![(base.clone(), "torch")];
    if opts.torch_compile {
        torch_lines.push((format!("{base} compile"), "torch_compile"));
    }
    let mut rates: Vec<Vec<f64>> = vec![vec![]; rows.len()];
    let mut torch_rates: Vec<Vec<f64>> = vec![vec![]; torch_lines.len()];
    let mut torch_peak = None;
    let mut torch_round = |t: &mut TorchWorker| -> Result<()> {
        for ((line, _), r) in torch_lines.iter().zip(torch_rates.iter_mut()) {
            let reply = t.round(line)?;
            if torch_peak.is_none() && line == &base {
                torch_peak = reply["peak_mem_mib"].as_f64();
            }
            r.push(reply["steps_per_s"].as_f64().unwrap_or(0.0));
        }
        Ok(())
    };
    for round in 0..opts.rounds.max(1) {
        let forward = round % 2 == 0;
        if let (true, Some(t)) = (forward, torch.as_deref_mut()) {
            torch_round(t)?;
        }
        let mut order: Vec<usize> = (0..rows.len()).collect();
        if !forward {
            order.reverse();
        }
        for k in order {
            rates[k].push(rows[k].1(opts.steps)?);
        }
        if let (false, Some(t)) = (forward, torch.as_deref_mut()) {
            torch_round(t)?;
        }
    }
    let tokens = (opts.micro_batch * opts.seq_len) as f64;
    let fpt = flops_per_token(&cfg, opts.seq_len);
    out.insert("workload".into(), "gpt2_124m".into());
    out.insert("parameters".into(), cfg.num_params().into());
    out.insert("micro_batch".into(), opts.micro_batch.into());
    out.insert("seq_len".into(), opts.seq_len.into());
    out.insert("tokens_per_step".into(), (tokens as u64).into());
    out.insert("mixed_precision".into(), opts.precision.to_string().into());
    for ((name, _), r) in rows.iter().zip(&rates) {
        out.insert(
            format!("{name}_tokens_per_s"),
            rounded(median(r.clone()) * tokens, 0),
        );
    }
    for ((_, name), r) in torch_lines.iter().zip(&torch_rates) {
        if !r.is_empty() {
            out.insert(
                format!("{name}_tokens_per_s"),
                rounded(median(r.clone()) * tokens, 0),
            );
        }
    }
    // Per-round ratios, as the other workloads pair rows.
    let paired = |a: &[f64], b: &[f64]| median(a.iter().zip(b).map(|(x, y)| x / y).collect());
    if !torch_rates[0].is_empty() {
        out.insert(
            "accel_nn_vs_torch".into(),
            rounded(paired(&rates[0], &torch_rates[0]), 3),
        );
        out.insert(
            "accelerator_vs_torch".into(),
            rounded(paired(&rates[1], &torch_rates[0]), 3),
        );
    }
    if cuda {
        let mfu = |r: &[f64]| rounded(median(r.to_vec()) * tokens * fpt / PEAK_BF16_FLOPS, 4);
        out.insert("mfu".into(), mfu(&rates[1]));
        out.insert("accel_nn_mfu".into(), mfu(&rates[0]));
        if !torch_rates[0].is_empty() {
            out.insert("torch_mfu".into(), mfu(&torch_rates[0]));
        }
        out.insert("mfu_peak_tflops".into(), json!(PEAK_BF16_FLOPS / 1e12));
        if let Some(mib) = torch_peak {
            out.insert("torch_peak_gpu_mem_mib".into(), rounded(mib, 0));
        }
        let name = accel_core::kernels::cuda::device_name(&opts.device)?;
        out.insert("gpu_name".into(), name.into());
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flops_per_token_is_nanogpts_count_for_gpt2_small() {
        // nanoGPT: N = 124.44M - 1024 * 768 position weights = 123.65M;
        // 6N + 12 * 12 * 768 * 1024.
        let cfg = GptConfig::gpt2_124m();
        let n = 124_439_808.0 - 786_432.0;
        assert_eq!(
            flops_per_token(&cfg, 1024),
            6.0 * n + 12.0 * 12.0 * 768.0 * 1024.0
        );
    }
}
