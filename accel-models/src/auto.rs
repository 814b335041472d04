//! [`AutoModel`]: any supported checkpoint folder, picked by `model_type`.

use std::path::Path;
use std::sync::Arc;

use accel_bigmodel::lora::LoraAdapter;
use accel_bigmodel::quant::BnbQuantizationConfig;
use accel_bigmodel::{
    infer_auto_device_map, CheckpointSource, DeviceMap, EmptyWeights, ModuleTree, PlanOptions,
};
use accel_nn::block::{AnyBlock, Model};
use accel_nn::{
    load_checkpoint_and_dispatch, DeviceMapChoice, DispatchReport, LoadDispatchOptions,
};
use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;

use crate::error::bail_input;
use crate::{Bert, Gemma3, Gpt2, Llama, ModelConfig, Result};

/// A model of whichever architecture a folder's `config.json` names
/// (transformers' `AutoModel` / `AutoModelForCausalLM`).
#[derive(Debug)]
pub enum AutoModel {
    /// `llama`, `mistral`, `qwen2`, `qwen3`, `phi3`, `mixtral`, `qwen3_moe`.
    Llama(Llama),
    /// `gemma3_text`, `gemma3` (its text model), `gemma2`.
    Gemma3(Gemma3),
    /// `gpt2`.
    Gpt2(Gpt2),
    /// `bert`.
    Bert(Bert),
}

impl AutoModel {
    /// Builds the architecture of `cfg` on `vb`.
    ///
    /// # Errors
    /// A weight the source lacks or holds in another shape.
    pub fn new(cfg: &ModelConfig, vb: VarBuilder) -> Result<Self> {
        Ok(match cfg {
            ModelConfig::Llama(c) => Self::Llama(Llama::new(c, vb)?),
            ModelConfig::Gemma3(c) => Self::Gemma3(Gemma3::new(c, vb)?),
            ModelConfig::Gpt2(c) => Self::Gpt2(Gpt2::new(c, vb)?),
            ModelConfig::Bert(c) => Self::Bert(Bert::new(c, vb)?),
        })
    }

    /// Loads a checkpoint folder onto `device`, weights converted to `dtype`.
    /// `dir` may also be a Hugging Face model id (`org/name`), found in the
    /// Hugging Face cache or downloaded ([`crate::hub::resolve_model`]).
    ///
    /// # Errors
    /// Those of [`ModelConfig::from_path`]; a missing shard, tensor or shape
    /// mismatch, naming the file and the tensor; a model id found nowhere.
    pub fn load(dir: impl AsRef<Path>, dtype: DType, device: &Device) -> Result<Self> {
        Self::load_with_adapter(dir, None, dtype, device)
    }

    /// [`AutoModel::load`] with a PEFT LoRA adapter folder merged into the
    /// weights it adapts as they are read: the model PEFT's
    /// `PeftModel.from_pretrained(base, adapter).merge_and_unload()` gives.
    ///
    /// # Errors
    /// As [`AutoModel::load`]; a bad adapter folder (see [`LoraAdapter::open`])
    /// or one adapting modules the model lacks.
    pub fn load_with_adapter(
        dir: impl AsRef<Path>,
        adapter: Option<&Path>,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        Self::load_quantized(dir, None, adapter, dtype, device)
    }

    /// Loads a checkpoint folder with its linear layers quantized as
    /// `quantization` says (transformers' `from_pretrained(...,
    /// quantization_config=BitsAndBytesConfig(...))`), each weight
    /// quantized as it is read; a folder saved quantized (its `config.json`
    /// has a `quantization_config`) loads quantized with `None`. Other
    /// weights are converted to `dtype`. On a quantized model an adapter
    /// runs unmerged, as PEFT runs it on a 4-bit base; on a full-precision
    /// one it is merged as [`AutoModel::load_with_adapter`] says.
    ///
    /// # Errors
    /// As [`AutoModel::load_with_adapter`]; quantization asked for on a
    /// folder that is already quantized; a bad quantization setting.
    pub fn load_quantized(
        dir: impl AsRef<Path>,
        quantization: Option<&BnbQuantizationConfig>,
        adapter: Option<&Path>,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        let dir = &crate::hub::resolve_model(dir.as_ref(), None)?;
        let mut cfg = ModelConfig::from_path(dir)?;
        let mut source = CheckpointSource::open(dir)?;
        if let Some(q) = quantization {
            if cfg.quantization().is_some() {
                bail_input!(
                    "quantization",
                    "{} is already quantized (config.json has a quantization_config); load it \
                     without quantization flags",
                    dir.display()
                );
            }
            cfg.set_quantization(q.clone());
            if let Some(on_load) = cfg.quantize_on_load()? {
                source = source.with_quantization(on_load)?;
            }
        }
        if let Some(adapter) = adapter {
            let adapter = Arc::new(LoraAdapter::open(adapter)?);
            source = if cfg.quantization().is_some() {
                cfg.set_lora(adapter.config().clone());
                source.with_adapter_unmerged(adapter)?
            } else {
                source.with_adapter(adapter)?
            };
        }
        Self::new(
            &cfg,
            VarBuilder::from_backend(Box::new(source), dtype, device.clone()),
        )
    }

