//! GPT-2 (`GPT2LMHeadModel`) with transformers' names.
//!
//! Blocks: `transformer.wte` and `transformer.wpe` (`Embedding`),
//! `transformer.h.{i}` (`GPT2Block`), `transformer.ln_f` (`LayerNorm`) and
//! `lm_head` (`Linear`, tied to `transformer.wte.weight`). GPT-2's `Conv1D`
//! stores weights `[in, out]`, the transpose of `nn.Linear`'s: the block keeps
//! the stored tensor as its parameter (so checkpoints, offload and sharding
//! see the file's shape) and transposes it when the block is built.
//! Checkpoints of a bare `GPT2Model` (keys without `transformer.`, as the
//! original `gpt2` on the Hub) load too.

use std::path::Path;

use accel_bigmodel::{CheckpointSource, ModuleTree};
use accel_nn::block::{Activations, AnyBlock, Block, BlockForward, KvCacheSlot, Model};
use accel_nn::layers::{
    layer_norm, Activation, Embedding, LayerNorm, Linear, LoraSpec, QuantSpec, QuantizedWeight,
};
use accel_nn::ops;
use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{Init, VarBuilder};

use crate::config::{Gpt2Config, ModelConfig};
use crate::decode::{self, CausalLm};
use crate::error::bail_input;
use crate::parts::{self, LmHead, TokenEmbedding};
use crate::{Error, Result};

const INIT: Init = Init::Randn {
    mean: 0.0,
    stdev: 0.02,
};

/// A `Conv1D` of transformers: weight stored `[in, out]`, used as a
/// `Linear` on its transpose.
///
/// The transpose stays a view of the weight, never a copy made here: a
/// built block is cached and reused while its weights are updated in place
/// (`PreparedModel::load_checkpoint`, optimizer steps), so a copy taken at
/// build time would keep the values the weight had then.
/// With a LoRA adapter where `lora` targets the module (its `A` and `B`
/// are PEFT's `[r, in]` and `[out, r]` either way). A quantized `Conv1D`
/// is stored `[out, in]`: transformers transposes it before quantizing.
fn conv1d(
    inp: usize,
    out: usize,
    vb: VarBuilder,
    lora: Option<&LoraSpec>,
    quant: Option<&QuantSpec>,
) -> candle_core::Result<Linear> {
    if let Some(q) = QuantizedWeight::from_var_builder(&vb, out, inp, quant)? {
        let b = vb.get_with_hints(out, "bias", Init::Const(0.0))?;
        return Linear::from_quantized(q, Some(b)).with_lora(lora, &vb);
    }
    let w = vb.get_with_hints((inp, out), "weight", INIT)?;
    let b = vb.get_with_hints(out, "bias", Init::Const(0.0))?;
    Linear::new(w.t()?, Some(b)).with_lora(lora, &vb)
}

/// The learned position table, added to the token embeddings at the
/// activations' positions.
struct PositionEmbedding(Tensor);

impl BlockForward for PositionEmbedding {
    fn forward(&self, x: &Activations) -> candle_core::Result<Tensor> {
        let t = x.hidden.dim(1)?;
        x.hidden
            .broadcast_add(&self.0.narrow(0, x.position_offset, t)?)
    }
}

/// One `GPT2Block`: pre-LayerNorm causal attention from the fused `c_attn`
/// projection, then a pre-LayerNorm MLP.
struct Gpt2Block {
    n_head: usize,
    scale: f64,
    act: Activation,
    ln_1: LayerNorm,
    c_attn: Linear,
    attn_proj: Linear,
    ln_2: LayerNorm,
    c_fc: Linear,
    mlp_proj: Linear,
}

impl Gpt2Block {
    fn new(cfg: &Gpt2Config, layer: usize, vb: VarBuilder) -> candle_core::Result<Self> {
        let d = cfg.n_embd;
        let inner = cfg.n_inner.unwrap_or(4 * d);
        let eps = cfg.layer_norm_epsilon;
        let mut scale = 1.0;
        if cfg.scale_attn_weights {
            scale /= ((d / cfg.n_head) as f64).sqrt();
        }
        if cfg.scale_attn_by_inverse_layer_idx {
            scale /= (layer + 1) as f64;
        }
        let (lora, quant) = (cfg.lora.as_ref(), cfg.quant.as_ref());
        Ok(Self {
            n_head: cfg.n_head,
            scale,
            act: cfg.activation_function,
            ln_1: layer_norm(d, eps, vb.pp("ln_1"))?,
            c_attn: conv1d(d, 3 * d, vb.pp("attn").pp("c_attn"), lora, quant)?,
            attn_proj: conv1d(d, d, vb.pp("attn").pp("c_proj"), lora, quant)?,
            ln_2: layer_norm(d, eps, vb.pp("ln_2"))?,
            c_fc: conv1d(d, inner, vb.pp("mlp").pp("c_fc"), lora, quant)?,
            mlp_proj: conv1d(inner, d, vb.pp("mlp").pp("c_proj"), lora, quant)?,
        })
    }

