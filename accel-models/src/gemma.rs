//! Gemma 3's text model (`gemma3_text`, and the text part of a `gemma3`
//! folder) with transformers' names and numerics: `(1 + w)` RMS norms in
//! f32, four of them per layer, embeddings scaled by `sqrt(hidden)`, GeGLU
//! (tanh GELU), per-head q/k norms, `query_pre_attn_scalar`, sliding layers
//! alternating with full ones (`layer_types`), each type with its own
//! rotary embedding, a tied head and final logit softcapping.

use std::path::Path;

use accel_bigmodel::{CheckpointSource, DTypeName, ModuleTree};
use accel_nn::block::{Activations, AnyBlock, Block, BlockForward, KvCacheSlot, Model};
use accel_nn::layers::{linear_b_with, Embedding, Linear};
use accel_nn::ops;
use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{Init, VarBuilder};

use crate::config::ModelConfig;
use crate::decode::{self, CausalLm};
use crate::error::bail_input;
pub use crate::gemma_config::Gemma3Config;
use crate::parts;
use crate::{Error, Result};

/// Gemma's RMSNorm: `norm(x) * (1 + w)`, in f32 whatever the input dtype.
struct GemmaNorm {
    weight: Tensor,
    eps: f64,
}

impl GemmaNorm {
    fn new(dim: usize, eps: f64, vb: VarBuilder) -> candle_core::Result<Self> {
        Ok(Self {
            weight: vb.get_with_hints(dim, "weight", Init::Const(0.0))?,
            eps,
        })
    }

    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        // `1 + w` per forward: the weight may be updated in place.
        let w = (self.weight.to_dtype(DType::F32)? + 1.0)?;
        ops::rms_norm(&x.to_dtype(DType::F32)?, &w, self.eps)?.to_dtype(x.dtype())
    }
}

/// One `Gemma3DecoderLayer` (or `Gemma2DecoderLayer`).
struct Layer {
    cfg: Gemma3Config,
    sliding: bool,
    input_layernorm: GemmaNorm,
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    /// Gemma 3's per-head norms (Gemma 2 has none).
    q_norm: Option<GemmaNorm>,
    k_norm: Option<GemmaNorm>,
    post_attention_layernorm: GemmaNorm,
    pre_feedforward_layernorm: GemmaNorm,
    gate_proj: Linear,
    up_proj: Linear,
    down_proj: Linear,
    post_feedforward_layernorm: GemmaNorm,
}

