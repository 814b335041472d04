//! Fine-tuning a Hugging Face causal language model folder on a fixed batch
//! of token ids: the `finetune_hf` example, kept in the library so the
//! integration tests can run the very same code as a binary of their own.
//!
//! The model is built with [`Accelerator::prepare`], so one program runs
//! plain, data-parallel under `accel launch` or sharded under a config file
//! with `distributed_type: FSDP`, and starts from the folder's weights in
//! every precision ([`Accelerator::prepare_pretrained`]). The batch is split
//! across the ranks as Accelerate's `split_batches` does, and the loss each
//! step prints is that of the whole batch, so every way of running prints
//! the same numbers.

use std::io::Write;
use std::path::{Path, PathBuf};

use accel_core::bigmodel::lora::{adapter_module, LoraConfig, LoraTargets, LORA_A};
use accel_core::bigmodel::quant::{quant_state_name, QuantType};
use accel_core::dist::ReduceOp;
use accel_core::fsdp::FullyShardedDataParallelPlugin;
use accel_core::models::{AutoModel, ModelConfig};
use accel_core::nn::block::apply_activation_checkpointing;
use accel_core::nn::layers::LoraSpec;
use accel_core::optim::{AdamW, AdamWConfig};
use accel_core::{Accelerator, AcceleratorConfig, PrecisionType, PreparedModel};
use anyhow::{bail, Context, Result};
use candle_core::{DType, Tensor};
use clap::Parser;
use serde_json::{json, Value};

/// `finetune_hf`'s flags.
#[derive(Parser, Debug, Clone)]
#[command(
    about = "Fine-tune a Hugging Face causal LM folder (llama, mistral, qwen2, qwen3, phi3, mixtral, qwen3_moe, gemma3, gpt2) on a fixed batch of token ids",
    long_about = "Fine-tune a Hugging Face causal LM folder (llama, mistral, qwen2, qwen3, phi3, mixtral, qwen3_moe, gemma3, gpt2) on a fixed \
batch of token ids with AdamW (betas 0.9/0.999, eps 1e-8, weight decay 0, constant learning rate). \
Every step trains on the whole batch; under `accel launch` each rank takes its contiguous share \
(Accelerate's split_batches), and the printed loss is the mean next-token cross-entropy of the whole \
batch before the step's update. Plain, MULTI_CPU/MULTI_GPU and FSDP (distributed_type: FSDP in the \
launcher's config file) runs print the same losses."
)]
pub struct Args {
    /// Checkpoint folder: config.json and model.safetensors (or shards with an
    /// index), or a Hugging Face model id (`org/name`).
    #[arg(long)]
    pub model: PathBuf,
    /// A model id's revision (branch, tag or commit) when `--model` is a
    /// Hugging Face Hub id rather than a folder.
    #[arg(long)]
    pub revision: Option<String>,
    /// JSON file: an array of equal-length token-id sequences, the batch of every step.
    #[arg(long, required_unless_present = "data", conflicts_with = "data")]
    pub data_ids: Option<PathBuf>,
    /// JSON Lines file of examples, `{"text": ...}`, `{"prompt": ..., "completion": ...}`
    /// (loss on the completion) or `{"messages": [...]}` (the folder's chat template; loss on
    /// the assistant's turns), tokenized with the folder's tokenizer.json; batches of
    /// `--batch-size` windows, shuffled per epoch with the seed and split across ranks.
    #[arg(long)]
    pub data: Option<PathBuf>,
    /// Tokens per window of `--data`.
    #[arg(long, default_value_t = 512)]
    pub seq_len: usize,
    /// Truncate or pad each `--data` example to a window instead of packing them end to end.
    #[arg(long)]
    pub no_packing: bool,
    /// Windows of `--data` held out; their mean loss is printed after training.
    #[arg(long, default_value_t = 0.0)]
    pub eval_fraction: f64,
    /// Windows per step and process with `--data`.
    #[arg(long, default_value_t = 8)]
    pub batch_size: usize,
    /// Seed of the shuffle and the held-out split.
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
    /// Optimizer steps to run.
    #[arg(long, default_value_t = 10)]
    pub steps: u64,
    /// AdamW learning rate (constant; weight decay 0).
    #[arg(long, default_value_t = 1e-3)]
    pub lr: f64,
    /// no, bf16 or fp16 [default: the launcher's ACCELERATE_MIXED_PRECISION, else no].
    #[arg(long)]
    pub mixed_precision: Option<PrecisionType>,
    /// Print one JSON object per line: the setup, then `{"step": k, "loss": f}` per step.
    #[arg(long)]
    pub json: bool,
    /// Save the fine-tuned model here as a Hugging Face folder: the weights in
    /// the source's dtype, its config.json, generation_config.json and tokenizer files.
    #[arg(long)]
    pub output_dir: Option<PathBuf>,
    /// Shard the saved weights past this size, with an index (save_pretrained's default).
    #[arg(long, default_value = "5GB")]
    pub max_shard_size: String,
    /// Train LoRA adapters of this rank instead of the whole model (PEFT's `r`);
    /// the base stays frozen and `--output-dir` gets a PEFT adapter folder.
    #[arg(long)]
    pub lora_r: Option<usize>,
    /// LoRA's alpha: updates are scaled by alpha / r.
    #[arg(long, default_value_t = 8.0, requires = "lora_r")]
    pub lora_alpha: f64,
    /// Dropout on the adapters' input while training.
    #[arg(long, default_value_t = 0.0, requires = "lora_r")]
    pub lora_dropout: f32,
    /// Recompute each decoder layer in backward instead of keeping its activations
    /// (transformers' gradient_checkpointing_enable; under FSDP, each unit).
    #[arg(long)]
    pub gradient_checkpointing: bool,
    /// Modules that get adapters, as PEFT names them (q_proj,v_proj), or all-linear
    /// [default: PEFT's for the architecture: q_proj,v_proj; c_attn for gpt2].
    #[arg(long, requires = "lora_r")]
    pub lora_target: Option<String>,
    /// Capture the step as a CUDA graph and replay it. Not built yet: says
    /// so at start-up and trains eagerly.
    #[arg(long)]
    pub cuda_graphs: bool,
    /// The base's linear layers quantized as they load (QLoRA with `--lora-r`).
    #[command(flatten)]
    pub quant: crate::hf::QuantFlags,
}

