//! Training throughput, side by side in one run, on the MLP (784-512-512-10,
//! batch 64) and the GPT (vocab 4096, d 256, 4 layers, 4 heads, seq 128,
//! batch 8), all AdamW (lr 1e-3, weight decay 0.01):
//!
//! - `candle_nn`: the model on stock candle-nn layers (`accel_examples::stock`)
//!   with `candle_nn::AdamW`, what a candle user writes today (candle's
//!   AdamW decays every parameter);
//! - `accel_nn`: the same model on accel-nn, raw loop: `loss.backward()` and
//!   the fused `accel_kernels::adamw_step`, no decay on biases and norm
//!   weights (transformers' rule);
//! - `accelerator`: the accel-nn model through the Accelerator (`prepare`,
//!   `accumulate`, `backward`, prepared AdamW with the same rule);
//! - `torch`: `scripts/bench_train_torch.py`, the same models and AdamW rule in
//!   PyTorch on 2 threads, when `import torch` works. It runs as a worker
//!   process (`--serve`) that times one round per request, and its rounds
//!   take their turn in the alternation below like the other rows'.
//!
//! `overhead_pct` compares `accelerator` with `accel_nn` (same model, same
//! optimizer maths), so it measures only what the Accelerator adds. Rounds
//! alternate between loops (odd rounds in reverse order, each round of a
//! row after one untimed step) so machine noise hits each alike; steps/s are median rounds, and the ratios are medians of
//! the per-round ratios (rows of one round run seconds apart).
//! `CANDLE_NUM_THREADS` (the size of candle's CPU pool, which accel-nn's
//! kernels share) is reported as `candle_num_threads` when set.
//!
//! ```text
//! cargo run --release --example bench_train -- --json
//! ```
//!
//! `--workload gpt2_124m` runs GPT-2 small at 8 x 1024 tokens a step instead
//! (`accel_examples::bench_gpt2`): `accel_nn_tokens_per_s`,
//! `accelerator_tokens_per_s`, `torch_tokens_per_s` (eager, SDPA, fused
//! AdamW; `--torch-compile` adds `torch_compile_tokens_per_s`), `mfu`,
//! `peak_gpu_mem_mib` and `torch_peak_gpu_mem_mib` on a GPU, `gpu_name`:
//!
//! ```text
//! cargo run --release --example bench_train --features cuda -- --device cuda \
//!     --workload gpt2_124m --mixed-precision bf16 --json
//! ```

use accel_core::optim::transformers_no_decay;
use accel_core::prelude::{Accelerator, AcceleratorConfig, AdamW, AdamWConfig, PrecisionType};
use accel_examples::bench_gpt2::{self, Gpt2Options};
use accel_examples::mnist_like::synthetic_classification;
use accel_examples::raw_loop::{self, median, RawAdamW};
use accel_examples::stock::{StockGpt, StockMlp};
use accel_examples::text::synthetic_tokens;
use accel_examples::torch_worker::TorchWorker;
use accel_examples::{Gpt, GptConfig, Mlp};
use anyhow::Result;
use candle_core::{DType, Device, Tensor};
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
    /// Adds an Accelerator row in this precision (no, bf16, fp16); without
    /// it, the launcher's `ACCELERATE_MIXED_PRECISION` decides (Accelerate's
    /// precedence). The compared rows are always fp32; with bf16, torch also
    /// runs the workload under bf16 autocast (`torch_mixed`), which has no
    /// fp16 counterpart here (it would need a GradScaler).
    #[arg(long)]
    mixed_precision: Option<PrecisionType>,
    /// `cpu` (the figures in BENCHMARKS.md) or `cuda` (cuda:0, with a build
    /// `--features cuda`; torch then runs on the same GPU). Every row runs
    /// on this device. `cuda-untracked` is a diagnostic: candle's own
    /// `Device::new_cuda(0)`, whose context has one stream, so cudarc
    /// tracks no per-allocation events (unsafe once work crosses streams or
    /// threads, see docs/design/stream-model.md); it measures what that
    /// tracking costs a step.
    #[arg(long, default_value = "cpu")]
    device: String,
    /// `gpt2_124m` runs GPT-2 small instead of the `--only` workloads: the
    /// rows `accel_nn`, `accelerator` and `torch` in the `--mixed-precision`
    /// given (see `accel_examples::bench_gpt2`), reported in tokens/s with
    /// `mfu` and peak GPU memory. A GPU workload: a CPU step takes minutes.
    #[arg(long, value_parser = ["gpt2_124m"])]
    workload: Option<String>,
    /// gpt2_124m's sequences a step.
    #[arg(long, default_value_t = 8)]
    micro_batch: usize,
    /// gpt2_124m's tokens a sequence (at most 1024).
    #[arg(long, default_value_t = 1024)]
    seq_len: usize,
    /// gpt2_124m's steps per timed round (default 10 on a GPU, 1 on CPU).
    #[arg(long)]
    steps: Option<usize>,
    /// gpt2_124m: adds torch's `torch.compile` row (`torch_compile_tokens_per_s`).
    #[arg(long)]
    torch_compile: bool,
    /// Capture the Rust rows' steps as CUDA graphs. Not built yet: says so
    /// at start-up, the rows run eagerly and no graph keys are reported.
    #[arg(long)]
    cuda_graphs: bool,
}

