//! The main job's program (`train_gpt`): a small character-level GPT on the
//! text embedded in this repository, with a progress bar, a falling loss,
//! trackers and a checkpoint at the end. Here so the integration tests can
//! run it as a binary of their own crate (`train_gpt_worker`).

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use accel_core::checkpoint::{Checkpointable, StateDict};

use crate::text::{windows, CharTokenizer, CORPUS};
use crate::{Gpt, GptConfig};
use accel_core::prelude::{
    Accelerator, AcceleratorConfig, AdamW, AdamWConfig, DataLoader, DataLoaderConfig, LrScheduler,
    PrecisionType, ProjectConfiguration, Schedule, TensorDataset,
};
use anyhow::Result;
use candle_core::{Device, Tensor};
use candle_nn::VarMap;
use clap::Parser;
use indicatif::{ProgressBar, ProgressStyle};

/// [`run`] as a process (see [`crate::exit_if_stopped`]).
pub fn main_with(args: &Args) -> Result<()> {
    crate::exit_if_stopped(run(args))
}

/// Optimizer steps taken, saved with each checkpoint (`custom_checkpoint_0`).
struct StepCount(u64);

impl Checkpointable for StepCount {
    fn state_dict(&self) -> accel_core::Result<StateDict> {
        Ok(StateDict::from_meta(serde_json::json!({ "step": self.0 })))
    }

    fn load_state_dict(&mut self, state: StateDict) -> accel_core::Result<()> {
        self.0 = state.meta["step"]
            .as_u64()
            .ok_or_else(|| accel_core::Error::Config {
                key: "custom_checkpoint_0 (train_gpt's step)".into(),
                reason: format!("no step count in {}", state.meta),
            })?;
        Ok(())
    }
}

fn lock(steps: &Mutex<StepCount>) -> std::sync::MutexGuard<'_, StepCount> {
    steps.lock().unwrap_or_else(|e| e.into_inner())
}

/// The command line of `train_gpt`.
#[derive(Parser, Debug)]
#[command(about = "Train a character-level GPT on the embedded corpus")]
pub struct Args {
    /// Optimizer steps to run.
    #[arg(long, default_value_t = 600)]
    pub steps: u64,
    /// Sequences per micro-batch.
    #[arg(long, default_value_t = 16)]
    pub batch_size: usize,
    /// Micro-batches per optimizer step.
    #[arg(long, default_value_t = 1)]
    pub gradient_accumulation_steps: usize,
    /// no, bf16 or fp16 [default: the launcher's ACCELERATE_MIXED_PRECISION, else no].
    #[arg(long)]
    pub mixed_precision: Option<PrecisionType>,
    /// Peak learning rate.
    #[arg(long, default_value_t = 3e-3)]
    pub lr: f64,
    /// Run folder: checkpoints, the final model and logs.
    #[arg(long, default_value = "runs/train_gpt")]
    pub out: PathBuf,
    /// Seed of initialisation and data order.
    #[arg(long, default_value_t = 1337)]
    pub seed: u64,
    /// Resume from the newest checkpoint in the run folder (automatic when
    /// `accel launch --max_restarts` starts the job again).
    #[arg(long)]
    pub resume: bool,
    /// Train on the CPU even when a GPU is available (Accelerate's `cpu=True`;
    /// `accel launch --cpu` sets it for every rank). Without it, a build with
    /// `--features cuda` trains on `cuda:LOCAL_RANK` when CUDA is available.
    #[arg(long)]
    pub cpu: bool,
    /// Save a checkpoint every N optimizer steps (0: only at the end).
    #[arg(long, default_value_t = 0)]
    pub checkpoint_every: u64,
    /// Every machine keeps its own copy of each checkpoint under `--out`
    /// (Accelerate's `save_on_each_node`: no shared storage needed).
    #[arg(long)]
    pub save_on_each_node: bool,
    /// Capture the step as a CUDA graph and replay it. Not built yet: says
    /// so at start-up and trains eagerly.
    #[arg(long)]
    pub cuda_graphs: bool,
}