impl Args {
    /// The LoRA adapters the flags ask for, set on `cfg`, if any.
    ///
    /// # Errors
    /// A bad `--lora-target`.
    pub(crate) fn lora(&self, cfg: &mut ModelConfig) -> Result<Option<LoraSpec>> {
        let Some(r) = self.lora_r else {
            return Ok(None);
        };
        // PEFT's default target modules per architecture.
        let default = match cfg {
            ModelConfig::Gpt2(_) => "c_attn".to_string(),
            ModelConfig::Bert(_) => "query,value".to_string(),
            ModelConfig::Llama(c) => c.family.default_lora_targets().join(","),
            ModelConfig::Gemma3(_) => "q_proj,v_proj".to_string(),
        };
        let targets = LoraTargets::parse(self.lora_target.as_deref().unwrap_or(&default))
            .map_err(|e| anyhow::anyhow!("--lora-target {e}"))?;
        let mut config = LoraConfig::new(r, targets);
        config.alpha = self.lora_alpha;
        config.dropout = self.lora_dropout;
        config
            .validate()
            .map_err(|e| anyhow::anyhow!("bad LoRA flags: {e}"))?;
        Ok(Some(cfg.set_lora(config)))
    }
}

/// The token ids of `path`: a JSON array of non-empty, equal-length arrays
/// of ids below `vocab_size`, each at least 2 long (one next token).
///
/// # Errors
/// Unreadable file, bad JSON, an empty batch, ragged or too short
/// sequences, an id outside the vocabulary; every message names the file.
pub fn read_batch(path: &Path, vocab_size: usize) -> Result<Vec<Vec<u32>>> {
    let name = path.display();
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading --data-ids {name}"))?;
    let seqs: Vec<Vec<u64>> = serde_json::from_str(&text).with_context(|| {
        format!("{name}: not a JSON array of token-id sequences (arrays of non-negative integers)")
    })?;
    let Some(first) = seqs.first() else {
        bail!("{name}: the batch is empty (need at least one sequence)");
    };
    let len = first.len();
    if len < 2 {
        bail!("{name}: sequence 0 has {len} token(s); a next-token loss needs at least 2");
    }
    let mut batch = Vec::with_capacity(seqs.len());
    for (i, seq) in seqs.iter().enumerate() {
        if seq.len() != len {
            bail!(
                "{name}: ragged batch: sequence {i} has {} tokens, sequence 0 has {len} \
                 (every sequence must have the same length)",
                seq.len()
            );
        }
        if let Some((j, id)) = seq
            .iter()
            .enumerate()
            .find(|(_, &id)| id >= vocab_size as u64)
        {
            bail!(
                "{name}: token id {id} at sequence {i}, position {j} is outside the model's \
                 vocabulary (vocab_size {vocab_size})"
            );
        }
        batch.push(seq.iter().map(|&id| id as u32).collect());
    }
    Ok(batch)
}

