//! The `minilm_dispatch` example's program: a real checkpoint,
//! all-MiniLM-L6-v2 (a 6-layer BERT sentence encoder, fp32, ~90 MB), loaded
//! as [`Bert`] from its folder and run three ways, the sentence embeddings
//! compared:
//!
//! * **plain**: [`AutoModel::load`], every weight in RAM; checked against
//!   transformers' embeddings for the same sentences
//!   (`examples/data/minilm_reference.json`, written by
//!   `scripts/minilm_reference.py`), so a change in the model code, the
//!   tokenizer or the pooling shows up here and not only as a difference
//!   between two runs of the same code;
//! * **dispatched**: [`AutoModel::load_dispatched`]
//!   (`load_checkpoint_and_dispatch`) with the embeddings, layers 0-2 and the
//!   pooler on `cpu` and layers 3-5 on `disk`, read per forward straight from
//!   the checkpoint file as Accelerate does when the checkpoint holds them;
//! * **offload folder**: loaded, then [`dispatch_model`] with the same map
//!   and no weights map, so layers 3-5 are written to a temporary offload
//!   folder and read back from it per forward.
//!
//! Token ids come from the folder's `tokenizer.json` through `tokenizers`
//! and are checked against the reference's (transformers' tokenizer).

use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use accel_core::bigmodel::{DeviceMap, Placement};
use accel_core::models::{AutoModel, Bert, Tokenizer};
use accel_core::nn::{
    dispatch_model, DeviceMapChoice, DispatchOptions, LoadDispatchOptions, Model,
};
use anyhow::{bail, ensure, Context, Result};
use candle_core::{DType, Device, Tensor, D};
use clap::Parser;

/// The sentences embedded; the last one exercises punctuation, `##` pieces
/// and padding (the others are padded to its length).
pub const SENTENCES: [&str; 3] = [
    "This is an example sentence",
    "Each sentence is converted",
    "Accelerate's big-model inference runs MiniLM in pure Rust, layer by layer!",
];
/// Largest difference allowed between any two runs' embeddings, and between
/// the plain run and transformers'.
pub const TOLERANCE: f32 = 1e-5;
/// Layers placed on disk by the device map.
pub const DISK_LAYERS: [usize; 3] = [3, 4, 5];

/// transformers' embeddings and token ids for [`SENTENCES`], embedded so the
/// check needs nothing but the checkpoint.
const REFERENCE: &str = include_str!("../data/minilm_reference.json");
const REFERENCE_NAME: &str = "examples/data/minilm_reference.json";

/// The command line.
#[derive(Parser, Debug)]
#[command(
    about = "all-MiniLM-L6-v2 plain, dispatched with layers on disk, and from an offload folder"
)]
pub struct Args {
    /// The checkpoint folder written by `scripts/fetch_minilm.sh`.
    #[arg(long, default_value = "target/minilm")]
    pub dir: PathBuf,
}

/// What `scripts/minilm_reference.py` writes.
#[derive(serde::Deserialize)]
struct Reference {
    sentences: Vec<String>,
    token_ids: Vec<Vec<u32>>,
    embeddings: Vec<Vec<f32>>,
}

impl Reference {
    fn embedded() -> Result<Self> {
        let r: Self = serde_json::from_str(REFERENCE).with_context(|| REFERENCE_NAME)?;
        ensure!(
            r.sentences == SENTENCES,
            "{REFERENCE_NAME} holds other sentences than SENTENCES; rerun scripts/minilm_reference.py"
        );
        Ok(r)
    }
}

/// Token ids `[b, t]` padded with `[PAD]`, and the attention mask `[b, t]`.
struct Batch {
    ids: Tensor,
    mask: Tensor,
    token_ids: Vec<Vec<u32>>,
}