    /// The model of a checkpoint folder with placeholder weights (nothing
    /// read), its optional parts (BERT's pooler, GPT-2's prefix) as the
    /// checkpoint has them: what [`accel_nn::dispatch_model`] and
    /// [`load_checkpoint_and_dispatch`] take (Accelerate's
    /// `init_empty_weights`).
    ///
    /// # Errors
    /// As [`AutoModel::load`], without reading tensor data.
    pub fn empty(dir: impl AsRef<Path>, dtype: DType) -> Result<Self> {
        let dir = &crate::hub::resolve_model(dir.as_ref(), None)?;
        let cfg = ModelConfig::from_path(dir)?;
        let source = Arc::new(CheckpointSource::open(dir)?);
        let names = source.names().map(str::to_string);
        // A quantized weight's state and code books are read for real: its
        // parts' shapes follow from them.
        let reader = source.clone();
        let known = EmptyWeights::with_known_names(names).with_describer(Arc::new(move |n, d| {
            reader.tensor(n, &Device::Cpu, Some(d)).ok()
        }));
        Self::new(&cfg, known.var_builder(dtype, &Device::Cpu))
    }

    /// Loads a checkpoint folder dispatched as `opts` says (CPU and disk
    /// offload, a device map or Accelerate's "auto" planning over
    /// [`Model::tree`]): Accelerate's `load_checkpoint_and_dispatch` on an
    /// empty model.
    ///
    /// # Errors
    /// As [`AutoModel::empty`] and [`load_checkpoint_and_dispatch`].
    pub fn load_dispatched(
        dir: impl AsRef<Path>,
        opts: &LoadDispatchOptions,
    ) -> Result<(Self, DispatchReport)> {
        let dir = &crate::hub::resolve_model(dir.as_ref(), None)?;
        let model = Self::empty(dir, opts.dtype.unwrap_or(DType::F32))?;
        let mut opts = opts.clone();
        if let DeviceMapChoice::Auto(plan) = &opts.device_map {
            let map = model.plan_device_map(plan)?;
            opts.device_map = DeviceMapChoice::Map(model.weights_only(&map));
        }
        let report = load_checkpoint_and_dispatch(&model, dir, &opts)?;
        Ok((model, report))
    }

    /// Accelerate's `infer_auto_device_map` over the model's own module tree
    /// (transformers' module order, tied `lm_head`, rotary and position
    /// buffers): the map Python plans for the transformers model under the
    /// same budget. Pass the block class in `no_split_module_classes` to
    /// keep decoder layers whole.
    ///
    /// # Errors
    /// Those of [`infer_auto_device_map`].
    pub fn plan_device_map(&self, plan: &PlanOptions) -> Result<DeviceMap> {
        // Weights as built; `plan.dtype` converts them in the sizes, as in Accelerate.
        let tree = self.tree(None)?;
        Ok(infer_auto_device_map(&tree, plan)?.device_map)
    }

    /// `map` without the keys that hold no weight (buffer-only modules such
    /// as `model.rotary_emb`, which Python places but which this crate
    /// recomputes per forward): what [`accel_nn::dispatch_model`] accepts.
    pub fn weights_only(&self, map: &DeviceMap) -> DeviceMap {
        let names: Vec<String> = self.named_tensors().into_iter().map(|(n, _)| n).collect();
        let blocks: Vec<String> = self.blocks().iter().map(|b| b.name()).collect();
        map.iter()
            .filter(|(k, _)| {
                let prefix = format!("{k}.");
                k.is_empty()
                    || blocks.iter().any(|b| b == k)
                    || names.iter().any(|n| n == k || n.starts_with(&prefix))
            })
            .map(|(k, p)| (k.to_string(), p))
            .collect()
    }

