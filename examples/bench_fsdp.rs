//! Memory and speed of DDP versus ZeRO-1/2/3 (`SHARD_OPTIMIZER`,
//! `SHARD_GRAD_OP`, `FULL_SHARD`) at 2 ranks on a ~100M-parameter GPT
//! (vocab 16384, d 768, 12 layers, 12 heads, context 64), AdamW, batch 2.
//!
//! The parent launches the ranks of each variant in turn (real processes on
//! loopback) and prints one JSON object: per variant and rank, the peak RSS
//! of the whole run and of the training steps alone (`VmHWM`, reset after
//! the first step), the bytes of parameters + gradients + optimizer state
//! the rank holds, steps/s and the last loss; and the ZeRO/DDP ratios.
//!
//! ```text
//! cargo run --release --example bench_fsdp -- --json
//! ```

use std::path::{Path, PathBuf};
use std::time::Instant;

use accel_core::dist::launch::{plan, run, LaunchConfig, RunOptions};
use accel_core::fsdp::{AutoWrapPolicy, FullyShardedDataParallelPlugin};
use accel_core::prelude::{Accelerator, AcceleratorConfig, AdamW, AdamWConfig};
use accel_examples::text::synthetic_tokens;
use accel_examples::{Gpt, GptConfig};
use anyhow::{Context, Result};
use candle_core::Tensor;
use candle_nn::VarMap;
use clap::Parser;
use serde_json::{json, Value};

#[derive(Parser, Debug)]
struct Args {
    /// Print only the JSON object.
    #[arg(long)]
    json: bool,
    /// Timed optimizer steps per variant (after one warm-up step).
    #[arg(long, default_value_t = 3)]
    steps: usize,
    /// Ranks.
    #[arg(long, default_value_t = 2)]
    world_size: usize,
    /// Layers of the model (12 gives ~98M parameters).
    #[arg(long, default_value_t = 12)]
    layers: usize,
    /// Variants, comma-separated: ddp, SHARD_OPTIMIZER, SHARD_GRAD_OP, FULL_SHARD.
    #[arg(long, default_value = "ddp,SHARD_OPTIMIZER,SHARD_GRAD_OP,FULL_SHARD")]
    variants: String,
    /// Internal: run as one rank of `variant`, writing to this folder.
    #[arg(long, hide = true)]
    worker: Option<PathBuf>,
    /// Internal: the variant a worker runs.
    #[arg(long, hide = true, default_value = "ddp")]
    variant: String,
}

fn model_config(layers: usize) -> GptConfig {
    GptConfig {
        vocab_size: 16384,
        n_embd: 768,
        n_layer: layers,
        n_head: 12,
        block_size: 64,
    }
}

fn main() -> Result<()> {
    accel_core::init_logging();
    let args = Args::parse();
    if let Some(dir) = &args.worker {
        return worker(&args, dir);
    }
    let tmp = std::env::temp_dir().join(format!("bench_fsdp_{}", std::process::id()));
    let mut variants = serde_json::Map::new();
    for variant in args.variants.split(',') {
        let dir = tmp.join(variant);
        std::fs::create_dir_all(&dir)?;
        let mut config = LaunchConfig::local(args.world_size, std::env::current_exe()?);
        config.args = [
            "--worker",
            &dir.display().to_string(),
            "--variant",
            variant,
            "--steps",
            &args.steps.to_string(),
            "--layers",
            &args.layers.to_string(),
        ]
        .iter()
        .map(Into::into)
        .collect();
        run(&plan(&config)?, &RunOptions::default())
            .with_context(|| format!("variant {variant}"))?;
        let ranks: Vec<Value> = (0..args.world_size)
            .map(|r| read_json(&dir.join(format!("rank{r}.json"))))
            .collect::<Result<_>>()?;
        variants.insert(variant.to_string(), json!({ "ranks": ranks }));
    }
    let _ = std::fs::remove_dir_all(&tmp);
    let max_of = |v: &Value, key: &str| -> f64 {
        v["ranks"]
            .as_array()
            .map(|r| r.iter().filter_map(|x| x[key].as_f64()).fold(0.0, f64::max))
            .unwrap_or(0.0)
    };
    let mut ratios = serde_json::Map::new();
    if let Some(ddp) = variants.get("ddp").cloned() {
        for (name, v) in &variants {
            if name == "ddp" {
                continue;
            }
            ratios.insert(
                name.clone(),
                json!({
                    "state_bytes_vs_ddp": max_of(v, "state_bytes") / max_of(&ddp, "state_bytes"),
                    "train_peak_rss_vs_ddp": max_of(v, "train_peak_rss_bytes") / max_of(&ddp, "train_peak_rss_bytes"),
                    "peak_rss_vs_ddp": max_of(v, "peak_rss_bytes") / max_of(&ddp, "peak_rss_bytes"),
                }),
            );
        }
    }
    let cfg = model_config(args.layers);
    let out = json!({
        "model": format!("gpt v{} d{} l{} h{} t{}", cfg.vocab_size, cfg.n_embd, cfg.n_layer, cfg.n_head, cfg.block_size),
        "parameters": cfg.num_params(),
        "world_size": args.world_size,
        "batch_size": 2,
        "variants": variants,
        "ratios_vs_ddp": ratios,
    });
    if args.json {
        println!("{out}");
    } else {
        println!("{}", serde_json::to_string_pretty(&out)?);
    }
    Ok(())
}