impl Batch {
    fn encode(tok: &Tokenizer) -> Result<Self> {
        let token_ids = SENTENCES
            .iter()
            .map(|s| Ok(tok.encode(s, true)?))
            .collect::<Result<Vec<_>>>()?;
        let pad = tok
            .inner()
            .token_to_id("[PAD]")
            .with_context(|| format!("{} has no [PAD] token", tok.path().display()))?;
        let t = token_ids.iter().map(Vec::len).max().unwrap_or(0);
        let (mut ids, mut mask) = (Vec::new(), Vec::new());
        for row in &token_ids {
            ids.extend(row.iter().copied().chain(std::iter::repeat(pad)).take(t));
            mask.extend((0..t).map(|i| u32::from(i < row.len())));
        }
        let shape = (token_ids.len(), t);
        Ok(Self {
            ids: Tensor::from_vec(ids, shape, &Device::Cpu)?,
            mask: Tensor::from_vec(mask, shape, &Device::Cpu)?,
            token_ids,
        })
    }

    /// sentence-transformers' embedding for this model: [`Bert`]'s mean
    /// pooling over the mask, then its `Normalize` module (L2, as
    /// `torch.nn.functional.normalize` with eps 1e-12).
    fn embed(&self, model: &AutoModel) -> Result<Tensor> {
        let mean = bert(model)?.sentence_embedding(&self.ids, &self.mask)?;
        let norm = mean
            .sqr()?
            .sum_keepdim(D::Minus1)?
            .sqrt()?
            .clamp(1e-12, f64::INFINITY)?;
        Ok(mean.broadcast_div(&norm)?)
    }
}

fn bert(model: &AutoModel) -> Result<&Bert> {
    match model {
        AutoModel::Bert(b) => Ok(b),
        _ => bail!("config.json names a model_type other than bert; MiniLM is a BERT encoder"),
    }
}

/// Every block on `cpu` but the layers of [`DISK_LAYERS`], on `disk`.
fn device_map(model: &AutoModel) -> DeviceMap {
    model
        .blocks()
        .iter()
        .map(|b| {
            let name = b.name();
            let layer = name
                .rsplit_once("encoder.layer.")
                .and_then(|(_, i)| i.parse::<usize>().ok());
            let on_disk = layer.is_some_and(|i| DISK_LAYERS.contains(&i));
            let placement = if on_disk {
                Placement::Disk
            } else {
                Placement::Cpu
            };
            (name, placement)
        })
        .collect()
}

fn max_abs_diff(a: &Tensor, b: &Tensor) -> Result<f32> {
    Ok((a - b)?.abs()?.max_all()?.to_scalar::<f32>()?)
}

fn count_entries(dir: &std::path::Path) -> Result<usize> {
    Ok(std::fs::read_dir(dir)
        .with_context(|| dir.display().to_string())?
        .count())
}

