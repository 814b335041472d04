//! A GPT-2 style decoder-only transformer, used by the char-level demo and
//! by the GPT training benchmark.
//!
//! Parameter names follow Hugging Face's `GPT2Model` (`wte.weight`,
//! `h.0.attn.c_attn.weight`, `ln_f.bias`, ...) so checkpoints are easy to
//! compare with the PyTorch reference, but weights use the `[out, in]`
//! layout of `nn.Linear` (GPT-2's `Conv1D` stores `[in, out]`).
//!
//! Its ops are accel-nn's: on CPU they run as fused kernels with
//! hand-written backward passes (layer norm, every linear layer together
//! with its bias and GELU, the whole causal attention from the fused `qkv`
//! projection to the merged heads, and the tied `lm_head` together with the
//! cross entropy). On other devices, or after
//! [`Gpt::set_fused_kernels(false)`](Gpt::set_fused_kernels), the same maths
//! is composed from stock candle ops. Both paths support training and
//! agree to float rounding (see the tests).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use accel_core::prelude::{Activations, AnyBlock, Block, BlockForward, Model};
use accel_core::rng::SplitMix64;
use candle_core::{DType, Device, Result, Tensor};
use candle_nn::{Init, VarBuilder};

use accel_core::nn::ops::{self, composed, Activation, AttentionMask};

/// Layer-norm epsilon of GPT-2.
const LN_EPS: f64 = 1e-5;

/// Standard deviation of GPT-2's weight initialisation.
const INIT_STD: f64 = 0.02;

/// Shape of a [`Gpt`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GptConfig {
    /// Number of distinct tokens.
    pub vocab_size: usize,
    /// Width of the residual stream (`d_model`).
    pub n_embd: usize,
    /// Number of transformer blocks.
    pub n_layer: usize,
    /// Number of attention heads; must divide `n_embd`.
    pub n_head: usize,
    /// Longest context the model can see (size of the position table).
    pub block_size: usize,
}

impl GptConfig {
    /// The benchmark model: vocabulary 4096, width 256, 4 layers, 4 heads,
    /// context 128 (about 4.2M parameters).
    pub fn bench() -> Self {
        Self {
            vocab_size: 4096,
            n_embd: 256,
            n_layer: 4,
            n_head: 4,
            block_size: 128,
        }
    }

    /// GPT-2 small ("124M"): vocabulary 50257, width 768, 12 layers, 12
    /// heads, context 1024 (124.4M parameters with the tied head).
    pub fn gpt2_124m() -> Self {
        Self {
            vocab_size: 50257,
            n_embd: 768,
            n_layer: 12,
            n_head: 12,
            block_size: 1024,
        }
    }

    /// The character-level demo model for a tokenizer of `vocab_size`
    /// characters: width 128, 4 layers, 4 heads, context 64. Small enough to
    /// learn visible structure from [`crate::text::CORPUS`] in minutes on CPU.
    pub fn char_small(vocab_size: usize) -> Self {
        Self {
            vocab_size,
            n_embd: 128,
            n_layer: 4,
            n_head: 4,
            block_size: 64,
        }
    }

    /// Width of one attention head.
    pub fn head_dim(&self) -> usize {
        self.n_embd / self.n_head
    }

    /// Number of scalar parameters (the tied `lm_head` counted once).
    pub fn num_params(&self) -> usize {
        let d = self.n_embd;
        let block =
            4 * d + (3 * d * d + 3 * d) + (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d);
        self.vocab_size * d + self.block_size * d + self.n_layer * block + 2 * d
    }
}

/// Whether blocks use the fused CPU kernels; shared by all blocks of one
/// model so [`Gpt::set_fused_kernels`] reaches blocks built later too (FSDP
/// and offload rebuild blocks from other weights).
type Fused = Arc<AtomicBool>;

/// Creates `[out, in]` weight and `[out]` bias under `vb` with GPT-2's init.
fn linear_params(vb: &VarBuilder, inp: usize, out: usize, std: f64) -> Result<(Tensor, Tensor)> {
    let w = vb.get_with_hints(
        (out, inp),
        "weight",
        Init::Randn {
            mean: 0.0,
            stdev: std,
        },
    )?;
    let b = vb.get_with_hints(out, "bias", Init::Const(0.0))?;
    Ok((w, b))
}

/// Creates layer-norm scale (ones) and shift (zeros) of width `d` under `vb`.
fn ln_params(vb: &VarBuilder, d: usize) -> Result<(Tensor, Tensor)> {
    let w = vb.get_with_hints(d, "weight", Init::Const(1.0))?;
    let b = vb.get_with_hints(d, "bias", Init::Const(0.0))?;
    Ok((w, b))
}

