//! Fine-tune the character-level GPT with the high-level `Trainer`: the
//! embedded corpus split into training and evaluation text, evaluation with a
//! next-character accuracy metric, checkpoints, and `--resume`.
//!
//! ```text
//! cargo run --release --example finetune -- --max-steps 200
//! cargo run --release --example finetune -- --max-steps 300 --resume      # continue the run
//! accel launch --num_processes 2 --cpu target/release/examples/finetune   # data parallel
//! ```

use std::collections::BTreeMap;
use std::path::PathBuf;

use accel_core::prelude::{AnyBlock, Model, PrecisionType, TensorDataset};
use accel_core::trainer::{
    IntervalStrategy, Predictions, SchedulerType, TrainModel, Trainer, TrainingArguments,
};
use accel_examples::text::{windows, CharTokenizer, CORPUS};
use accel_examples::{Gpt, GptConfig};
use anyhow::Result;
use candle_core::{DType, Device, Tensor, D};
use clap::Parser;

#[derive(Parser, Debug)]
#[command(about = "Fine-tune a character-level GPT with the Trainer")]
struct Args {
    /// Optimizer steps to reach.
    #[arg(long, default_value_t = 200)]
    max_steps: i64,
    /// Windows per micro-batch and process.
    #[arg(long, default_value_t = 16)]
    batch_size: usize,
    /// Micro-batches per optimizer step.
    #[arg(long, default_value_t = 1)]
    gradient_accumulation_steps: usize,
    /// Peak learning rate.
    #[arg(long, default_value_t = 3e-3)]
    learning_rate: f64,
    /// no, bf16 or fp16; defaults to what `accel launch` exported, else no.
    #[arg(long)]
    mixed_precision: Option<PrecisionType>,
    /// Log the training loss every N steps.
    #[arg(long, default_value_t = 10)]
    logging_steps: u64,
    /// Evaluate every N steps.
    #[arg(long, default_value_t = 50)]
    eval_steps: u64,
    /// Save a checkpoint every N steps.
    #[arg(long, default_value_t = 50)]
    save_steps: u64,
    /// Keep at most this many checkpoints.
    #[arg(long, default_value_t = 2)]
    save_total_limit: usize,
    /// Run folder.
    #[arg(long, default_value = "runs/finetune")]
    output_dir: PathBuf,
    /// Seed of initialisation and data order.
    #[arg(long, default_value_t = 1337)]
    seed: u64,
    /// Continue from the newest checkpoint in the run folder.
    #[arg(long)]
    resume: bool,
    /// A smaller model (2 layers, width 64) for quick runs.
    #[arg(long)]
    tiny: bool,
    /// Hide the progress bar.
    #[arg(long)]
    disable_tqdm: bool,
    /// Shard the model (transformers' `fsdp` words), e.g. "full_shard auto_wrap":
    /// each block `h.*` becomes a unit.
    #[arg(long, default_value = "")]
    fsdp: String,
}

/// The GPT as a `TrainModel`: batches are (inputs, next characters). Under
/// FSDP the same forward runs sharded (hooks on the GPT's blocks).
struct CharLm(Gpt);

impl Model for CharLm {
    fn blocks(&self) -> Vec<&dyn AnyBlock> {
        self.0.blocks()
    }
}

impl TrainModel for CharLm {
    type Batch = Vec<Tensor>;

    fn loss(&self, b: &Vec<Tensor>) -> accel_core::Result<Tensor> {
        Ok(self.0.loss(&b[0], &b[1])?)
    }

    fn predictions(&self, b: &Vec<Tensor>) -> accel_core::Result<Option<Predictions>> {
        let logits = self.0.forward(&b[0])?;
        Ok(Some(Predictions {
            predictions: logits.argmax(D::Minus1)?,
            labels: b[1].clone(),
        }))
    }
}

/// Fraction of characters predicted exactly.
fn accuracy(p: &Predictions) -> accel_core::Result<BTreeMap<String, f64>> {
    let hits = p.predictions.eq(&p.labels)?.to_dtype(DType::F32)?;
    let acc = hits.mean_all()?.to_scalar::<f32>()? as f64;
    Ok(BTreeMap::from([("accuracy".to_string(), acc)]))
}

fn dataset(tok: &CharTokenizer, text: &str, block: usize) -> Result<TensorDataset> {
    let ids = tok.encode(text)?;
    let (x, y, n) = windows(&ids, block, block / 2);
    let x = Tensor::from_vec(x, (n, block), &Device::Cpu)?;
    let y = Tensor::from_vec(y, (n, block), &Device::Cpu)?;
    Ok(TensorDataset::new(vec![x, y])?)
}

fn main() -> Result<()> {
    let cli = Args::parse();
    let tok = CharTokenizer::new(CORPUS);
    let cfg = if cli.tiny {
        GptConfig {
            vocab_size: tok.vocab_size(),
            n_embd: 64,
            n_layer: 2,
            n_head: 2,
            block_size: 32,
        }
    } else {
        GptConfig::char_small(tok.vocab_size())
    };
    // Hold out the last tenth of the text, so evaluation windows never
    // overlap training windows.
    let chars: Vec<char> = CORPUS.chars().collect();
    let cut = chars.len() * 9 / 10;
    let train_text: String = chars[..cut].iter().collect();
    let eval_text: String = chars[cut..].iter().collect();
    let train = dataset(&tok, &train_text, cfg.block_size)?;
    let eval = dataset(&tok, &eval_text, cfg.block_size)?;

    let mut args = TrainingArguments::new(&cli.output_dir)
        .with_max_steps(cli.max_steps)
        .with_batch_size(cli.batch_size)
        .with_learning_rate(cli.learning_rate)
        .with_logging_steps(cli.logging_steps)
        .with_eval_strategy(IntervalStrategy::Steps, cli.eval_steps)
        .with_save_strategy(IntervalStrategy::Steps, cli.save_steps);
    args.run_name = "finetune".into();
    args.gradient_accumulation_steps = cli.gradient_accumulation_steps;
    // Unset: the Accelerator takes the launcher's precision, then `no`.
    args.mixed_precision = cli.mixed_precision;
    args.save_total_limit = Some(cli.save_total_limit);
    args.seed = cli.seed;
    args.weight_decay = 0.1;
    args.lr_scheduler_type = SchedulerType::Cosine;
    args.warmup_ratio = 0.1;
    args.use_cpu = true;
    args.disable_tqdm = cli.disable_tqdm;
    args.report_to = vec!["jsonl".into(), "tensorboard".into()];
    if cli.resume {
        args.resume_from_checkpoint = Some("latest".into());
    }

    args.fsdp = cli.fsdp.clone();
    args.fsdp_config.transformer_layer_cls_to_wrap = vec!["h.*".into()];
    let mut trainer = Trainer::new(args, |vb| Ok(CharLm(Gpt::new(cfg, vb)?)), train, Some(eval))?
        .with_compute_metrics(accuracy);
    let params = trainer.parameters().num_parameters();
    trainer.accelerator().print(format!(
        "GPT of {params} parameters, {} steps ({} an epoch) on {} process(es)",
        trainer.num_training_steps(),
        trainer.steps_per_epoch(),
        trainer.accelerator().num_processes(),
    ));
    let out = trainer.train()?;
    let eval = trainer.evaluate()?;
    trainer.save_model(cli.output_dir.join("model"))?;
    let result = serde_json::json!({
        "global_step": out.global_step,
        "training_loss": out.training_loss,
        "train": out.metrics,
        "eval": eval,
        "processes": trainer.accelerator().num_processes(),
    });
    trainer.accelerator().print(result);
    Ok(())
}
