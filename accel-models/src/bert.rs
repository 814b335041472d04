//! BERT (`BertModel`) with transformers' names, and mean pooling for
//! sentence embeddings.
//!
//! Blocks: `embeddings` (`BertEmbeddings`), `encoder.layer.{i}`
//! (`BertLayer`) and, when the checkpoint has one, `pooler` (`BertPooler`);
//! under `bert.` for checkpoints saved from a task model. The padding mask
//! travels between blocks as [`Activations::attention_bias`].
//!
//! The embeddings block takes token ids `[b, t]` as the hidden states and
//! the segment ids, if any, as [`Activations::token_type_ids`] (which
//! offload hooks move with the rest).

use std::path::Path;

use accel_bigmodel::{CheckpointSource, DTypeName, ModuleTree};
use accel_nn::block::{Activations, AnyBlock, Block, BlockForward, Model};
use accel_nn::layers::{
    layer_norm, linear, linear_b_with, Activation, Embedding, LayerNorm, Linear,
};
use accel_nn::ops::{self, AttentionMask};
use candle_core::{DType, Device, Module, Tensor, D};
use candle_nn::{Init, VarBuilder};

use crate::config::{BertConfig, ModelConfig};
use crate::error::bail_input;
use crate::parts;
use crate::{Error, Result};

const INIT: Init = Init::Randn {
    mean: 0.0,
    stdev: 0.02,
};

/// Word, position and token-type embeddings, summed and normalised.
struct BertEmbeddings {
    word: Embedding,
    position: Embedding,
    token_type: Embedding,
    layer_norm: LayerNorm,
}

impl BertEmbeddings {
    fn new(cfg: &BertConfig, vb: VarBuilder) -> candle_core::Result<Self> {
        let d = cfg.hidden_size;
        let table = |n: usize, name: &str| -> candle_core::Result<Embedding> {
            Ok(Embedding::new(
                vb.pp(name).get_with_hints((n, d), "weight", INIT)?,
                d,
            ))
        };
        Ok(Self {
            word: table(cfg.vocab_size, "word_embeddings")?,
            position: table(cfg.max_position_embeddings, "position_embeddings")?,
            token_type: table(cfg.type_vocab_size, "token_type_embeddings")?,
            layer_norm: layer_norm(d, cfg.layer_norm_eps, vb.pp("LayerNorm"))?,
        })
    }
}

impl BlockForward for BertEmbeddings {
    fn forward(&self, x: &Activations) -> candle_core::Result<Tensor> {
        let ids = &x.hidden;
        let types = match &x.token_type_ids {
            Some(types) => types.clone(),
            None => ids.zeros_like()?,
        };
        let t = ids.dim(1)?;
        let start = x.position_offset as u32;
        let positions = Tensor::arange(start, start + t as u32, ids.device())?;
        let e = self.word.forward(ids)?;
        let e = (e + self.token_type.forward(&types)?)?;
        let e = e.broadcast_add(&self.position.forward(&positions)?)?;
        self.layer_norm.forward(&e)
    }
}

/// One `BertLayer`: post-LayerNorm self-attention, then the MLP.
struct BertLayer {
    n_head: usize,
    act: Activation,
    query: Linear,
    key: Linear,
    value: Linear,
    attn_out: Linear,
    attn_norm: LayerNorm,
    intermediate: Linear,
    output: Linear,
    out_norm: LayerNorm,
}

impl BertLayer {
    fn new(cfg: &BertConfig, vb: VarBuilder) -> candle_core::Result<Self> {
        let (d, i, eps) = (cfg.hidden_size, cfg.intermediate_size, cfg.layer_norm_eps);
        let att = vb.pp("attention");
        let linear =
            |i, o, vb| linear_b_with(i, o, true, vb, cfg.lora.as_ref(), cfg.quant.as_ref());
        Ok(Self {
            n_head: cfg.num_attention_heads,
            act: cfg.hidden_act,
            query: linear(d, d, att.pp("self").pp("query"))?,
            key: linear(d, d, att.pp("self").pp("key"))?,
            value: linear(d, d, att.pp("self").pp("value"))?,
            attn_out: linear(d, d, att.pp("output").pp("dense"))?,
            attn_norm: layer_norm(d, eps, att.pp("output").pp("LayerNorm"))?,
            intermediate: linear(d, i, vb.pp("intermediate").pp("dense"))?,
            output: linear(i, d, vb.pp("output").pp("dense"))?,
            out_norm: layer_norm(d, eps, vb.pp("output").pp("LayerNorm"))?,
        })
    }
}