fn ln(fused: bool, x: &Tensor, (w, b): &(Tensor, Tensor)) -> Result<Tensor> {
    if fused {
        ops::layer_norm(x, w, Some(b), LN_EPS)
    } else {
        composed::layer_norm(x, w, Some(b), LN_EPS)
    }
}

/// `act(x @ w^T + b)`: accel-nn's op (fused on CPU), or the composed candle ops.
fn dense(
    x: &Tensor,
    w: &Tensor,
    b: Option<&Tensor>,
    act: Option<Activation>,
    fused: bool,
) -> Result<Tensor> {
    if fused {
        ops::linear(x, w, b, act)
    } else {
        composed::linear(x, w, b, act)
    }
}

/// The token embedding `wte` (block `wte`): token ids `[B, T]` to `[B, T, d]`.
struct TokenEmbedding {
    wte: Tensor,
}

impl BlockForward for TokenEmbedding {
    fn forward(&self, x: &Activations) -> Result<Tensor> {
        let (b, t) = x.hidden.dims2()?;
        let d = self.wte.dim(1)?;
        self.wte
            .index_select(&x.hidden.flatten_all()?, 0)?
            .reshape((b, t, d))
    }
}

/// The learned position embedding `wpe` (block `wpe`), added to the tokens'.
struct PositionEmbedding {
    wpe: Tensor,
}

impl BlockForward for PositionEmbedding {
    fn forward(&self, x: &Activations) -> Result<Tensor> {
        let t = x.hidden.dim(1)?;
        let block_size = self.wpe.dim(0)?;
        if x.position_offset + t > block_size {
            candle_core::bail!(
                "sequence length {} exceeds block_size {block_size}",
                x.position_offset + t
            )
        }
        x.hidden
            .broadcast_add(&self.wpe.narrow(0, x.position_offset, t)?)
    }
}

/// One pre-LayerNorm transformer block `h.{i}` (class `GPT2Block`).
struct GptBlock {
    cfg: GptConfig,
    fused: Fused,
    ln_1: (Tensor, Tensor),
    c_attn: (Tensor, Tensor),
    attn_proj: (Tensor, Tensor),
    ln_2: (Tensor, Tensor),
    c_fc: (Tensor, Tensor),
    mlp_proj: (Tensor, Tensor),
}

impl GptBlock {
    fn new(cfg: GptConfig, fused: Fused, vb: VarBuilder) -> Result<Self> {
        let d = cfg.n_embd;
        // GPT-2 scales the projections that write into the residual stream
        // by 1/sqrt(2 * n_layer) so its variance does not grow with depth.
        let proj_std = INIT_STD / ((2 * cfg.n_layer) as f64).sqrt();
        Ok(Self {
            cfg,
            fused,
            ln_1: ln_params(&vb.pp("ln_1"), d)?,
            c_attn: linear_params(&vb.pp("attn").pp("c_attn"), d, 3 * d, INIT_STD)?,
            attn_proj: linear_params(&vb.pp("attn").pp("c_proj"), d, d, proj_std)?,
            ln_2: ln_params(&vb.pp("ln_2"), d)?,
            c_fc: linear_params(&vb.pp("mlp").pp("c_fc"), d, 4 * d, INIT_STD)?,
            mlp_proj: linear_params(&vb.pp("mlp").pp("c_proj"), 4 * d, d, proj_std)?,
        })
    }

    fn fused(&self) -> bool {
        self.fused.load(Ordering::Relaxed) && self.ln_1.0.device().is_cpu()
    }

    /// Whether the layer norms take accel-nn's op, which is fused on CUDA
    /// too (the other fused ops are CPU kernels).
    fn fused_norms(&self) -> bool {
        self.fused.load(Ordering::Relaxed)
    }

    fn dense(
        &self,
        x: &Tensor,
        (w, b): &(Tensor, Tensor),
        act: Option<Activation>,
    ) -> Result<Tensor> {
        dense(x, w, Some(b), act, self.fused())
    }

    /// Causal multi-head self-attention of `h [B, T, d]`, straight from the
    /// fused `qkv` projection (one gemm instead of three).
    fn attention(&self, h: &Tensor) -> Result<Tensor> {
        let (d, nh) = (self.cfg.n_embd, self.cfg.n_head);
        let qkv = self.dense(h, &self.c_attn, None)?;
        let scale = 1.0 / ((d / nh) as f64).sqrt();
        let causal = AttentionMask::Causal { offset: 0 };
        let y = if self.fused() {
            ops::attention_qkv(&qkv, nh, &causal, scale)?
        } else {
            composed::attention_qkv(&qkv, nh, &causal, scale)?
        };
        self.dense(&y, &self.attn_proj, None)
    }
}