fn read_json(path: &Path) -> Result<Value> {
    let text = std::fs::read_to_string(path).with_context(|| path.display().to_string())?;
    Ok(serde_json::from_str(&text)?)
}

/// `VmHWM` / `VmRSS` of this process in bytes.
fn status_bytes(key: &str) -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find(|l| l.starts_with(key))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|kb| kb.parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

fn worker(args: &Args, dir: &Path) -> Result<()> {
    let cfg = model_config(args.layers);
    let mut config = AcceleratorConfig::default().with_seed(0);
    let sharded = args.variant != "ddp";
    if sharded {
        config = config.with_fsdp(
            FullyShardedDataParallelPlugin::new(args.variant.parse()?).with_auto_wrap_policy(
                AutoWrapPolicy::Transformer {
                    patterns: vec!["h.*".into()],
                },
            ),
        );
    }
    let mut acc = Accelerator::new(config)?;
    let (model, params, fsdp) = if sharded {
        let (model, fsdp) = acc.prepare_fsdp_model(|vb| Gpt::new(cfg, vb))?;
        (model, fsdp.params().clone(), Some(fsdp))
    } else {
        let varmap = VarMap::new();
        let model = Gpt::new(cfg, acc.var_builder(&varmap))?;
        (model, acc.prepare_model(&varmap)?, None)
    };
    let mut opt = acc.prepare_optimizer(&params, AdamW::new(AdamWConfig::default()));
    let (b, t) = (2, cfg.block_size);
    let rank = acc.process_index();
    let ids = synthetic_tokens(
        (args.steps + 1) * b * (t + 1),
        cfg.vocab_size,
        7 + rank as u64,
    );
    let mut step = |i: usize, acc: &mut Accelerator| -> Result<f32> {
        let window = &ids[i * b * (t + 1)..(i + 1) * b * (t + 1)];
        let x: Vec<u32> = window.chunks(t + 1).flat_map(|w| w[..t].to_vec()).collect();
        let y: Vec<u32> = window.chunks(t + 1).flat_map(|w| w[1..].to_vec()).collect();
        let x = Tensor::from_vec(x, (b, t), acc.device())?;
        let y = Tensor::from_vec(y, (b, t), acc.device())?;
        let loss = model.loss(&x, &y)?;
        acc.backward(&loss)?;
        opt.step()?;
        opt.zero_grad();
        Ok(loss.to_scalar::<f32>()?)
    };
    step(0, &mut acc)?;
    let startup_peak = status_bytes("VmHWM:");
    // The training peak, apart from start-up: reset VmHWM to the current RSS.
    let reset = std::fs::write("/proc/self/clear_refs", "5").is_ok();
    acc.wait_for_everyone()?;
    let start = Instant::now();
    let mut loss = 0.0;
    for i in 1..=args.steps {
        loss = step(i, &mut acc)?;
    }
    acc.wait_for_everyone()?;
    let secs = start.elapsed().as_secs_f64();
    // Parameters + gradients + AdamW moments this rank holds, in fp32, plus
    // the full parameters ZeRO-1 keeps.
    let local = params.num_parameters();
    let resident = fsdp
        .as_ref()
        .map_or(0, |f| f.resident_full_parameter_bytes());
    let state_bytes = 4 * local * 4 + resident;
    let result = json!({
        "rank": rank,
        "local_parameters": local,
        "state_bytes": state_bytes,
        "peak_rss_bytes": startup_peak.max(status_bytes("VmHWM:")),
        "train_peak_rss_bytes": if reset { status_bytes("VmHWM:") } else { 0 },
        "rss_bytes": status_bytes("VmRSS:"),
        "steps_per_s": args.steps as f64 / secs,
        "last_loss": loss,
    });
    std::fs::write(dir.join(format!("rank{rank}.json")), result.to_string())?;
    Ok(())
}
