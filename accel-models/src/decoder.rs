//! The decoder layer of the Llama-shaped models: pre-norm grouped-query
//! attention with rotary embeddings, then a pre-norm MLP, each added to the
//! residual stream. The members differ in the parts:
//!
//! | part | Llama / Mistral / Qwen2 | Qwen3 | Phi-3 | Mixtral | Qwen3-MoE |
//! |---|---|---|---|---|---|
//! | q/k/v | `q_proj`, `k_proj`, `v_proj` | same | fused `qkv_proj` | same as Llama | same |
//! | q/k norm | - | per head | - | - | per head |
//! | rotary | whole head | whole head | `partial_rotary_factor` | whole head | whole head |
//! | MLP | SwiGLU | SwiGLU | fused `gate_up_proj` | experts `w1/w3/w2` | experts (or dense) |

use std::sync::{Arc, Mutex};

use accel_nn::block::{Activations, BlockForward};
use accel_nn::layers::{
    linear_b_with, rms_norm, swiglu_mlp_with, ExpertNames, Linear, RmsNorm, RouterStats, SparseMoe,
    SwiGluMlp,
};
use accel_nn::ops;
use candle_core::{Module, Tensor, D};
use candle_nn::VarBuilder;

use crate::config::{LlamaConfig, LlamaFamily};
use crate::parts;
use crate::rope;

/// Where the sparse layers of a forward leave their router statistics when
/// the loss adds the load-balancing term (`None`: not collecting).
pub(crate) type RouterLog = Arc<Mutex<Option<Vec<RouterStats>>>>;

/// The q/k/v projections: separate, or Phi-3's one `qkv_proj`.
enum Qkv {
    Separate(Box<[Linear; 3]>),
    Fused(Linear),
}

/// The MLP: SwiGLU, Phi-3's fused `gate_up_proj`, or routed experts.
enum Mlp {
    Dense(SwiGluMlp),
    FusedGateUp { gate_up: Linear, down: Linear },
    Sparse(SparseMoe),
}

/// One decoder layer (class `{Family}DecoderLayer`).
pub(crate) struct DecoderLayer {
    cfg: LlamaConfig,
    window: Option<usize>,
    input_layernorm: RmsNorm,
    qkv: Qkv,
    q_norm: Option<RmsNorm>,
    k_norm: Option<RmsNorm>,
    o_proj: Linear,
    post_attention_layernorm: RmsNorm,
    mlp: Mlp,
    router_log: RouterLog,
}

impl DecoderLayer {
    /// Layer `i` of `cfg` under `vb`.
    pub fn new(
        cfg: LlamaConfig,
        i: usize,
        router_log: RouterLog,
        vb: VarBuilder,
    ) -> candle_core::Result<Self> {
        let (d, hd) = (cfg.hidden_size, cfg.head_dim);
        let (q, kv) = (cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd);
        let att = vb.pp("self_attn");
        let (lora, quant) = (cfg.lora.clone(), cfg.quant.clone());
        let linear_b =
            |i, o, bias, vb| linear_b_with(i, o, bias, vb, lora.as_ref(), quant.as_ref());
        let qkv = if cfg.family == LlamaFamily::Phi3 {
            Qkv::Fused(linear_b(d, q + 2 * kv, false, att.pp("qkv_proj"))?)
        } else {
            Qkv::Separate(Box::new([
                linear_b(d, q, cfg.qkv_bias, att.pp("q_proj"))?,
                linear_b(d, kv, cfg.qkv_bias, att.pp("k_proj"))?,
                linear_b(d, kv, cfg.qkv_bias, att.pp("v_proj"))?,
            ]))
        };
        let (q_norm, k_norm) = if cfg.qk_norm {
            (
                Some(rms_norm(hd, cfg.rms_norm_eps, att.pp("q_norm"))?),
                Some(rms_norm(hd, cfg.rms_norm_eps, att.pp("k_norm"))?),
            )
        } else {
            (None, None)
        };
        let f = cfg.intermediate_size;
        let sparse = cfg.moe.as_ref().filter(|m| m.sparse_layers[i]);
        let mlp = match (cfg.family, sparse) {
            (_, Some(m)) => {
                let (name, names) = match cfg.family {
                    LlamaFamily::Mixtral => ("block_sparse_moe", ExpertNames::Mixtral),
                    _ => ("mlp", ExpertNames::GateUpDown),
                };
                Mlp::Sparse(SparseMoe::new(
                    d,
                    m.intermediate_size,
                    (m.num_experts, m.top_k, m.norm_topk_prob),
                    names,
                    vb.pp(name),
                    lora.as_ref(),
                    quant.as_ref(),
                )?)
            }
            (LlamaFamily::Phi3, None) => Mlp::FusedGateUp {
                gate_up: linear_b(d, 2 * f, false, vb.pp("mlp").pp("gate_up_proj"))?,
                down: linear_b(f, d, false, vb.pp("mlp").pp("down_proj"))?,
            },
            (_, None) => Mlp::Dense(swiglu_mlp_with(
                d,
                f,
                cfg.mlp_bias,
                vb.pp("mlp"),
                lora.as_ref(),
                quant.as_ref(),
            )?),
        };
        Ok(Self {
            window: cfg.window_of(i),
            input_layernorm: rms_norm(d, cfg.rms_norm_eps, vb.pp("input_layernorm"))?,
            qkv,
            q_norm,
            k_norm,
            o_proj: linear_b(q, d, cfg.o_bias, att.pp("o_proj"))?,
            post_attention_layernorm: rms_norm(
                d,
                cfg.rms_norm_eps,
                vb.pp("post_attention_layernorm"),
            )?,
            mlp,
            router_log,
            cfg,
        })
    }

