//! Big-model inference on one checkpoint for both sides: a ~2.2 GB
//! Llama-architecture checkpoint written by transformers in 5 shards, loaded
//! with half its decoder layers on disk, then two forwards of 1 x 32 tokens;
//! the same run times transformers' `from_pretrained(device_map=...,
//! offload_folder=...)` on the same folder with the same map. One JSON object;
//! `forward_s` is the first forward (what a one-shot job pays),
//! `forward_warm_s` a second one.
//!
//! ```text
//! cargo run --release --example bench_bigmodel -- --json   [--model DIR] [--rounds N]
//! ```
//! Without `--model`, the checkpoint is written to `target/bench_llama_2gb`
//! by `scripts/bench_bigmodel_torch.py write` (needs `pip install torch
//! transformers accelerate`); it is reused by later runs.
//!
//! Each side runs in a process of its own (peak RSS is per process), with
//! the page cache warm: `accel_rs` with weights mapped from the checkpoint
//! (this program installs [`MappedAlloc`]), `accel_rs_read` the same with
//! `ACCEL_MMAP_WEIGHTS=0` (weights read into memory), then transformers. With
//! `--rounds N` the three alternate N times and each figure is the median.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use accel_core::bigmodel::{mapped, DeviceMap, MappedAlloc, Placement};
use accel_core::models::AutoModel;
use accel_core::nn::{DeviceMapChoice, LoadDispatchOptions, Model};
use accel_examples::bench_proc::{run_side, script_checkpoint, status_kib};
use anyhow::Result;
use candle_core::{DType, Tensor};
use clap::Parser;
use serde_json::{json, Value};

// Weights resident on the CPU and disk-offloaded ones are the checkpoint's
// own pages, not copies (see `accel_bigmodel::mapped`).
#[global_allocator]
static ALLOC: MappedAlloc = MappedAlloc::system();

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
    /// Alternate the three sides this many times; figures are medians.
    #[arg(long, default_value_t = 1)]
    rounds: usize,
    /// Internal: run one accel-rs side with this device map and print its JSON.
    #[arg(long, hide = true)]
    child: Option<PathBuf>,
}

const SCRIPT: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../scripts/bench_bigmodel_torch.py"
);

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

fn python(dir: &Path, map: &Path, offload: &Path) -> Result<Value> {
    let mut cmd = Command::new("python3");
    cmd.args([SCRIPT, "time"]).arg(dir).arg(map).arg(offload);
    run_side(&mut cmd, "transformers")
}

fn rust(dir: &Path, map: &Path, read: bool) -> Result<Value> {
    let mut cmd = Command::new(std::env::current_exe()?);
    cmd.arg("--model").arg(dir).arg("--child").arg(map);
    cmd.env("ACCEL_MMAP_WEIGHTS", if read { "0" } else { "1" });
    run_side(&mut cmd, if read { "accel-rs (read)" } else { "accel-rs" })
}

/// One accel-rs side, in this process: load, two forwards, figures as JSON.
fn child(dir: &Path, map_file: &Path) -> Result<Value> {
    let map: DeviceMap = serde_json::from_str(&std::fs::read_to_string(map_file)?)?;
    let tmp = tempfile::tempdir()?;
    let rss_before = status_kib("VmRSS:");
    let t = Instant::now();
    let opts = LoadDispatchOptions {
        device_map: DeviceMapChoice::Map(map),
        dtype: None,
        offload_folder: Some(tmp.path().join("offload")),
        main_device: None,
        adapter: None,
    };
    let (model, report) = AutoModel::load_dispatched(dir, &opts)?;
    let load_s = t.elapsed().as_secs_f64();
    let mapped_after_load = mapped::stats();
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
    let round3 = |x: f64| (x * 1000.0).round() / 1000.0;
    let mib = |kib: u64| kib / 1024;
    Ok(json!({
        "load_s": round3(load_s),
        "forward_s": round3(forward_s),
        "forward_warm_s": round3(forward_warm_s),
        "peak_rss_mib": ((status_kib("VmHWM:") as f64 / 1024.0) * 10.0).round() / 10.0,
        // What the resident set holds after the forwards: the process's own
        // memory, and pages of mapped files (the page cache's, shared).
        "rss_anon_mib": mib(status_kib("RssAnon:")),
        "rss_file_mib": mib(status_kib("RssFile:")),
        "rss_before_load_mib": mib(rss_before),
        "mapped_weights_mib": mapped_after_load.bytes >> 20,
        "blocks_on_disk": report.count(Placement::Disk),
        "logits_sum": logits_sum,
    }))
}