    fn attention(&self, x: &Activations, h: &Tensor) -> candle_core::Result<Tensor> {
        let (_, t, d) = h.dims3()?;
        let qkv = self.c_attn.forward(h)?;
        let Some(slot) = &x.cache else {
            // Training and plain forwards: one fused op from qkv to merged heads.
            let mask = parts::causal_mask(x, t, t, None)?;
            return ops::attention_qkv(&qkv, self.n_head, &mask, self.scale);
        };
        let hd = d / self.n_head;
        let heads = |i: usize| parts::split_heads(&qkv.narrow(2, i * d, d)?, self.n_head, hd);
        let (q, k, v) = (heads(0)?, heads(1)?, heads(2)?);
        let (k, v) = slot
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .append(&k, &v)?;
        let mask = parts::causal_mask(x, t, k.dim(2)?, None)?;
        let y = ops::scaled_dot_product_attention(&q, &k, &v, &mask, self.scale)?;
        parts::merge_heads(&y)
    }
}

impl BlockForward for Gpt2Block {
    fn forward(&self, x: &Activations) -> candle_core::Result<Tensor> {
        let a = self.attention(x, &self.ln_1.forward(&x.hidden)?)?;
        let h = (&x.hidden + self.attn_proj.forward(&a)?)?;
        let m = self
            .c_fc
            .forward_act(&self.ln_2.forward(&h)?, Some(self.act))?;
        h + self.mlp_proj.forward(&m)?
    }
}

/// The final LayerNorm `transformer.ln_f`.
struct FinalNorm(LayerNorm);

impl BlockForward for FinalNorm {
    fn forward(&self, x: &Activations) -> candle_core::Result<Tensor> {
        self.0.forward(&x.hidden)
    }
}

/// GPT-2 with its tied language-model head.
pub struct Gpt2 {
    cfg: Gpt2Config,
    prefix: String,
    wte: Block<TokenEmbedding>,
    wpe: Block<PositionEmbedding>,
    h: Vec<Block<Gpt2Block>>,
    ln_f: Block<FinalNorm>,
    lm_head: Block<LmHead>,
}

impl std::fmt::Debug for Gpt2 {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gpt2")
            .field("cfg", &self.cfg)
            .finish_non_exhaustive()
    }
}

impl Gpt2 {
    /// Builds the model on `vb` under `transformer.` (or at the root when
    /// the source holds a bare `GPT2Model`'s `wte.weight` only).
    ///
    /// # Errors
    /// A weight the source lacks or holds in another shape, naming the
    /// tensor and the file.
    pub fn new(cfg: &Gpt2Config, vb: VarBuilder) -> Result<Self> {
        let bare =
            vb.contains_tensor("wte.weight") && !vb.contains_tensor("transformer.wte.weight");
        let prefix = if bare { "" } else { "transformer." }.to_string();
        let (v, d, n) = (cfg.vocab_size, cfg.n_embd, cfg.n_positions);
        let wte = Block::new(&vb, &format!("{prefix}wte"), "Embedding", move |vb| {
            Ok(TokenEmbedding(Embedding::new(
                vb.get_with_hints((v, d), "weight", INIT)?,
                d,
            )))
        })?;
        let wpe = Block::new(&vb, &format!("{prefix}wpe"), "Embedding", move |vb| {
            Ok(PositionEmbedding(vb.get_with_hints(
                (n, d),
                "weight",
                INIT,
            )?))
        })?;
        let h = (0..cfg.n_layer)
            .map(|i| {
                let c = cfg.clone();
                Block::new(&vb, &format!("{prefix}h.{i}"), "GPT2Block", move |vb| {
                    Gpt2Block::new(&c, i, vb)
                })
            })
            .collect::<accel_nn::Result<Vec<_>>>()?;
        let eps = cfg.layer_norm_epsilon;
        let ln_f = Block::new(&vb, &format!("{prefix}ln_f"), "LayerNorm", move |vb| {
            Ok(FinalNorm(layer_norm(d, eps, vb)?))
        })?;
        let tied = format!("{prefix}wte.weight");
        let lm_head = Block::new(&vb, "lm_head", "Linear", move |vb| {
            Ok(LmHead {
                weight: vb.root().get_with_hints((v, d), &tied, INIT)?,
            })
        })?;
        Ok(Self {
            cfg: cfg.clone(),
            prefix,
            wte,
            wpe,
            h,
            ln_f,
            lm_head,
        })
    }