/// The device every row runs on (set once from `--device`).
static DEVICE: std::sync::OnceLock<Device> = std::sync::OnceLock::new();

fn device() -> &'static Device {
    DEVICE.get_or_init(|| Device::Cpu)
}

/// Steps per timed round: a GPU step is much shorter, so rounds are longer.
fn steps_per_round(kind: Kind) -> usize {
    let cpu = match kind {
        Kind::Mlp => 60,
        Kind::Gpt => 3,
    };
    if device().is_cpu() {
        cpu
    } else {
        cpu * 20
    }
}

fn main() -> Result<()> {
    accel_core::init_logging();
    let mut args = Args::parse();
    let dev = accel_examples::device_named(&args.device)?;
    accel_examples::cuda_graphs_notice(args.cuda_graphs, &dev);
    let _ = DEVICE.set(dev);
    // The Accelerator row would tune glibc's malloc when it is built (see
    // accel_dist::malloc); doing it first gives every row, candle_nn and
    // accel_nn included, the same allocator settings.
    let malloc = accel_core::dist::malloc::tune_for_training();
    let env = std::env::var(accel_core::config::ENV_MIXED_PRECISION).ok();
    args.mixed_precision = Some(accel_core::config::resolve_precision(
        args.mixed_precision,
        env.as_deref(),
    )?);
    let mut out = serde_json::Map::new();
    let mut torch;
    if args.workload.is_some() {
        let opts = Gpt2Options {
            device: device().clone(),
            precision: args.mixed_precision.unwrap_or(PrecisionType::No),
            micro_batch: args.micro_batch,
            seq_len: args.seq_len,
            rounds: args.rounds,
            steps: args.steps.unwrap_or(if device().is_cpu() { 1 } else { 10 }),
            torch_compile: args.torch_compile,
        };
        torch = TorchWorker::start(device(), &bench_gpt2::torch_args(&opts))?;
        out = bench_gpt2::run(&opts, torch.as_mut())?;
    } else {
        torch = TorchWorker::start(device(), &[])?;
        for (kind, name) in [(Kind::Mlp, MLP), (Kind::Gpt, GPT)] {
            if args.only == "all" || args.only == kind.arg() {
                out.insert(name.into(), bench(&args, kind, torch.as_mut())?);
            }
        }
    }
    if let Some(t) = &torch {
        out.insert("torch_version".into(), t.version.clone().into());
    }
    out.insert("malloc_tuning".into(), format!("{malloc:?}").into());
    out.insert("threads".into(), rayon_threads().into());
    out.insert(
        "candle_num_threads".into(),
        std::env::var("CANDLE_NUM_THREADS")
            .unwrap_or_default()
            .into(),
    );
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

const MLP: &str = "mlp_784_512_512_10_b64";
const GPT: &str = "gpt_v4096_d256_l4_h4_t128_b8";

#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Mlp,
    Gpt,
}

impl Kind {
    /// The workload's name for `--only` and the torch worker.
    fn arg(self) -> &'static str {
        match self {
            Kind::Mlp => "mlp",
            Kind::Gpt => "gpt",
        }
    }
}

/// The loss of batch `i` of a workload.
type LossFn = Box<dyn Fn(usize) -> Result<Tensor>>;

