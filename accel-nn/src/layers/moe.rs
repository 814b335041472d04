//! [`SparseMoe`]: a sparse mixture-of-experts MLP (Mixtral's
//! `block_sparse_moe`, Qwen3-MoE's `mlp`), routed as the fast frameworks do.
//!
//! A softmax router picks each token's top-k experts; the `n * k` (token,
//! expert) pairs are grouped by expert with one permutation (one gather of
//! the rows), each expert runs once over its contiguous rows, and the outputs
//! are scaled by their routing weights and scattered back with one
//! `index_add`. Every step has a backward, so the router and every expert
//! that received tokens get gradients; an expert that received none still
//! runs on zero rows, so its gradient is zero, not missing. No per-token
//! loop and no dense all-experts product.

use candle_core::{DType, Module, Result, Tensor, D};
use candle_nn::VarBuilder;

use super::linear::{linear_b_with, Linear};
use super::lora::LoraSpec;
use super::mlp::SwiGluMlp;
use super::quantized::QuantSpec;

/// How a checkpoint names an expert's three projections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExpertNames {
    /// Mixtral: `w1` (gate), `w3` (up), `w2` (down).
    Mixtral,
    /// Qwen-MoE: `gate_proj`, `up_proj`, `down_proj`.
    GateUpDown,
}

impl ExpertNames {
    fn names(self) -> [&'static str; 3] {
        match self {
            ExpertNames::Mixtral => ["w1", "w3", "w2"],
            ExpertNames::GateUpDown => ["gate_proj", "up_proj", "down_proj"],
        }
    }
}

/// What one routed forward saw: the router's probabilities summed over the
/// tokens (with their graph) and how many tokens each (slot, expert) took,
/// which the load-balancing loss combines over layers.
#[derive(Debug, Clone)]
pub struct RouterStats {
    /// `[experts]` f32: the softmax probabilities summed over tokens.
    pub prob_sum: Tensor,
    /// Tokens routed to each expert (over all k slots).
    pub tokens: Vec<usize>,
    /// Tokens in the forward.
    pub n: usize,
}

/// A router `gate` `[experts, hidden]` over SwiGLU experts `experts.{e}`.
#[derive(Debug, Clone)]
pub struct SparseMoe {
    gate: Linear,
    experts: Vec<SwiGluMlp>,
    top_k: usize,
    norm_topk_prob: bool,
}