impl BlockForward for GptBlock {
    fn forward(&self, x: &Activations) -> Result<Tensor> {
        let norms = self.fused_norms();
        let h = ln(norms, &x.hidden, &self.ln_1)?;
        let x = (&x.hidden + self.attention(&h)?)?;
        let h = ln(norms, &x, &self.ln_2)?;
        let h = self.dense(&h, &self.c_fc, Some(Activation::GeluTanh))?;
        x + self.dense(&h, &self.mlp_proj, None)?
    }
}

/// The final LayerNorm `ln_f` and the `lm_head` tied to `wte.weight` (block
/// `ln_f`): logits `[B, T, vocab]`, or with labels the mean cross entropy,
/// where on CPU the lm_head and the loss run as one op, so the `[B*T, vocab]`
/// logits never enter the autograd graph.
struct Head {
    fused: Fused,
    ln_f: (Tensor, Tensor),
    wte: Tensor,
}

impl BlockForward for Head {
    fn forward(&self, x: &Activations) -> Result<Tensor> {
        let (b, t, d) = x.hidden.dims3()?;
        let norms = self.fused.load(Ordering::Relaxed);
        let fused = norms && self.wte.device().is_cpu();
        let h = ln(norms, &x.hidden.reshape((b * t, d))?, &self.ln_f)?;
        match &x.labels {
            Some(y) if fused => ops::linear_cross_entropy(&h, &self.wte, &y.flatten_all()?),
            Some(y) => composed::linear_cross_entropy(&h, &self.wte, &y.flatten_all()?),
            None => dense(&h, &self.wte, None, None, fused)?.reshape((b, t, self.wte.dim(0)?)),
        }
    }
}

/// GPT-2 style decoder: token + learned position embeddings, `n_layer`
/// pre-LayerNorm blocks (causal multi-head self-attention, then a 4x MLP
/// with tanh-approximated GELU), a final LayerNorm and an `lm_head` tied to
/// the token embedding.
///
/// The model is a list of [`Block`]s (`wte`, `wpe`, `h.{i}`, `ln_f`) and one
/// forward; run plain, under DDP, under FSDP (the blocks `h.*` or the class
/// `GPT2Block` as units) or dispatched with offload, that forward is the same.
pub struct Gpt {
    cfg: GptConfig,
    wte: Block<TokenEmbedding>,
    wpe: Block<PositionEmbedding>,
    blocks: Vec<Block<GptBlock>>,
    head: Block<Head>,
    fused: Fused,
}

impl std::fmt::Debug for Gpt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gpt")
            .field("cfg", &self.cfg)
            .finish_non_exhaustive()
    }
}

fn block<B: BlockForward>(
    vb: &VarBuilder,
    name: &str,
    class: &str,
    build: impl Fn(VarBuilder) -> Result<B> + Send + Sync + 'static,
) -> Result<Block<B>> {
    Ok(Block::new(vb, name, class, build)?)
}

impl Gpt {
    /// Creates the parameters under `vb` with GPT-2's initialisation, in the
    /// VarBuilder's dtype (f32, f16 or bf16; all activations use it too).
    pub fn new(cfg: GptConfig, vb: VarBuilder) -> Result<Self> {
        if cfg.n_embd.checked_rem(cfg.n_head) != Some(0) {
            candle_core::bail!(
                "n_embd {} is not a multiple of n_head {}",
                cfg.n_embd,
                cfg.n_head
            )
        }
        let d = cfg.n_embd;
        let emb = Init::Randn {
            mean: 0.0,
            stdev: INIT_STD,
        };
        let fused: Fused = Arc::new(AtomicBool::new(vb.device().is_cpu()));
        let (v, n) = (cfg.vocab_size, cfg.block_size);
        let wte = block(&vb, "wte", "Embedding", move |vb| {
            Ok(TokenEmbedding {
                wte: vb.get_with_hints((v, d), "weight", emb)?,
            })
        })?;
        let wpe = block(&vb, "wpe", "Embedding", move |vb| {
            Ok(PositionEmbedding {
                wpe: vb.get_with_hints((n, d), "weight", emb)?,
            })
        })?;
        let blocks = (0..cfg.n_layer)
            .map(|i| {
                let f = fused.clone();
                block(&vb, &format!("h.{i}"), "GPT2Block", move |vb| {
                    GptBlock::new(cfg, f.clone(), vb)
                })
            })
            .collect::<Result<_>>()?;
        let f = fused.clone();
        let head = block(&vb, "ln_f", "GPT2Head", move |vb| {
            Ok(Head {
                fused: f.clone(),
                ln_f: ln_params(&vb, d)?,
                wte: vb.root().get_with_hints((v, d), "wte.weight", emb)?,
            })
        })?;
        Ok(Self {
            cfg,
            wte,
            wpe,
            blocks,
            head,
            fused,
        })
    }

