//! A real checkpoint through dispatch with disk offload: all-MiniLM-L6-v2
//! (a 6-layer BERT sentence encoder, fp32, ~90 MB) run three ways, and the
//! sentence embeddings compared:
//!
//! * **plain**: every weight in RAM through a `VarBuilder` over [`CheckpointSource`];
//! * **dispatched**: [`load_checkpoint_and_dispatch`] with embeddings and layers
//!   0-2 on `cpu` and layers 3-5 on `disk` (read per forward straight from the
//!   checkpoint file, as Accelerate does when the checkpoint holds them);
//! * **offload folder**: the model loaded, then [`dispatch_model`] with the same
//!   map but no weights map, so layers 3-5 are written to a temporary offload
//!   folder and read back from it per forward.
//!
//! Fetch the checkpoint first with `scripts/fetch_minilm.sh` (into `target/minilm`),
//! then `cargo run -p accel-bigmodel --example minilm_dispatch -- [--dir D]`.
//! Prints one JSON object; exits non-zero when an embedding differs from the
//! plain run by more than 1e-5.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use accel_nn::{
    dispatch_model, load_checkpoint_and_dispatch, Block, DeviceMapChoice, DispatchOptions,
    LoadDispatchOptions, Sequential,
};

type Dyn = Box<dyn Module + Send + Sync>;
use accel_bigmodel::{CheckpointSource, DeviceMap, Placement};
use anyhow::{bail, ensure, Context, Result};
use candle_core::{DType, Device, IndexOp, Module, Tensor, D};
use candle_nn::{Embedding, LayerNorm, Linear, VarBuilder};

/// The sentences embedded; the last one exercises punctuation, `##` pieces and padding.
const SENTENCES: [&str; 3] = [
    "This is an example sentence",
    "Each sentence is converted",
    "Accelerate's big-model inference runs MiniLM in pure Rust, layer by layer!",
];
const TOLERANCE: f32 = 1e-5;
/// Layers placed on disk by the device map.
const DISK_LAYERS: [usize; 3] = [3, 4, 5];

/// The `config.json` fields the encoder needs.
#[derive(Clone, Copy, Debug, serde::Deserialize)]
struct BertConfig {
    vocab_size: usize,
    hidden_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    intermediate_size: usize,
    max_position_embeddings: usize,
    type_vocab_size: usize,
    layer_norm_eps: f64,
}

// ---------------------------------------------------------------- tokenizer

/// BERT's uncased WordPiece tokenizer, reduced to what ASCII input needs:
/// lower-casing, whitespace and punctuation splitting (BasicTokenizer), then
/// greedy longest-match-first pieces with `##` continuations (WordpieceTokenizer).
/// Accent stripping and CJK splitting are left out because the sentences are ASCII.
struct WordPiece {
    vocab: HashMap<String, u32>,
}

impl WordPiece {
    fn open(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).with_context(|| format!("{}", path.display()))?;
        let vocab = text
            .lines()
            .enumerate()
            .map(|(i, t)| (t.to_string(), i as u32))
            .collect();
        Ok(WordPiece { vocab })
    }

    fn id(&self, token: &str) -> Result<u32> {
        self.vocab
            .get(token)
            .copied()
            .with_context(|| format!("vocab.txt lacks {token}"))
    }

    /// `[CLS] pieces… [SEP]`, as `BertTokenizer` encodes a single sentence.
    fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let mut words = Vec::new();
        let mut word = String::new();
        for c in text.chars().flat_map(char::to_lowercase) {
            if c.is_whitespace() || c.is_control() {
                words.extend((!word.is_empty()).then(|| std::mem::take(&mut word)));
            } else if c.is_ascii_punctuation() {
                // Every punctuation character is a word of its own.
                words.extend((!word.is_empty()).then(|| std::mem::take(&mut word)));
                words.push(c.to_string());
            } else {
                word.push(c);
            }
        }
        words.extend((!word.is_empty()).then_some(word));

        let mut ids = vec![self.id("[CLS]")?];
        for word in &words {
            ids.extend(self.pieces(word)?);
        }
        ids.push(self.id("[SEP]")?);
        Ok(ids)
    }

    /// Greedy longest-match-first; a word with an unmatched rest is `[UNK]` whole.
    fn pieces(&self, word: &str) -> Result<Vec<u32>> {
        let chars: Vec<char> = word.chars().collect();
        if chars.len() > 100 {
            return Ok(vec![self.id("[UNK]")?]);
        }
        let mut out = Vec::new();
        let mut start = 0;
        while start < chars.len() {
            let found = (start + 1..=chars.len()).rev().find_map(|end| {
                let s: String = chars[start..end].iter().collect();
                let s = if start > 0 { format!("##{s}") } else { s };
                self.vocab.get(&s).map(|&id| (end, id))
            });
            match found {
                Some((end, id)) => {
                    out.push(id);
                    start = end;
                }
                None => return Ok(vec![self.id("[UNK]")?]),
            }
        }
        Ok(out)
    }
}

