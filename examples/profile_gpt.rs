//! Times training steps (forward + backward + `candle_nn::AdamW`) of the
//! benchmark models on CPU and prints one JSON object per workload.
//!
//! `cargo run --release -p accel-examples --example profile_gpt -- [--composed] [--steps N] [--dtype f32|bf16|f16] [--only gpt|mlp] [--device cpu|cuda|cuda-untracked|cuda-both] [--optimizer candle|fused]`
//!
//! `--composed` switches the GPT from the fused CPU kernels to plain candle
//! ops, to see what the kernels buy. Each workload reports the mean time of
//! the forward, backward and optimizer phases so a regression can be pinned
//! to one of them.
//!
//! On a GPU (a build with `--features cuda`) the phases are host time: the
//! calls return once their work is enqueued, and only reading the loss
//! waits for the device. So `fwd_ms + bwd_ms + opt_ms` close to the whole
//! step means the step is bound by the host's enqueueing, not the GPU.
//! `cuda` is `accel_kernels::cuda_device(0)` (cudarc's per-allocation event
//! tracking on, see docs/design/stream-model.md), `cuda-untracked` candle's
//! own `Device::new_cuda(0)` (one stream, no tracking), and `cuda-both`
//! alternates the two in one process, two rounds each, so their ratio is
//! not blurred by process-to-process variation.
//!
//! `--optimizer fused` steps with `accel_kernels::adamw_step` (one pass
//! over all parameters, what `bench_train`'s accel_nn row uses) instead of
//! candle-nn's `AdamW` (a dozen tensor ops per parameter), so a profile of
//! the GPT matches that benchmark.

use std::time::Instant;

use accel_examples::{mnist_like, text, Gpt, GptConfig, Mlp};
use anyhow::Result;
use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor};
use candle_nn::{AdamW, Optimizer, ParamsAdamW, VarBuilder, VarMap};

struct Args {
    composed: bool,
    steps: usize,
    dtype: DType,
    only: Option<String>,
    device: String,
    fused_optimizer: bool,
}

fn parse_args() -> Result<Args> {
    let mut args = Args {
        composed: false,
        steps: 10,
        dtype: DType::F32,
        only: None,
        device: "cpu".into(),
        fused_optimizer: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        match a.as_str() {
            "--composed" => args.composed = true,
            "--steps" => args.steps = it.next().unwrap_or_default().parse()?,
            "--dtype" => {
                args.dtype = match it.next().as_deref() {
                    Some("bf16") => DType::BF16,
                    Some("f16") => DType::F16,
                    _ => DType::F32,
                }
            }
            "--only" => args.only = it.next(),
            "--device" => args.device = it.next().unwrap_or_default(),
            "--optimizer" => {
                args.fused_optimizer = match it.next().as_deref() {
                    Some("fused") => true,
                    Some("candle") => false,
                    other => anyhow::bail!("--optimizer {other:?}: expected candle or fused"),
                }
            }
            other => anyhow::bail!("unknown argument {other}"),
        }
    }
    Ok(args)
}

/// Mean seconds of each phase over the timed steps (after one warm-up step,
/// which pays for allocations and thread-pool start-up).
#[derive(Default)]
struct Phases {
    fwd: f64,
    bwd: f64,
    opt: f64,
    /// Median of the whole-step times (the loss read back included, which
    /// waits for the device): robust to other processes stealing the CPU
    /// for part of the run.
    median_step: f64,
}

/// One optimizer step from a gradient store: candle-nn's `AdamW`, or
/// [`FusedAdamW`].
trait Stepper {
    fn step_with(&mut self, grads: &GradStore) -> Result<()>;
}

impl Stepper for AdamW {
    fn step_with(&mut self, grads: &GradStore) -> Result<()> {
        Ok(self.step(grads)?)
    }
}

/// AdamW with the same hyperparameters through `accel_kernels::adamw_step`.
struct FusedAdamW {
    params: Vec<Tensor>,
    m: Vec<Tensor>,
    v: Vec<Tensor>,
    hp: accel_core::kernels::AdamWParams,
    step: u64,
}

impl FusedAdamW {
    fn new(vars: Vec<candle_core::Var>, p: &ParamsAdamW) -> Result<Self> {
        let params: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
        let zeros = |ps: &[Tensor]| {
            ps.iter()
                .map(Tensor::zeros_like)
                .collect::<candle_core::Result<Vec<_>>>()
        };
        Ok(Self {
            m: zeros(&params)?,
            v: zeros(&params)?,
            params,
            hp: accel_core::kernels::AdamWParams {
                lr: p.lr,
                beta1: p.beta1,
                beta2: p.beta2,
                eps: p.eps,
                weight_decay: p.weight_decay,
            },
            step: 0,
        })
    }
}

impl Stepper for FusedAdamW {
    fn step_with(&mut self, grads: &GradStore) -> Result<()> {
        self.step += 1;
        let gs: Vec<Tensor> = self
            .params
            .iter()
            .map(|p| {
                grads
                    .get(p)
                    .cloned()
                    .ok_or_else(|| anyhow::anyhow!("a parameter has no gradient"))
            })
            .collect::<Result<_>>()?;
        accel_core::kernels::adamw_step(&self.params, &gs, &self.m, &self.v, self.step, &self.hp)?;
        Ok(())
    }
}

