//! A user's own data: a JSON Lines file of training examples, tokenized and
//! cut into fixed-length windows for a causal language model, as TRL's
//! `SFTTrainer` prepares a dataset.
//!
//! Each line is one example, in one of three shapes:
//!
//! * `{"text": "..."}`: the loss is on every token;
//! * `{"prompt": "...", "completion": "..."}`: the loss is on the completion
//!   only (the prompt's labels are ignored);
//! * `{"messages": [{"role": ..., "content": ...}, ...]}`: rendered with the
//!   model's chat template ([`ChatTemplate`](super::ChatTemplate)); the loss
//!   is on the assistant's tokens only, as TRL's `assistant_only_loss`.
//!
//! An example is tokenized with the tokenizer's own special tokens (a Llama
//! tokenizer adds its BOS, GPT-2's adds nothing) and ends with the model's
//! EOS, as TRL appends it. Examples are then packed end to end into windows
//! of `seq_len` tokens (the tail that fills no window is dropped), or, without
//! packing, each is truncated or padded to `seq_len` (padding ignored by the
//! loss). The file is read a line at a time: only the token ids are kept.
//!
//! Samples are windows; [`DataLoader`](super::DataLoader) shuffles them per
//! epoch with the Accelerator's seed and splits them across ranks.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};

use accel_models::Tokenizer;
use candle_core::{Device, Tensor};
use serde::Deserialize;

use super::Dataset;
use crate::rng::SplitMix64;
use crate::{Error, Result};

/// The label of a position the loss ignores (`-100` in PyTorch).
pub const IGNORE: u32 = u32::MAX;

/// How a [`JsonlDataset`] cuts its examples into windows.
#[derive(Debug, Clone)]
pub struct JsonlOptions {
    /// Tokens per window.
    pub seq_len: usize,
    /// Pack examples end to end (true), or truncate and pad each one.
    pub packing: bool,
    /// Appended to every example unless it already ends with it.
    pub eos_token_id: Option<u32>,
    /// Fills the windows of short examples without packing.
    pub pad_token_id: u32,
    /// Renders `{"messages": ...}` examples; without one they are an error.
    pub chat: Option<super::ChatTemplate>,
}

impl JsonlOptions {
    /// Packed windows of `seq_len` tokens, no EOS, padding with 0.
    pub fn new(seq_len: usize) -> Self {
        Self {
            seq_len,
            packing: true,
            eos_token_id: None,
            pad_token_id: 0,
            chat: None,
        }
    }
}

/// One line of the file.
#[derive(Deserialize)]
#[serde(deny_unknown_fields, untagged)]
enum Line {
    Text { text: String },
    PromptCompletion { prompt: String, completion: String },
}

/// Windows of token ids and labels from a JSON Lines file.
#[derive(Debug, Clone)]
pub struct JsonlDataset {
    /// `n x seq_len` token ids, row-major.
    ids: Vec<u32>,
    /// `n x seq_len` labels ([`IGNORE`] where the loss does not look).
    labels: Vec<u32>,
    seq_len: usize,
    examples: usize,
    path: PathBuf,
    device: Device,
}

/// The error for line `line` (1-based) of `path`.
fn bad_line(path: &Path, line: usize, reason: impl Into<String>) -> Error {
    Error::Dataset {
        path: path.to_path_buf(),
        line,
        reason: reason.into(),
    }
}

/// The ids and labels of a chat example: its rendering, the loss on the
/// assistant's tokens only (the template ends the turns: no EOS is added).
fn chat_example(
    path: &Path,
    n: usize,
    messages: &serde_json::Value,
    tokenizer: &Tokenizer,
    options: &JsonlOptions,
) -> Result<(Vec<u32>, Vec<u32>)> {
    let Some(template) = &options.chat else {
        return Err(bad_line(
            path,
            n,
            "chat examples ({\"messages\": [...]}) need the model's chat template \
             (chat_template.jinja, or chat_template in tokenizer_config.json); none was found",
        ));
    };
    let turns = messages.as_array().filter(|m| {
        m.iter()
            .all(|t| t.get("role").is_some_and(|r| r.is_string()) && t.get("content").is_some())
    });
    if turns.is_none() {
        return Err(bad_line(
            path,
            n,
            "\"messages\" must be an array of {\"role\": string, \"content\": ...}",
        ));
    }
    let (ids, mask) = template
        .tokenize(tokenizer, messages, false)
        .map_err(|e| bad_line(path, n, e.to_string()))?;
    let labels = ids
        .iter()
        .zip(&mask)
        .map(|(&id, &m)| if m { id } else { IGNORE })
        .collect();
    Ok((ids, labels))
}