/// The rows `[start, end)` of a batch of `n` this rank trains on: its
/// contiguous share, as Accelerate's `split_batches`.
///
/// # Errors
/// `n` not a multiple of `world` (Accelerate refuses the same).
pub fn rank_share(n: usize, world: usize, rank: usize, data: &Path) -> Result<(usize, usize)> {
    if !n.is_multiple_of(world) {
        bail!(
            "{}: {n} sequences cannot be split evenly between {world} processes \
             (split_batches needs the batch to be a multiple of the number of processes)",
            data.display()
        );
    }
    let per = n / world;
    Ok((rank * per, (rank + 1) * per))
}

/// The `--json` setup line: the run's kind, parameter counts, the attention
/// kernel choice (`auto`, `tiled`, `reference`; `composed` off the CPU),
/// whether layers are recomputed in backward, then `extra` (`, "key": value`
/// pairs) before the closing braces. Written by hand to keep the keys in
/// this order (serde_json sorts them).
///
/// # Errors
/// As [`parameter_counts`].
pub(crate) fn setup_line(
    acc: &Accelerator,
    params: &PreparedModel,
    args: &Args,
    sharding: &Value,
    tokens_per_step: usize,
    extra: &str,
) -> Result<String> {
    let (trainable, all) = parameter_counts(params, &args.model)?;
    // The fused CPU attention's kernel; on other devices the composed ops run.
    let attention = if acc.device().is_cpu() {
        accel_core::nn::ops::attention_kernel()?.name()
    } else {
        "composed"
    };
    Ok(format!(
        r#"{{"setup": {{"distributed": {}, "mixed_precision": {}, "world_size": {}, "sharding": {sharding}, "trainable_parameters": {trainable}, "all_parameters": {all}, "tokens_per_step": {tokens_per_step}, "attention": {}, "gradient_checkpointing": {}{extra}}}}}"#,
        json!(acc.distributed_type().to_string()),
        json!(acc.mixed_precision().to_string()),
        acc.num_processes(),
        json!(attention),
        args.gradient_checkpointing,
    ))
}

/// The setup line's `trainable_parameters` and `all_parameters`: counted
/// from the checkpoint's shapes of the model's parameters, so every rank of
/// a sharded run reports the whole model's, as PEFT's
/// `print_trainable_parameters` counts (each tied weight once).
///
/// # Errors
/// A parameter the checkpoint does not hold.
fn parameter_counts(params: &PreparedModel, dir: &Path) -> Result<(usize, usize)> {
    let source = accel_core::bigmodel::CheckpointSource::open(dir)?;
    let sharded = params.sharded_quantized_names();
    let frozen: std::collections::HashSet<String> = params
        .frozen_parameters()
        .into_iter()
        .chain(sharded.iter().cloned())
        .collect();
    let (mut trainable, mut all) = (0, 0);
    let lora_r = params.adapter_config().map_or(0, |c| c.r);
    // Under FSDP a quantized base's codes are kept apart from the parameters.
    for name in params.names().into_iter().chain(sharded) {
        if accel_core::bigmodel::quant::is_quant_part(&name) {
            // A quantized weight's state: no parameter of the model.
            continue;
        }
        if let Some(module) = adapter_module(&name) {
            // A new adapter is not in the checkpoint: r * (in + out) per pair,
            // counted at its A (either orientation of the base weight).
            if name.ends_with(LORA_A) {
                let base = format!("{module}.weight");
                let at = source
                    .locate(&base)
                    .with_context(|| format!("{}: no tensor `{base}`", dir.display()))?;
                let n = lora_r * at.shape().iter().sum::<usize>();
                trainable += n;
                all += n;
            }
            continue;
        }
        let at = source
            .locate(&name)
            .with_context(|| format!("{}: no tensor `{name}`", dir.display()))?;
        let mut n: usize = at.shape().iter().product();
        if at.dtype() == Some(DType::U8) && is_4bit(&source, &name) {
            // Packed 4-bit codes, two a byte: PEFT counts the weight's own
            // elements (`numel * 2` for a Params4bit).
            n *= 2;
        }
        all += n;
        if !frozen.contains(&name) {
            trainable += n;
        }
    }
    Ok((trainable, all))
}

