//! Collective bandwidth and latency of the TCP backend on loopback.
//!
//! `cargo run --release -p accel-dist --example bench_allreduce -- --world-size 2 --json`
//!
//! The parent hosts the rendezvous store and re-executes this binary once per
//! rank (with `RANK`, `WORLD_SIZE`, `MASTER_PORT`, ...). Each timed iteration
//! starts after a barrier; an iteration's time is the slowest rank's. Rank 0
//! prints one JSON object: per op and size the median and minimum time, the
//! algorithm and the bus bandwidth (NCCL's definition: all-reduce moves
//! `2 (n-1)/n` of the buffer per rank, all-gather `(n-1)/n` of the output,
//! broadcast the whole buffer).
//!
//! With `--transport both` (the default) every rank connects two
//! communicators, one over shared memory and one over sockets only, and
//! alternates them iteration by iteration, so both are measured under the
//! same load of a noisy machine; each result names its transport (`shm`,
//! `unix` or `tcp`) and algorithm. Sizes up to the direct limit take the
//! socket direct path in both.
//!
//! When `python3 -c "import torch"` works (and `--no-gloo` is not given),
//! the same run then measures PyTorch's gloo at the same sizes, ops and
//! iteration counts (`scripts/bench_gloo.py`) and adds `gloo_ms` (its median)
//! and `gloo_min_ms` next to each result, so the two are compared under the
//! same machine load; `loadavg` records that load at the start.

use std::io::Read;
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use accel_dist::{
    Algorithm, Collective, Communicator, ProcessGroupConfig, ReduceOp, StoreServer,
    TcpCommunicator, TcpConfig, TcpStore,
};
use anyhow::{bail, Context};
use clap::Parser;

#[derive(Parser, Debug)]
#[command(about = "Benchmark accel-dist's TCP collectives on loopback")]
struct Args {
    /// Number of ranks to spawn.
    #[arg(long, default_value_t = 2)]
    world_size: usize,
    /// Print only the JSON object.
    #[arg(long)]
    json: bool,
    /// Buffer sizes in bytes (default: 4 KiB to 256 MiB).
    #[arg(long, value_delimiter = ',')]
    sizes: Option<Vec<usize>>,
    /// Collectives to run (default: all_reduce,all_gather,broadcast).
    #[arg(long, value_delimiter = ',')]
    ops: Option<Vec<String>>,
    /// Ring segment size in bytes (default: the backend's).
    #[arg(long)]
    segment_bytes: Option<usize>,
    /// Largest buffer on the direct path (default: the backend's).
    #[arg(long)]
    direct_max_bytes: Option<usize>,
    /// Use TCP even between ranks on this host (default: Unix domain sockets).
    #[arg(long)]
    tcp_only: bool,
    /// Which data path to measure: shm, socket, or both side by side.
    #[arg(long, default_value = "both", value_parser = ["both", "shm", "socket"])]
    transport: String,
    /// Shared-memory slot size in bytes (default: the backend's).
    #[arg(long)]
    shm_slot_bytes: Option<usize>,
    /// Timed iterations per size (default: from 200 for small to 5 for 256 MiB).
    #[arg(long)]
    iters: Option<usize>,
    /// Do not run PyTorch's gloo at the same sizes afterwards.
    #[arg(long)]
    no_gloo: bool,
    /// Internal: run as one rank.
    #[arg(long, hide = true)]
    worker: bool,
}

const DEFAULT_SIZES: &[usize] = &[4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20, 256 << 20];

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if args.worker {
        return worker(&args);
    }
    let loadavg = std::fs::read_to_string("/proc/loadavg").ok();
    let token = format!("bench-{}-{:?}", std::process::id(), Instant::now());
    let server = StoreServer::bind(SocketAddr::from(([127, 0, 0, 1], 0)), &token)?;
    let exe = std::env::current_exe()?;
    let mut children = Vec::new();
    for rank in 0..args.world_size {
        let mut cmd = Command::new(&exe);
        cmd.args(std::env::args().skip(1)).arg("--worker");
        for (k, v) in [
            ("RANK", rank.to_string()),
            ("WORLD_SIZE", args.world_size.to_string()),
            ("LOCAL_RANK", rank.to_string()),
            ("LOCAL_WORLD_SIZE", args.world_size.to_string()),
            ("MASTER_ADDR", "127.0.0.1".into()),
            ("MASTER_PORT", server.local_addr().port().to_string()),
            ("ACCEL_JOB_TOKEN", token.clone()),
            ("ACCEL_USE_AGENT_STORE", "1".into()),
            ("ACCEL_DIST_TIMEOUT", "120".into()),
        ] {
            cmd.env(k, v);
        }
        cmd.stdout(if rank == 0 {
            Stdio::piped()
        } else {
            Stdio::null()
        });
        children.push(cmd.spawn().context("spawning a rank")?);
    }
    let mut out = String::new();
    children[0]
        .stdout
        .take()
        .expect("piped")
        .read_to_string(&mut out)?;
    for (rank, mut child) in children.into_iter().enumerate() {
        let status = child.wait()?;
        if !status.success() {
            bail!("rank {rank} failed: {status}");
        }
    }
    let mut report: serde_json::Value =
        serde_json::from_str(out.trim()).context("rank 0 printed no JSON report")?;
    report["loadavg"] = loadavg.map(|l| l.trim().to_string()).into();
    if !args.no_gloo {
        match gloo(&args) {
            Ok(Some(gloo)) => add_gloo(&mut report, &gloo),
            Ok(None) => report["gloo"] = "not measured: python3 cannot import torch".into(),
            Err(e) => report["gloo"] = format!("not measured: {e:#}").into(),
        }
    }
    if args.json {
        println!("{report}");
    } else {
        println!("{}", serde_json::to_string_pretty(&report)?);
    }
    Ok(())
}