impl JsonlDataset {
    /// Reads, tokenizes and windows `path`; batches are built on `device`.
    ///
    /// # Errors
    /// [`Error::Dataset`] naming the file, and the line (1-based) for a line
    /// that is not JSON, has neither `text` nor `prompt` and `completion`,
    /// or does not tokenize; naming the file for an empty dataset or one
    /// shorter than a window; a file that cannot be read.
    pub fn open(
        path: impl AsRef<Path>,
        tokenizer: &Tokenizer,
        options: &JsonlOptions,
        device: &Device,
    ) -> Result<Self> {
        let path = path.as_ref();
        if options.seq_len < 2 {
            return Err(bad_line(
                path,
                0,
                "seq_len must be at least 2 (one next token)",
            ));
        }
        let file = std::fs::File::open(path).map_err(|e| Error::io("opening", path, e))?;
        let mut windows = Windows::new(options);
        let mut examples = 0;
        for (i, line) in BufReader::new(file).lines().enumerate() {
            let n = i + 1;
            let line = line.map_err(|e| Error::io("reading", path, e))?;
            if line.trim().is_empty() {
                continue;
            }
            let value: serde_json::Value = serde_json::from_str(&line)
                .map_err(|e| bad_line(path, n, format!("not JSON: {e}")))?;
            if let Some(messages) = value.get("messages") {
                let (ids, labels) = chat_example(path, n, messages, tokenizer, options)?;
                if !ids.is_empty() {
                    windows.push(&ids, &labels);
                    examples += 1;
                }
                continue;
            }
            let parsed: Line = serde_json::from_value(value).map_err(|_| {
                bad_line(
                    path,
                    n,
                    "expected {\"text\": string}, {\"prompt\": string, \"completion\": string} \
                     or {\"messages\": [{\"role\": string, \"content\": string}, ...]}",
                )
            })?;
            let encode = |text: &str, special: bool| {
                tokenizer
                    .encode(text, special)
                    .map_err(|e| bad_line(path, n, e.to_string()))
            };
            let (mut ids, mut labels) = match parsed {
                Line::Text { text } => {
                    let ids = encode(&text, true)?;
                    (ids.clone(), ids)
                }
                Line::PromptCompletion { prompt, completion } => {
                    let mut ids = encode(&prompt, true)?;
                    let mut labels = vec![IGNORE; ids.len()];
                    let completion = encode(&completion, false)?;
                    labels.extend(&completion);
                    ids.extend(completion);
                    (ids, labels)
                }
            };
            if let Some(eos) = options.eos_token_id {
                if ids.last() != Some(&eos) {
                    ids.push(eos);
                    labels.push(eos);
                }
            }
            if ids.is_empty() {
                continue;
            }
            windows.push(&ids, &labels);
            examples += 1;
        }
        if examples == 0 {
            return Err(bad_line(path, 0, "the dataset has no examples"));
        }
        let (ids, labels) = windows.finish();
        if ids.is_empty() {
            return Err(bad_line(
                path,
                0,
                format!(
                    "the dataset's {examples} example(s) hold fewer tokens than one window of \
                     {} (lower --seq-len, or add data)",
                    options.seq_len
                ),
            ));
        }
        Ok(Self {
            ids,
            labels,
            seq_len: options.seq_len,
            examples,
            path: path.to_path_buf(),
            device: device.clone(),
        })
    }

    /// Examples read from the file.
    pub fn examples(&self) -> usize {
        self.examples
    }

    /// Tokens per window.
    pub fn seq_len(&self) -> usize {
        self.seq_len
    }