/// The fixed batches of a workload and a loss over them for `model`.
fn batches<M: 'static>(
    kind: Kind,
    dtype: DType,
    model: M,
    loss: impl Fn(&M, &Tensor, &Tensor) -> candle_core::Result<Tensor> + 'static,
) -> Result<LossFn> {
    let dev = device();
    let (x, y, n) = match kind {
        Kind::Mlp => {
            let (x, y) = synthetic_classification(64 * 8, 784, 10, 7);
            let x = Tensor::from_vec(x, (8, 64, 784), dev)?.to_dtype(dtype)?;
            (x, Tensor::from_vec(y, (8, 64), dev)?, 8)
        }
        Kind::Gpt => {
            let cfg = GptConfig::bench();
            let toks = synthetic_tokens(4 * 8 * 129, cfg.vocab_size, 11);
            let t = Tensor::from_vec(toks, (4, 8, 129), dev)?;
            let x = t.narrow(2, 0, 128)?.contiguous()?;
            (x, t.narrow(2, 1, 128)?.contiguous()?, 4)
        }
    };
    Ok(Box::new(move |i: usize| {
        let k = i % n;
        Ok(loss(&model, &x.get(k)?, &y.get(k)?)?)
    }))
}

/// The workload's model on accel-nn (the examples' `Mlp` / `Gpt`).
fn accel_nn_model(kind: Kind, vb: VarBuilder, dtype: DType) -> Result<LossFn> {
    match kind {
        Kind::Mlp => {
            let m = Mlp::new(&[784, 512, 512, 10], vb)?;
            batches(kind, dtype, m, |m, x, y| m.loss(x, y))
        }
        Kind::Gpt => {
            let m = Gpt::new(GptConfig::bench(), vb)?;
            batches(kind, dtype, m, |m, x, y| m.loss(x, y))
        }
    }
}

/// A loop that runs `n` optimizer steps and returns steps per second.
type Loop = Box<dyn FnMut(usize) -> Result<f64>>;

fn timed(step: impl FnMut(usize) -> Result<()> + 'static) -> Loop {
    raw_loop::timed(device().clone(), step)
}

const LR: f64 = 1e-3;
const WEIGHT_DECAY: f64 = 0.01;

fn candle_nn_loop(kind: Kind) -> Result<Loop> {
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, device());
    let loss = match kind {
        Kind::Mlp => batches(
            kind,
            DType::F32,
            StockMlp::new(&[784, 512, 512, 10], vb)?,
            |m, x, y| m.loss(x, y),
        )?,
        Kind::Gpt => batches(
            kind,
            DType::F32,
            StockGpt::new(GptConfig::bench(), vb)?,
            |m, x, y| m.loss(x, y),
        )?,
    };
    let params = candle_nn::ParamsAdamW {
        lr: LR,
        weight_decay: WEIGHT_DECAY,
        ..Default::default()
    };
    let mut opt = candle_nn::AdamW::new(varmap.all_vars(), params)?;
    Ok(timed(move |i| Ok(opt.backward_step(&loss(i)?)?)))
}

fn accel_nn_loop(kind: Kind) -> Result<Loop> {
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, device());
    let loss = accel_nn_model(kind, vb, DType::F32)?;
    // transformers' grouping, as the Accelerator's AdamW below applies it.
    let mut opt = RawAdamW::new(&varmap, LR, WEIGHT_DECAY)?;
    Ok(timed(move |i| opt.step(&loss(i)?.backward()?)))
}

fn accelerator_loop(kind: Kind, precision: PrecisionType) -> Result<Loop> {
    let mut acc = Accelerator::new(
        AcceleratorConfig::default()
            .with_seed(0)
            .with_mixed_precision(precision)
            .with_device(device().clone()),
    )?;
    let dtype = acc.compute_dtype();
    let (loss, params) = match kind {
        Kind::Mlp => {
            let (m, p) = acc.prepare(|vb| Mlp::new(&[784, 512, 512, 10], vb))?;
            (batches(kind, dtype, m, |m, x, y| m.loss(x, y))?, p)
        }
        Kind::Gpt => {
            let (m, p) = acc.prepare(|vb| Gpt::new(GptConfig::bench(), vb))?;
            (batches(kind, dtype, m, |m, x, y| m.loss(x, y))?, p)
        }
    };
    let config = AdamWConfig {
        lr: LR,
        weight_decay: WEIGHT_DECAY,
        ..Default::default()
    };
    let mut opt = acc.prepare_optimizer(
        &params,
        AdamW::new(config).with_no_decay(transformers_no_decay),
    );
    Ok(timed(move |i| {
        acc.try_accumulate(|acc| {
            // The loss closure gives anyhow's error; accel-core's convert into it.
            let loss = loss(i)?;
            acc.backward(&loss)?;
            opt.step()?;
            opt.zero_grad();
            Ok::<_, anyhow::Error>(())
        })?;
        Ok(())
    }))
}

