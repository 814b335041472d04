//! Fine-tune the character-level GPT with the high-level `Trainer`: the
//! embedded corpus split into training and evaluation text, evaluation with a
//! next-character accuracy metric, checkpoints, and `--resume`.
//!
//! ```text
//! cargo run --release --example finetune -- --max-steps 200
//! cargo run --release --example finetune -- --max-steps 300 --resume      # continue the run
//! accel launch --num_processes 2 --cpu target/release/examples/finetune   # data parallel
//! cargo run --release --example finetune -- --model tests/fixtures/hf/llama --max-steps 50
//! ```
//!
//! With `--model DIR` it fine-tunes a Hugging Face causal LM folder instead
//! (llama, mistral, qwen2, qwen3, phi3, mixtral, qwen3_moe, gemma3, gpt2), starting from its weights, on the corpus
//! tokenised by the folder's `tokenizer.json`; `--fsdp` then wraps each of
//! its decoder layers (`LlamaDecoderLayer`, `GPT2Block`).

use std::collections::BTreeMap;
use std::path::PathBuf;

use accel_core::data::{ChatTemplate, Dataset, JsonlDataset, JsonlOptions, IGNORE};
use accel_core::models::{ModelConfig, Tokenizer};
use accel_core::prelude::{AnyBlock, Model, PrecisionType, TensorDataset};
use accel_core::trainer::{
    IntervalStrategy, Predictions, SchedulerType, TrainModel, Trainer, TrainingArguments,
};
use accel_examples::finetune_hf::read_batch;
use accel_examples::hf::HfLm;
use accel_examples::text::{windows, CharTokenizer, CORPUS};
use accel_examples::{Gpt, GptConfig};
use anyhow::{Context, Result};
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
    /// Fine-tune this Hugging Face causal LM folder (config.json, safetensors,
    /// tokenizer.json) from its weights instead of the character-level GPT.
    #[arg(long)]
    model: Option<PathBuf>,
    /// With --model: train on these token ids (a JSON array of equal-length
    /// sequences; the last tenth, at least one, held out) instead of the
    /// corpus through tokenizer.json.
    #[arg(long, requires = "model", conflicts_with = "data")]
    data_ids: Option<PathBuf>,
    /// With --model: train on this JSON Lines file (`{"text"}`, `{"prompt", "completion"}` or
    /// chat `{"messages"}` examples; see finetune_hf) in windows of the model's block size,
    /// `--eval-fraction` of them held out.
    #[arg(long, requires = "model")]
    data: Option<PathBuf>,
    /// With --data: the fraction of windows held out for evaluation.
    #[arg(long, default_value_t = 0.1)]
    eval_fraction: f64,
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

/// Fraction of tokens predicted exactly, over the positions the loss counts
/// (labels other than `IGNORE`).
fn accuracy(p: &Predictions) -> accel_core::Result<BTreeMap<String, f64>> {
    let predicted = p.predictions.flatten_all()?.to_vec1::<u32>()?;
    let labels = p.labels.flatten_all()?.to_vec1::<u32>()?;
    let (mut hits, mut counted) = (0usize, 0usize);
    for (p, l) in predicted.iter().zip(&labels) {
        if *l != IGNORE {
            counted += 1;
            hits += usize::from(p == l);
        }
    }
    let acc = hits as f64 / counted.max(1) as f64;
    Ok(BTreeMap::from([("accuracy".to_string(), acc)]))
}

fn dataset(tok: &CharTokenizer, text: &str, block: usize) -> Result<TensorDataset> {
    let ids = tok.encode(text)?;
    let (x, y, n) = windows(&ids, block, block / 2);
    let x = Tensor::from_vec(x, (n, block), &Device::Cpu)?;
    let y = Tensor::from_vec(y, (n, block), &Device::Cpu)?;
    Ok(TensorDataset::new(vec![x, y])?)
}

/// The corpus split at nine tenths, so evaluation windows never overlap
/// training windows.
fn split_corpus() -> (String, String) {
    let chars: Vec<char> = CORPUS.chars().collect();
    let cut = chars.len() * 9 / 10;
    (chars[..cut].iter().collect(), chars[cut..].iter().collect())
}

/// Windows of `block` token ids (stride `block / 2`) as one-tensor samples.
fn id_windows(ids: &[u32], block: usize) -> Result<TensorDataset> {
    anyhow::ensure!(
        ids.len() > block,
        "{} tokens are too few for windows of {block}",
        ids.len()
    );
    let starts: Vec<usize> = (0..=ids.len() - block).step_by(block / 2).collect();
    let rows: Vec<u32> = starts
        .iter()
        .flat_map(|&s| ids[s..s + block].to_vec())
        .collect();
    let x = Tensor::from_vec(rows, (starts.len(), block), &Device::Cpu)?;
    Ok(TensorDataset::new(vec![x])?)
}

/// Equal-length id sequences as one-tensor samples.
fn rows(seqs: &[Vec<u32>]) -> Result<TensorDataset> {
    let len = seqs[0].len();
    let x = Tensor::from_vec(seqs.concat(), (seqs.len(), len), &Device::Cpu)?;
    Ok(TensorDataset::new(vec![x])?)
}

