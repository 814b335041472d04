//! Big-model inference with less RAM than the model: a synthetic 24-block
//! decoder checkpoint (fp32, 5 shards, ~2.2 GB at `--scale 1`), planned with a
//! CPU budget of half the model, loaded with the rest offloaded to disk (read
//! straight from the shards per forward), and run once. Prints one JSON object.
//!
//! `cargo run --release -p accel-bigmodel --example sharded_inference -- [--dir D] [--scale 0.1]`

use std::collections::BTreeMap;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

use accel_nn::{
    load_checkpoint_and_dispatch, Block, DeviceMapChoice, LoadDispatchOptions, Sequential,
};

type Dyn = Box<dyn Module + Send + Sync>;
use accel_bigmodel::{Placement, PlanOptions};
use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Module, Tensor, D};
use candle_nn::{Embedding, LayerNorm, Linear, VarBuilder};

const BLOCKS: usize = 24;
const SHARDS: usize = 5;

#[derive(Clone, Copy)]
struct Config {
    vocab: usize,
    hidden: usize,
}

impl Config {
    fn new(scale: f64) -> Self {
        let round64 = |x: f64| ((x / 64.0).round() as usize).max(1) * 64;
        Config {
            vocab: round64(32000.0 * scale),
            hidden: round64(1280.0 * scale.sqrt()),
        }
    }

    /// Every tensor of the checkpoint, in model order.
    fn tensors(&self) -> Vec<(String, Vec<usize>)> {
        let (v, d) = (self.vocab, self.hidden);
        let mut out = vec![("model.embed.weight".to_string(), vec![v, d])];
        for i in 0..BLOCKS {
            let p = format!("model.layers.{i}");
            for (n, s) in [
                ("ln1.weight", vec![d]),
                ("ln1.bias", vec![d]),
                ("qkv.weight", vec![3 * d, d]),
                ("o.weight", vec![d, d]),
                ("ln2.weight", vec![d]),
                ("ln2.bias", vec![d]),
                ("fc1.weight", vec![4 * d, d]),
                ("fc2.weight", vec![d, 4 * d]),
            ] {
                out.push((format!("{p}.{n}"), s));
            }
        }
        out.push(("model.norm.weight".into(), vec![d]));
        out.push(("model.norm.bias".into(), vec![d]));
        out.push(("lm_head.weight".into(), vec![v, d]));
        out
    }
}

