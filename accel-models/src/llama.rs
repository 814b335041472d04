//! The Llama family (Llama 2/3, Mistral, Qwen2) with transformers' names.
//!
//! Blocks, as transformers names the modules: `model.embed_tokens`
//! (`Embedding`), `model.layers.{i}` (`LlamaDecoderLayer`,
//! `MistralDecoderLayer` or `Qwen2DecoderLayer`), `model.norm` and `lm_head`
//! (which reads `model.embed_tokens.weight` when the embeddings are tied).
//! Rotary tables are computed per forward for the positions it needs, so a
//! 128k-context config costs nothing until it is used.

use std::path::Path;

use accel_bigmodel::{CheckpointSource, DTypeName, ModuleTree};
use accel_nn::block::{Activations, AnyBlock, Block, KvCacheSlot, Model};
use accel_nn::layers::{load_balancing_loss, rms_norm, Embedding};
use candle_core::{DType, Device, Tensor};
use candle_nn::{Init, VarBuilder};

use crate::config::{LlamaConfig, ModelConfig};
use crate::decode::{self, CausalLm};
use crate::decoder::{DecoderLayer, FinalNorm, RouterLog};
use crate::error::bail_input;
use crate::parts::{self, LmHead, TokenEmbedding};
use crate::{Error, Result};

/// A Llama-family causal language model (`LlamaForCausalLM`,
/// `MistralForCausalLM`, `Qwen2ForCausalLM`, `Qwen3ForCausalLM`,
/// `Phi3ForCausalLM`, `MixtralForCausalLM`, `Qwen3MoeForCausalLM`).
pub struct Llama {
    cfg: LlamaConfig,
    embed_tokens: Block<TokenEmbedding>,
    layers: Vec<Block<DecoderLayer>>,
    norm: Block<FinalNorm>,
    lm_head: Block<LmHead>,
    router_log: RouterLog,
}

impl std::fmt::Debug for Llama {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Llama")
            .field("cfg", &self.cfg)
            .finish_non_exhaustive()
    }
}

