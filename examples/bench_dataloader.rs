//! The data loader's workers overlapping batch preparation with the step, as
//! one JSON object: a dataset whose `get_batch` works `--prepare-ms` on the
//! CPU and a step that works `--step-ms`, timed per step with the batch made
//! in the loop (`num_workers` 0) and on one background worker, against the
//! step alone. Both sides are CPU work on one thread each (spinning on
//! arithmetic), so the figure is the loader's overlap, not a model's speed.
//!
//! ```text
//! cargo run --release --example bench_dataloader -- [--prepare-ms 20] [--step-ms 20] [--steps 50]
//! ```

use std::time::{Duration, Instant};

use accel_core::data::{DataLoader, DataLoaderConfig, Dataset};
use anyhow::Result;
use clap::Parser;
use serde_json::json;

#[derive(Parser, Debug)]
struct Args {
    /// CPU time each batch takes to make.
    #[arg(long, default_value_t = 20.0)]
    prepare_ms: f64,
    /// CPU time each step takes.
    #[arg(long, default_value_t = 20.0)]
    step_ms: f64,
    /// Steps timed per side.
    #[arg(long, default_value_t = 50)]
    steps: usize,
}

/// Arithmetic for `d` on this thread (not a sleep: the work needs a core).
fn work(d: Duration) -> u64 {
    let start = Instant::now();
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    while start.elapsed() < d {
        for _ in 0..1000 {
            x = std::hint::black_box(x.rotate_left(7) ^ x.wrapping_mul(0xff51_afd7_ed55_8ccd));
        }
    }
    x
}

struct Slow {
    n: usize,
    prepare: Duration,
}

impl Dataset for Slow {
    type Batch = u64;
    fn len(&self) -> usize {
        self.n
    }
    fn get_batch(&self, indices: &[usize]) -> accel_core::Result<u64> {
        Ok(work(self.prepare) ^ indices[0] as u64)
    }
}

/// Seconds per step over `steps` steps with `workers` loader threads.
fn per_step(args: &Args, workers: usize) -> f64 {
    let loader = DataLoader::new(
        Slow {
            n: args.steps,
            prepare: Duration::from_secs_f64(args.prepare_ms / 1e3),
        },
        DataLoaderConfig::new(1).with_workers(workers, 2),
    );
    let step = Duration::from_secs_f64(args.step_ms / 1e3);
    let start = Instant::now();
    let mut sink = 0u64;
    for batch in loader.iter() {
        sink ^= batch.expect("synthetic batches do not fail");
        sink ^= work(step);
    }
    std::hint::black_box(sink);
    start.elapsed().as_secs_f64() / args.steps as f64
}

fn main() -> Result<()> {
    let args = Args::parse();
    let step = Duration::from_secs_f64(args.step_ms / 1e3);
    let start = Instant::now();
    for _ in 0..args.steps {
        std::hint::black_box(work(step));
    }
    let alone = start.elapsed().as_secs_f64() / args.steps as f64;
    let in_loop = per_step(&args, 0);
    let one_worker = per_step(&args, 1);
    let r = |x: f64| (x * 1e4).round() / 1e4;
    println!(
        "{}",
        json!({
            "prepare_ms": args.prepare_ms,
            "step_ms": args.step_ms,
            "steps": args.steps,
            "cores": std::thread::available_parallelism().map_or(0, |n| n.get()),
            "step_alone_s": r(alone),
            "num_workers_0_s_per_step": r(in_loop),
            "num_workers_1_s_per_step": r(one_worker),
            "num_workers_0_vs_step_alone": r(in_loop / alone),
            "num_workers_1_vs_step_alone": r(one_worker / alone),
        })
    );
    Ok(())
}