impl BlockForward for BertLayer {
    fn forward(&self, x: &Activations) -> candle_core::Result<Tensor> {
        let h = &x.hidden;
        let hd = h.dim(2)? / self.n_head;
        let heads = |l: &Linear| parts::split_heads(&l.forward(h)?, self.n_head, hd);
        let (q, k, v) = (heads(&self.query)?, heads(&self.key)?, heads(&self.value)?);
        let mask = match &x.attention_bias {
            Some(b) => AttentionMask::Additive(b.clone()),
            None => AttentionMask::None,
        };
        let y = ops::scaled_dot_product_attention(&q, &k, &v, &mask, 1.0 / (hd as f64).sqrt())?;
        let a = self
            .attn_norm
            .forward(&(h + self.attn_out.forward(&parts::merge_heads(&y)?)?)?)?;
        let m = self.intermediate.forward_act(&a, Some(self.act))?;
        self.out_norm.forward(&(a + self.output.forward(&m)?)?)
    }
}

/// `tanh(dense(hidden[:, 0]))`: BERT's pooled `[CLS]` output.
struct BertPooler(Linear);

impl BlockForward for BertPooler {
    fn forward(&self, x: &Activations) -> candle_core::Result<Tensor> {
        self.0
            .forward(&x.hidden.narrow(1, 0, 1)?.squeeze(1)?)?
            .tanh()
    }
}

/// A BERT encoder (`BertModel`).
pub struct Bert {
    cfg: BertConfig,
    prefix: String,
    embeddings: Block<BertEmbeddings>,
    layers: Vec<Block<BertLayer>>,
    pooler: Option<Block<BertPooler>>,
}

impl std::fmt::Debug for Bert {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Bert")
            .field("cfg", &self.cfg)
            .finish_non_exhaustive()
    }
}