/// The batch as one `u32` tensor `(batch, 2, seq)`: row 0 the token ids
/// (padded with `[PAD]` = 0), row 1 the attention mask.
///
/// [`Sequential::forward`] passes one tensor from part to part, so the mask
/// travels with the data: packed next to the ids here, then as an extra last
/// channel of the hidden states (see [`Embeddings`]).
fn batch(tok: &WordPiece) -> Result<Tensor> {
    let encoded = SENTENCES
        .iter()
        .map(|s| tok.encode(s))
        .collect::<Result<Vec<_>>>()?;
    let t = encoded.iter().map(Vec::len).max().unwrap_or(0);
    let mut data = Vec::with_capacity(encoded.len() * 2 * t);
    for ids in &encoded {
        data.extend(ids.iter().copied().chain(std::iter::repeat(0)).take(t));
        data.extend((0..t).map(|i| u32::from(i < ids.len())));
    }
    Ok(Tensor::from_vec(data, (encoded.len(), 2, t), &Device::Cpu)?)
}

// ---------------------------------------------------------------- encoder

/// `BertEmbeddings`: word + position + token-type (all type 0) embeddings,
/// then LayerNorm. Input `(batch, 2, seq)` ids and mask; output
/// `(batch, seq, hidden + 1)`, the mask appended as the last channel.
struct Embeddings {
    word: Embedding,
    position: Embedding,
    token_type: Embedding,
    norm: LayerNorm,
}

impl Module for Embeddings {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let ids = x.i((.., 0, ..))?.contiguous()?;
        let mask = x.i((.., 1, ..))?.to_dtype(DType::F32)?;
        let t = ids.dim(1)?;
        let positions = Tensor::arange(0u32, t as u32, x.device())?;
        let types = ids.zeros_like()?;
        let h = self
            .word
            .forward(&ids)?
            .broadcast_add(&self.position.forward(&positions)?)?
            .add(&self.token_type.forward(&types)?)?;
        let h = self.norm.forward(&h)?;
        Tensor::cat(&[h, mask.unsqueeze(2)?], 2)
    }
}

/// `BertLayer`: post-norm multi-head self-attention and a GELU (erf) MLP.
/// Input and output `(batch, seq, hidden + 1)`, the mask channel passed through.
struct Layer {
    heads: usize,
    query: Linear,
    key: Linear,
    value: Linear,
    attn_out: Linear,
    attn_norm: LayerNorm,
    intermediate: Linear,
    output: Linear,
    out_norm: LayerNorm,
}

