//! Training throughput of models built only from accel-nn ops: the MLP
//! (784-512-512-10, batch 64) and the GPT (vocab 4096, d 256, 4 layers, 4
//! heads, seq 128, batch 8) of the examples' `bench_train`, stepped with
//! the fused `accel_kernels::adamw_step` like its `raw_fused` loop (set
//! `ACCEL_BENCH_CANDLE_ADAMW=1` for candle's AdamW, `ACCEL_BENCH_NO_OPT=1`
//! for forward + backward only). Prints one JSON object.
//!
//! ```text
//! cargo run --release -p accel-nn --example bench_nn -- [mlp|gpt|all] [packed]
//! ```

use std::time::Instant;

use accel_nn::layers::{embedding, layer_norm, linear, Embedding, LayerNorm, Linear};
use accel_nn::ops::{self, Activation, AttentionMask};
use anyhow::Result;
use candle_core::{DType, Device, Module, Tensor, D};
use candle_nn::{AdamW, Optimizer, ParamsAdamW, VarBuilder, VarMap};

/// The optimizer a bench step ends with.
enum Opt {
    Candle(AdamW),
    Fused {
        params: Vec<Tensor>,
        m: Vec<Tensor>,
        v: Vec<Tensor>,
        step: u64,
    },
    None,
}

impl Opt {
    fn new(map: &VarMap) -> Result<Self> {
        if std::env::var("ACCEL_BENCH_NO_OPT").is_ok() {
            return Ok(Opt::None);
        }
        if std::env::var("ACCEL_BENCH_CANDLE_ADAMW").is_ok() {
            return Ok(Opt::Candle(AdamW::new(
                map.all_vars(),
                ParamsAdamW::default(),
            )?));
        }
        let params: Vec<Tensor> = map
            .all_vars()
            .iter()
            .map(|v| v.as_tensor().clone())
            .collect();
        let zeros = |p: &Tensor| p.zeros_like();
        Ok(Opt::Fused {
            m: params
                .iter()
                .map(zeros)
                .collect::<candle_core::Result<_>>()?,
            v: params
                .iter()
                .map(zeros)
                .collect::<candle_core::Result<_>>()?,
            params,
            step: 0,
        })
    }

    fn backward_step(&mut self, loss: &Tensor) -> Result<()> {
        match self {
            Opt::Candle(opt) => opt.backward_step(loss)?,
            Opt::None => {
                loss.backward()?;
            }
            Opt::Fused { params, m, v, step } => {
                let grads = loss.backward()?;
                let g: Vec<Tensor> = params
                    .iter()
                    .map(|p| grads.get(p).expect("gradient").clone())
                    .collect();
                *step += 1;
                let hp = accel_kernels::AdamWParams::default();
                accel_kernels::adamw_step(params, &g, m, v, *step, &hp)?;
            }
        }
        Ok(())
    }
}

fn mlp(steps: usize) -> Result<f64> {
    let dev = Device::Cpu;
    let map = VarMap::new();
    let vb = VarBuilder::from_varmap(&map, DType::F32, &dev);
    let sizes = [784, 512, 512, 10];
    let layers: Vec<Linear> = sizes
        .windows(2)
        .enumerate()
        .map(|(i, w)| linear(w[0], w[1], vb.pp(format!("layers.{i}"))))
        .collect::<candle_core::Result<_>>()?;
    let x = Tensor::randn(0f32, 1.0, (64, 784), &dev)?;
    let y = Tensor::from_vec((0..64u32).map(|i| i % 10).collect(), 64, &dev)?;
    let mut opt = Opt::new(&map)?;
    let step = |opt: &mut Opt| -> Result<()> {
        let mut h = x.clone();
        for (i, l) in layers.iter().enumerate() {
            let act = (i + 1 < layers.len()).then_some(Activation::Relu);
            h = l.forward_act(&h, act)?;
        }
        opt.backward_step(&ops::cross_entropy(&h, &y)?)
    };
    for _ in 0..10 {
        step(&mut opt)?;
    }
    let t0 = Instant::now();
    for _ in 0..steps {
        step(&mut opt)?;
    }
    Ok(steps as f64 / t0.elapsed().as_secs_f64())
}

struct Block {
    ln_1: LayerNorm,
    c_attn: Linear,
    attn_proj: Linear,
    ln_2: LayerNorm,
    c_fc: Linear,
    mlp_proj: Linear,
}