/// Whether the checkpoint's `name` is the packed codes of a 4-bit weight.
fn is_4bit(source: &accel_core::bigmodel::CheckpointSource, name: &str) -> bool {
    [QuantType::Nf4, QuantType::Fp4]
        .iter()
        .any(|q| source.contains(&format!("{name}.{}", quant_state_name(*q))))
}

/// The causal language models `finetune_hf` trains.
pub(crate) const CAUSAL_TYPES: &str =
    "llama, mistral, qwen2, qwen3, phi3, mixtral, qwen3_moe, gemma2, gemma3_text, gemma3, gpt2";

/// Vocabulary size of a decoder config; BERT is refused.
pub(crate) fn decoder_vocab(cfg: &ModelConfig, dir: &Path) -> Result<usize> {
    match cfg {
        ModelConfig::Llama(c) => Ok(c.vocab_size),
        ModelConfig::Gemma3(c) => Ok(c.vocab_size),
        ModelConfig::Gpt2(c) => Ok(c.vocab_size),
        ModelConfig::Bert(_) => bail!(
            "{}: model_type bert is an encoder without a language-model head; finetune_hf \
             trains causal language models ({})",
            dir.display(),
            CAUSAL_TYPES
        ),
    }
}

/// The architecture of `cfg` on `vb`, its error boxed in accel-core's.
fn build(cfg: &ModelConfig, vb: candle_nn::VarBuilder) -> accel_core::Result<AutoModel> {
    Ok(AutoModel::new(cfg, vb)?)
}

/// The quantization `args` ask for, set on `cfg` with the on-load
/// quantization of its checkpoint (`None` for a folder saved quantized, whose
/// parts load as they are). A quantized base trains adapters only.
///
/// # Errors
/// Bad quantization flags; a quantized base without `--lora-r`.
pub(crate) fn quantization(
    args: &Args,
    cfg: &mut ModelConfig,
) -> Result<Option<accel_core::bigmodel::quant::QuantizeOnLoad>> {
    let on_load = match args.quant.config()? {
        Some(q) => {
            cfg.set_quantization(q);
            cfg.quantize_on_load()?
        }
        None => None,
    };
    if cfg.quantization().is_some() && args.lora_r.is_none() {
        bail!(
            "{}: a quantized base cannot be fine-tuned itself (transformers refuses the same): \
             add --lora-r to train LoRA adapters on it (QLoRA)",
            args.model.display()
        );
    }
    Ok(on_load)
}

/// Builds the model as the run trains (plain, DDP or FSDP), its parameters
/// starting from the folder's weights (LoRA adapters on them with `lora`,
/// the base quantized as it loads with `quantize`; each decoder layer
/// recomputed in backward with `checkpointing`), and returns it with its
/// parameters and the `sharding` value of the setup line.
pub(crate) fn prepare_model(
    acc: &mut Accelerator,
    cfg: &ModelConfig,
    dir: &Path,
    lora: Option<&LoraSpec>,
    quantize: Option<accel_core::bigmodel::quant::QuantizeOnLoad>,
    checkpointing: bool,
) -> Result<(AutoModel, PreparedModel, Value)> {
    let (model, params, sharding) = prepare_unchecked(acc, cfg, dir, lora, quantize)?;
    if checkpointing && acc.config().fsdp.is_none() {
        // Under FSDP the units checkpoint themselves (the plugin's setting).
        apply_activation_checkpointing(&model, &[model.layer_class()])?;
    }
    Ok((model, params, sharding))
}