    /// The file the dataset was read from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Splits off a held-out set of `fraction` of the windows (at least one
    /// when `fraction > 0`), chosen with `seed`; returns `(train, eval)`.
    ///
    /// # Errors
    /// A fraction outside `[0, 1)`, or one that leaves no training window.
    pub fn split(self, fraction: f64, seed: u64) -> Result<(Self, Self)> {
        let n = self.len();
        if !(0.0..1.0).contains(&fraction) {
            return Err(bad_line(
                &self.path,
                0,
                format!("the eval fraction {fraction} is not in [0, 1)"),
            ));
        }
        let held = if fraction > 0.0 {
            ((n as f64 * fraction).ceil() as usize).max(1)
        } else {
            0
        };
        if held >= n {
            return Err(bad_line(
                &self.path,
                0,
                format!(
                    "an eval fraction of {fraction} leaves none of the {n} windows to train on"
                ),
            ));
        }
        // A seeded permutation: which windows are held out does not follow
        // the file's order.
        let order = SplitMix64::new(seed).permutation(n);
        let (eval, train) = order.split_at(held);
        let (mut eval, mut train) = (eval.to_vec(), train.to_vec());
        eval.sort_unstable();
        train.sort_unstable();
        Ok((self.subset(&train), self.subset(&eval)))
    }

    /// Windows `rows` of this dataset (without copying the others first).
    fn subset(&self, rows: &[usize]) -> Self {
        Self {
            ids: gather_rows(&self.ids, rows, self.seq_len),
            labels: gather_rows(&self.labels, rows, self.seq_len),
            seq_len: self.seq_len,
            examples: self.examples,
            path: self.path.clone(),
            device: self.device.clone(),
        }
    }
}

impl Dataset for JsonlDataset {
    /// `[ids, labels]`, each `(batch, seq_len)` u32.
    type Batch = Vec<Tensor>;

    fn len(&self) -> usize {
        self.ids.len() / self.seq_len
    }

    fn get_batch(&self, indices: &[usize]) -> Result<Vec<Tensor>> {
        let (l, shape) = (self.seq_len, (indices.len(), self.seq_len));
        Ok(vec![
            Tensor::from_vec(gather_rows(&self.ids, indices, l), shape, &self.device)?,
            Tensor::from_vec(gather_rows(&self.labels, indices, l), shape, &self.device)?,
        ])
    }
}

/// Rows `rows` of the row-major `n x len` matrix `v`, in that order.
fn gather_rows(v: &[u32], rows: &[usize], len: usize) -> Vec<u32> {
    rows.iter()
        .flat_map(|&r| v[r * len..(r + 1) * len].iter().copied())
        .collect()
}

/// Cuts examples into windows as they arrive.
struct Windows {
    seq_len: usize,
    packing: bool,
    pad: u32,
    ids: Vec<u32>,
    labels: Vec<u32>,
    /// Packing: the tokens not yet in a full window.
    open_ids: Vec<u32>,
    open_labels: Vec<u32>,
}

impl Windows {
    fn new(o: &JsonlOptions) -> Self {
        Self {
            seq_len: o.seq_len,
            packing: o.packing,
            pad: o.pad_token_id,
            ids: vec![],
            labels: vec![],
            open_ids: vec![],
            open_labels: vec![],
        }
    }

    fn push(&mut self, ids: &[u32], labels: &[u32]) {
        let l = self.seq_len;
        if !self.packing {
            let n = ids.len().min(l);
            self.ids.extend(&ids[..n]);
            self.labels.extend(&labels[..n]);
            self.ids.extend(std::iter::repeat_n(self.pad, l - n));
            self.labels.extend(std::iter::repeat_n(IGNORE, l - n));
            return;
        }
        self.open_ids.extend(ids);
        self.open_labels.extend(labels);
        let full = self.open_ids.len() / l * l;
        self.ids.extend(self.open_ids.drain(..full));
        self.labels.extend(self.open_labels.drain(..full));
    }

    fn finish(self) -> (Vec<u32>, Vec<u32>) {
        (self.ids, self.labels)
    }
}

#[cfg(test)]
#[path = "jsonl_tests.rs"]
mod tests;