struct Gpt {
    wte: Embedding,
    wpe: Embedding,
    blocks: Vec<Block>,
    ln_f: LayerNorm,
    heads: usize,
    packed: bool,
}

impl Gpt {
    fn new(
        vb: VarBuilder,
        vocab: usize,
        d: usize,
        layers: usize,
        heads: usize,
        ctx: usize,
    ) -> Result<Self> {
        let blocks = (0..layers)
            .map(|i| {
                let vb = vb.pp(format!("h.{i}"));
                Ok(Block {
                    ln_1: layer_norm(d, 1e-5, vb.pp("ln_1"))?,
                    c_attn: linear(d, 3 * d, vb.pp("attn.c_attn"))?,
                    attn_proj: linear(d, d, vb.pp("attn.c_proj"))?,
                    ln_2: layer_norm(d, 1e-5, vb.pp("ln_2"))?,
                    c_fc: linear(d, 4 * d, vb.pp("mlp.c_fc"))?,
                    mlp_proj: linear(4 * d, d, vb.pp("mlp.c_proj"))?,
                })
            })
            .collect::<Result<_>>()?;
        Ok(Self {
            wte: embedding(vocab, d, vb.pp("wte"))?,
            wpe: embedding(ctx, d, vb.pp("wpe"))?,
            blocks,
            ln_f: layer_norm(d, 1e-5, vb.pp("ln_f"))?,
            heads,
            packed: std::env::args().any(|a| a == "packed"),
        })
    }

    fn loss(&self, idx: &Tensor, targets: &Tensor) -> Result<Tensor> {
        let (b, t) = idx.dims2()?;
        let d = self.wte.hidden_size();
        let (nh, hd) = (self.heads, d / self.heads);
        let pos = Tensor::arange(0u32, t as u32, idx.device())?;
        let mut x = self
            .wte
            .forward(idx)?
            .broadcast_add(&self.wpe.forward(&pos)?)?;
        for blk in &self.blocks {
            let qkv = blk.c_attn.forward(&blk.ln_1.forward(&x)?)?;
            let mask = AttentionMask::Causal { offset: 0 };
            let scale = 1.0 / (hd as f64).sqrt();
            let y = if self.packed {
                ops::attention_qkv(&qkv, nh, &mask, scale)?
            } else {
                let qkv = qkv.reshape((b, t, 3, nh, hd))?;
                let part = |i| qkv.narrow(2, i, 1)?.squeeze(2)?.transpose(1, 2);
                let (q, k, v) = (part(0)?, part(1)?, part(2)?);
                let y = ops::scaled_dot_product_attention(&q, &k, &v, &mask, scale)?;
                y.transpose(1, 2)?.reshape((b, t, d))?
            };
            x = (x + blk.attn_proj.forward(&y)?)?;
            let h = blk
                .c_fc
                .forward_act(&blk.ln_2.forward(&x)?, Some(Activation::GeluTanh))?;
            x = (&x + blk.mlp_proj.forward(&h)?)?;
        }
        let x = self.ln_f.forward(&x)?;
        Ok(ops::linear_cross_entropy(
            &x,
            self.wte.embeddings(),
            targets,
        )?)
    }
}

fn gpt(steps: usize) -> Result<f64> {
    let dev = Device::Cpu;
    let map = VarMap::new();
    let vb = VarBuilder::from_varmap(&map, DType::F32, &dev);
    let model = Gpt::new(vb, 4096, 256, 4, 4, 128)?;
    let idx = Tensor::rand(0f32, 4096.0, (8, 128), &dev)?.to_dtype(DType::U32)?;
    let targets = idx.roll(-1, D::Minus1)?;
    let mut opt = Opt::new(&map)?;
    for _ in 0..2 {
        opt.backward_step(&model.loss(&idx, &targets)?)?;
    }
    let t0 = Instant::now();
    for _ in 0..steps {
        opt.backward_step(&model.loss(&idx, &targets)?)?;
    }
    Ok(steps as f64 / t0.elapsed().as_secs_f64())
}

fn main() -> Result<()> {
    let which = std::env::args().nth(1).unwrap_or_else(|| "all".into());
    let mut out = serde_json::Map::new();
    if which == "all" || which == "mlp" {
        out.insert("mlp_steps_per_s".into(), mlp(300)?.into());
    }
    if which == "all" || which == "gpt" {
        out.insert("gpt_steps_per_s".into(), gpt(15)?.into());
    }
    out.insert("threads".into(), rayon::current_num_threads().into());
    println!("{}", serde_json::Value::Object(out));
    Ok(())
}