fn training_arguments(cli: &Args) -> TrainingArguments {
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
    args
}

/// Trains, evaluates and saves, then prints the result (main process).
fn finish<M: TrainModel<Batch = Vec<Tensor>>, D: Dataset<Batch = Vec<Tensor>>>(
    mut trainer: Trainer<M, D>,
    cli: &Args,
    what: &str,
) -> Result<()> {
    let params = trainer.parameters().num_parameters();
    trainer.accelerator().print(format!(
        "{what}: {params} parameters, {} steps ({} an epoch) on {} process(es)",
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

/// `--model DIR`: the folder's causal LM from its weights, on the corpus in
/// its own tokens.
fn finetune_hf(cli: &Args, dir: &std::path::Path) -> Result<()> {
    let cfg = ModelConfig::from_path(dir)?;
    let (vocab, positions) = match &cfg {
        ModelConfig::Llama(c) => (c.vocab_size, c.max_position_embeddings),
        ModelConfig::Gemma3(c) => (c.vocab_size, c.max_position_embeddings),
        ModelConfig::Gpt2(c) => (c.vocab_size, c.n_positions),
        ModelConfig::Bert(_) => anyhow::bail!(
            "{}: model_type bert is an encoder without a language-model head; --model takes \
             a causal language model (llama, mistral, qwen2, qwen3, phi3, mixtral, qwen3_moe, \
             gemma2, gemma3_text, gpt2)",
            dir.display()
        ),
    };
    let mut args = training_arguments(cli);
    let probe = accel_core::models::AutoModel::empty(dir, DType::F32)?;
    args.fsdp_config.transformer_layer_cls_to_wrap = vec![probe.layer_class().into()];
    drop(probe);
    let block = positions.min(if cli.tiny { 32 } else { 128 });
    // Pretrained weights as the fp32 masters and compute copies (or the
    // FSDP shards); a --resume then continues from its checkpoint instead.
    let build = |vb| HfLm::new(&cfg, vb);
    if let Some(file) = &cli.data {
        let tok = Tokenizer::for_model(dir, vocab)?;
        let eos = match &cfg {
            ModelConfig::Llama(c) => c.eos_token_ids.first().copied(),
            ModelConfig::Gemma3(c) => c.eos_token_ids.first().copied(),
            ModelConfig::Gpt2(c) => c.eos_token_id,
            ModelConfig::Bert(_) => None,
        };
        let options = JsonlOptions {
            seq_len: block,
            packing: true,
            eos_token_id: eos,
            pad_token_id: eos.unwrap_or(0),
            chat: ChatTemplate::from_folder(dir).ok(),
        };
        let data = JsonlDataset::open(file, &tok, &options, &Device::Cpu)?;
        let (train, eval) = data.split(cli.eval_fraction, cli.seed)?;
        let trainer = Trainer::from_pretrained(args, dir, build, train, Some(eval))?
            .with_compute_metrics(accuracy);
        return finish(
            trainer,
            cli,
            &format!("{} on {}", dir.display(), file.display()),
        );
    }
    let (train, eval, source) = match &cli.data_ids {
        Some(file) => {
            let seqs = read_batch(file, vocab)?;
            anyhow::ensure!(
                seqs.len() >= 2,
                "{}: need at least 2 sequences (one held out)",
                file.display()
            );
            let held = (seqs.len() / 10).max(1);
            let (train, eval) = seqs.split_at(seqs.len() - held);
            (rows(train)?, rows(eval)?, file.display().to_string())
        }
        None => {
            let tok = Tokenizer::for_model(dir, vocab).with_context(|| {
                format!(
                    "{}: no usable tokenizer.json; pass --data-ids FILE",
                    dir.display()
                )
            })?;
            let (train_text, eval_text) = split_corpus();
            let train = id_windows(&tok.encode(&train_text, false)?, block)?;
            let eval = id_windows(&tok.encode(&eval_text, false)?, block)?;
            (train, eval, tok.path().display().to_string())
        }
    };
    let trainer = Trainer::from_pretrained(args, dir, build, train, Some(eval))?
        .with_compute_metrics(accuracy);
    finish(trainer, cli, &format!("{} on {source}", dir.display()))
}

fn main() -> Result<()> {
    accel_core::init_logging();
    accel_examples::exit_if_stopped(run())
}

fn run() -> Result<()> {
    let cli = Args::parse();
    if let Some(dir) = cli.model.clone() {
        return finetune_hf(&cli, &dir);
    }
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
    let (train_text, eval_text) = split_corpus();
    let train = dataset(&tok, &train_text, cfg.block_size)?;
    let eval = dataset(&tok, &eval_text, cfg.block_size)?;
    let mut args = training_arguments(&cli);
    args.fsdp_config.transformer_layer_cls_to_wrap = vec!["h.*".into()];
    let trainer = Trainer::new(args, |vb| Ok(CharLm(Gpt::new(cfg, vb)?)), train, Some(eval))?
        .with_compute_metrics(accuracy);
    finish(trainer, &cli, "GPT")
}
