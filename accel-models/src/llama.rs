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
use accel_nn::block::{Activations, AnyBlock, Block, BlockForward, KvCacheSlot, Model};
use accel_nn::layers::{
    linear_b_with, rms_norm, swiglu_mlp_with, Embedding, Linear, RmsNorm, RotaryEmbedding,
    SwiGluMlp,
};
use accel_nn::ops;
use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{Init, VarBuilder};

use crate::config::{LlamaConfig, ModelConfig};
use crate::decode::{self, CausalLm};
use crate::error::bail_input;
use crate::parts::{self, LmHead, TokenEmbedding};
use crate::{Error, Result};

/// One decoder layer: pre-norm grouped-query attention with RoPE, then a
/// pre-norm SwiGLU MLP, each added to the residual stream.
struct DecoderLayer {
    cfg: LlamaConfig,
    input_layernorm: RmsNorm,
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    post_attention_layernorm: RmsNorm,
    mlp: SwiGluMlp,
}

impl DecoderLayer {
    fn new(cfg: LlamaConfig, vb: VarBuilder) -> candle_core::Result<Self> {
        let (d, hd) = (cfg.hidden_size, cfg.head_dim);
        let (q, kv) = (cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd);
        let att = vb.pp("self_attn");
        let (lora, quant) = (cfg.lora.clone(), cfg.quant.clone());
        let linear_b =
            |i, o, bias, vb| linear_b_with(i, o, bias, vb, lora.as_ref(), quant.as_ref());
        Ok(Self {
            input_layernorm: rms_norm(d, cfg.rms_norm_eps, vb.pp("input_layernorm"))?,
            q_proj: linear_b(d, q, cfg.qkv_bias, att.pp("q_proj"))?,
            k_proj: linear_b(d, kv, cfg.qkv_bias, att.pp("k_proj"))?,
            v_proj: linear_b(d, kv, cfg.qkv_bias, att.pp("v_proj"))?,
            o_proj: linear_b(q, d, cfg.o_bias, att.pp("o_proj"))?,
            post_attention_layernorm: rms_norm(
                d,
                cfg.rms_norm_eps,
                vb.pp("post_attention_layernorm"),
            )?,
            mlp: swiglu_mlp_with(
                d,
                cfg.intermediate_size,
                cfg.mlp_bias,
                vb.pp("mlp"),
                lora.as_ref(),
                quant.as_ref(),
            )?,
            cfg,
        })
    }

    fn attention(&self, x: &Activations, h: &Tensor) -> candle_core::Result<Tensor> {
        let (hd, nh, nkv) = (
            self.cfg.head_dim,
            self.cfg.num_attention_heads,
            self.cfg.num_key_value_heads,
        );
        let t = h.dim(1)?;
        let q = parts::split_heads(&self.q_proj.forward(h)?, nh, hd)?;
        let k = parts::split_heads(&self.k_proj.forward(h)?, nkv, hd)?;
        let v = parts::split_heads(&self.v_proj.forward(h)?, nkv, hd)?;
        let Some((cos, sin)) = &x.rope else {
            candle_core::bail!("a Llama decoder layer needs rotary tables in Activations::rope")
        };
        let (q, k) = (ops::rope(&q, cos, sin)?, ops::rope(&k, cos, sin)?);
        let (k, v) = match &x.cache {
            Some(slot) => slot
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .append(&k, &v)?,
            None => (k, v),
        };
        let mask = parts::causal_mask(x, t, k.dim(2)?, self.cfg.sliding_window)?;
        let y = ops::scaled_dot_product_attention(&q, &k, &v, &mask, 1.0 / (hd as f64).sqrt())?;
        self.o_proj.forward(&parts::merge_heads(&y)?)
    }
}

impl BlockForward for DecoderLayer {
    fn forward(&self, x: &Activations) -> candle_core::Result<Tensor> {
        let h = self.input_layernorm.forward(&x.hidden)?;
        let h = (&x.hidden + self.attention(x, &h)?)?;
        let m = self
            .mlp
            .forward(&self.post_attention_layernorm.forward(&h)?)?;
        h + m
    }
}

/// The final RMSNorm `model.norm`.
struct FinalNorm(RmsNorm);

impl BlockForward for FinalNorm {
    fn forward(&self, x: &Activations) -> candle_core::Result<Tensor> {
        self.0.forward(&x.hidden)
    }
}

/// A Llama-family causal language model (`LlamaForCausalLM`,
/// `MistralForCausalLM`, `Qwen2ForCausalLM`).
pub struct Llama {
    cfg: LlamaConfig,
    embed_tokens: Block<TokenEmbedding>,
    layers: Vec<Block<DecoderLayer>>,
    norm: Block<FinalNorm>,
    lm_head: Block<LmHead>,
    inv_freq: Vec<f32>,
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
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| {
                let c = cfg.clone();
                let name = format!("model.layers.{i}");
                Block::new(&vb, &name, cfg.family.layer_class(), move |vb| {
                    DecoderLayer::new(c.clone(), vb)
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
        let inv_freq =
            RotaryEmbedding::inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling.as_ref());
        Ok(Self {
            cfg: cfg.clone(),
            embed_tokens,
            layers,
            norm,
            lm_head,
            inv_freq,
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
                    known: "llama, mistral, qwen2",
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

    /// `(cos, sin)` `[t, head_dim / 2]` for positions `offset..offset + t`,
    /// computed in f32 as transformers does, then cast to `dtype`.
    fn rope(
        &self,
        offset: usize,
        t: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<(Tensor, Tensor)> {
        let angles: Vec<f32> = (offset..offset + t)
            .flat_map(|p| self.inv_freq.iter().map(move |&f| p as f32 * f))
            .collect();
        let angles = Tensor::from_vec(angles, (t, self.inv_freq.len()), device)?;
        Ok((
            angles.cos()?.to_dtype(dtype)?,
            angles.sin()?.to_dtype(dtype)?,
        ))
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
        x.rope = Some(self.rope(offset, t, x.hidden.dtype(), x.device())?);
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
    pub fn loss(&self, ids: &Tensor, labels: &Tensor) -> Result<Tensor> {
        self.run(ids, 0, None, Some(parts::shift_labels(labels)?))
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
        let half = vec![self.cfg.head_dim / 2];
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