/// Each numeric field's median over `runs`, other fields from the first.
fn medians(runs: &[Value]) -> Value {
    let mut out = runs[0].clone();
    if let Value::Object(fields) = &mut out {
        for (k, v) in fields.iter_mut() {
            if !v.is_f64() && !v.is_u64() {
                continue;
            }
            let mut xs: Vec<f64> = runs.iter().filter_map(|r| r[k].as_f64()).collect();
            xs.sort_by(f64::total_cmp);
            *v = json!(xs[xs.len() / 2]);
        }
    }
    if runs.len() > 1 {
        out["runs"] = json!(runs);
    }
    out
}

fn ensure_checkpoint(model: Option<PathBuf>) -> Result<PathBuf> {
    match model {
        Some(d) => Ok(d),
        None => script_checkpoint(
            "bench_llama_2gb",
            "model.safetensors.index.json",
            SCRIPT,
            "torch transformers accelerate",
        ),
    }
}

fn main() -> Result<()> {
    accel_core::init_logging();
    let args = Args::parse();
    let dir = ensure_checkpoint(args.model)?;
    if let Some(map) = &args.child {
        println!("{}", child(&dir, map)?);
        return Ok(());
    }
    let shards: Vec<PathBuf> = std::fs::read_dir(&dir)?
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    let mut bytes = 0u64;
    for shard in &shards {
        // Read once, so every side starts with the page cache warm.
        bytes += std::io::copy(&mut std::fs::File::open(shard)?, &mut std::io::sink())?;
    }
    let empty = AutoModel::empty(&dir, DType::F32)?;
    let map = half_on_disk(&empty);
    drop(empty);
    let tmp = tempfile::tempdir()?;
    let map_file = tmp.path().join("device_map.json");
    std::fs::write(&map_file, serde_json::to_string(&map)?)?;
    let (mut mapped_runs, mut read_runs, mut py_runs) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..args.rounds.max(1) {
        mapped_runs.push(rust(&dir, &map_file, false)?);
        read_runs.push(rust(&dir, &map_file, true)?);
        if !args.no_python {
            py_runs.push(python(&dir, &map_file, &tmp.path().join("offload_py"))?);
        }
    }
    let mut out = json!({
        "checkpoint_gb": (bytes as f64 / 1e9 * 100.0).round() / 100.0,
        "rounds": args.rounds.max(1),
        "accel_rs": medians(&mapped_runs),
        "accel_rs_read": medians(&read_runs),
    });
    if !py_runs.is_empty() {
        let py = medians(&py_runs);
        let rust = out["accel_rs"].clone();
        let ratio = |k: &str| {
            let r = py[k].as_f64().unwrap_or(f64::NAN) / rust[k].as_f64().unwrap_or(f64::NAN);
            json!((r * 10.0).round() / 10.0)
        };
        out["load_speedup"] = ratio("load_s");
        out["forward_speedup"] = ratio("forward_s");
        out["forward_warm_speedup"] = ratio("forward_warm_s");
        out["transformers"] = py;
    }
    if args.json {
        println!("{out}");
    } else {
        println!("{}", serde_json::to_string_pretty(&out)?);
    }
    Ok(())
}