    /// Logits `[b, t, vocab]` for the decoders, the last hidden state
    /// `[b, t, d]` for BERT (no attention mask).
    ///
    /// # Errors
    /// Whatever the model returns.
    pub fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        match self {
            Self::Llama(m) => m.forward(ids),
            Self::Gemma3(m) => m.forward(ids),
            Self::Gpt2(m) => m.forward(ids),
            Self::Bert(m) => m.forward(ids, None, None),
        }
    }

    /// Mean next-token cross-entropy (decoders only).
    ///
    /// # Errors
    /// [`crate::Error::BadInput`] for BERT; whatever the model returns.
    pub fn loss(&self, ids: &Tensor, labels: &Tensor) -> Result<Tensor> {
        match self {
            Self::Llama(m) => m.loss(ids, labels),
            Self::Gemma3(m) => m.loss(ids, labels),
            Self::Gpt2(m) => m.loss(ids, labels),
            Self::Bert(_) => bail_input!("loss", "BERT has no language-model head"),
        }
    }

    /// Greedy decoding with a KV cache (decoders only).
    ///
    /// # Errors
    /// [`crate::Error::BadInput`] for BERT; whatever the model returns.
    pub fn generate(
        &self,
        prompt: &[u32],
        max_new_tokens: usize,
        eos_token_ids: &[u32],
    ) -> Result<Vec<u32>> {
        match self {
            Self::Llama(m) => m.generate(prompt, max_new_tokens, eos_token_ids),
            Self::Gemma3(m) => m.generate(prompt, max_new_tokens, eos_token_ids),
            Self::Gpt2(m) => m.generate(prompt, max_new_tokens, eos_token_ids),
            Self::Bert(_) => bail_input!("generate", "BERT is an encoder"),
        }
    }

    /// [`AutoModel::generate`] with each token chosen as `sampling` says
    /// (transformers' repetition penalty, temperature, top-k, top-p and a
    /// seeded draw; greedy when `do_sample` is off).
    ///
    /// # Errors
    /// [`crate::Error::BadInput`] for BERT or a bad setting (named); whatever
    /// the model returns.
    pub fn generate_with(
        &self,
        prompt: &[u32],
        max_new_tokens: usize,
        eos_token_ids: &[u32],
        sampling: &crate::Sampling,
    ) -> Result<Vec<u32>> {
        use crate::decode::generate;
        match self {
            Self::Llama(m) => generate(m, prompt, max_new_tokens, eos_token_ids, sampling),
            Self::Gemma3(m) => generate(m, prompt, max_new_tokens, eos_token_ids, sampling),
            Self::Gpt2(m) => generate(m, prompt, max_new_tokens, eos_token_ids, sampling),
            Self::Bert(_) => bail_input!("generate", "BERT is an encoder"),
        }
    }

    /// The token ids that end generation by default (`eos_token_id`).
    pub fn eos_token_ids(&self) -> Vec<u32> {
        match self {
            Self::Llama(m) => m.config().eos_token_ids.clone(),
            Self::Gemma3(m) => m.config().eos_token_ids.clone(),
            Self::Gpt2(m) => m.config().eos_token_id.into_iter().collect(),
            Self::Bert(_) => Vec::new(),
        }
    }

    /// transformers' block class that must stay on one device: the decoder
    /// or encoder layer (`LlamaDecoderLayer`, `GPT2Block`, `BertLayer`), what
    /// `no_split_module_classes` and `fsdp_transformer_layer_cls_to_wrap` name.
    pub fn layer_class(&self) -> &'static str {
        match self {
            Self::Llama(m) => m.config().family.layer_class(),
            Self::Gemma3(m) => m.config().layer_class(),
            Self::Gpt2(_) => "GPT2Block",
            Self::Bert(_) => "BertLayer",
        }
    }

    /// The vocabulary size.
    pub fn vocab_size(&self) -> usize {
        match self {
            Self::Llama(m) => m.config().vocab_size,
            Self::Gemma3(m) => m.config().vocab_size,
            Self::Gpt2(m) => m.config().vocab_size,
            Self::Bert(m) => m.config().vocab_size,
        }
    }

    fn inner(&self) -> &dyn Model {
        match self {
            Self::Llama(m) => m,
            Self::Gemma3(m) => m,
            Self::Gpt2(m) => m,
            Self::Bert(m) => m,
        }
    }
}

impl Model for AutoModel {
    fn blocks(&self) -> Vec<&dyn AnyBlock> {
        self.inner().blocks()
    }

    fn tree(&self, dtype: Option<DType>) -> accel_nn::Result<ModuleTree> {
        self.inner().tree(dtype)
    }
}