impl Module for Layer {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let (b, t, d1) = x.dims3()?;
        let d = d1 - 1;
        let (hd, nh) = (d / self.heads, self.heads);
        let h = x.narrow(2, 0, d)?.contiguous()?;
        let mask = x.narrow(2, d, 1)?;
        // HF's extended attention mask: 0 where attended, the dtype's minimum
        // where padded, broadcast over heads and query positions.
        let bias = ((mask.ones_like()? - &mask)? * f64::from(f32::MIN))?
            .reshape((b, 1, 1, t))?
            .contiguous()?;
        let split = |l: &Linear| -> candle_core::Result<Tensor> {
            l.forward(&h)?
                .reshape((b, t, nh, hd))?
                .transpose(1, 2)?
                .contiguous()
        };
        let (q, k, v) = (split(&self.query)?, split(&self.key)?, split(&self.value)?);
        let scores = (q.matmul(&k.t()?.contiguous()?)? / (hd as f64).sqrt())?;
        let probs = candle_nn::ops::softmax_last_dim(&scores.broadcast_add(&bias)?)?;
        let ctx = probs
            .matmul(&v)?
            .transpose(1, 2)?
            .contiguous()?
            .reshape((b, t, d))?;
        let h = self
            .attn_norm
            .forward(&(self.attn_out.forward(&ctx)? + &h)?)?;
        let m = self.intermediate.forward(&h)?.gelu_erf()?;
        let h = self.out_norm.forward(&(self.output.forward(&m)? + &h)?)?;
        Tensor::cat(&[h, mask.contiguous()?], 2)
    }
}

type Built = candle_core::Result<Box<dyn Module + Send + Sync>>;

fn build_embeddings(cfg: BertConfig) -> impl Fn(VarBuilder) -> Built + Send + Sync + 'static {
    move |vb| {
        let d = cfg.hidden_size;
        let emb = |n, rows| candle_nn::embedding(rows, d, vb.pp(n));
        Ok(Box::new(Embeddings {
            word: emb("word_embeddings", cfg.vocab_size)?,
            position: emb("position_embeddings", cfg.max_position_embeddings)?,
            token_type: emb("token_type_embeddings", cfg.type_vocab_size)?,
            norm: candle_nn::layer_norm(d, cfg.layer_norm_eps, vb.pp("LayerNorm"))?,
        }))
    }
}

fn build_layer(cfg: BertConfig) -> impl Fn(VarBuilder) -> Built + Send + Sync + 'static {
    move |vb| {
        let (d, i, eps) = (cfg.hidden_size, cfg.intermediate_size, cfg.layer_norm_eps);
        let lin = |a, b, n: &str| candle_nn::linear(a, b, vb.pp(n));
        let norm = |n: &str| candle_nn::layer_norm(d, eps, vb.pp(n));
        Ok(Box::new(Layer {
            heads: cfg.num_attention_heads,
            query: lin(d, d, "attention.self.query")?,
            key: lin(d, d, "attention.self.key")?,
            value: lin(d, d, "attention.self.value")?,
            attn_out: lin(d, d, "attention.output.dense")?,
            attn_norm: norm("attention.output.LayerNorm")?,
            intermediate: lin(d, i, "intermediate.dense")?,
            output: lin(i, d, "output.dense")?,
            out_norm: norm("output.LayerNorm")?,
        }))
    }
}

/// Part names (dotted prefixes) in execution order: embeddings, then each layer.
fn part_names(cfg: BertConfig, prefix: &str) -> Vec<String> {
    let layers = (0..cfg.num_hidden_layers).map(|i| format!("{prefix}encoder.layer.{i}"));
    std::iter::once(format!("{prefix}embeddings"))
        .chain(layers)
        .collect()
}

/// The encoder as hooked parts with placeholder weights, ready to be dispatched.
fn empty_model(cfg: BertConfig, prefix: &str) -> Result<Sequential<Dyn>> {
    let (dt, dev) = (DType::F32, Device::Cpu);
    let names = part_names(cfg, prefix);
    let mut parts = vec![Block::empty(
        &names[0],
        "",
        dt,
        &dev,
        build_embeddings(cfg),
    )?];
    for name in &names[1..] {
        parts.push(Block::empty(name, "BertLayer", dt, &dev, build_layer(cfg))?);
    }
    Ok(Sequential::new(parts))
}