/// [`prepare_model`] before activation checkpointing.
fn prepare_unchecked(
    acc: &mut Accelerator,
    cfg: &ModelConfig,
    dir: &Path,
    lora: Option<&LoraSpec>,
    quantize: Option<accel_core::bigmodel::quant::QuantizeOnLoad>,
) -> Result<(AutoModel, PreparedModel, Value)> {
    let loading = || format!("loading the weights of {}", dir.display());
    if let Some(spec) = lora {
        let (model, params) = acc
            .prepare_lora_quantized(dir, spec, quantize, |vb| build(cfg, vb))
            .with_context(loading)?;
        let sharding = acc.config().fsdp.as_ref().map_or(Value::Null, |p| {
            json!({
                "strategy": p.sharding_strategy.name(),
                "quantized_bytes_per_rank": params.sharded_quantized_bytes(),
            })
        });
        // Adapters train: their dropout is on from here.
        spec.set_training(true);
        return Ok((model, params, sharding));
    }
    if acc.config().fsdp.is_some() {
        let (model, fsdp) = acc
            .prepare_fsdp_pretrained(dir, |vb| build(cfg, vb))
            .with_context(loading)?;
        let sharding = json!({
            "strategy": fsdp.strategy().name(),
            "units": fsdp.unit_names().len(),
        });
        return Ok((model, fsdp.params().clone(), sharding));
    }
    let (model, params) = acc
        .prepare_pretrained(dir, |vb| build(cfg, vb))
        .with_context(loading)?;
    Ok((model, params, Value::Null))
}

