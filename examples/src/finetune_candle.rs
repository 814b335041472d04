//! Fine-tune candle-transformers' own models through the Accelerator: what
//! a candle user already has, trained without rewriting it.
//!
//! ```text
//! scripts/fetch_minilm.sh    # once: all-MiniLM-L6-v2 into target/minilm
//! cargo run --release --example finetune_candle -- --model bert --steps 20
//! cargo run --release --example finetune_candle -- --model llama --mixed-precision bf16
//! ```
//!
//! * `bert`: `candle_transformers::models::bert::BertModel` from the MiniLM
//!   checkpoint, with a linear head on the mean-pooled tokens, classifies
//!   [`SENTIMENT`] (positive or negative, embedded).
//! * `llama`: `candle_transformers::models::llama::Llama` from a Hugging Face
//!   folder (default: the repository's Llama fixture) learns to predict the
//!   token after each window of [`TEXT`]. candle-transformers' Llama returns
//!   the logits of the last position only, so that is the objective.
//!
//! Each step prints the loss and how many parameters received a gradient:
//! with upstream candle-nn that count was 2 of BERT's and 1 of Llama's,
//! since its fused norms and rotary embeddings had no backward (see the
//! workspace's `[patch.crates-io]`).

use std::io::Write;
use std::path::{Path, PathBuf};

use accel_core::models::Tokenizer;
use accel_core::optim::{AdamW, AdamWConfig};
use accel_core::{Accelerator, AcceleratorConfig, PrecisionType, PreparedModel};
use anyhow::{ensure, Context, Result};
use candle_core::{DType, Tensor, D};
use candle_nn::{Module, VarMap};
use candle_transformers::models::{bert, llama};
use clap::{Parser, ValueEnum};

/// Labelled sentences (1: positive, 0: negative) for the BERT classifier.
pub const SENTIMENT: [(&str, u32); 12] = [
    ("I loved this film, it was wonderful", 1),
    ("A delightful and moving story", 1),
    ("The best meal I have had in years", 1),
    ("Great service and friendly staff", 1),
    ("An absolute joy from start to finish", 1),
    ("I would happily come back again", 1),
    ("This was a terrible waste of time", 0),
    ("The food was cold and bland", 0),
    ("I hated every minute of it", 0),
    ("Rude staff and a dirty room", 0),
    ("A boring, predictable plot", 0),
    ("I will never buy this again", 0),
];

/// The text the Llama learns to continue.
pub const TEXT: &str = "the quick brown fox jumps over the lazy dog. \
    the lazy dog sleeps under the old tree. the quick brown fox runs home.";

/// Which candle-transformers model to fine-tune.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Which {
    /// `bert::BertModel` with a classification head.
    Bert,
    /// `llama::Llama`, next token after a window.
    Llama,
}

/// The command line.
#[derive(Parser, Debug, Clone)]
#[command(about = "Fine-tune candle-transformers' BERT or Llama through the Accelerator")]
pub struct Args {
    /// The model to fine-tune.
    #[arg(long, value_enum)]
    pub model: Which,
    /// Its Hugging Face folder (default: target/minilm for bert, the
    /// repository's Llama fixture for llama).
    #[arg(long)]
    pub model_dir: Option<PathBuf>,
    /// Optimizer steps.
    #[arg(long, default_value_t = 20)]
    pub steps: usize,
    /// AdamW learning rate.
    #[arg(long, default_value_t = 1e-3)]
    pub lr: f64,
    /// Mixed precision: no, bf16 or fp16 (unset: the launcher's, else no).
    #[arg(long)]
    pub mixed_precision: Option<PrecisionType>,
    /// Seed of the new parameters and the data order.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Print one JSON object per step instead of a line of text.
    #[arg(long)]
    pub json: bool,
}

/// What one step did.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Step {
    /// The step, from 0.
    pub step: usize,
    /// The loss before this step's update.
    pub loss: f32,
    /// Parameters that received a gradient, over all prepared models.
    pub with_grad: usize,
    /// Trainable parameters, over all prepared models.
    pub params: usize,
}

