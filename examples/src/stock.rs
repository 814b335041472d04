//! The benchmark workloads written as a candle user writes them today, with
//! stock candle-nn layers: the `candle_nn_steps_per_s` rows of `bench_train`.
//!
//! Two stock conveniences cannot be used, because candle 0.11 registers them
//! without a backward and a model built on them silently stops training the
//! layers before them: `candle_nn::LayerNorm::forward` on contiguous input
//! (the fused `ops::layer_norm`) and `ops::softmax_last_dim`. They are
//! replaced by what candle-nn offers with a backward: the layer norm composed
//! from tensor ops and `ops::softmax`. Everything else is candle-nn's own:
//! `linear`, `embedding`, `Module::forward`, `loss::cross_entropy`, `AdamW`.

use candle_core::{DType, Module, Result, Tensor, D};
use candle_nn::{Embedding, Linear, VarBuilder};

use crate::GptConfig;

/// `784-512-512-10` style MLP of candle-nn `Linear`s with ReLU between.
pub struct StockMlp {
    layers: Vec<Linear>,
}

impl StockMlp {
    /// The layers `sizes[0] -> ... -> sizes[n-1]`, named `layers.{i}`.
    pub fn new(sizes: &[usize], vb: VarBuilder) -> Result<Self> {
        let vb = vb.pp("layers");
        let layers = sizes
            .windows(2)
            .enumerate()
            .map(|(i, io)| candle_nn::linear(io[0], io[1], vb.pp(i)))
            .collect::<Result<_>>()?;
        Ok(Self { layers })
    }

    /// Mean cross entropy of the logits for `x` against `labels`.
    pub fn loss(&self, x: &Tensor, labels: &Tensor) -> Result<Tensor> {
        let mut h = x.clone();
        for (i, l) in self.layers.iter().enumerate() {
            h = l.forward(&h)?;
            if i + 1 < self.layers.len() {
                h = h.relu()?;
            }
        }
        candle_nn::loss::cross_entropy(&h, labels)
    }
}

/// Layer norm from tensor ops (candle-nn's fused one has no backward).
fn layer_norm(x: &Tensor, w: &Tensor, b: &Tensor) -> Result<Tensor> {
    let mean = x.mean_keepdim(D::Minus1)?;
    let c = x.broadcast_sub(&mean)?;
    let var = c.sqr()?.mean_keepdim(D::Minus1)?;
    c.broadcast_div(&(var + 1e-5)?.sqrt()?)?
        .broadcast_mul(w)?
        .broadcast_add(b)
}

struct LnParams(Tensor, Tensor);

fn ln(vb: VarBuilder, d: usize) -> Result<LnParams> {
    Ok(LnParams(
        vb.get_with_hints(d, "weight", candle_nn::Init::Const(1.0))?,
        vb.get_with_hints(d, "bias", candle_nn::Init::Const(0.0))?,
    ))
}

struct StockBlock {
    ln_1: LnParams,
    c_attn: Linear,
    c_proj: Linear,
    ln_2: LnParams,
    c_fc: Linear,
    mlp_proj: Linear,
}

/// The GPT of [`crate::Gpt`] (pre-LayerNorm blocks, causal attention, tanh
/// GELU MLP, tied lm_head) on candle-nn layers.
pub struct StockGpt {
    cfg: GptConfig,
    wte: Embedding,
    wpe: Embedding,
    blocks: Vec<StockBlock>,
    ln_f: LnParams,
    mask: Tensor,
}

impl StockGpt {
    /// Builds the model under `vb` (candle-nn's initialisations).
    pub fn new(cfg: GptConfig, vb: VarBuilder) -> Result<Self> {
        let d = cfg.n_embd;
        let blocks = (0..cfg.n_layer)
            .map(|i| {
                let vb = vb.pp("h").pp(i);
                Ok(StockBlock {
                    ln_1: ln(vb.pp("ln_1"), d)?,
                    c_attn: candle_nn::linear(d, 3 * d, vb.pp("attn.c_attn"))?,
                    c_proj: candle_nn::linear(d, d, vb.pp("attn.c_proj"))?,
                    ln_2: ln(vb.pp("ln_2"), d)?,
                    c_fc: candle_nn::linear(d, 4 * d, vb.pp("mlp.c_fc"))?,
                    mlp_proj: candle_nn::linear(4 * d, d, vb.pp("mlp.c_proj"))?,
                })
            })
            .collect::<Result<_>>()?;
        let n = cfg.block_size;
        let mask: Vec<f32> = (0..n * n)
            .map(|k| {
                if k % n <= k / n {
                    0.0
                } else {
                    f32::NEG_INFINITY
                }
            })
            .collect();
        Ok(Self {
            cfg,
            wte: candle_nn::embedding(cfg.vocab_size, d, vb.pp("wte"))?,
            wpe: candle_nn::embedding(cfg.block_size, d, vb.pp("wpe"))?,
            blocks,
            ln_f: ln(vb.pp("ln_f"), d)?,
            mask: Tensor::from_vec(mask, (n, n), vb.device())?.to_dtype(vb.dtype())?,
        })
    }