/// Runs the fine-tuning job, writing its lines to `out` on the main process.
///
/// # Errors
/// Bad flags, checkpoint or data file; a failed step or collective.
pub fn run(args: &Args, out: &mut dyn Write) -> Result<()> {
    // A model id becomes its folder in the Hugging Face cache first.
    let resolved = Args {
        model: accel_core::models::hub::resolve_model(&args.model, args.revision.as_deref())?,
        ..args.clone()
    };
    let args = &resolved;
    let mut cfg = accel_core::models::ModelConfig::from_path(&args.model)?;
    let vocab = decoder_vocab(&cfg, &args.model)?;
    let lora = args.lora(&mut cfg)?;
    let quantize = quantization(args, &mut cfg)?;
    let mut config = AcceleratorConfig {
        // Unset: Accelerator::new takes the launcher's precision, then `no`.
        mixed_precision: args.mixed_precision,
        seed: Some(args.seed),
        ..Default::default()
    };
    if args.gradient_checkpointing {
        // An FSDP unit recomputes itself: the launcher's plugin, checkpointing.
        config.fsdp = FullyShardedDataParallelPlugin::from_env()?
            .map(|p| p.with_activation_checkpointing(true));
    }
    let Some(data_ids) = &args.data_ids else {
        return crate::finetune_data::run(args, &cfg, lora.as_ref(), quantize, config, out);
    };
    let batch = read_batch(data_ids, vocab)?;
    let mut acc = Accelerator::new(config)?;
    crate::cuda_graphs_notice(args.cuda_graphs, acc.device());
    let (model, params, sharding) = prepare_model(
        &mut acc,
        &cfg,
        &args.model,
        lora.as_ref(),
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

    let (world, rank) = (acc.num_processes(), acc.process_index());
    let (start, end) = rank_share(batch.len(), world, rank, data_ids)?;
    let len = batch[0].len();
    let mine: Vec<u32> = batch[start..end].iter().flatten().copied().collect();
    let ids = Tensor::from_vec(mine, (end - start, len), acc.device())?;
    // Positions with a next token: the shifted labels drop the last one.
    let tokens = ((end - start) * (len - 1)) as f64;

    let main = acc.is_main_process();
    let setup = setup_line(&acc, &params, args, &sharding, batch.len() * len, "")?;
    if main {
        if args.json {
            writeln!(out, "{setup}")?;
        } else {
            writeln!(
                out,
                "{} on {}: {world} process(es), {}, sharding {}, {} parameters here, batch {}x{len}",
                args.model.display(),
                acc.distributed_type(),
                acc.mixed_precision(),
                if sharding.is_null() { "none".to_string() } else { sharding.to_string() },
                params.num_parameters(),
                batch.len()
            )?;
        }
    }
    for step in 1..=args.steps {
        let loss = model.loss(&ids, &ids)?;
        let whole = global_mean(&acc, &loss, tokens)?;
        acc.backward(&loss)?;
        opt.step()?;
        opt.zero_grad();
        if main {
            print_step(out, args.json, step, whole)?;
        }
    }
    save_and_end(&mut acc, &params, args)
}

/// The whole batch's mean loss: the sum over ranks of each rank's mean
/// `loss` times its counted `tokens`, over all counted tokens (a collective).
pub(crate) fn global_mean(acc: &Accelerator, loss: &Tensor, tokens: f64) -> Result<f64> {
    let local = loss.to_dtype(DType::F64)?.to_scalar::<f64>()?;
    let local = if tokens > 0.0 { local * tokens } else { 0.0 };
    let parts = Tensor::new(&[local, tokens], acc.device())?;
    let sums = acc.reduce(&parts, ReduceOp::Sum)?.to_vec1::<f64>()?;
    Ok(if sums[1] > 0.0 {
        sums[0] / sums[1]
    } else {
        f64::NAN
    })
}

/// A step's output line: `{"step": k, "loss": f}` with `json`, else text.
pub(crate) fn print_step(out: &mut dyn Write, json: bool, step: u64, loss: f64) -> Result<()> {
    if json {
        writeln!(out, r#"{{"step": {step}, "loss": {}}}"#, json!(loss))?;
    } else {
        writeln!(out, "step {step}: loss {loss:.6}")?;
    }
    out.flush()?;
    Ok(())
}

/// `--output-dir` (every rank takes part), then the trackers closed.
pub(crate) fn save_and_end(
    acc: &mut Accelerator,
    params: &PreparedModel,
    args: &Args,
) -> Result<()> {
    if let Some(dir) = &args.output_dir {
        params
            .save_pretrained(acc, dir, &args.max_shard_size)
            .with_context(|| format!("saving the model to --output-dir {}", dir.display()))?;
    }
    acc.end_training()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(text: &str) -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ids.json");
        std::fs::write(&path, text).unwrap();
        (dir, path)
    }

    #[test]
    fn a_good_batch_reads() {
        let (_d, p) = file("[[1, 2, 3], [4, 5, 6]]");
        assert_eq!(
            read_batch(&p, 10).unwrap(),
            vec![vec![1, 2, 3], vec![4, 5, 6]]
        );
    }

    #[test]
    fn bad_batches_name_the_file_and_the_fault() {
        for (text, want) in [
            ("[[1, 2], [3", "not a JSON array"),
            ("{\"a\": 1}", "not a JSON array"),
            ("[[1, -2]]", "not a JSON array"),
            ("[]", "empty"),
            ("[[1]]", "at least 2"),
            ("[[1, 2, 3], [4, 5]]", "ragged"),
            ("[[1, 2], [3, 10]]", "vocab_size 10"),
        ] {
            let (_d, p) = file(text);
            let e = format!("{:#}", read_batch(&p, 10).unwrap_err());
            assert!(e.contains("ids.json") && e.contains(want), "{text}: {e}");
        }
    }

    #[test]
    fn the_batch_splits_into_contiguous_shares() {
        let p = Path::new("ids.json");
        assert_eq!(rank_share(4, 2, 1, p).unwrap(), (2, 4));
        assert_eq!(rank_share(3, 1, 0, p).unwrap(), (0, 3));
        let e = rank_share(3, 2, 0, p).unwrap_err().to_string();
        assert!(e.contains("ids.json") && e.contains("2 processes"), "{e}");
    }
}
