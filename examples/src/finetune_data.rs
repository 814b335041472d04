//! `finetune_hf --data FILE`: fine-tuning on a JSON Lines dataset
//! ([`JsonlDataset`]) instead of one fixed batch. Each step takes the next
//! batch of windows of this rank's share (a new shuffled epoch when one
//! runs out); the printed loss is the mean over every rank's counted tokens.

use std::io::Write;

use accel_core::data::{DataLoader, DataLoaderConfig, Dataset, JsonlDataset, JsonlOptions, IGNORE};
use accel_core::models::{AutoModel, ModelConfig, Tokenizer};
use accel_core::nn::layers::LoraSpec;
use accel_core::optim::{AdamW, AdamWConfig};
use accel_core::{Accelerator, AcceleratorConfig};
use anyhow::{Context, Result};
use candle_core::{DType, Tensor};
use serde_json::json;

use crate::finetune_hf::{
    decoder_vocab, global_mean, prepare_model, print_step, save_and_end, setup_line, Args,
};

/// Positions whose next-token label the loss counts: labels `[1..]` not ignored.
fn counted(labels: &Tensor) -> Result<f64> {
    let rows: Vec<Vec<u32>> = labels.to_vec2()?;
    Ok(rows
        .iter()
        .map(|r| r.iter().skip(1).filter(|&&l| l != IGNORE).count())
        .sum::<usize>() as f64)
}

fn loss_of(model: &AutoModel, batch: &[Tensor]) -> Result<(Tensor, f64)> {
    Ok((model.loss(&batch[0], &batch[1])?, counted(&batch[1])?))
}

/// Runs `finetune_hf` on `args.data`.
///
/// # Errors
/// A bad dataset (named with its file and line), model or flag; a failed step.
pub fn run(
    args: &Args,
    cfg: &ModelConfig,
    lora: Option<&LoraSpec>,
    quantize: Option<accel_core::bigmodel::quant::QuantizeOnLoad>,
    config: AcceleratorConfig,
    out: &mut dyn Write,
) -> Result<()> {
    let path = args
        .data
        .as_ref()
        .context("--data or --data-ids is required")?;
    let vocab = decoder_vocab(cfg, &args.model)?;
    let tokenizer = Tokenizer::for_model(&args.model, vocab)?;
    let eos = match cfg {
        ModelConfig::Llama(c) => c.eos_token_ids.first().copied(),
        ModelConfig::Gemma3(c) => c.eos_token_ids.first().copied(),
        ModelConfig::Gpt2(c) => c.eos_token_id,
        ModelConfig::Bert(_) => None,
    };
    let options = JsonlOptions {
        seq_len: args.seq_len,
        packing: !args.no_packing,
        eos_token_id: eos,
        pad_token_id: eos.unwrap_or(0),
        // Only chat examples need it; without one they are an error naming the line.
        chat: accel_core::data::ChatTemplate::from_folder(&args.model).ok(),
    };
    let mut acc = Accelerator::new(config)?;
    crate::cuda_graphs_notice(args.cuda_graphs, acc.device());
    let data = JsonlDataset::open(path, &tokenizer, &options, acc.device())?;
    let (train, eval) = data.split(args.eval_fraction, args.seed)?;
    let windows = train.len();
    let loader = DataLoader::new(
        train,
        DataLoaderConfig::new(args.batch_size).with_shuffle(true),
    );
    let loader = acc.prepare_data_loader(loader);
    let (model, params, sharding) = prepare_model(
        &mut acc,
        cfg,
        &args.model,
        lora,
        quantize,
        args.gradient_checkpointing,
    )?;
    let mut opt = acc.prepare_optimizer(
        &params,
        AdamW::new(AdamWConfig {
            lr: args.lr,
            weight_decay: 0.0,
            ..Default::default()
        }),
    );
    let main = acc.is_main_process();
    let world = acc.num_processes();
    let extra = format!(
        r#", "train_windows": {windows}, "eval_windows": {}, "seq_len": {}"#,
        eval.len(),
        args.seq_len
    );
    let tokens = args.batch_size * args.seq_len * world;
    let setup = setup_line(&acc, &params, args, &sharding, tokens, &extra)?;
    if main {
        if args.json {
            writeln!(out, "{setup}")?;
        } else {
            writeln!(
                out,
                "{} on {} from {}: {world} process(es), {}, {windows} training windows of {} tokens",
                args.model.display(),
                acc.distributed_type(),
                path.display(),
                acc.mixed_precision(),
                args.seq_len
            )?;
        }
    }
    let mut epoch = loader.iter();
    for step in 1..=args.steps {
        let batch = match epoch.next() {
            Some(b) => b?,
            None => {
                epoch = loader.iter();
                epoch
                    .next()
                    .context("an epoch of the training data has no batch")??
            }
        };
        let (loss, tokens) = loss_of(&model, &batch)?;
        let whole = global_mean(&acc, &loss, tokens)?;
        acc.backward(&loss)?;
        opt.step()?;
        opt.zero_grad();
        if main {
            print_step(out, args.json, step, whole)?;
        }
    }
    if !eval.is_empty() {
        if let Some(spec) = lora {
            // Evaluation: no adapter dropout.
            spec.set_training(false);
        }
        // Every rank evaluates the whole held-out set; the mean is the same.
        let all: Vec<usize> = (0..eval.len()).collect();
        let (mut sum, mut count) = (0.0, 0.0);
        for rows in all.chunks(args.batch_size) {
            let batch = eval.get_batch(rows)?;
            let (loss, tokens) = loss_of(&model, &batch)?;
            sum += loss.to_dtype(DType::F64)?.to_scalar::<f64>()? * tokens;
            count += tokens;
        }
        if main {
            let eval_loss = sum / count;
            if args.json {
                writeln!(out, r#"{{"eval_loss": {}}}"#, json!(eval_loss))?;
            } else {
                writeln!(out, "eval loss {eval_loss:.6}")?;
            }
        }
    }
    save_and_end(&mut acc, &params, args)
}