    /// Mean next-token cross entropy for `idx [B, T]` against `targets [B, T]`.
    pub fn loss(&self, idx: &Tensor, targets: &Tensor) -> Result<Tensor> {
        let (b, t) = idx.dims2()?;
        let (d, nh) = (self.cfg.n_embd, self.cfg.n_head);
        let hd = d / nh;
        let pos = Tensor::arange(0u32, t as u32, idx.device())?;
        let mut x = self
            .wte
            .forward(idx)?
            .broadcast_add(&self.wpe.forward(&pos)?)?;
        let mask = self.mask.narrow(0, 0, t)?.narrow(1, 0, t)?;
        for blk in &self.blocks {
            let h = layer_norm(&x, &blk.ln_1.0, &blk.ln_1.1)?;
            let qkv = blk.c_attn.forward(&h)?.reshape((b, t, 3, nh, hd))?;
            let qkv = qkv.permute((2, 0, 3, 1, 4))?.contiguous()?;
            let (q, k, v) = (qkv.get(0)?, qkv.get(1)?, qkv.get(2)?);
            let att = (q.matmul(&k.t()?)? / (hd as f64).sqrt())?.broadcast_add(&mask)?;
            let att = candle_nn::ops::softmax(&att, D::Minus1)?;
            let y = att.matmul(&v)?.transpose(1, 2)?.reshape((b, t, d))?;
            x = (x + blk.c_proj.forward(&y)?)?;
            let h = layer_norm(&x, &blk.ln_2.0, &blk.ln_2.1)?;
            let h = blk.c_fc.forward(&h)?.gelu()?;
            x = (x + blk.mlp_proj.forward(&h)?)?;
        }
        let h = layer_norm(&x, &self.ln_f.0, &self.ln_f.1)?.reshape((b * t, d))?;
        let logits = h.matmul(&self.wte.embeddings().t()?)?;
        let logits = match logits.dtype() {
            DType::F32 => logits,
            _ => logits.to_dtype(DType::F32)?,
        };
        candle_nn::loss::cross_entropy(&logits, &targets.flatten_all()?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;
    use candle_nn::VarMap;

    /// The stock models are fair baselines only if they train every weight.
    #[test]
    fn stock_models_get_a_gradient_for_every_parameter() -> Result<()> {
        let cfg = GptConfig {
            vocab_size: 11,
            n_embd: 16,
            n_layer: 2,
            n_head: 2,
            block_size: 8,
        };
        let map = VarMap::new();
        let gpt = StockGpt::new(cfg, VarBuilder::from_varmap(&map, DType::F32, &Device::Cpu))?;
        let ids = Tensor::new(&[[1u32, 2, 3, 4], [5, 6, 7, 8]], &Device::Cpu)?;
        let grads = gpt.loss(&ids, &ids)?.backward()?;
        let vars = map.all_vars();
        assert_eq!(vars.len(), 2 + 2 + 2 * 12);
        assert!(vars.iter().all(|v| grads.get(v.as_tensor()).is_some()));

        let map = VarMap::new();
        let mlp = StockMlp::new(
            &[8, 4, 3],
            VarBuilder::from_varmap(&map, DType::F32, &Device::Cpu),
        )?;
        let x = Tensor::ones((2, 8), DType::F32, &Device::Cpu)?;
        let grads = mlp
            .loss(&x, &Tensor::new(&[0u32, 2], &Device::Cpu)?)?
            .backward()?;
        assert!(map
            .all_vars()
            .iter()
            .all(|v| grads.get(v.as_tensor()).is_some()));
        Ok(())
    }
}
