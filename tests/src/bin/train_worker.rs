//! A training process driven by the integration tests: trains the tiny job,
//! optionally saving or resuming, and prints its losses and final weights as
//! JSON so a test can compare runs bit for bit.

use std::path::PathBuf;

use accel_core::fsdp::{AutoWrapPolicy, FullyShardedDataParallelPlugin, StateDictType};
use accel_core::{Accelerator, AcceleratorConfig, PrecisionType, ProjectConfiguration};
use accel_tests::TinyJob;
use anyhow::Result;
use clap::Parser;

#[derive(Parser)]
struct Args {
    /// Run folder (automatic checkpoint naming under it).
    #[arg(long)]
    dir: PathBuf,
    /// Optimizer steps to reach.
    #[arg(long)]
    steps: u64,
    /// Resume from the newest checkpoint first.
    #[arg(long)]
    resume: bool,
    /// Save the state when done.
    #[arg(long)]
    save: bool,
    /// Save after every optimizer step, forever (for the kill test).
    #[arg(long)]
    save_forever: bool,
    /// Precision mode.
    #[arg(long, default_value = "no")]
    mixed_precision: PrecisionType,
    /// Micro-batches per step.
    #[arg(long, default_value_t = 2)]
    accumulation: usize,
    /// Windows per micro-batch and process.
    #[arg(long, default_value_t = 4)]
    batch_size: usize,
    /// Keep the learning rate constant (an Accelerate scheduler steps once per
    /// process per optimizer step, so schedules differ between world sizes).
    #[arg(long)]
    constant_lr: bool,
    /// Shard the model: FULL_SHARD, SHARD_GRAD_OP, SHARD_OPTIMIZER or NO_SHARD.
    #[arg(long)]
    fsdp: Option<String>,
    /// With --fsdp: wrap each transformer block `h.*` as a unit (else one root unit).
    #[arg(long)]
    wrap_blocks: bool,
    /// With --fsdp: write sharded checkpoints instead of full ones.
    #[arg(long)]
    sharded_state_dict: bool,
    /// With --fsdp: load these full weights into the shards first.
    #[arg(long)]
    init_from: Option<PathBuf>,
    /// Write the result JSON here (main process only) instead of stdout.
    #[arg(long)]
    out: Option<PathBuf>,
}

fn main() -> Result<()> {
    let args = Args::parse();
    let project = ProjectConfiguration::automatic(&args.dir).with_total_limit(3);
    let mut config = AcceleratorConfig::default()
        .with_seed(5)
        .with_mixed_precision(args.mixed_precision)
        .with_gradient_accumulation_steps(args.accumulation)
        .with_project(project);
    if let Some(strategy) = &args.fsdp {
        let mut plugin = FullyShardedDataParallelPlugin::new(strategy.parse()?);
        if args.wrap_blocks {
            plugin = plugin.with_auto_wrap_policy(AutoWrapPolicy::Transformer {
                patterns: vec!["h.*".into()],
            });
        }
        if args.sharded_state_dict {
            plugin = plugin.with_state_dict_type(StateDictType::ShardedStateDict);
        }
        config = config.with_fsdp(plugin);
    }
    let mut acc = Accelerator::new(config)?;
    let schedule = if args.constant_lr {
        accel_core::scheduler::Schedule::Constant
    } else {
        accel_tests::cosine()
    };
    let mut job = TinyJob::new(&mut acc, 600, args.batch_size, schedule)?;
    if let Some(path) = &args.init_from {
        job.params.load_checkpoint(path)?;
    }
    let mut done = 0;
    if args.resume {
        acc.load_state(None)?;
        done = acc.gradient_state().step() / args.accumulation as u64;
    }
    if args.save_forever {
        loop {
            job.train(&mut acc, done, done + 1)?;
            done += 1;
            acc.save_state(None)?;
            println!("saved {done}");
        }
    }
    let losses = job.train(&mut acc, done, args.steps)?;
    if args.save {
        acc.save_state(None)?;
    }
    let weights: serde_json::Map<String, serde_json::Value> = job
        .params
        .full_weights()?
        .into_iter()
        .map(|(n, t)| {
            let bits: Vec<u32> = t
                .flatten_all()?
                .to_vec1::<f32>()?
                .iter()
                .map(|x| x.to_bits())
                .collect();
            Ok((n, serde_json::json!(bits)))
        })
        .collect::<Result<_>>()?;
    let losses: Vec<u32> = losses.iter().map(|x| x.to_bits()).collect();
    let result = serde_json::json!({
        "losses": losses,
        "weights": weights,
        "position": job.loader.position().batch,
        "epoch": job.loader.epoch(),
    });
    match (&args.out, acc.is_main_process()) {
        (Some(path), true) => std::fs::write(path, result.to_string())?,
        (None, _) => println!("{result}"),
        (Some(_), false) => {}
    }
    Ok(())
}