impl Bert {
    /// Builds the encoder on `vb`, under `bert.` when the source holds a
    /// task model's weights, with a pooler when the source has one.
    ///
    /// # Errors
    /// A weight the source lacks or holds in another shape, naming the
    /// tensor and the file.
    pub fn new(cfg: &BertConfig, vb: VarBuilder) -> Result<Self> {
        let word = "embeddings.word_embeddings.weight";
        let nested = vb.contains_tensor(&format!("bert.{word}")) && !vb.contains_tensor(word);
        let prefix = if nested { "bert." } else { "" }.to_string();
        let c = cfg.clone();
        let embeddings = Block::new(
            &vb,
            &format!("{prefix}embeddings"),
            "BertEmbeddings",
            move |vb| BertEmbeddings::new(&c, vb),
        )?;
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| {
                let c = cfg.clone();
                Block::new(
                    &vb,
                    &format!("{prefix}encoder.layer.{i}"),
                    "BertLayer",
                    move |vb| BertLayer::new(&c, vb),
                )
            })
            .collect::<accel_nn::Result<Vec<_>>>()?;
        let d = cfg.hidden_size;
        let pooler = match vb.contains_tensor(&format!("{prefix}pooler.dense.weight")) {
            true => Some(Block::new(
                &vb,
                &format!("{prefix}pooler"),
                "BertPooler",
                move |vb| Ok(BertPooler(linear(d, d, vb.pp("dense"))?)),
            )?),
            false => None,
        };
        Ok(Self {
            cfg: cfg.clone(),
            prefix,
            embeddings,
            layers,
            pooler,
        })
    }

    /// Loads a checkpoint folder onto `device`, weights converted to `dtype`.
    ///
    /// # Errors
    /// Those of [`ModelConfig::from_path`] and [`Bert::new`]; a folder whose
    /// `model_type` is not `bert`.
    pub fn load(dir: impl AsRef<Path>, dtype: DType, device: &Device) -> Result<Self> {
        let dir = dir.as_ref();
        let cfg = match ModelConfig::from_path(dir)? {
            ModelConfig::Bert(c) => c,
            other => {
                return Err(Error::UnknownModelType {
                    path: crate::config::config_path(dir),
                    model_type: other.model_type().into(),
                    known: "bert",
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
    pub fn config(&self) -> &BertConfig {
        &self.cfg
    }

    /// Whether the checkpoint had a pooler.
    pub fn has_pooler(&self) -> bool {
        self.pooler.is_some()
    }

    /// The last hidden state `[b, t, d]` for `ids [b, t]` (u32), with an
    /// optional attention mask `[b, t]` (1 = token, 0 = padding) and token
    /// type ids `[b, t]` (zeros when absent).
    ///
    /// # Errors
    /// Sequences longer than `max_position_embeddings`; mismatched shapes.
    pub fn forward(
        &self,
        ids: &Tensor,
        attention_mask: Option<&Tensor>,
        token_type_ids: Option<&Tensor>,
    ) -> Result<Tensor> {
        let (_, t) = ids.dims2()?;
        if t > self.cfg.max_position_embeddings {
            bail_input!(
                "forward",
                "{t} tokens exceed max_position_embeddings {}",
                self.cfg.max_position_embeddings
            );
        }
        let mut x = Activations::new(ids.clone());
        x.token_type_ids = token_type_ids.cloned();
        x.hidden = self.embeddings.forward(&x)?;
        x.attention_bias = attention_mask
            .map(|m| padding_bias(m, x.hidden.dtype()))
            .transpose()?;
        for layer in &self.layers {
            x.hidden = layer.forward(&x)?;
        }
        Ok(x.hidden)
    }

    /// The pooler's output `[b, d]` for a last hidden state.
    ///
    /// # Errors
    /// [`Error::BadInput`] when the checkpoint has no pooler.
    pub fn pool(&self, last_hidden_state: &Tensor) -> Result<Tensor> {
        let Some(pooler) = &self.pooler else {
            bail_input!(
                "pool",
                "this BERT checkpoint has no pooler (no {}pooler.dense.weight)",
                self.prefix
            );
        };
        Ok(pooler.forward_hidden(last_hidden_state)?)
    }

    /// Sentence embeddings `[b, d]`: the last hidden state mean-pooled over
    /// the attention mask (sentence-transformers' pooling).
    ///
    /// # Errors
    /// As [`Bert::forward`].
    pub fn sentence_embedding(&self, ids: &Tensor, attention_mask: &Tensor) -> Result<Tensor> {
        mean_pooling(
            &self.forward(ids, Some(attention_mask), None)?,
            attention_mask,
        )
    }
}

/// `[b, 1, 1, t]` additive bias from a `[b, t]` mask of ones and zeros: the
/// most negative float where the mask is 0, as transformers' eager path.
fn padding_bias(mask: &Tensor, dtype: DType) -> Result<Tensor> {
    let (b, t) = mask.dims2()?;
    let m = mask.to_dtype(DType::F32)?;
    let bias = ((1.0 - m)? * f64::from(f32::MIN))?;
    Ok(bias.reshape((b, 1, 1, t))?.to_dtype(dtype)?)
}

/// Mean of `hidden [b, t, d]` over the positions where `mask [b, t]` is 1
/// (padding excluded; an all-zero row divides by 1e-9 as
/// sentence-transformers does, giving zeros).
///
/// # Errors
/// Shapes that do not match.
pub fn mean_pooling(hidden: &Tensor, mask: &Tensor) -> Result<Tensor> {
    let m = mask.to_dtype(hidden.dtype())?.unsqueeze(D::Minus1)?;
    let sum = hidden.broadcast_mul(&m)?.sum(1)?;
    let count = m.sum(1)?.clamp(1e-9, f64::MAX)?;
    Ok(sum.broadcast_div(&count)?)
}

impl Model for Bert {
    fn blocks(&self) -> Vec<&dyn AnyBlock> {
        let mut all: Vec<&dyn AnyBlock> = vec![&self.embeddings];
        all.extend(self.layers.iter().map(|b| b as &dyn AnyBlock));
        if let Some(p) = &self.pooler {
            all.push(p);
        }
        all
    }

    fn tree(&self, dtype: Option<DType>) -> accel_nn::Result<ModuleTree> {
        // BertEmbeddings' non-persistent `position_ids` and `token_type_ids`.
        let shape = vec![1, self.cfg.max_position_embeddings];
        let buffers = ["position_ids", "token_type_ids"].map(|b| {
            (
                format!("{}embeddings.{b}", self.prefix),
                shape.clone(),
                DTypeName::INT64,
            )
        });
        crate::tree::model_tree(self, dtype, None, &buffers, &[])
    }
}