    /// Loads a checkpoint folder onto `device`, weights converted to `dtype`.
    ///
    /// # Errors
    /// Those of [`ModelConfig::from_path`] and [`Gpt2::new`]; a folder whose
    /// `model_type` is not `gpt2`.
    pub fn load(dir: impl AsRef<Path>, dtype: DType, device: &Device) -> Result<Self> {
        let dir = dir.as_ref();
        let cfg = match ModelConfig::from_path(dir)? {
            ModelConfig::Gpt2(c) => c,
            other => {
                return Err(Error::UnknownModelType {
                    path: crate::config::config_path(dir),
                    model_type: other.model_type().into(),
                    known: "gpt2",
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
    pub fn config(&self) -> &Gpt2Config {
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
        if offset + t > self.cfg.n_positions {
            bail_input!(
                "forward",
                "positions up to {} exceed n_positions {}",
                offset + t,
                self.cfg.n_positions
            );
        }
        let mut x = Activations::new(ids.clone());
        x.position_offset = offset;
        x.hidden = self.wte.forward(&x)?;
        x.hidden = self.wpe.forward(&x)?;
        for (i, block) in self.h.iter().enumerate() {
            let xi = x.with_cache(caches.map(|c| c[i].clone()));
            x.hidden = block.forward(&xi)?;
        }
        x.hidden = self.ln_f.forward(&x)?;
        x.labels = labels;
        Ok(self.lm_head.forward(&x)?)
    }

    /// Logits `[b, t, vocab]` for token ids `[b, t]` (u32).
    ///
    /// # Errors
    /// Ids past `n_positions`; whatever a block returns.
    pub fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        self.run(ids, 0, None, None)
    }

    /// Mean next-token cross-entropy with transformers' label shift (see
    /// [`crate::Llama::loss`]).
    ///
    /// # Errors
    /// As [`Gpt2::forward`]; labels of another dtype.
    pub fn loss(&self, ids: &Tensor, labels: &Tensor) -> Result<Tensor> {
        self.run(ids, 0, None, Some(parts::shift_labels(labels)?))
    }

    /// Greedy decoding with a KV cache (see [`crate::Llama::generate`]).
    ///
    /// # Errors
    /// An empty prompt, a sequence past `n_positions`.
    pub fn generate(
        &self,
        prompt: &[u32],
        max_new_tokens: usize,
        eos_token_ids: &[u32],
    ) -> Result<Vec<u32>> {
        decode::greedy(self, prompt, max_new_tokens, eos_token_ids)
    }
}

impl CausalLm for Gpt2 {
    fn num_layers(&self) -> usize {
        self.h.len()
    }
    fn max_positions(&self) -> usize {
        self.cfg.n_positions
    }
    fn input_device(&self) -> Device {
        parts::weights_device(&self.wte)
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

impl Model for Gpt2 {
    fn blocks(&self) -> Vec<&dyn AnyBlock> {
        let mut all: Vec<&dyn AnyBlock> = vec![&self.wte, &self.wpe];
        all.extend(self.h.iter().map(|b| b as &dyn AnyBlock));
        all.push(&self.ln_f);
        all.push(&self.lm_head);
        all
    }

    fn tree(&self, dtype: Option<DType>) -> accel_nn::Result<ModuleTree> {
        let p = &self.prefix;
        let (wte, drop, h) = (
            format!("{p}wte.weight"),
            format!("{p}drop"),
            format!("{p}h"),
        );
        // GPT2Model's Dropout `drop`, registered between `wpe` and `h`.
        crate::tree::model_tree(
            self,
            dtype,
            Some(("lm_head.weight", &wte)),
            &[],
            &[(&drop, &h)],
        )
    }
}
