//! Bandwidth of the fused cast / unscale kernels against memcpy.
//!
//! For each source size (f32 elements), measures in one run the median of
//! several repetitions of:
//! - `memcpy`: `copy_from_slice` of the source bytes into a preallocated
//!   buffer (single thread, the practical ceiling of one core);
//! - `loop_f32_to_bf16`: the naive per-element `bf16::from_f32` loop;
//! - `cast_into` f32 -> bf16, bf16 -> f32 and f32 -> f16 (the per-step
//!   master-weight refresh), and `unscale_and_check` on f32.
//!
//! Bandwidth counts bytes read plus bytes written, the same way for every
//! entry (memcpy of N f32 moves 8N bytes, an f32 -> bf16 cast 6N).
//! Run: `cargo run --release -p accel-kernels --example bench_cast -- [--json]`.

use std::hint::black_box;
use std::time::Instant;

use accel_kernels::{cast_into, unscale_and_check};
use candle_core::{DType, Device, Tensor};
use half::bf16;
use serde_json::{json, Value};

/// One measured operation: its name, the bytes it reads plus writes, and
/// the work (called with the repetition index).
struct Op<'a> {
    name: &'static str,
    bytes: usize,
    run: Box<dyn FnMut(usize) + 'a>,
}

/// Times every op once per round, round-robin, for two warm-up rounds (which
/// fault in every page) and `reps` measured ones, and returns each op's
/// median seconds. Interleaving matters on shared machines: every op sees
/// the same mix of quiet and noisy moments, so the ratios stay meaningful.
fn median_secs(ops: &mut [Op<'_>], reps: usize) -> Vec<f64> {
    let mut times = vec![Vec::with_capacity(reps); ops.len()];
    for round in 0..reps + 2 {
        for (op, t) in ops.iter_mut().zip(&mut times) {
            let start = Instant::now();
            (op.run)(round);
            if round >= 2 {
                t.push(start.elapsed().as_secs_f64());
            }
        }
    }
    times
        .into_iter()
        .map(|mut t| {
            t.sort_by(f64::total_cmp);
            t[t.len() / 2]
        })
        .collect()
}

fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

/// Benchmarks one source size of `n` f32 elements.
fn bench_size(n: usize, reps: usize) -> candle_core::Result<Value> {
    let dev = Device::Cpu;
    // Varied, finite values so the casts round for real.
    let src_vec: Vec<f32> = (0..n)
        .map(|i| ((i as f32) * 0.618_034).sin() * 1e3)
        .collect();
    let src = Tensor::from_vec(src_vec.clone(), n, &dev)?;
    let bf = Tensor::zeros(n, DType::BF16, &dev)?;
    let (s, b) = ([src], [bf.clone()]);
    let h = [Tensor::zeros(n, DType::F16, &dev)?];
    let w = [Tensor::zeros(n, DType::F32, &dev)?];
    let mut copy_dst = vec![0f32; n];
    let mut loop_dst = vec![bf16::ZERO; n];
    let src_ref = &src_vec;
    let mut ops = [
        Op {
            name: "memcpy",
            bytes: n * 8,
            run: Box::new(|_| {
                copy_dst.copy_from_slice(black_box(src_ref));
                black_box(&mut copy_dst);
            }),
        },
        Op {
            name: "loop_f32_to_bf16",
            bytes: n * 6,
            run: Box::new(|_| {
                let src = black_box(src_ref);
                for i in 0..n {
                    loop_dst[i] = bf16::from_f32(src[i]);
                }
                black_box(&mut loop_dst);
            }),
        },
        Op {
            name: "cast_into_f32_to_bf16",
            bytes: n * 6,
            run: Box::new(|_| cast_into(&s, &b).unwrap()),
        },
        Op {
            name: "cast_into_bf16_to_f32",
            bytes: n * 6,
            run: Box::new(|_| cast_into(&b, &w).unwrap()),
        },
        Op {
            name: "cast_into_f32_to_f16",
            bytes: n * 6,
            run: Box::new(|_| cast_into(&s, &h).unwrap()),
        },
        // Alternate 0.5 and 2.0: exact, and values never drift into subnormals.
        Op {
            name: "unscale_and_check_f32",
            bytes: n * 8,
            run: Box::new(|r| {
                assert!(!unscale_and_check(&w, if r % 2 == 0 { 0.5 } else { 2.0 }).unwrap())
            }),
        },
    ];
    let secs = median_secs(&mut ops, reps);
    let gbps: Vec<f64> = ops
        .iter()
        .zip(&secs)
        .map(|(op, t)| op.bytes as f64 / t / 1e9)
        .collect();
    let mut out = json!({ "src_bytes": n * 4, "elements": n, "reps": reps });
    for ((op, t), g) in ops.iter().zip(&secs).zip(&gbps) {
        out[op.name] = json!({ "gbps": round3(*g), "ms": round3(t * 1e3), "ratio_to_memcpy": round3(g / gbps[0]) });
    }
    drop(ops);
    // The fused cast must agree with the naive loop.
    let tail = bf.narrow(0, n - 4, 4)?.to_vec1::<bf16>()?;
    assert_eq!(
        tail,
        loop_dst[n - 4..],
        "cast_into disagrees with the per-element loop"
    );
    Ok(out)
}

fn main() -> candle_core::Result<()> {
    let json_only = std::env::args().any(|a| a == "--json");
    let sizes = [(256usize << 20, 15usize), (4 << 20, 101)];
    let results = sizes
        .iter()
        .map(|&(bytes, reps)| bench_size(bytes / 4, reps))
        .collect::<candle_core::Result<Vec<_>>>()?;
    let out = json!({
        "threads": accel_kernels::par::threads(),
        "bytes_counted": "read + written",
        "sizes": results,
    });
    if !json_only {
        for r in &results {
            println!("source {} MiB:", r["src_bytes"].as_u64().unwrap_or(0) >> 20);
            for (k, v) in r
                .as_object()
                .into_iter()
                .flatten()
                .filter(|(_, v)| v.is_object())
            {
                let (g, r) = (
                    v["gbps"].as_f64().unwrap_or(0.0),
                    v["ratio_to_memcpy"].as_f64().unwrap_or(0.0),
                );
                println!("  {k:<24} {g:>8.2} GB/s  {r:>6.3} x memcpy");
            }
        }
    }
    println!("{out}");
    Ok(())
}