    /// The model's shape.
    pub fn config(&self) -> &GptConfig {
        &self.cfg
    }

    /// Chooses between the fused CPU kernels (the default on CPU) and the
    /// composed candle ops (the only choice elsewhere; asking for fused
    /// kernels on another device is ignored). Useful to check one against
    /// the other.
    pub fn set_fused_kernels(&mut self, fused: bool) {
        self.fused.store(fused, Ordering::Relaxed);
    }

    /// The final hidden states' activations after every block but the head.
    fn trunk(&self, idx: &Tensor, labels: Option<&Tensor>) -> Result<Activations> {
        let mut x = Activations::new(idx.clone());
        x.labels = labels.cloned();
        x.hidden = self.wte.forward(&x)?;
        x.hidden = self.wpe.forward(&x)?;
        for block in &self.blocks {
            x.hidden = block.forward(&x)?;
        }
        Ok(x)
    }

    /// Logits `[B, T, vocab_size]` for token ids `idx [B, T]` (u32), with
    /// `T <= block_size`.
    pub fn forward(&self, idx: &Tensor) -> Result<Tensor> {
        Ok(self.head.forward(&self.trunk(idx, None)?)?)
    }

    /// Mean next-token cross entropy of the logits for `idx [B, T]` against
    /// `targets [B, T]` (u32), over all `B * T` positions, computed in f32.
    pub fn loss(&self, idx: &Tensor, targets: &Tensor) -> Result<Tensor> {
        Ok(self.head.forward(&self.trunk(idx, Some(targets))?)?)
    }

    /// Continues `prompt` by `max_new_tokens` tokens and returns prompt and
    /// continuation together. Each step feeds the last `block_size` tokens
    /// (no KV cache: the demo model is small and clarity wins). With
    /// `temperature <= 0` it picks the most likely token, otherwise it
    /// samples from `softmax(logits / temperature)` using `rng`.
    pub fn generate(
        &self,
        prompt: &[u32],
        max_new_tokens: usize,
        temperature: f64,
        rng: &mut SplitMix64,
    ) -> Result<Vec<u32>> {
        if prompt.is_empty() {
            candle_core::bail!("generate needs a non-empty prompt")
        }
        let dev = self
            .wte
            .weights()
            .tensor("wte.weight")
            .map_or(Device::Cpu, |t| t.device().clone());
        let mut tokens = prompt.to_vec();
        for _ in 0..max_new_tokens {
            let ctx = &tokens[tokens.len().saturating_sub(self.cfg.block_size)..];
            let idx = Tensor::new(ctx, &dev)?.unsqueeze(0)?;
            let logits = self.forward(&idx)?.get(0)?.get(ctx.len() - 1)?;
            let logits: Vec<f32> = logits.to_dtype(DType::F32)?.to_vec1()?;
            tokens.push(sample(&logits, temperature, rng));
        }
        Ok(tokens)
    }
}

impl Model for Gpt {
    fn blocks(&self) -> Vec<&dyn AnyBlock> {
        let mut all: Vec<&dyn AnyBlock> = vec![&self.wte, &self.wpe];
        all.extend(self.blocks.iter().map(|b| b as &dyn AnyBlock));
        all.push(&self.head);
        all
    }
}

/// Index of the largest logit, or a draw from the tempered softmax.
fn sample(logits: &[f32], temperature: f64, rng: &mut SplitMix64) -> u32 {
    let argmax = logits
        .iter()
        .enumerate()
        .max_by(|a, b| a.1.total_cmp(b.1))
        .map_or(0, |(i, _)| i);
    if temperature <= 0.0 {
        return argmax as u32;
    }
    let max = logits[argmax] as f64;
    let weights: Vec<f64> = logits
        .iter()
        .map(|&l| ((l as f64 - max) / temperature).exp())
        .collect();
    let mut u = rng.next_f64() * weights.iter().sum::<f64>();
    for (i, w) in weights.iter().enumerate() {
        u -= w;
        if u < 0.0 {
            return i as u32;
        }
    }
    // Rounding can leave a sliver of mass unassigned; give it to the mode.
    argmax as u32
}

#[cfg(test)]
#[path = "gpt_tests.rs"]
mod tests;