/// The folder `args` names, or the default for its model.
fn model_dir(args: &Args) -> PathBuf {
    args.model_dir.clone().unwrap_or_else(|| {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        match args.model {
            Which::Bert => root.join("target/minilm"),
            Which::Llama => root.join("tests/fixtures/hf/llama"),
        }
    })
}

fn read_config<T: serde::de::DeserializeOwned>(dir: &Path) -> Result<T> {
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path).with_context(|| {
        format!(
            "{}: no model config (for bert run scripts/fetch_minilm.sh first)",
            path.display()
        )
    })?;
    serde_json::from_str(&text).with_context(|| format!("{}", path.display()))
}

/// Fine-tunes the model `args` names, writing a line per step to `out`.
///
/// # Errors
/// A missing or malformed folder; a non-finite loss.
pub fn run(args: &Args, out: &mut dyn Write) -> Result<Vec<Step>> {
    let dir = model_dir(args);
    let mut config = AcceleratorConfig::default().with_seed(args.seed);
    if let Some(p) = args.mixed_precision {
        config = config.with_mixed_precision(p);
    }
    let mut acc = Accelerator::new(config)?;
    let tokenizer = Tokenizer::from_file(dir.join("tokenizer.json"))?;
    let mut task: Box<dyn Task> = match args.model {
        Which::Bert => Box::new(BertTask::new(&mut acc, &dir, &tokenizer)?),
        Which::Llama => Box::new(LlamaTask::new(&mut acc, &dir, &tokenizer)?),
    };
    let models = task.models();
    let mut opts: Vec<_> = models
        .iter()
        .map(|m| {
            let cfg = AdamWConfig {
                lr: args.lr,
                ..Default::default()
            };
            acc.prepare_optimizer(m, AdamW::new(cfg))
        })
        .collect();
    let params: usize = models.iter().map(|m| m.len()).sum();
    let mut steps = Vec::with_capacity(args.steps);
    for step in 0..args.steps {
        let loss = task.loss(&acc)?;
        acc.backward(&loss)?;
        let with_grad = models.iter().map(|m| m.gradients().len()).sum();
        for opt in &mut opts {
            opt.step()?;
            opt.zero_grad();
        }
        let loss = loss.to_dtype(DType::F32)?.to_scalar::<f32>()?;
        ensure!(loss.is_finite(), "step {step}: the loss is {loss}");
        let s = Step {
            step,
            loss,
            with_grad,
            params,
        };
        if args.json {
            writeln!(out, "{}", serde_json::to_string(&s)?)?;
        } else {
            writeln!(
                out,
                "step {step:3}  loss {loss:.4}  parameters with a gradient {with_grad}/{params}"
            )?;
        }
        steps.push(s);
    }
    Ok(steps)
}

/// A model, its data and its loss.
trait Task {
    /// The prepared models whose parameters train.
    fn models(&self) -> Vec<PreparedModel>;
    /// The loss on the (whole, fixed) training batch.
    fn loss(&mut self, acc: &Accelerator) -> Result<Tensor>;
}

/// candle-transformers' BERT with a linear head on the mean-pooled tokens.
struct BertTask {
    bert: bert::BertModel,
    head: candle_nn::Linear,
    models: Vec<PreparedModel>,
    ids: Tensor,
    types: Tensor,
    mask: Tensor,
    labels: Tensor,
}