/// `scripts/bench_gloo.py`'s report at the same world size, sizes, ops and
/// iterations, or `None` when torch cannot be imported.
fn gloo(args: &Args) -> anyhow::Result<Option<serde_json::Value>> {
    let importable = Command::new("python3")
        .args(["-c", "import torch"])
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !importable {
        return Ok(None);
    }
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/bench_gloo.py");
    let join = |v: Vec<String>| v.join(",");
    let sizes = args.sizes.clone().unwrap_or_else(|| DEFAULT_SIZES.to_vec());
    let mut cmd = Command::new("python3");
    cmd.arg(script)
        .args(["--world-size", &args.world_size.to_string()])
        .args([
            "--sizes",
            &join(sizes.iter().map(|s| s.to_string()).collect()),
        ]);
    if let Some(ops) = &args.ops {
        cmd.args(["--ops", &join(ops.clone())]);
    }
    if let Some(i) = args.iters {
        cmd.args(["--iters", &i.to_string()]);
    }
    let out = cmd.stderr(Stdio::inherit()).output().context(script)?;
    if !out.status.success() {
        bail!("{script} failed: {}", out.status);
    }
    Ok(Some(
        serde_json::from_slice(&out.stdout).context("bench_gloo.py's JSON")?,
    ))
}

/// Adds gloo's median and best time to each result of the same op and size.
fn add_gloo(report: &mut serde_json::Value, gloo: &serde_json::Value) {
    let empty = vec![];
    let theirs = gloo["results"].as_array().unwrap_or(&empty);
    if let Some(ours) = report["results"].as_array_mut() {
        for r in ours {
            let same = theirs
                .iter()
                .find(|g| g["op"] == r["op"] && g["bytes"] == r["bytes"]);
            if let Some(g) = same {
                r["gloo_ms"] = g["median_ms"].clone();
                r["gloo_min_ms"] = g["min_ms"].clone();
            }
        }
    }
    report["gloo"] = serde_json::json!({
        "torch": gloo["torch"],
        "measured": "after accel-dist, in the same run (scripts/bench_gloo.py)",
    });
}

/// Iterations per size: enough for a stable median, bounded run time.
fn iterations(bytes: usize) -> usize {
    match bytes {
        0..=65_536 => 200,
        65_537..=1_048_576 => 50,
        1_048_577..=16_777_216 => 20,
        16_777_217..=67_108_864 => 10,
        _ => 5,
    }
}