impl Layer {
    fn new(cfg: Gemma3Config, i: usize, vb: VarBuilder) -> candle_core::Result<Self> {
        let (d, hd, eps) = (cfg.hidden_size, cfg.head_dim, cfg.rms_norm_eps);
        let (q, kv) = (cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd);
        let (lora, quant) = (cfg.lora.clone(), cfg.quant.clone());
        let lin = |i, o, b, vb| linear_b_with(i, o, b, vb, lora.as_ref(), quant.as_ref());
        let (att, mlp, bias) = (vb.pp("self_attn"), vb.pp("mlp"), cfg.attention_bias);
        Ok(Self {
            sliding: cfg.sliding_layers[i],
            input_layernorm: GemmaNorm::new(d, eps, vb.pp("input_layernorm"))?,
            q_proj: lin(d, q, bias, att.pp("q_proj"))?,
            k_proj: lin(d, kv, bias, att.pp("k_proj"))?,
            v_proj: lin(d, kv, bias, att.pp("v_proj"))?,
            o_proj: lin(q, d, bias, att.pp("o_proj"))?,
            q_norm: (cfg.version >= 3)
                .then(|| GemmaNorm::new(hd, eps, att.pp("q_norm")))
                .transpose()?,
            k_norm: (cfg.version >= 3)
                .then(|| GemmaNorm::new(hd, eps, att.pp("k_norm")))
                .transpose()?,
            post_attention_layernorm: GemmaNorm::new(d, eps, vb.pp("post_attention_layernorm"))?,
            pre_feedforward_layernorm: GemmaNorm::new(d, eps, vb.pp("pre_feedforward_layernorm"))?,
            gate_proj: lin(d, cfg.intermediate_size, false, mlp.pp("gate_proj"))?,
            up_proj: lin(d, cfg.intermediate_size, false, mlp.pp("up_proj"))?,
            down_proj: lin(cfg.intermediate_size, d, false, mlp.pp("down_proj"))?,
            post_feedforward_layernorm: GemmaNorm::new(
                d,
                eps,
                vb.pp("post_feedforward_layernorm"),
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
        let norm = |n: &Option<GemmaNorm>, t: Tensor| match n {
            Some(n) => n.forward(&t),
            None => Ok(t),
        };
        let q = norm(
            &self.q_norm,
            parts::split_heads(&self.q_proj.forward(h)?, nh, hd)?,
        )?;
        let k = norm(
            &self.k_norm,
            parts::split_heads(&self.k_proj.forward(h)?, nkv, hd)?,
        )?;
        let v = parts::split_heads(&self.v_proj.forward(h)?, nkv, hd)?;
        let Some((cos, sin)) = &x.rope else {
            candle_core::bail!("a Gemma layer needs rotary tables in Activations::rope")
        };
        let (q, k) = (ops::rope(&q, cos, sin)?, ops::rope(&k, cos, sin)?);
        let window = self.sliding.then_some(self.cfg.sliding_window);
        let scale = self.cfg.query_pre_attn_scalar.powf(-0.5);
        let y = match self.cfg.attn_logit_softcapping {
            Some(cap) => parts::softcapped_attention(x, (q, k, v), window, scale, cap)?,
            None => parts::causal_attention(x, (q, k, v), window, scale)?,
        };
        self.o_proj.forward(&y)
    }
}

impl BlockForward for Layer {
    fn forward(&self, x: &Activations) -> candle_core::Result<Tensor> {
        let a = self.attention(x, &self.input_layernorm.forward(&x.hidden)?)?;
        let h = (&x.hidden + self.post_attention_layernorm.forward(&a)?)?;
        let m = self.pre_feedforward_layernorm.forward(&h)?;
        let m = ops::gelu_tanh(&self.gate_proj.forward(&m)?)?.mul(&self.up_proj.forward(&m)?)?;
        let m = self.down_proj.forward(&m)?;
        h + self.post_feedforward_layernorm.forward(&m)?
    }
}

/// The embedding scaled by `sqrt(hidden)` (rounded to the weights' dtype,
/// as transformers' `Gemma3TextScaledWordEmbedding` does).
struct ScaledEmbedding(Embedding, f64);

impl BlockForward for ScaledEmbedding {
    fn forward(&self, x: &Activations) -> candle_core::Result<Tensor> {
        let e = self.0.forward(&x.hidden)?;
        let scale = Tensor::new(self.1 as f32, e.device())?.to_dtype(e.dtype())?;
        e.broadcast_mul(&scale)
    }
}

/// The final norm.
struct FinalNorm(GemmaNorm);

impl BlockForward for FinalNorm {
    fn forward(&self, x: &Activations) -> candle_core::Result<Tensor> {
        self.0.forward(&x.hidden)
    }
}

/// The head, softcapping its logits when the config says so (then the
/// loss is computed on the capped logits, not fused with the product).
struct Head {
    weight: Tensor,
    softcap: Option<f64>,
}

impl BlockForward for Head {
    fn forward(&self, x: &Activations) -> candle_core::Result<Tensor> {
        match (self.softcap, &x.labels) {
            (None, Some(labels)) => ops::linear_cross_entropy(&x.hidden, &self.weight, labels),
            (None, None) => ops::linear(&x.hidden, &self.weight, None, None),
            (Some(c), labels) => {
                let logits = ops::linear(&x.hidden, &self.weight, None, None)?;
                let logits = ((logits / c)?.tanh()? * c)?;
                match labels {
                    Some(l) => ops::cross_entropy(&logits, l),
                    None => Ok(logits),
                }
            }
        }
    }
}

/// A Gemma 3 causal language model (`Gemma3ForCausalLM`), or Gemma 2's
/// (`Gemma2ForCausalLM`).
pub struct Gemma3 {
    cfg: Gemma3Config,
    embed_tokens: Block<ScaledEmbedding>,
    layers: Vec<Block<Layer>>,
    norm: Block<FinalNorm>,
    lm_head: Block<Head>,
}

impl std::fmt::Debug for Gemma3 {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gemma3")
            .field("cfg", &self.cfg)
            .finish_non_exhaustive()
    }
}

impl Gemma3 {
    /// Builds the model on `vb` with transformers' parameter names.
    ///
    /// # Errors
    /// A weight the source lacks or holds in another shape.
    pub fn new(cfg: &Gemma3Config, vb: VarBuilder) -> Result<Self> {
        let (v, d, p) = (cfg.vocab_size, cfg.hidden_size, cfg.prefix.clone());
        let init = Init::Randn {
            mean: 0.0,
            stdev: 0.02,
        };
        let emb_name = format!("{p}.embed_tokens");
        let embed_tokens = Block::new(&vb, &emb_name, cfg.embedding_class(), move |vb| {
            let w = vb.get_with_hints((v, d), "weight", init)?;
            Ok(ScaledEmbedding(Embedding::new(w, d), (d as f64).sqrt()))
        })?;
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| {
                let c = cfg.clone();
                Block::new(
                    &vb,
                    &format!("{p}.layers.{i}"),
                    cfg.layer_class(),
                    move |vb| Layer::new(c.clone(), i, vb),
                )
            })
            .collect::<accel_nn::Result<Vec<_>>>()?;
        let eps = cfg.rms_norm_eps;
        let norm = Block::new(&vb, &format!("{p}.norm"), cfg.norm_class(), move |vb| {
            Ok(FinalNorm(GemmaNorm::new(d, eps, vb)?))
        })?;
        let (softcap, tied) = (cfg.final_logit_softcapping, cfg.tie_word_embeddings);
        let lm_head = Block::new(&vb, "lm_head", "Linear", move |vb| {
            let weight = if tied {
                vb.root()
                    .get_with_hints((v, d), &format!("{emb_name}.weight"), init)?
            } else {
                vb.get_with_hints((v, d), "weight", init)?
            };
            Ok(Head { weight, softcap })
        })?;
        Ok(Self {
            cfg: cfg.clone(),
            embed_tokens,
            layers,
            norm,
            lm_head,
        })
    }

    /// Loads a checkpoint folder onto `device`, weights converted to `dtype`.
    ///
    /// # Errors
    /// Those of [`ModelConfig::from_path`] and [`Gemma3::new`].
    pub fn load(dir: impl AsRef<Path>, dtype: DType, device: &Device) -> Result<Self> {
        let dir = dir.as_ref();
        let ModelConfig::Gemma3(cfg) = ModelConfig::from_path(dir)? else {
            return Err(Error::UnknownModelType {
                path: crate::config::config_path(dir),
                model_type: "not gemma3".into(),
                known: "gemma3_text, gemma3",
            });
        };
        let source = CheckpointSource::open(dir)?;
        Self::new(
            &cfg,
            VarBuilder::from_backend(Box::new(source), dtype, device.clone()),
        )
    }

    /// The configuration.
    pub fn config(&self) -> &Gemma3Config {
        &self.cfg
    }

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
        let (dt, dev) = (x.hidden.dtype(), x.device().clone());
        let local = self.cfg.rope_local.tables(offset, t, dt, &dev)?;
        let global = self.cfg.rope_global.tables(offset, t, dt, &dev)?;
        for (i, layer) in self.layers.iter().enumerate() {
            let mut xi = x.with_cache(caches.map(|c| c[i].clone()));
            let tables = if self.cfg.sliding_layers[i] {
                &local
            } else {
                &global
            };
            xi.rope = Some(tables.clone());
            x.hidden = layer.forward(&xi)?;
        }
        x.hidden = self.norm.forward(&x)?;
        x.labels = labels;
        Ok(self.lm_head.forward(&x)?)
    }