    fn attention(&self, x: &Activations, h: &Tensor) -> candle_core::Result<Tensor> {
        let (hd, nh, nkv) = (
            self.cfg.head_dim,
            self.cfg.num_attention_heads,
            self.cfg.num_key_value_heads,
        );
        let (q, k, v) = match &self.qkv {
            Qkv::Separate(qkv) => {
                let [q, k, v] = &**qkv;
                (q.forward(h)?, k.forward(h)?, v.forward(h)?)
            }
            Qkv::Fused(qkv) => {
                let all = qkv.forward(h)?;
                let (nq, nk) = (nh * hd, nkv * hd);
                (
                    all.narrow(D::Minus1, 0, nq)?,
                    all.narrow(D::Minus1, nq, nk)?,
                    all.narrow(D::Minus1, nq + nk, nk)?,
                )
            }
        };
        let mut q = parts::split_heads(&q, nh, hd)?;
        let mut k = parts::split_heads(&k, nkv, hd)?;
        let v = parts::split_heads(&v, nkv, hd)?;
        // Qwen3: each head normalised over its dims before the rotation.
        if let (Some(qn), Some(kn)) = (&self.q_norm, &self.k_norm) {
            q = qn.forward(&q)?;
            k = kn.forward(&k)?;
        }
        let Some(tables) = &x.rope else {
            candle_core::bail!("a decoder layer needs rotary tables in Activations::rope")
        };
        let rd = self.cfg.rope.rotary_dim;
        let (q, k) = (rope::apply(&q, tables, rd)?, rope::apply(&k, tables, rd)?);
        let y = parts::causal_attention(x, (q, k, v), self.window, 1.0 / (hd as f64).sqrt())?;
        self.o_proj.forward(&y)
    }

    fn mlp(&self, h: &Tensor) -> candle_core::Result<Tensor> {
        match &self.mlp {
            Mlp::Dense(m) => m.forward(h),
            Mlp::FusedGateUp { gate_up, down } => {
                let gu = gate_up.forward(h)?;
                let f = gu.dim(D::Minus1)? / 2;
                let (gate, up) = (gu.narrow(D::Minus1, 0, f)?, gu.narrow(D::Minus1, f, f)?);
                down.forward(&ops::swiglu(&gate.contiguous()?, &up.contiguous()?)?)
            }
            Mlp::Sparse(moe) => {
                let (y, stats) = moe.forward_with_stats(h)?;
                if let Some(log) = self
                    .router_log
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .as_mut()
                {
                    log.push(stats);
                }
                Ok(y)
            }
        }
    }
}

impl BlockForward for DecoderLayer {
    fn forward(&self, x: &Activations) -> candle_core::Result<Tensor> {
        let h = self.input_layernorm.forward(&x.hidden)?;
        let h = (&x.hidden + self.attention(x, &h)?)?;
        let m = self.mlp(&self.post_attention_layernorm.forward(&h)?)?;
        h + m
    }
}

/// The final RMSNorm `model.norm`.
pub(crate) struct FinalNorm(pub RmsNorm);

impl BlockForward for FinalNorm {
    fn forward(&self, x: &Activations) -> candle_core::Result<Tensor> {
        self.0.forward(&x.hidden)
    }
}