impl Llama {
    /// Builds the model on `vb` (a checkpoint, a `VarMap` for training from
    /// scratch, or `init_empty_weights` for a model to dispatch), with
    /// transformers' parameter names.
    ///
    /// # Errors
    /// A weight the source lacks or holds in another shape, naming the
    /// tensor and the file.
    pub fn new(cfg: &LlamaConfig, vb: VarBuilder) -> Result<Self> {
        let (v, d) = (cfg.vocab_size, cfg.hidden_size);
        let emb_init = Init::Randn {
            mean: 0.0,
            stdev: 0.02,
        };
        let embed_tokens = Block::new(&vb, "model.embed_tokens", "Embedding", move |vb| {
            Ok(TokenEmbedding(Embedding::new(
                vb.get_with_hints((v, d), "weight", emb_init)?,
                d,
            )))
        })?;
        let router_log = RouterLog::default();
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| {
                let (c, log) = (cfg.clone(), router_log.clone());
                let name = format!("model.layers.{i}");
                Block::new(&vb, &name, cfg.family.layer_class(), move |vb| {
                    DecoderLayer::new(c.clone(), i, log.clone(), vb)
                })
            })
            .collect::<accel_nn::Result<Vec<_>>>()?;
        let eps = cfg.rms_norm_eps;
        let norm = Block::new(&vb, "model.norm", cfg.family.norm_class(), move |vb| {
            Ok(FinalNorm(rms_norm(d, eps, vb)?))
        })?;
        let lm_head = if cfg.tie_word_embeddings {
            Block::new(&vb, "lm_head", "Linear", move |vb| {
                let weight =
                    vb.root()
                        .get_with_hints((v, d), "model.embed_tokens.weight", emb_init)?;
                Ok(LmHead { weight })
            })?
        } else {
            Block::new(&vb, "lm_head", "Linear", move |vb| {
                Ok(LmHead {
                    weight: vb.get_with_hints((v, d), "weight", emb_init)?,
                })
            })?
        };
        Ok(Self {
            cfg: cfg.clone(),
            embed_tokens,
            layers,
            norm,
            lm_head,
            router_log,
        })
    }

    /// Loads a checkpoint folder (`config.json` and safetensors, one file or
    /// sharded) onto `device`, weights converted to `dtype`.
    ///
    /// # Errors
    /// Those of [`ModelConfig::from_path`] and [`Llama::new`]; a folder whose
    /// `model_type` is not of the Llama family.
    pub fn load(dir: impl AsRef<Path>, dtype: DType, device: &Device) -> Result<Self> {
        let dir = dir.as_ref();
        let cfg = match ModelConfig::from_path(dir)? {
            ModelConfig::Llama(c) => c,
            other => {
                return Err(Error::UnknownModelType {
                    path: crate::config::config_path(dir),
                    model_type: other.model_type().into(),
                    known: "llama, mistral, qwen2, qwen3, phi3, mixtral, qwen3_moe",
                })
            }
        };
        let source = CheckpointSource::open(dir)?;
        Self::new(
            &cfg,
            VarBuilder::from_backend(Box::new(source), dtype, device.clone()),
        )
    }

    /// The configuration.
    pub fn config(&self) -> &LlamaConfig {
        &self.cfg
    }

    /// Runs every block: logits, or with `labels` (already shifted) the loss.
    fn run(
        &self,
        ids: &Tensor,
        offset: usize,
        caches: Option<&[KvCacheSlot]>,
        labels: Option<Tensor>,
    ) -> Result<Tensor> {
        let (_, t) = ids.dims2()?;
        if offset + t > self.cfg.max_position_embeddings {
            bail_input!(
                "forward",
                "positions up to {} exceed max_position_embeddings {}",
                offset + t,
                self.cfg.max_position_embeddings
            );
        }
        let mut x = Activations::new(ids.clone());
        x.position_offset = offset;
        x.hidden = self.embed_tokens.forward(&x)?;
        x.rope = Some(
            self.cfg
                .rope
                .tables(offset, t, x.hidden.dtype(), x.device())?,
        );
        for (i, layer) in self.layers.iter().enumerate() {
            let xi = x.with_cache(caches.map(|c| c[i].clone()));
            x.hidden = layer.forward(&xi)?;
        }
        x.hidden = self.norm.forward(&x)?;
        x.labels = labels;
        Ok(self.lm_head.forward(&x)?)
    }

    /// Logits `[b, t, vocab]` for token ids `[b, t]` (u32).
    ///
    /// # Errors
    /// Ids past `max_position_embeddings`; whatever a block returns.
    pub fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        self.run(ids, 0, None, None)
    }

    /// Mean next-token cross-entropy of `ids [b, t]` against `labels [b, t]`
    /// (u32 or i64; ignored positions `u32::MAX` / `-100`), shifted as
    /// transformers does: what `model(ids, labels=labels).loss` returns.
    ///
    /// # Errors
    /// As [`Llama::forward`]; labels of another dtype.
    ///
    /// A mixture of experts with `output_router_logits` adds the
    /// load-balancing loss times `router_aux_loss_coef`, as transformers does.
    pub fn loss(&self, ids: &Tensor, labels: &Tensor) -> Result<Tensor> {
        let labels = parts::shift_labels(labels)?;
        let Some(moe) = self.cfg.moe.as_ref().filter(|m| m.output_router_logits) else {
            return self.run(ids, 0, None, Some(labels));
        };
        let (loss, aux) = self.shifted_loss_and_aux(ids, labels)?;
        Ok((loss + (aux * moe.router_aux_loss_coef)?)?)
    }

    /// The language-model loss (labels shifted as in [`Llama::loss`]) and
    /// the load-balancing loss of the sparse layers (transformers'
    /// `aux_loss`, before `router_aux_loss_coef`), for a mixture of experts
    /// whatever its `output_router_logits`.
    ///
    /// # Errors
    /// A model without sparse layers; a decoder layer whose hook recomputes
    /// it (FSDP, activation checkpointing), through which the router's
    /// statistics would carry no gradient.
    pub fn loss_and_aux(&self, ids: &Tensor, labels: &Tensor) -> Result<(Tensor, Tensor)> {
        self.shifted_loss_and_aux(ids, parts::shift_labels(labels)?)
    }

    fn shifted_loss_and_aux(&self, ids: &Tensor, labels: Tensor) -> Result<(Tensor, Tensor)> {
        if self.cfg.moe.is_none() {
            bail_input!(
                "loss",
                "{} has no sparse layers",
                self.cfg.family.model_type()
            );
        }
        if self
            .layers
            .iter()
            .any(|b| b.with_hook(|h| h.is_some_and(|h| h.wraps_forward())))
        {
            bail_input!(
                "output_router_logits",
                "the load-balancing loss is collected beside the layers' outputs and would get \
                 no gradient through a layer that FSDP or activation checkpointing recomputes; \
                 set output_router_logits to false in config.json for such runs"
            );
        }
        *self.router_log.lock().unwrap_or_else(|e| e.into_inner()) = Some(Vec::new());
        let loss = self.run(ids, 0, None, Some(labels));
        let stats = self
            .router_log
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
            .unwrap_or_default();
        let loss = loss?;
        Ok((loss, load_balancing_loss(&stats)?))
    }

    /// Greedy decoding with a KV cache, as `generate(do_sample=False)`:
    /// prompt and continuation, stopping after `max_new_tokens` or a token
    /// of `eos_token_ids` (pass `&self.config().eos_token_ids` to stop where
    /// transformers does by default).
    ///
    /// # Errors
    /// An empty prompt, a sequence past the position limit.
    pub fn generate(
        &self,
        prompt: &[u32],
        max_new_tokens: usize,
        eos_token_ids: &[u32],
    ) -> Result<Vec<u32>> {
        decode::greedy(self, prompt, max_new_tokens, eos_token_ids)
    }
}

impl CausalLm for Llama {
    fn num_layers(&self) -> usize {
        self.layers.len()
    }
    fn max_positions(&self) -> usize {
        self.cfg.max_position_embeddings
    }
    fn input_device(&self) -> Device {
        parts::weights_device(&self.embed_tokens)
    }
    fn forward_cached(
        &self,
        ids: &Tensor,
        offset: usize,
        caches: &[KvCacheSlot],
    ) -> Result<Tensor> {
        self.run(ids, offset, Some(caches), None)
    }
}

impl Model for Llama {
    fn blocks(&self) -> Vec<&dyn AnyBlock> {
        let mut all: Vec<&dyn AnyBlock> = vec![&self.embed_tokens];
        all.extend(self.layers.iter().map(|b| b as &dyn AnyBlock));
        all.push(&self.norm);
        all.push(&self.lm_head);
        all
    }

    fn tree(&self, dtype: Option<DType>) -> accel_nn::Result<ModuleTree> {
        // LlamaRotaryEmbedding's two non-persistent buffers, after `model.norm`.
        let half = vec![self.cfg.rope.rotary_dim / 2];
        let buffers = ["inv_freq", "original_inv_freq"].map(|b| {
            (
                format!("model.rotary_emb.{b}"),
                half.clone(),
                DTypeName::FLOAT32,
            )
        });
        let tied = self.cfg.tie_word_embeddings;
        let head = tied.then_some(("lm_head.weight", "model.embed_tokens.weight"));
        crate::tree::model_tree(self, dtype, head, &buffers, &[])
    }
}