impl SparseMoe {
    /// The layer under `vb` (`gate`, `experts.{e}.{gate,up,down}`), with
    /// adapters and quantization on the experts' projections as given.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        hidden: usize,
        intermediate: usize,
        (num_experts, top_k, norm_topk_prob): (usize, usize, bool),
        names: ExpertNames,
        vb: VarBuilder,
        lora: Option<&LoraSpec>,
        quant: Option<&QuantSpec>,
    ) -> Result<Self> {
        if top_k == 0 || top_k > num_experts {
            candle_core::bail!(
                "{}: num_experts_per_tok {top_k} for {num_experts} experts",
                vb.prefix()
            )
        }
        // The router stays in full precision and without adapters, as
        // transformers and PEFT keep it.
        let gate = linear_b_with(hidden, num_experts, false, vb.pp("gate"), None, None)?;
        let [g, u, d] = names.names();
        let experts = (0..num_experts)
            .map(|e| {
                let vb = vb.pp("experts").pp(e);
                Ok(SwiGluMlp::new(
                    linear_b_with(hidden, intermediate, false, vb.pp(g), lora, quant)?,
                    linear_b_with(hidden, intermediate, false, vb.pp(u), lora, quant)?,
                    linear_b_with(intermediate, hidden, false, vb.pp(d), lora, quant)?,
                ))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            gate,
            experts,
            top_k,
            norm_topk_prob,
        })
    }

    /// Experts in the layer.
    pub fn num_experts(&self) -> usize {
        self.experts.len()
    }

    /// `x [.., hidden]` through the routed experts, and the router's
    /// statistics for the load-balancing loss.
    pub fn forward_with_stats(&self, x: &Tensor) -> Result<(Tensor, RouterStats)> {
        let shape = x.shape().clone();
        let d = x.dim(D::Minus1)?;
        let x2 = x.reshape(((), d))?;
        let n = x2.dim(0)?;
        let (e_count, k) = (self.experts.len(), self.top_k);
        let logits = self.gate.forward(&x2)?;
        // Routing in f32, as transformers routes.
        let probs = candle_nn::ops::softmax_last_dim(&logits.to_dtype(DType::F32)?)?;
        let host: Vec<f32> = probs.flatten_all()?.to_vec1()?;
        // Each token's top-k experts (largest first; the lower index on a tie).
        let mut chosen = Vec::with_capacity(n * k);
        for row in host.chunks(e_count) {
            let mut order: Vec<usize> = (0..e_count).collect();
            order.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
            chosen.extend(order[..k].iter().map(|&e| e as u32));
        }
        let idx = Tensor::from_vec(chosen.clone(), (n, k), x.device())?;
        let mut weights = probs.gather(&idx, 1)?;
        if self.norm_topk_prob {
            weights = weights.broadcast_div(&weights.sum_keepdim(1)?)?;
        }
        let weights = weights.to_dtype(x.dtype())?.flatten_all()?;
        // One permutation groups the (token, slot) pairs by expert.
        let mut tokens = vec![0usize; e_count];
        chosen.iter().for_each(|&e| tokens[e as usize] += 1);
        let mut order: Vec<u32> = (0..(n * k) as u32).collect();
        order.sort_by_key(|&p| chosen[p as usize]);
        let rows: Vec<u32> = order.iter().map(|&p| p / k as u32).collect();
        let order = Tensor::from_vec(order, n * k, x.device())?;
        let rows = Tensor::from_vec(rows, n * k, x.device())?;
        let grouped = x2.index_select(&rows, 0)?;
        let mut outs = Vec::with_capacity(e_count);
        let mut start = 0;
        for (expert, &count) in self.experts.iter().zip(&tokens) {
            // An expert without tokens runs on zero rows: its weights stay in
            // the graph and get a zero gradient.
            outs.push(expert.forward(&grouped.narrow(0, start, count)?)?);
            start += count;
        }
        let ys = Tensor::cat(&outs, 0)?;
        let ys = ys.broadcast_mul(&weights.index_select(&order, 0)?.unsqueeze(1)?)?;
        let out = x2.zeros_like()?.index_add(&rows, &ys, 0)?;
        let stats = RouterStats {
            prob_sum: probs.sum(0)?,
            tokens,
            n,
        };
        Ok((out.reshape(shape)?, stats))
    }
}

impl Module for SparseMoe {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(self.forward_with_stats(x)?.0)
    }
}

/// transformers' `load_balancing_loss_func` over the sparse layers of one
/// forward: `experts * sum_e(f_e * P_e)`, `f_e` the top-k assignments to
/// `e` per token and `P_e` the mean router probability, both over every
/// layer's tokens. Only `P` carries a gradient (the choices are
/// constants), as in PyTorch.
///
/// # Errors
/// No layers, or layers with different expert counts.
pub fn load_balancing_loss(stats: &[RouterStats]) -> Result<Tensor> {
    let Some(first) = stats.first() else {
        candle_core::bail!("load_balancing_loss: no router statistics")
    };
    let experts = first.tokens.len();
    let total: usize = stats.iter().map(|s| s.n).sum();
    let mut counts = vec![0f32; experts];
    for s in stats {
        if s.tokens.len() != experts {
            candle_core::bail!("load_balancing_loss: layers with different expert counts")
        }
        counts
            .iter_mut()
            .zip(&s.tokens)
            .for_each(|(c, &t)| *c += t as f32);
    }
    let prob_sum = stats
        .iter()
        .map(|s| s.prob_sum.clone())
        .reduce(|a, b| (a + b).expect("same shape"))
        .expect("at least one");
    // f_e = count_e / total, P_e = prob_sum_e / total.
    let scale = experts as f64 / (total as f64 * total as f64);
    let f = Tensor::from_vec(counts, experts, prob_sum.device())?;
    (prob_sum * f)?.sum_all()? * scale
}