/// Runs the three loads, writes one JSON object to `out`, and fails when an
/// embedding differs by more than [`TOLERANCE`] from the plain run or the
/// plain run from transformers', or the token ids from transformers'.
///
/// # Errors
/// A missing or bad checkpoint folder (naming the file); the differences above.
pub fn run(args: &Args, out: &mut impl Write) -> Result<()> {
    let dir = &args.dir;
    let checkpoint = dir.join("model.safetensors");
    ensure!(
        checkpoint.is_file(),
        "{} is missing: run scripts/fetch_minilm.sh {}",
        checkpoint.display(),
        dir.display()
    );
    let reference = Reference::embedded()?;

    // (a) Plain: every weight read into RAM.
    let start = Instant::now();
    let plain = AutoModel::load(dir, DType::F32, &Device::Cpu)?;
    let plain_load_s = start.elapsed().as_secs_f64();
    let cfg = bert(&plain)?.config().clone();
    ensure!(
        cfg.num_hidden_layers > *DISK_LAYERS.iter().max().unwrap_or(&0),
        "{}: the device map needs at least {} layers, num_hidden_layers is {}",
        dir.join("config.json").display(),
        DISK_LAYERS.iter().max().unwrap_or(&0) + 1,
        cfg.num_hidden_layers
    );
    let tok = Tokenizer::for_model(dir, cfg.vocab_size)?;
    let batch = Batch::encode(&tok)?;
    let start = Instant::now();
    let plain_emb = batch.embed(&plain)?;
    let plain_forward_s = start.elapsed().as_secs_f64();
    let map = device_map(&plain);
    let prefix = plain.blocks()[0]
        .name()
        .trim_end_matches("embeddings")
        .to_string();
    drop(plain);

    // (b) load_checkpoint_and_dispatch: disk layers are read from the
    // checkpoint per forward, so the offload folder stays empty.
    let offload = tempfile::tempdir()?;
    let start = Instant::now();
    let opts = LoadDispatchOptions {
        device_map: DeviceMapChoice::Map(map.clone()),
        dtype: None,
        offload_folder: Some(offload.path().to_path_buf()),
        main_device: None,
        adapter: None,
    };
    let (model, report) = AutoModel::load_dispatched(dir, &opts)?;
    let load_s = start.elapsed().as_secs_f64();
    let disk_parts = report.count(Placement::Disk);
    ensure!(
        disk_parts == DISK_LAYERS.len(),
        "{disk_parts} parts on disk, expected {}",
        DISK_LAYERS.len()
    );
    let start = Instant::now();
    let dispatched = batch.embed(&model)?;
    let forward_s = start.elapsed().as_secs_f64();
    // The disk parts must be placeholders again after the forward.
    let resident: Vec<usize> = model
        .blocks()
        .iter()
        .map(|b| b.weights().resident_bytes())
        .collect();
    drop(model);

    // (c) dispatch_model over a loaded model with no weights map: the disk
    // layers are written to the offload folder and read back per forward.
    let folder = tempfile::tempdir()?;
    let model = AutoModel::load(dir, DType::F32, &Device::Cpu)?;
    let dispatch = DispatchOptions {
        main_device: None,
        offload_dir: Some(folder.path().to_path_buf()),
        weights_map: None,
    };
    dispatch_model(&model, &map, &dispatch)?;
    let folder_files = count_entries(folder.path())?;
    let from_folder = batch.embed(&model)?;

    let python = Tensor::new(reference.embeddings.clone(), &Device::Cpu)
        .with_context(|| format!("{REFERENCE_NAME}: embeddings are not a 3 x d matrix"))?;
    ensure!(
        python.dims() == plain_emb.dims(),
        "{REFERENCE_NAME}: embeddings {:?}, the model gives {:?}",
        python.dims(),
        plain_emb.dims()
    );
    let diff = max_abs_diff(&plain_emb, &dispatched)?;
    let diff_folder = max_abs_diff(&plain_emb, &from_folder)?;
    let diff_python = max_abs_diff(&plain_emb, &python)?;
    let ids_match = batch.token_ids == reference.token_ids;
    let first: Vec<f32> = plain_emb.get(0)?.narrow(0, 0, 5)?.to_vec1()?;
    let json = serde_json::json!({
        "max_abs_diff": diff,
        "max_abs_diff_offload_folder": diff_folder,
        "max_abs_diff_transformers": diff_python,
        "token_ids_match_transformers": ids_match,
        "dims": plain_emb.dims(),
        "sentences": SENTENCES,
        "token_counts": batch.token_ids.iter().map(Vec::len).collect::<Vec<_>>(),
        "token_ids": batch.token_ids,
        "checkpoint_prefix": prefix,
        "disk_layers": DISK_LAYERS,
        "device_map": map,
        "load_s": load_s,
        "forward_s": forward_s,
        "plain_load_s": plain_load_s,
        "plain_forward_s": plain_forward_s,
        "resident_bytes_per_part_after_forward": resident,
        "offload_dir_entries_after_load_checkpoint_and_dispatch": count_entries(offload.path())?,
        "offload_folder_files": folder_files,
        "embedding0_head": first,
    });
    writeln!(out, "{json}")?;
    ensure!(
        ids_match,
        "token ids {:?} differ from transformers' {:?} ({REFERENCE_NAME})",
        batch.token_ids,
        reference.token_ids
    );
    ensure!(
        diff <= TOLERANCE && diff_folder <= TOLERANCE,
        "dispatched embeddings differ from the plain ones by {diff} / {diff_folder} > {TOLERANCE}"
    );
    ensure!(
        diff_python <= TOLERANCE,
        "plain embeddings differ from transformers' ({REFERENCE_NAME}) by {diff_python} > {TOLERANCE}"
    );
    Ok(())
}