fn worker(args: &Args) -> anyhow::Result<()> {
    let cfg = ProcessGroupConfig::from_env()?;
    let mut tcp = TcpConfig::default().with_timeout(Duration::from_secs(120));
    if let Some(s) = args.segment_bytes {
        tcp = tcp.with_segment_bytes(s);
    }
    if let Some(d) = args.direct_max_bytes {
        tcp = tcp.with_direct_max_bytes(d);
    }
    if let Some(b) = args.shm_slot_bytes {
        tcp = tcp.with_shm_slot_bytes(b);
    }
    tcp = tcp.with_unix_sockets(!args.tcp_only);
    let store = TcpStore::from_config(&cfg)?;
    let mut comms = Vec::new();
    for shm in [true, false] {
        let wanted = match args.transport.as_str() {
            "shm" => shm,
            "socket" => !shm,
            _ => true,
        };
        if wanted {
            let config = tcp.clone().with_shared_memory(shm);
            comms.push(TcpCommunicator::connect_with(
                &store,
                cfg.rank,
                cfg.world_size,
                config,
            )?);
        }
    }
    let first = &comms[0];
    if args.transport != "socket" && !first.shared_memory() {
        bail!("shared memory is unavailable (ACCEL_DIST_SHM=0, or /dev/shm cannot be mapped)");
    }
    let n = first.world_size() as f64;
    let sizes = args.sizes.clone().unwrap_or_else(|| DEFAULT_SIZES.to_vec());
    let mut results = Vec::new();
    for (op, collective) in [
        ("all_reduce", Collective::AllReduce),
        ("all_gather", Collective::AllGather),
        ("broadcast", Collective::Broadcast),
    ] {
        if args
            .ops
            .as_ref()
            .is_some_and(|ops| !ops.iter().any(|o| o == op))
        {
            continue;
        }
        for &bytes in &sizes {
            let elems = bytes / 4;
            let iters = args.iters.unwrap_or_else(|| iterations(elems * 4));
            let timed = time_op(&comms, collective, elems, iters)?;
            let factor = match collective {
                Collective::AllReduce => 2.0 * (n - 1.0) / n,
                Collective::AllGather => (n - 1.0) / n,
                _ => 1.0,
            };
            for (comm, (times, cpu)) in comms.iter().zip(timed) {
                let median = median(&times);
                let algo: Algorithm = comm.algorithm(collective, elems * 4);
                let transport = comm.transport_for(collective, elems * 4);
                results.push(serde_json::json!({
                    "op": op,
                    "bytes": elems * 4,
                    "size": human(elems * 4),
                    "transport": transport.map(|t| t.name()),
                    "algorithm": algo.name(),
                    "iters": times.len(),
                    "median_ms": round(median * 1e3),
                    "min_ms": round(times.iter().copied().fold(f64::INFINITY, f64::min) * 1e3),
                    "algbw_gbps": round((elems * 4) as f64 / median / 1e9),
                    "busbw_gbps": round((elems * 4) as f64 * factor / median / 1e9),
                    "cpu_ms_rank0": cpu.map(|c| round(c * 1e3)),
                }));
            }
        }
    }
    if first.rank() == 0 {
        let report = serde_json::json!({
            "bench": "bench_allreduce",
            "backend": "tcp",
            "compared": args.transport,
            "socket_transport": first.transport((first.rank() + 1) % first.world_size()).map(|t| t.name()),
            "world_size": first.world_size(),
            "dtype": "f32",
            "segment_bytes": first.config().segment_bytes,
            "direct_max_bytes": first.config().direct_max_bytes,
            "shm_slot_bytes": first.config().shm_slot_bytes,
            "results": results,
        });
        // The parent parses this, adds gloo's figures and prints it.
        println!("{report}");
    }
    first.barrier()?;
    Ok(())
}

/// For each communicator, the times of each iteration (the slowest
/// rank's) and this rank's CPU time per iteration (user + system, all
/// threads), in seconds. Communicators alternate iteration by iteration.
fn time_op(
    comms: &[TcpCommunicator],
    collective: Collective,
    elems: usize,
    iters: usize,
) -> anyhow::Result<Vec<(Vec<f64>, Option<f64>)>> {
    let n = comms[0].world_size();
    let per_rank = elems / n;
    let mut buf = vec![1.0f32; elems];
    let input = vec![1.0f32; per_rank];
    let mut gathered = vec![0.0f32; per_rank * n];
    let mut run = |comm: &TcpCommunicator| -> accel_dist::Result<()> {
        match collective {
            Collective::AllReduce => comm.all_reduce((&mut buf).into(), ReduceOp::Sum),
            Collective::AllGather => comm.all_gather((&input).into(), (&mut gathered).into()),
            _ => comm.broadcast((&mut buf).into(), 0),
        }
    };
    for comm in comms {
        for _ in 0..2 {
            run(comm)?;
        }
    }
    let mut times = vec![Vec::with_capacity(iters); comms.len()];
    let mut cpu = vec![Some(0.0); comms.len()];
    for _ in 0..iters {
        for (c, comm) in comms.iter().enumerate() {
            comm.barrier()?;
            let cpu_before = cpu_seconds();
            let start = Instant::now();
            run(comm)?;
            times[c].push(start.elapsed().as_secs_f64());
            let used = cpu_seconds().zip(cpu_before).map(|(a, b)| a - b);
            cpu[c] = cpu[c].zip(used).map(|(sum, u)| sum + u);
        }
    }
    let mut out = Vec::new();
    for ((comm, mut t), c) in comms.iter().zip(times).zip(cpu) {
        comm.all_reduce((&mut t).into(), ReduceOp::Max)?;
        out.push((t, c.map(|c| c / iters as f64)));
    }
    Ok(out)
}

/// CPU time of this process so far, from `/proc/self/stat` (Linux; in
/// clock ticks of 10 ms, so only meaningful summed over many iterations).
fn cpu_seconds() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Fields after the parenthesised command name; utime and stime are fields 14 and 15.
    let rest = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks: f64 = fields.get(11)?.parse::<f64>().ok()? + fields.get(12)?.parse::<f64>().ok()?;
    Some(ticks / 100.0)
}

fn median(times: &[f64]) -> f64 {
    let mut sorted = times.to_vec();
    sorted.sort_by(f64::total_cmp);
    sorted[sorted.len() / 2]
}

fn round(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

fn human(bytes: usize) -> String {
    match bytes {
        b if b >= 1 << 20 => format!("{} MiB", b >> 20),
        b if b >= 1 << 10 => format!("{} KiB", b >> 10),
        b => format!("{b} B"),
    }
}