/// sentence-transformers' pooling for this model: the mean of the token
/// states where the mask is 1, then L2 normalisation. `x` is the encoder's
/// `(batch, seq, hidden + 1)` output with the mask as last channel.
fn pool(x: &Tensor) -> Result<Tensor> {
    let d = x.dim(2)? - 1;
    let (h, mask) = (x.narrow(2, 0, d)?, x.narrow(2, d, 1)?);
    let summed = h.broadcast_mul(&mask)?.sum(1)?;
    // clamp(min=1e-9) as sentence-transformers does, against empty masks.
    let counts = mask.sum(1)?.clamp(1e-9, f64::INFINITY)?;
    let mean = summed.broadcast_div(&counts)?;
    let norm = mean
        .sqr()?
        .sum_keepdim(D::Minus1)?
        .sqrt()?
        .clamp(1e-12, f64::INFINITY)?;
    Ok(mean.broadcast_div(&norm)?)
}

/// The checkpoint's name prefix (`""`, or e.g. `"bert."` for a `BertFor…` export),
/// read from the header so either layout loads.
fn name_prefix(source: &CheckpointSource) -> Result<String> {
    const KEY: &str = "embeddings.word_embeddings.weight";
    let name = source
        .names()
        .find(|n| n.ends_with(KEY))
        .with_context(|| format!("the checkpoint has no *{KEY}"))?;
    Ok(name[..name.len() - KEY.len()].to_string())
}

/// embeddings + layers 0-2 on cpu, [`DISK_LAYERS`] on disk.
fn device_map(cfg: BertConfig, prefix: &str) -> DeviceMap {
    part_names(cfg, prefix)
        .into_iter()
        .enumerate()
        .map(|(k, name)| {
            // Part 0 is the embeddings; part k > 0 is layer k - 1.
            let on_disk = k > 0 && DISK_LAYERS.contains(&(k - 1));
            (
                name,
                if on_disk {
                    Placement::Disk
                } else {
                    Placement::Cpu
                },
            )
        })
        .collect()
}

fn max_abs_diff(a: &Tensor, b: &Tensor) -> Result<f32> {
    Ok((a - b)?.abs()?.max_all()?.to_scalar::<f32>()?)
}