    /// Logits `[b, t, vocab]` for token ids `[b, t]`.
    ///
    /// # Errors
    /// Ids past `max_position_embeddings`; whatever a block returns.
    pub fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        self.run(ids, 0, None, None)
    }

    /// Mean next-token cross-entropy, shifted as transformers does.
    ///
    /// # Errors
    /// As [`Gemma3::forward`]; labels of another dtype.
    pub fn loss(&self, ids: &Tensor, labels: &Tensor) -> Result<Tensor> {
        self.run(ids, 0, None, Some(parts::shift_labels(labels)?))
    }

    /// Greedy decoding with a KV cache, as `generate(do_sample=False)`.
    ///
    /// # Errors
    /// An empty prompt, a sequence past the position limit.
    pub fn generate(&self, prompt: &[u32], max_new_tokens: usize, eos: &[u32]) -> Result<Vec<u32>> {
        decode::greedy(self, prompt, max_new_tokens, eos)
    }
}

impl CausalLm for Gemma3 {
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

impl Model for Gemma3 {
    fn blocks(&self) -> Vec<&dyn AnyBlock> {
        let mut all: Vec<&dyn AnyBlock> = vec![&self.embed_tokens];
        all.extend(self.layers.iter().map(|b| b as &dyn AnyBlock));
        all.push(&self.norm);
        all.push(&self.lm_head);
        all
    }

    fn tree(&self, dtype: Option<DType>) -> accel_nn::Result<ModuleTree> {
        // Gemma3RotaryEmbedding's buffers per layer type, and the
        // embedding's `embed_scale`, as transformers registers them.
        let p = &self.cfg.prefix;
        let half = vec![self.cfg.head_dim / 2];
        let mut buffers = vec![(
            format!("{p}.embed_tokens.embed_scale"),
            vec![],
            DTypeName::FLOAT32,
        )];
        for t in ["full_attention", "sliding_attention"] {
            for b in ["inv_freq", "original_inv_freq"] {
                buffers.push((
                    format!("{p}.rotary_emb.{t}_{b}"),
                    half.clone(),
                    DTypeName::FLOAT32,
                ));
            }
        }
        let tied = self.cfg.tie_word_embeddings;
        let emb = format!("{p}.embed_tokens.weight");
        let head = tied.then_some(("lm_head.weight", emb.as_str()));
        crate::tree::model_tree(self, dtype, head, &buffers, &[])
    }
}