impl BertTask {
    fn new(acc: &mut Accelerator, dir: &Path, tokenizer: &Tokenizer) -> Result<Self> {
        let cfg: bert::Config = read_config(dir)?;
        let varmap = VarMap::new();
        let bert = bert::BertModel::load(acc.var_builder(&varmap), &cfg)?;
        let model = acc.prepare_model(&varmap)?;
        model.load_checkpoint(dir)?;
        // The head is new: its own VarMap, drawn from the seed.
        let head_map = VarMap::new();
        let head = candle_nn::linear(
            cfg.hidden_size,
            2,
            acc.var_builder(&head_map).pp("classifier"),
        )?;
        let head_model = acc.prepare_model(&head_map)?;
        let mut encoded = Vec::with_capacity(SENTIMENT.len());
        for (text, _) in SENTIMENT {
            encoded.push(tokenizer.encode(text, true)?);
        }
        let len = encoded.iter().map(Vec::len).max().unwrap_or(0);
        let (mut ids, mut mask) = (vec![], vec![]);
        for e in &encoded {
            ids.extend(
                e.iter()
                    .copied()
                    .chain(std::iter::repeat_n(0, len - e.len())),
            );
            mask.extend((0..len).map(|i| u32::from(i < e.len())));
        }
        let n = SENTIMENT.len();
        let dev = acc.device();
        let ids = Tensor::from_vec(ids, (n, len), dev)?;
        let labels: Vec<u32> = SENTIMENT.iter().map(|(_, l)| *l).collect();
        Ok(Self {
            bert,
            head,
            models: vec![model, head_model],
            types: ids.zeros_like()?,
            ids,
            mask: Tensor::from_vec(mask, (n, len), dev)?,
            labels: Tensor::from_vec(labels, n, dev)?,
        })
    }
}

impl Task for BertTask {
    fn models(&self) -> Vec<PreparedModel> {
        self.models.clone()
    }

    fn loss(&mut self, acc: &Accelerator) -> Result<Tensor> {
        let hidden = self
            .bert
            .forward(&self.ids, &self.types, Some(&self.mask))?;
        // Mean over the real tokens, as sentence-transformers pools MiniLM.
        let mask = self
            .mask
            .to_dtype(acc.compute_dtype())?
            .unsqueeze(D::Minus1)?;
        let pooled = hidden
            .broadcast_mul(&mask)?
            .sum(1)?
            .broadcast_div(&mask.sum(1)?)?;
        let logits = self.head.forward(&pooled)?.to_dtype(DType::F32)?;
        Ok(candle_nn::loss::cross_entropy(&logits, &self.labels)?)
    }
}

/// candle-transformers' Llama predicting the token after each window.
struct LlamaTask {
    llama: llama::Llama,
    config: llama::Config,
    models: Vec<PreparedModel>,
    windows: Tensor,
    next: Tensor,
}

/// Tokens in a window of [`TEXT`].
const WINDOW: usize = 12;

impl LlamaTask {
    fn new(acc: &mut Accelerator, dir: &Path, tokenizer: &Tokenizer) -> Result<Self> {
        let cfg: llama::LlamaConfig = read_config(dir)?;
        let config = cfg.into_config(false);
        let varmap = VarMap::new();
        let llama = llama::Llama::load(acc.var_builder(&varmap), &config)?;
        let model = acc.prepare_model(&varmap)?;
        model.load_checkpoint(dir)?;
        let ids = tokenizer.encode(TEXT, false)?;
        ensure!(ids.len() > WINDOW + 1, "the text is shorter than a window");
        let starts: Vec<usize> = (0..ids.len() - WINDOW).step_by(3).collect();
        let windows: Vec<u32> = starts
            .iter()
            .flat_map(|&s| ids[s..s + WINDOW].iter().copied())
            .collect();
        let next: Vec<u32> = starts.iter().map(|&s| ids[s + WINDOW]).collect();
        let dev = acc.device();
        Ok(Self {
            llama,
            config,
            models: vec![model],
            windows: Tensor::from_vec(windows, (starts.len(), WINDOW), dev)?,
            next: Tensor::from_vec(next, starts.len(), dev)?,
        })
    }
}

impl Task for LlamaTask {
    fn models(&self) -> Vec<PreparedModel> {
        self.models.clone()
    }

    fn loss(&mut self, acc: &Accelerator) -> Result<Tensor> {
        // No KV cache in training: each forward sees its whole window.
        let mut cache = llama::Cache::new(false, acc.compute_dtype(), &self.config, acc.device())?;
        let logits = self.llama.forward(&self.windows, 0, &mut cache)?;
        Ok(candle_nn::loss::cross_entropy(&logits, &self.next)?)
    }
}