fn main() -> Result<()> {
    let mut dir = PathBuf::from("target/minilm");
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--dir" => dir = args.next().context("--dir needs a path")?.into(),
            other => bail!("unknown argument {other}"),
        }
    }
    let checkpoint = dir.join("model.safetensors");
    ensure!(
        checkpoint.is_file(),
        "{} is missing: run scripts/fetch_minilm.sh {}",
        checkpoint.display(),
        dir.display()
    );
    let cfg: BertConfig = serde_json::from_slice(&std::fs::read(dir.join("config.json"))?)?;
    ensure!(
        cfg.num_hidden_layers > *DISK_LAYERS.iter().max().unwrap_or(&0),
        "the device map needs at least {} layers",
        DISK_LAYERS.len() + 3
    );
    let tok = WordPiece::open(&dir.join("vocab.txt"))?;
    let input = batch(&tok)?;

    // (a) Plain: every weight read into RAM through a VarBuilder, the same
    // layer code run without hooks.
    let start = Instant::now();
    let source = CheckpointSource::open(&checkpoint)?;
    let prefix = name_prefix(&source)?;
    let vb = VarBuilder::from_backend(Box::new(source), DType::F32, Device::Cpu);
    let names = part_names(cfg, &prefix);
    let mut plain: Vec<Box<dyn Module + Send + Sync>> =
        vec![build_embeddings(cfg)(vb.pp(&names[0]))?];
    for name in &names[1..] {
        plain.push(build_layer(cfg)(vb.pp(name))?);
    }
    drop(vb);
    let plain_load_s = start.elapsed().as_secs_f64();
    let start = Instant::now();
    let mut x = input.clone();
    for layer in &plain {
        x = layer.forward(&x)?;
    }
    let reference = pool(&x)?;
    let plain_forward_s = start.elapsed().as_secs_f64();

    // (b) load_checkpoint_and_dispatch: disk layers are read from the
    // checkpoint per forward, so the offload folder stays empty.
    let offload = tempfile::tempdir()?;
    let map = device_map(cfg, &prefix);
    let start = Instant::now();
    let model = empty_model(cfg, &prefix)?;
    let opts = LoadDispatchOptions {
        device_map: DeviceMapChoice::Map(map.clone()),
        dtype: None,
        offload_folder: Some(offload.path().to_path_buf()),
        main_device: None,
    };
    let report = load_checkpoint_and_dispatch(&model, &checkpoint, &opts)?;
    let load_s = start.elapsed().as_secs_f64();
    let disk_parts = report.count(Placement::Disk);
    ensure!(
        disk_parts == DISK_LAYERS.len(),
        "{disk_parts} parts on disk"
    );
    let start = Instant::now();
    let dispatched = pool(&model.forward_hidden(&input)?)?;
    let forward_s = start.elapsed().as_secs_f64();
    // The disk parts must be placeholders again after the forward.
    let resident: Vec<usize> = model
        .blocks
        .iter()
        .map(|p| p.weights().resident_bytes())
        .collect();
    drop(model);

    // (c) dispatch_model over a loaded model with no weights map: the disk
    // layers are written to the offload folder and read back per forward.
    let folder = tempfile::tempdir()?;
    let model = empty_model(cfg, &prefix)?;
    let source = CheckpointSource::open(&checkpoint)?;
    for part in &model.blocks {
        for name in part.weights().names() {
            part.weights()
                .set(&name, source.tensor(&name, &Device::Cpu, None)?)?;
        }
    }
    drop(source);
    let dispatch = DispatchOptions {
        main_device: None,
        offload_dir: Some(folder.path().to_path_buf()),
        weights_map: None,
    };
    dispatch_model(&model, &map, &dispatch)?;
    let folder_files = std::fs::read_dir(folder.path())?.count();
    let from_folder = pool(&model.forward_hidden(&input)?)?;

    let diff = max_abs_diff(&reference, &dispatched)?;
    let diff_folder = max_abs_diff(&reference, &from_folder)?;
    let dims = reference.dims().to_vec();
    let lens: Vec<usize> = (0..SENTENCES.len())
        .map(|i| -> Result<usize> {
            let row = input.i((i, 1))?.to_dtype(DType::F32)?;
            Ok(row.sum_all()?.to_scalar::<f32>()? as usize)
        })
        .collect::<Result<_>>()?;
    let token_ids: Vec<Vec<u32>> = (0..SENTENCES.len())
        .map(|i| -> Result<Vec<u32>> {
            let ids: Vec<u32> = input.i((i, 0))?.to_vec1()?;
            Ok(ids[..lens[i]].to_vec())
        })
        .collect::<Result<_>>()?;
    let first: Vec<f32> = reference.i((0, ..5))?.to_vec1()?;
    let json = serde_json::json!({
        "max_abs_diff": diff,
        "max_abs_diff_offload_folder": diff_folder,
        "dims": dims,
        "sentences": SENTENCES,
        "token_counts": lens,
        "token_ids": token_ids,
        "checkpoint_prefix": prefix,
        "disk_layers": DISK_LAYERS,
        "load_s": load_s,
        "forward_s": forward_s,
        "plain_load_s": plain_load_s,
        "plain_forward_s": plain_forward_s,
        "resident_bytes_per_part_after_forward": resident,
        "offload_dir_entries_after_load_checkpoint_and_dispatch":
            std::fs::read_dir(offload.path())?.count(),
        "offload_folder_files": folder_files,
        "embedding0_head": first,
    });
    println!("{json}");
    if diff > TOLERANCE || diff_folder > TOLERANCE {
        bail!("dispatched embeddings differ from the plain ones by {diff} / {diff_folder} > {TOLERANCE}");
    }
    Ok(())
}