/// The optimizer `args` asks for over `vars`.
fn optimizer(args: &Args, vars: Vec<candle_core::Var>, p: ParamsAdamW) -> Result<Box<dyn Stepper>> {
    Ok(if args.fused_optimizer {
        Box::new(FusedAdamW::new(vars, &p)?)
    } else {
        Box::new(AdamW::new(vars, p)?)
    })
}

fn time_steps(
    steps: usize,
    mut loss_fn: impl FnMut() -> candle_core::Result<Tensor>,
    opt: &mut dyn Stepper,
) -> Result<(Phases, f32, f32)> {
    let mut p = Phases::default();
    let mut steps_s = Vec::with_capacity(steps);
    let mut first = f32::NAN;
    let mut last = f32::NAN;
    for step in 0..=steps {
        let t0 = Instant::now();
        let loss = loss_fn()?;
        let t1 = Instant::now();
        let grads = loss.backward()?;
        let t2 = Instant::now();
        opt.step_with(&grads)?;
        let t3 = Instant::now();
        last = loss.to_dtype(DType::F32)?.to_scalar::<f32>()?;
        let t4 = Instant::now();
        if step == 0 {
            first = last;
            continue;
        }
        p.fwd += (t1 - t0).as_secs_f64();
        p.bwd += (t2 - t1).as_secs_f64();
        p.opt += (t3 - t2).as_secs_f64();
        steps_s.push((t4 - t0).as_secs_f64());
    }
    let n = steps as f64;
    steps_s.sort_by(f64::total_cmp);
    let median_step = steps_s[steps_s.len() / 2];
    Ok((
        Phases {
            fwd: p.fwd / n,
            bwd: p.bwd / n,
            opt: p.opt / n,
            median_step,
        },
        first,
        last,
    ))
}

fn report(name: &str, p: &Phases, first: f32, last: f32, extra: serde_json::Value) {
    let total = p.fwd + p.bwd + p.opt;
    let mut v = serde_json::json!({
        "workload": name,
        "steps_per_s": 1.0 / total,
        "median_step_ms": p.median_step * 1e3,
        "median_steps_per_s": 1.0 / p.median_step,
        "fwd_ms": p.fwd * 1e3,
        "bwd_ms": p.bwd * 1e3,
        "opt_ms": p.opt * 1e3,
        "first_loss": first,
        "last_loss": last,
    });
    v.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    println!("{v}");
}

/// The AdamW settings of both workloads.
fn adamw_params() -> ParamsAdamW {
    ParamsAdamW {
        lr: 3e-4,
        weight_decay: 0.1,
        ..Default::default()
    }
}

/// Times the benchmark GPT on `dev` and prints its line.
fn profile_gpt(args: &Args, dev: &Device, device: &str, round: usize) -> Result<()> {
    let params = adamw_params();
    let cfg = GptConfig::bench();
    let (b, t) = (8, cfg.block_size);
    let map = VarMap::new();
    let mut gpt = Gpt::new(cfg, VarBuilder::from_varmap(&map, args.dtype, dev))?;
    gpt.set_fused_kernels(!args.composed);
    let tokens = text::synthetic_tokens(b * (t + 1), cfg.vocab_size, 0);
    let (x, y, n) = text::windows(&tokens, t, t + 1);
    assert_eq!(n, b);
    let x = Tensor::from_vec(x, (b, t), dev)?;
    let y = Tensor::from_vec(y, (b, t), dev)?;
    let mut opt = optimizer(args, map.all_vars(), params)?;
    let (p, first, last) = time_steps(args.steps, || gpt.loss(&x, &y), opt.as_mut())?;
    let extra = serde_json::json!({
        "batch": b, "block": t, "fused": !args.composed,
        "dtype": format!("{:?}", args.dtype), "params": cfg.num_params(),
        "device": device, "round": round,
        "optimizer": if args.fused_optimizer { "fused" } else { "candle" },
    });
    report("gpt_bench", &p, first, last, extra);
    Ok(())
}

fn main() -> Result<()> {
    accel_core::init_logging();
    let args = parse_args()?;
    let params = adamw_params();
    let names: Vec<&str> = match args.device.as_str() {
        "cuda-both" => vec!["cuda", "cuda-untracked", "cuda-untracked", "cuda"],
        one => vec![one],
    };
    let devices = names
        .iter()
        .map(|n| accel_examples::device_named(n))
        .collect::<Result<Vec<_>>>()
        .map_err(|e| anyhow::anyhow!("{e} (profile_gpt also takes cuda-both)"))?;
    let dev = devices[0].clone();

    if args.only.as_deref() != Some("mlp") {
        for (round, (name, d)) in names.iter().zip(&devices).enumerate() {
            profile_gpt(&args, d, name, round)?;
        }
    }

    if args.only.as_deref() != Some("gpt") {
        let batch = 64;
        let map = VarMap::new();
        let mlp = Mlp::new(
            &[784, 512, 512, 10],
            VarBuilder::from_varmap(&map, args.dtype, &dev),
        )?;
        let (x, y) = mnist_like::synthetic_classification(batch, 784, 10, 0);
        let x = Tensor::from_vec(x, (batch, 784), &dev)?.to_dtype(args.dtype)?;
        let y = Tensor::from_vec(y, batch, &dev)?;
        let mut opt = optimizer(&args, map.all_vars(), params)?;
        let (p, first, last) = time_steps(args.steps * 10, || mlp.loss(&x, &y), opt.as_mut())?;
        let extra = serde_json::json!({ "batch": batch, "dtype": format!("{:?}", args.dtype) });
        report("mlp_784_512_512_10", &p, first, last, extra);
    }
    Ok(())
}
