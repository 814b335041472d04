//! What the Hugging Face command-line examples (`hf_logits`, `generate`)
//! share: loading a checkpoint folder plainly, with a planned budget
//! (`--max-memory cpu=300KB,disk=1GB`) or a device map file, and printing the
//! device map as Python writes it.

use std::path::{Path, PathBuf};

use accel_core::bigmodel::{DeviceMap, MemorySize, Placement, PlanOptions};
use accel_core::models::AutoModel;
use accel_core::nn::{DeviceMapChoice, LoadDispatchOptions};
use anyhow::{bail, Context, Result};
use candle_core::{DType, Device};

/// How to place a model: all on the CPU, planned under a budget, or by a map
/// (the placement flags `hf_logits` and `generate` share).
#[derive(Debug, Clone, Default, clap::Args)]
pub struct Placing {
    /// Budget per device for planning, e.g. `cpu=300KB,disk=1GB` (Accelerate's `max_memory`).
    #[arg(long)]
    pub max_memory: Option<String>,
    /// A JSON device map as Python writes it (`{"model.embed_tokens": "cpu", ...}`).
    #[arg(long)]
    pub device_map: Option<PathBuf>,
    /// Folder for offloaded weights the checkpoint cannot serve.
    #[arg(long)]
    pub offload_folder: Option<PathBuf>,
    /// A PEFT LoRA adapter folder (adapter_config.json, adapter_model.safetensors) merged
    /// into the model's weights as they load, as PEFT's merge_and_unload (on a quantized
    /// model it runs unmerged, as PEFT runs it on a 4-bit base).
    #[arg(long)]
    pub adapter: Option<PathBuf>,
    /// Quantization of the linear layers as they load.
    #[command(flatten)]
    pub quant: QuantFlags,
}

pub use accel_cli::QuantFlags;

/// `"cpu=300KB,disk=1GB"` as Accelerate's `max_memory` entries, in order.
///
/// # Errors
/// An entry without `=`, an unknown device.
pub fn parse_max_memory(text: &str) -> Result<Vec<(Placement, MemorySize)>> {
    text.split(',')
        .filter(|e| !e.trim().is_empty())
        .map(|entry| {
            let (device, size) = entry
                .split_once('=')
                .with_context(|| format!("--max-memory entry {entry:?} is not DEVICE=SIZE"))?;
            Ok((
                Placement::parse_key(device.trim())?,
                MemorySize::Text(size.trim().to_string()),
            ))
        })
        .collect()
}

/// Loads `dir` placed as `placing` says; returns the model and the device map
/// to print (the planned one as Accelerate plans it for the transformers
/// model, the file's, or `{"": "cpu"}` for a plain load).
///
/// # Errors
/// Bad flags, a bad checkpoint, a map naming modules the model lacks.
pub fn load(dir: &Path, placing: &Placing) -> Result<(AutoModel, DeviceMap)> {
    let quantization = placing.quant.config()?;
    let map = match (&placing.max_memory, &placing.device_map) {
        (Some(_), Some(_)) => bail!("give --max-memory or --device-map, not both"),
        (None, None) => {
            let model = AutoModel::load_quantized(
                dir,
                quantization.as_ref(),
                placing.adapter.as_deref(),
                DType::F32,
                &Device::Cpu,
            )?;
            return Ok((
                model,
                [(String::new(), Placement::Cpu)].into_iter().collect(),
            ));
        }
        (budget, file) if quantization.is_some() => {
            // Accelerate's load_and_quantize_model: planned over the quantized sizes.
            let choice = match (budget, file) {
                (Some(budget), _) => DeviceMapChoice::Auto(
                    PlanOptions::new(parse_max_memory(budget)?).with_no_split_module_classes([
                        AutoModel::empty(dir, DType::F32)?.layer_class(),
                    ]),
                ),
                (_, Some(file)) => DeviceMapChoice::Map(read_device_map(file)?),
                (None, None) => unreachable!("a plain load returned above"),
            };
            let opts = LoadDispatchOptions {
                device_map: choice,
                dtype: None,
                offload_folder: placing.offload_folder.clone(),
                main_device: None,
                adapter: placing.adapter.clone(),
            };
            let config = quantization.expect("checked by the guard");
            return Ok(accel_core::model::load_and_quantize_model(
                dir, &config, &opts,
            )?);
        }
        (Some(budget), None) => {
            let empty = AutoModel::empty(dir, DType::F32)?;
            let plan = PlanOptions::new(parse_max_memory(budget)?)
                .with_no_split_module_classes([empty.layer_class()]);
            empty.plan_device_map(&plan)?
        }
        (None, Some(file)) => read_device_map(file)?,
    };
    let empty = AutoModel::empty(dir, DType::F32)?;
    let opts = LoadDispatchOptions {
        device_map: DeviceMapChoice::Map(empty.weights_only(&map)),
        dtype: None,
        offload_folder: placing.offload_folder.clone(),
        main_device: None,
        adapter: placing.adapter.clone(),
    };
    drop(empty);
    let (model, _report) = AutoModel::load_dispatched(dir, &opts)?;
    Ok((model, map))
}