fn rounded(x: f64) -> serde_json::Value {
    serde_json::json!((x * 100.0).round() / 100.0)
}

fn bench(
    args: &Args,
    kind: Kind,
    mut torch: Option<&mut TorchWorker>,
) -> Result<serde_json::Value> {
    let steps = steps_per_round(kind);
    let mut loops: Vec<(&str, Loop)> = vec![
        ("candle_nn", candle_nn_loop(kind)?),
        ("accel_nn", accel_nn_loop(kind)?),
        ("accelerator", accelerator_loop(kind, PrecisionType::No)?),
    ];
    let mixed = args.mixed_precision.filter(|p| *p != PrecisionType::No);
    if let Some(p) = mixed {
        loops.push(("accelerator_mixed", accelerator_loop(kind, p)?));
    }
    // Warm-up: first steps allocate and fault in pages.
    for (_, l) in loops.iter_mut() {
        l(2)?;
    }
    // Every round runs each row once. Even rounds run torch first, odd
    // rounds the Rust rows in reverse order and torch last, so torch only
    // ever borders itself and candle_nn, and the pair behind overhead_pct
    // (accel_nn, accelerator) takes turns going first.
    // With bf16 mixed precision, torch runs a second instance of the
    // workload under bf16 autocast beside its fp32 one, for the
    // accelerator_mixed row to compare with.
    let torch_bf16 = mixed == Some(PrecisionType::Bf16);
    let mut rates: Vec<Vec<f64>> = vec![vec![]; loops.len()];
    let (mut torch_rates, mut torch_mixed_rates) = (vec![], vec![]);
    let mut torch_round = |t: &mut TorchWorker| -> Result<()> {
        torch_rates.push(t.steps_per_s(kind.arg())?);
        if torch_bf16 {
            torch_mixed_rates.push(t.steps_per_s(&format!("{} bf16", kind.arg()))?);
        }
        Ok(())
    };
    for round in 0..args.rounds {
        let forward = round % 2 == 0;
        if let (true, Some(t)) = (forward, torch.as_deref_mut()) {
            torch_round(t)?;
        }
        let mut order: Vec<usize> = (0..loops.len()).collect();
        if !forward {
            order.reverse();
        }
        for k in order {
            rates[k].push(loops[k].1(steps)?);
        }
        if let (false, Some(t)) = (forward, torch.as_deref_mut()) {
            torch_round(t)?;
        }
    }
    let mut obj = serde_json::Map::new();
    for ((name, _), r) in loops.iter().zip(&rates) {
        obj.insert(format!("{name}_steps_per_s"), rounded(median(r.clone())));
    }
    // Ratios are medians of per-round ratios: the two rows of a round ran
    // seconds apart, so a machine that slows down for a while slows both.
    let row = |name: &str| &rates[loops.iter().position(|(n, _)| *n == name).unwrap()];
    let paired = |a: &[f64], b: &[f64]| median(a.iter().zip(b).map(|(x, y)| x / y).collect());
    obj.insert(
        "overhead_pct".into(),
        rounded((paired(row("accel_nn"), row("accelerator")) - 1.0) * 100.0),
    );
    obj.insert(
        "accel_nn_vs_candle_nn".into(),
        rounded(paired(row("accel_nn"), row("candle_nn"))),
    );
    if !torch_rates.is_empty() {
        let vs = paired(row("accel_nn"), &torch_rates);
        obj.insert("torch_steps_per_s".into(), rounded(median(torch_rates)));
        obj.insert("accel_nn_vs_torch".into(), rounded(vs));
    }
    if !torch_mixed_rates.is_empty() {
        let vs = paired(row("accelerator_mixed"), &torch_mixed_rates);
        obj.insert(
            "torch_mixed_steps_per_s".into(),
            rounded(median(torch_mixed_rates)),
        );
        obj.insert("accelerator_mixed_vs_torch_mixed".into(), rounded(vs));
    }
    if let Some(p) = mixed {
        obj.insert("mixed_precision".into(), p.to_string().into());
    }
    Ok(serde_json::Value::Object(obj))
}