/// Writes the checkpoint tensor by tensor (never holding more than one),
/// with deterministic small values; LayerNorm weights are 1.
fn generate(dir: &Path, cfg: Config) -> Result<()> {
    std::fs::create_dir_all(dir)?;
    let tensors = cfg.tensors();
    let total: usize = tensors
        .iter()
        .map(|(_, s)| s.iter().product::<usize>() * 4)
        .sum();
    let mut shards: Vec<Vec<(String, Vec<usize>)>> = vec![Vec::new()];
    let mut filled = 0;
    for t in tensors {
        let bytes = t.1.iter().product::<usize>() * 4;
        if filled + bytes > total.div_ceil(SHARDS) && !shards.last().unwrap().is_empty() {
            shards.push(Vec::new());
            filled = 0;
        }
        filled += bytes;
        shards.last_mut().unwrap().push(t);
    }
    let n = shards.len();
    let mut weight_map = BTreeMap::new();
    let mut state = 0x2545_f491_4f6c_dd1du64;
    for (k, shard) in shards.iter().enumerate() {
        let file = format!("model-{:05}-of-{n:05}.safetensors", k + 1);
        let mut header = serde_json::Map::new();
        let mut offset = 0;
        for (name, shape) in shard {
            let end = offset + shape.iter().product::<usize>() * 4;
            header.insert(
                name.clone(),
                serde_json::json!({"dtype": "F32", "shape": shape, "data_offsets": [offset, end]}),
            );
            offset = end;
            weight_map.insert(name.clone(), file.clone());
        }
        let mut h = serde_json::to_vec(&header)?;
        h.resize(h.len().div_ceil(8) * 8, b' ');
        let tmp = dir.join(format!("{file}.tmp"));
        let mut w = BufWriter::with_capacity(1 << 22, std::fs::File::create(&tmp)?);
        w.write_all(&(h.len() as u64).to_le_bytes())?;
        w.write_all(&h)?;
        for (name, shape) in shard {
            let count = shape.iter().product::<usize>();
            let ones = name.contains(".ln") || name.contains("norm.weight");
            let mut buf = Vec::with_capacity(count * 4);
            for _ in 0..count {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                let v = if ones {
                    1.0
                } else if name.ends_with("bias") {
                    0.0
                } else {
                    ((state >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.06
                };
                buf.extend_from_slice(&v.to_le_bytes());
            }
            w.write_all(&buf)?;
        }
        w.into_inner()?.sync_all()?;
        std::fs::rename(&tmp, dir.join(&file))?;
    }
    let index = serde_json::json!({"metadata": {"total_size": total}, "weight_map": weight_map});
    std::fs::write(
        dir.join("model.safetensors.index.json"),
        serde_json::to_vec_pretty(&index)?,
    )?;
    Ok(())
}

/// Pre-norm block: causal self-attention (one head) and a GELU MLP, with residuals.
struct Layer {
    ln1: LayerNorm,
    qkv: Linear,
    o: Linear,
    ln2: LayerNorm,
    fc1: Linear,
    fc2: Linear,
}

impl Module for Layer {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let d = x.dim(D::Minus1)?;
        let qkv = self.qkv.forward(&self.ln1.forward(x)?)?;
        let (q, k, v) = (
            qkv.narrow(2, 0, d)?,
            qkv.narrow(2, d, d)?,
            qkv.narrow(2, 2 * d, d)?,
        );
        let scores = (q.matmul(&k.t()?)? / (d as f64).sqrt())?;
        let t = x.dim(1)?;
        let mask: Vec<f32> = (0..t * t)
            .map(|i| {
                if i % t > i / t {
                    f32::NEG_INFINITY
                } else {
                    0.0
                }
            })
            .collect();
        let mask = Tensor::from_vec(mask, (t, t), x.device())?;
        let att = candle_nn::ops::softmax_last_dim(&scores.broadcast_add(&mask)?)?;
        let x = (x + self.o.forward(&att.matmul(&v)?)?)?;
        let h = self
            .fc2
            .forward(&self.fc1.forward(&self.ln2.forward(&x)?)?.gelu()?)?;
        x + h
    }
}

type Built = candle_core::Result<Box<dyn Module + Send + Sync>>;

/// The decoder, built empty: one hooked part per block, plus embedding and head.
fn empty_model(cfg: Config) -> Result<Sequential<Dyn>> {
    let (v, d) = (cfg.vocab, cfg.hidden);
    let (dt, dev) = (DType::F32, Device::Cpu);
    let mut parts = vec![Block::empty(
        "model.embed",
        "",
        dt,
        &dev,
        move |vb| -> Built { Ok(Box::new(Embedding::new(vb.get((v, d), "weight")?, d))) },
    )?];
    for i in 0..BLOCKS {
        let build = move |vb: VarBuilder| -> Built {
            let lin = |i, o, n| candle_nn::linear_no_bias(i, o, vb.pp(n));
            Ok(Box::new(Layer {
                ln1: candle_nn::layer_norm(d, 1e-5, vb.pp("ln1"))?,
                qkv: lin(d, 3 * d, "qkv")?,
                o: lin(d, d, "o")?,
                ln2: candle_nn::layer_norm(d, 1e-5, vb.pp("ln2"))?,
                fc1: lin(d, 4 * d, "fc1")?,
                fc2: lin(4 * d, d, "fc2")?,
            }))
        };
        parts.push(Block::empty(
            &format!("model.layers.{i}"),
            "Block",
            dt,
            &dev,
            build,
        )?);
    }
    parts.push(Block::empty(
        "model.norm",
        "",
        dt,
        &dev,
        move |vb| -> Built { Ok(Box::new(candle_nn::layer_norm(d, 1e-5, vb)?)) },
    )?);
    parts.push(Block::empty("lm_head", "", dt, &dev, move |vb| -> Built {
        Ok(Box::new(candle_nn::linear_no_bias(d, v, vb)?))
    })?);
    Ok(Sequential::new(parts))
}

fn vm_hwm_bytes() -> Result<u64> {
    let status = std::fs::read_to_string("/proc/self/status")?;
    let line = status
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .context("no VmHWM")?;
    let kb: u64 = line
        .split_whitespace()
        .nth(1)
        .context("VmHWM value")?
        .parse()?;
    Ok(kb * 1024)
}

// Resident and disk-offloaded weights are the checkpoint's own pages, not
// copies (see `accel_bigmodel::mapped`).
#[global_allocator]
static ALLOC: accel_bigmodel::MappedAlloc = accel_bigmodel::MappedAlloc::system();

fn main() -> Result<()> {
    let mut dir: Option<PathBuf> = None;
    let mut scale = 1.0f64;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--dir" => dir = Some(args.next().context("--dir needs a path")?.into()),
            "--scale" => scale = args.next().context("--scale needs a number")?.parse()?,
            other => bail!("unknown argument {other}"),
        }
    }
    let cfg = Config::new(scale);
    let dir = dir.unwrap_or_else(|| std::env::temp_dir().join(format!("accel-rs-decoder-{scale}")));
    let generated = !dir.join("model.safetensors.index.json").is_file();
    if generated {
        generate(&dir, cfg)?;
    }
    let model_bytes: usize = cfg
        .tensors()
        .iter()
        .map(|(_, s)| s.iter().product::<usize>() * 4)
        .sum();
    let budget = model_bytes as u64 / 2;
    // The planner places resident weights only; keep 10% of the RAM budget
    // for what a forward adds on top: the disk-offloaded block being
    // materialised (~4% of the model here), activations and allocator slack.
    let weights_limit = budget - budget / 10;

    let start = Instant::now();
    let model = empty_model(cfg)?;
    let plan = PlanOptions::new(vec![(Placement::Cpu, weights_limit.into())])
        .with_no_split_module_classes(["Block"]);
    let opts = LoadDispatchOptions {
        device_map: DeviceMapChoice::Auto(plan),
        dtype: None,
        offload_folder: None,
        main_device: None,
        adapter: None,
    };
    let report = load_checkpoint_and_dispatch(&model, &dir, &opts)?;
    let load_s = start.elapsed().as_secs_f64();

    let ids = Tensor::new(&[[1u32, 5, 9, 42, 7, 3, 11, 2]], &Device::Cpu)?;
    let start = Instant::now();
    let logits = model.forward_hidden(&ids)?;
    let forward_s = start.elapsed().as_secs_f64();
    let checksum = logits.sum_all()?.to_scalar::<f32>()?;
    let hwm = vm_hwm_bytes()?;
    let blocks = |p| {
        let it = report.placements.iter();
        it.filter(|(n, q)| n.starts_with("model.layers.") && *q == p)
            .count()
    };
    let json = serde_json::json!({
        "scale": scale,
        "generated_checkpoint": generated,
        "model_bytes": model_bytes,
        "cpu_budget_bytes": budget,
        "cpu_weights_limit_bytes": weights_limit,
        "load_s": load_s,
        "forward_s": forward_s,
        "peak_rss_bytes": hwm,
        "peak_rss_below_budget": hwm < budget,
        "blocks_on_cpu": blocks(Placement::Cpu),
        "blocks_on_disk": blocks(Placement::Disk),
        "parts": report.placements.len(),
        "logits_shape": logits.dims(),
        "logits_sum": checksum,
        "accelerate_reference_load_s": 15.4,
    });
    println!("{json}");
    Ok(())
}
