//! Big-model inference on one checkpoint for both sides: a ~2.2 GB
//! Llama-architecture checkpoint written by transformers in 5 shards, loaded
//! with half its decoder layers on disk, then two forwards of 1 x 32 tokens;
//! the same run times transformers' `from_pretrained(device_map=...,
//! offload_folder=...)` on the same folder with the same map. One JSON object;
//! `forward_s` is the first forward (what a one-shot job pays),
//! `forward_warm_s` a second one.
//!
//! ```text
//! cargo run --release --example bench_bigmodel -- --json   [--model DIR]
//! ```
//! Without `--model`, the checkpoint is written to `target/bench_llama_2gb`
//! by `scripts/bench_bigmodel_torch.py write` (needs `pip install torch
//! transformers accelerate`); it is reused by later runs.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use accel_core::bigmodel::{DeviceMap, Placement};
use accel_core::models::AutoModel;
use accel_core::nn::{DeviceMapChoice, LoadDispatchOptions, Model};
use anyhow::{bail, Context, Result};
use candle_core::{DType, Tensor};
use clap::Parser;

#[derive(Parser, Debug)]
struct Args {
    /// The checkpoint folder (written by the script when absent).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Print only the JSON object.
    #[arg(long)]
    json: bool,
    /// Skip the transformers side.
    #[arg(long)]
    no_python: bool,
}

const SCRIPT: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../scripts/bench_bigmodel_torch.py"
);

fn status_kib(field: &str) -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let line = status.lines().find(|l| l.starts_with(field)).unwrap_or("");
    line.split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// Embeddings, the first half of the layers, the final norm and the head on
/// the CPU; the second half of the layers on disk.
fn half_on_disk(model: &AutoModel) -> DeviceMap {
    let blocks: Vec<String> = model.blocks().iter().map(|b| b.name()).collect();
    let layers: Vec<&String> = blocks.iter().filter(|b| b.contains(".layers.")).collect();
    let mut map = DeviceMap::new();
    for b in &blocks {
        let k = layers.iter().position(|l| *l == b);
        let disk = k.is_some_and(|k| k >= layers.len() / 2);
        map.insert(
            b.clone(),
            if disk {
                Placement::Disk
            } else {
                Placement::Cpu
            },
        );
    }
    map
}

fn python(dir: &Path, map: &Path, offload: &Path) -> Result<serde_json::Value> {
    let out = Command::new("python3")
        .args([SCRIPT, "time"])
        .arg(dir)
        .arg(map)
        .arg(offload)
        .output()
        .context("running python3")?;
    if !out.status.success() {
        bail!(
            "transformers side failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let last = String::from_utf8_lossy(&out.stdout)
        .lines()
        .last()
        .unwrap_or("")
        .to_string();
    Ok(serde_json::from_str(&last)?)
}

fn main() -> Result<()> {
    let args = Args::parse();
    let dir = match args.model {
        Some(d) => d,
        None => {
            let d = PathBuf::from(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/../target/bench_llama_2gb"
            ));
            if !d.join("model.safetensors.index.json").is_file() {
                eprintln!("writing the checkpoint to {} ...", d.display());
                let ok = Command::new("python3")
                    .args([SCRIPT, "write"])
                    .arg(&d)
                    .status()?;
                if !ok.success() {
                    bail!("could not write the checkpoint (pip install torch transformers accelerate)");
                }
            }
            d
        }
    };
    let bytes: u64 = std::fs::read_dir(&dir)?
        .filter_map(|e| e.ok())
        .filter(|e| e.path().extension().is_some_and(|x| x == "safetensors"))
        .map(|e| e.metadata().map(|m| m.len()).unwrap_or(0))
        .sum();
    let empty = AutoModel::empty(&dir, DType::F32)?;
    let map = half_on_disk(&empty);
    drop(empty);
    let tmp = tempfile::tempdir()?;
    let map_file = tmp.path().join("device_map.json");
    std::fs::write(&map_file, serde_json::to_string(&map)?)?;

    let rss_before = status_kib("VmRSS:");
    let t = Instant::now();
    let opts = LoadDispatchOptions {
        device_map: DeviceMapChoice::Map(map.clone()),
        dtype: None,
        offload_folder: Some(tmp.path().join("offload")),
        main_device: None,
    };
    let (model, report) = AutoModel::load_dispatched(&dir, &opts)?;
    let load_s = t.elapsed().as_secs_f64();
    let ids = Tensor::arange(1u32, 33, &candle_core::Device::Cpu)?.unsqueeze(0)?;
    let t = Instant::now();
    let logits = model.forward(&ids)?;
    let forward_s = t.elapsed().as_secs_f64();
    let logits_sum = logits.to_dtype(DType::F64)?.sum_all()?.to_scalar::<f64>()?;
    // A second forward shows the steady state: no first-touch page faults,
    // thread pools and caches warm.
    let t = Instant::now();
    model.forward(&ids)?;
    let forward_warm_s = t.elapsed().as_secs_f64();
    let peak_mib = status_kib("VmHWM:") as f64 / 1024.0;
    let rust = serde_json::json!({
        "load_s": (load_s * 1000.0).round() / 1000.0,
        "forward_s": (forward_s * 1000.0).round() / 1000.0,
        "forward_warm_s": (forward_warm_s * 1000.0).round() / 1000.0,
        "peak_rss_mib": (peak_mib * 10.0).round() / 10.0,
        "rss_before_load_mib": rss_before / 1024,
        "blocks_on_disk": report.count(Placement::Disk),
        "logits_sum": logits_sum,
    });
    drop(model);
    let mut out = serde_json::json!({
        "checkpoint_gb": (bytes as f64 / 1e9 * 100.0).round() / 100.0,
        "accel_rs": rust,
    });
    if !args.no_python {
        let py = python(&dir, &map_file, &tmp.path().join("offload_py"))?;
        let rust = out["accel_rs"].clone();
        let ratio = |k: &str| {
            let r = py[k].as_f64().unwrap_or(f64::NAN) / rust[k].as_f64().unwrap_or(f64::NAN);
            serde_json::json!((r * 10.0).round() / 10.0)
        };
        out["load_speedup"] = ratio("load_s");
        out["forward_speedup"] = ratio("forward_s");
        out["transformers"] = py;
    }
    if args.json {
        println!("{out}");
    } else {
        println!("{}", serde_json::to_string_pretty(&out)?);
    }
    Ok(())
}