/// The `--device-map` JSON file.
fn read_device_map(file: &Path) -> Result<DeviceMap> {
    let text = std::fs::read_to_string(file)
        .with_context(|| format!("reading --device-map {}", file.display()))?;
    serde_json::from_str(&text).with_context(|| format!("{}: not a device map", file.display()))
}

/// The device map as a JSON object text in the map's order (Python's
/// order; `serde_json::Value` would sort the keys).
///
/// # Errors
/// Never in practice (serialising strings).
pub fn device_map_json(map: &DeviceMap) -> Result<String> {
    Ok(serde_json::to_string(map)?)
}

/// `1,17,42` as token ids.
///
/// # Errors
/// A piece that is not a non-negative integer.
pub fn parse_ids(text: &str) -> Result<Vec<u32>> {
    text.split(',')
        .map(|s| {
            s.trim()
                .parse::<u32>()
                .with_context(|| format!("{s:?} is not a token id"))
        })
        .collect()
}

/// Fails unless every id of `ids` (given by `flag`) has an embedding in a
/// model of `vocab` tokens, naming the flag, rather than leaving an
/// index-select error deep in the forward.
///
/// # Errors
/// The first id `>= vocab`.
pub fn check_ids(ids: &[u32], vocab: usize, flag: &str) -> Result<()> {
    match ids.iter().find(|&&id| id as usize >= vocab) {
        Some(id) => bail!("{flag}: token id {id} is not below the model's vocab_size {vocab}"),
        None => Ok(()),
    }
}

/// A Hugging Face causal LM as the Trainer's model: a batch is one tensor of
/// token ids `[b, t]`, the loss is transformers' (labels = ids, shifted in
/// the model), predictions are the next-token argmax at the `t - 1`
/// positions that have a label. Its blocks are the model's, so the
/// Trainer's FSDP shards them by class (`LlamaDecoderLayer`, `GPT2Block`).
#[derive(Debug)]
pub struct HfLm(pub accel_core::models::AutoModel);

impl HfLm {
    /// Builds the architecture of `cfg` on `vb` (the Trainer's build
    /// closure); BERT is refused, having no language-model head.
    ///
    /// # Errors
    /// BERT; a weight the source lacks or holds in another shape.
    pub fn new(
        cfg: &accel_core::models::ModelConfig,
        vb: candle_nn::VarBuilder,
    ) -> accel_core::Result<Self> {
        if let accel_core::models::ModelConfig::Bert(_) = cfg {
            return Err(accel_core::Error::Usage(
                "model_type bert is an encoder without a language-model head; fine-tune a \
                 causal language model (llama, mistral, qwen2, qwen3, phi3, mixtral, qwen3_moe, gemma3, gpt2)"
                    .into(),
            ));
        }
        Ok(Self(AutoModel::new(cfg, vb)?))
    }
}

impl accel_core::nn::Model for HfLm {
    fn blocks(&self) -> Vec<&dyn accel_core::nn::AnyBlock> {
        self.0.blocks()
    }

    fn tree(
        &self,
        dtype: Option<DType>,
    ) -> accel_core::nn::Result<accel_core::bigmodel::ModuleTree> {
        self.0.tree(dtype)
    }
}

impl accel_core::TrainModel for HfLm {
    type Batch = Vec<candle_core::Tensor>;

    /// `batch` is `[ids]` (every token counts) or `[ids, labels]` (a
    /// [`JsonlDataset`](accel_core::data::JsonlDataset)'s, ignored positions
    /// `u32::MAX`).
    fn loss(&self, batch: &Self::Batch) -> accel_core::Result<candle_core::Tensor> {
        Ok(self.0.loss(&batch[0], batch.get(1).unwrap_or(&batch[0]))?)
    }

    fn predictions(
        &self,
        batch: &Self::Batch,
    ) -> accel_core::Result<Option<accel_core::trainer::Predictions>> {
        let ids = &batch[0];
        let t = ids.dim(1)?;
        let logits = self.0.forward(ids)?;
        Ok(Some(accel_core::trainer::Predictions {
            predictions: logits.narrow(1, 0, t - 1)?.argmax(candle_core::D::Minus1)?,
            labels: batch.get(1).unwrap_or(ids).narrow(1, 1, t - 1)?,
        }))
    }
}