/// Runs the job `args` describes.
///
/// # Errors
/// Whatever the Accelerator, the data or a checkpoint raises.
pub fn run(args: &Args) -> Result<()> {
    let mut project = ProjectConfiguration::automatic(&args.out)
        .with_total_limit(2)
        .with_save_on_each_node(args.save_on_each_node);
    // A second run in the same folder numbers its checkpoints after the
    // first's instead of refusing to overwrite them (as the Trainer does).
    let existing = accel_core::checkpoint::list_checkpoints(args.out.join("checkpoints"))?;
    project.iteration = existing.last().map_or(0, |(n, _)| n + 1);
    let mut config = AcceleratorConfig::default()
        .with_gradient_accumulation_steps(args.gradient_accumulation_steps)
        .with_seed(args.seed)
        .with_project(project)
        .with_log_with(["jsonl", "tensorboard"]);
    // Unset: Accelerator::new takes the launcher's precision, then `no`.
    config.mixed_precision = args.mixed_precision;
    if args.cpu {
        config = config.with_device(Device::Cpu);
    }
    let mut acc = Accelerator::new(config)?;
    crate::cuda_graphs_notice(args.cuda_graphs, acc.device());

    let tok = CharTokenizer::new(CORPUS);
    let cfg = GptConfig::char_small(tok.vocab_size());
    let ids = tok.encode(CORPUS)?;
    let (x, y, n) = windows(&ids, cfg.block_size, cfg.block_size / 2);
    let x = Tensor::from_vec(x, (n, cfg.block_size), acc.device())?;
    let y = Tensor::from_vec(y, (n, cfg.block_size), acc.device())?;
    let loader = DataLoader::new(
        TensorDataset::new(vec![x, y])?,
        DataLoaderConfig::new(args.batch_size)
            .with_shuffle(true)
            .with_drop_last(true),
    );

    let varmap = VarMap::new();
    let model = Gpt::new(cfg, acc.var_builder(&varmap))?;
    let params = acc.prepare_model(&varmap)?;
    let mut opt = acc.prepare_optimizer(
        &params,
        AdamW::new(AdamWConfig {
            lr: args.lr,
            weight_decay: 0.1,
            ..Default::default()
        }),
    );
    let schedule = Schedule::Cosine {
        warmup: args.steps / 10,
        total: args.steps,
    };
    let mut sched = acc.prepare_scheduler(LrScheduler::new(schedule, args.lr), &opt);
    let loader = acc.prepare_data_loader(loader);
    acc.init_trackers(
        "train_gpt",
        &serde_json::json!({
            "steps": args.steps, "batch_size": args.batch_size, "lr": args.lr,
            "mixed_precision": acc.mixed_precision().to_string(), "params": params.num_parameters(),
        }),
    )?;

    // The step count travels with the checkpoints. (The scheduler's count
    // is not it: it advances once per process per step, and not at all on
    // a step fp16 skips.)
    let steps = Arc::new(Mutex::new(StepCount(0)));
    acc.register_for_checkpointing(steps.clone());
    let mut step = 0u64;
    if args.resume {
        let dir = acc.load_state(None)?;
        step = lock(&steps).0;
        acc.print(format!("resumed from {} at step {step}", dir.display()));
    } else if acc.load_state_on_restart()?.is_some() {
        // Started again by `accel launch --max_restarts`: the newest
        // checkpoint, which makes the run end as an uninterrupted one does.
        step = lock(&steps).0;
    }
    acc.print(format!(
        "char-level GPT: {} parameters, vocab {}, {} windows of {} chars, {}",
        params.num_parameters(),
        tok.vocab_size(),
        n,
        cfg.block_size,
        acc.mixed_precision()
    ));

    // One bar for the job, drawn by the main process.
    let bar = if acc.is_main_process() {
        ProgressBar::new(args.steps).with_position(step)
    } else {
        ProgressBar::hidden()
    };
    bar.set_style(ProgressStyle::with_template(
        "{bar:40} {pos}/{len} [{elapsed_precise}<{eta_precise}] {msg}",
    )?);
    let mut smoothed: Option<f32> = None;
    let started = std::time::Instant::now();
    'train: loop {
        for batch in loader.iter() {
            let batch = batch?;
            let loss = acc.accumulate(|acc| {
                let loss = model.loss(&batch[0], &batch[1])?;
                acc.backward(&loss)?;
                if acc.sync_gradients() {
                    acc.clip_grad_norm(&params, 1.0)?;
                }
                opt.step()?;
                sched.step();
                opt.zero_grad();
                Ok(loss.to_scalar::<f32>()?)
            })?;
            if !acc.sync_gradients() {
                continue;
            }
            step += 1;
            let s = smoothed.map_or(loss, |s| 0.9 * s + 0.1 * loss);
            smoothed = Some(s);
            bar.set_position(step);
            bar.set_message(format!("loss {s:.3} lr {:.2e}", sched.lr()));
            acc.log([("loss", loss as f64), ("lr", sched.lr())], Some(step))?;
            lock(&steps).0 = step;
            if args.checkpoint_every > 0 && step.is_multiple_of(args.checkpoint_every) {
                acc.save_state(None)?;
            }
            if acc.should_stop()? {
                // Preempted (SIGTERM, or Ctrl-C passed on by `accel launch`):
                // this step's state, then out; `--resume` continues bitwise.
                let dir = acc.save_state(None)?;
                bar.abandon();
                acc.end_training()?;
                return Err(accel_core::Error::Stopped {
                    step,
                    checkpoint: dir,
                }
                .into());
            }
            if step >= args.steps {
                break 'train;
            }
        }
    }
    bar.finish();
    let secs = started.elapsed().as_secs_f64();
    let ckpt = acc.save_state(None)?;
    let files = acc.save_model(&params, args.out.join("model"), "10GB")?;
    // Only the main process writes the model; the others get an empty list.
    acc.end_training()?;
    let model_dir = args.out.join("model");
    acc.print(format!(
        "{:.1} steps/s; checkpoint {}; model {} ({} file(s))",
        step as f64 / secs,
        ckpt.display(),
        model_dir.display(),
        files.len()
    ));
    let prompt = tok.encode("The ")?;
    let text = model.generate(&prompt, 160, 0.8, acc.rng())?;
    acc.print(format!("sample: {:?}", tok.decode(&text)));
    Ok(())
}
