//! One rank of the multi-process tests in `tests/collectives.rs`.
//!
//! Reads its place in the job from the torchrun variables (plus
//! `ACCEL_TCP_DIRECT_MAX`/`ACCEL_TCP_SEGMENT` to force an algorithm and
//! `ACCEL_TCP_UNIX=0` to force TCP between local peers, `ACCEL_DIST_SHM=0`
//! to keep collectives off shared memory, `ACCEL_TCP_SHM_SLOT` to set its
//! slot size), runs
//! the scenario named by its argument and prints one JSON line. It checks
//! results itself: expected values are closed-form functions of rank and
//! index, so every rank knows what every other rank sent.
//!
//! `dist_worker store` only hosts a rendezvous store for `ACCEL_JOB_TOKEN`
//! (the hostile-client tests in `tests/hostile.rs` give it a low open-file
//! limit), prints its port and serves until its standard input closes.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use accel_dist::{
    Communicator, CommunicatorExt, Error, ProcessGroupConfig, ReduceOp, Result, TcpCommunicator,
    TcpConfig, TcpStore,
};
use candle_core::{Device, Tensor};
use half::bf16;

fn main() -> ExitCode {
    let scenario = std::env::args().nth(1).unwrap_or_default();
    match run(&scenario) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("dist_worker {scenario}: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(scenario: &str) -> Result<()> {
    if scenario == "store" {
        return host_store();
    }
    let cfg = ProcessGroupConfig::from_env()?;
    let mut tcp = TcpConfig::default().with_timeout(cfg.timeout);
    if let Some(v) = env_usize("ACCEL_TCP_DIRECT_MAX") {
        tcp = tcp.with_direct_max_bytes(v);
    }
    if let Some(v) = env_usize("ACCEL_TCP_SEGMENT") {
        tcp = tcp.with_segment_bytes(v);
    }
    if let Some(v) = env_usize("ACCEL_TCP_UNIX") {
        tcp = tcp.with_unix_sockets(v != 0);
    }
    if let Some(v) = env_usize("ACCEL_TCP_SHM_SLOT") {
        tcp = tcp.with_shm_slot_bytes(v);
    }
    let store = TcpStore::from_config(&cfg)?;
    let comm = TcpCommunicator::connect_with(&store, cfg.rank, cfg.world_size, tcp)?;
    match scenario {
        "collectives" => {
            let checks = collectives(&comm)?;
            let peer = (cfg.rank + 1) % cfg.world_size;
            let transport = comm.transport(peer).map_or("none", |t| t.name());
            let shm = comm.shared_memory();
            println!(
                r#"{{"rank":{},"ok":true,"checks":{checks},"transport":"{transport}","shm":{shm}}}"#,
                cfg.rank
            );
            Ok(())
        }
        "ddp" => {
            let checks = ddp(&comm)?;
            println!(r#"{{"rank":{},"ok":true,"checks":{checks}}}"#, cfg.rank);
            Ok(())
        }
        "killed" | "abort" | "stall" => failure(&comm, scenario),
        "mismatch" => {
            let mut v = vec![1.0f32; 4 + comm.rank().min(1)];
            report(
                &comm,
                Instant::now(),
                comm.all_reduce((&mut v).into(), ReduceOp::Sum),
            )
        }
        other => Err(Error::BadShape {
            op: "dist_worker",
            reason: format!("unknown scenario {other:?}"),
        }),
    }
}

fn env_usize(var: &str) -> Option<usize> {
    std::env::var(var).ok().and_then(|v| v.parse().ok())
}

/// Fails with a message when `got != want`.
fn expect_eq<T: PartialEq + std::fmt::Debug>(what: &str, got: &[T], want: &[T]) -> Result<()> {
    if got == want {
        return Ok(());
    }
    let first = got.iter().zip(want).position(|(g, w)| g != w);
    Err(Error::BadShape {
        op: "check",
        reason: format!(
            "{what}: got {} elements, want {}; first difference at {first:?}: {:?} vs {:?}",
            got.len(),
            want.len(),
            first.map(|i| &got[i]),
            first.map(|i| &want[i]),
        ),
    })
}

/// Fails with a message when some `got[i]` differs from `want[i]` by more
/// than `rel` of its magnitude.
fn expect_close(what: &str, got: &[f32], want: &[f32], rel: f32) -> Result<()> {
    let bad = got
        .iter()
        .zip(want)
        .position(|(g, w)| (g - w).abs() > rel * w.abs().max(1.0));
    match bad {
        None if got.len() == want.len() => Ok(()),
        _ => expect_eq(what, got, want),
    }
}

const SIZES: &[usize] = &[0, 1, 2, 3, 7, 64, 1000, 4099, 70_001];

/// The device of the `ddp` scenario's tensors: `cuda:0` (shared by every
/// rank) when `ACCEL_TEST_CUDA=1`, else the CPU.
fn test_device() -> Result<Device> {
    if std::env::var("ACCEL_TEST_CUDA").as_deref() == Ok("1") {
        return Ok(accel_kernels::cuda_device(0)?);
    }
    Ok(Device::Cpu)
}

/// DDP buckets and the parameter broadcast on f32, bf16 and f16 tensors of
/// the test device (so the host path and the device path both run on the
/// CPU, and the staged CUDA path on a GPU), with and without compression.
/// Values are small integers times (rank + 1), exact in every dtype; the
/// mean is checked to a relative 1e-6 without compression (the backend
/// divides in its own way) and to the wire dtype's precision with it.
fn ddp(c: &TcpCommunicator) -> Result<usize> {
    use accel_dist::ddp::{broadcast_parameters, CommHook, GradBuckets};
    use candle_core::DType;
    let (r, n) = (c.rank(), c.world_size());
    let dev = test_device()?;
    let numels = [3usize, 1000, 1, 4099, 64];
    let mut checks = 0;
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        for hook in [CommHook::None, CommHook::Fp16, CommHook::Bf16] {
            let base = |p: usize, i: usize| ((i + p) % 8) as f32;
            let grads = numels
                .iter()
                .enumerate()
                .map(|(p, &len)| {
                    let v: Vec<f32> = (0..len).map(|i| base(p, i) * (r + 1) as f32).collect();
                    Ok(Tensor::from_vec(v, len, &dev)?.to_dtype(dtype)?)
                })
                .collect::<Result<Vec<_>>>()?;
            let before: Vec<Tensor> = grads.to_vec();
            // A small cap: several buckets, one holding two parameters.
            GradBuckets::new(&numels, 4 * 1100).all_reduce_mean(c, &grads, hook)?;
            let scale = (1..=n).sum::<usize>() as f32 / n as f32;
            for (p, (g, b)) in grads.iter().zip(&before).enumerate() {
                // In place: the tensor handed in holds the mean.
                expect_eq(
                    &format!("ddp {dtype:?} {hook:?} param {p} stays in place"),
                    &[g.id()],
                    &[b.id()],
                )?;
                let got = g.to_dtype(DType::F32)?.to_vec1::<f32>()?;
                let want: Vec<f32> = (0..numels[p]).map(|i| base(p, i) * scale).collect();
                let tol = if hook == CommHook::None { 1e-6 } else { 1e-2 };
                expect_close(
                    &format!("ddp {dtype:?} {hook:?} param {p}"),
                    &got,
                    &want,
                    tol,
                )?;
                checks += 1;
            }
        }
        let params = numels
            .iter()
            .map(|&len| {
                let v: Vec<f32> = (0..len).map(|i| (i % 5 + r) as f32).collect();
                Ok(Tensor::from_vec(v, len, &dev)?.to_dtype(dtype)?)
            })
            .collect::<Result<Vec<_>>>()?;
        broadcast_parameters(c, &params, n - 1)?;
        for (p, t) in params.iter().enumerate() {
            let got = t.to_dtype(DType::F32)?.to_vec1::<f32>()?;
            let want: Vec<f32> = (0..numels[p]).map(|i| (i % 5 + n - 1) as f32).collect();
            expect_eq(&format!("broadcast {dtype:?} param {p}"), &got, &want)?;
            checks += 1;
        }
    }
    Ok(checks)
}

fn collectives(c: &TcpCommunicator) -> Result<usize> {
    let (r, n) = (c.rank(), c.world_size());
    let mut checks = 0;
    for &len in SIZES {
        // Integer-valued floats: every order of summation is exact.
        let val = |r: usize, i: usize| ((r + 1) * (i % 97) + r) as f32;
        let sum = |i: usize| (0..n).map(|q| val(q, i)).sum::<f32>();
        let mut v: Vec<f32> = (0..len).map(|i| val(r, i)).collect();
        c.all_reduce((&mut v).into(), ReduceOp::Sum)?;
        expect_eq(
            &format!("sum {len}"),
            &v,
            &(0..len).map(sum).collect::<Vec<_>>(),
        )?;

        let mut v: Vec<f32> = (0..len).map(|i| val(r, i)).collect();
        c.all_reduce((&mut v).into(), ReduceOp::Mean)?;
        let inv = 1.0 / n as f32;
        expect_eq(
            &format!("mean {len}"),
            &v,
            &(0..len).map(|i| sum(i) * inv).collect::<Vec<_>>(),
        )?;

        let wiggle = |r: usize, i: usize| ((i * 7 + r * 13) % 31) as f32 - 15.0;
        for (op, pick) in [
            (ReduceOp::Max, f32::max as fn(f32, f32) -> f32),
            (ReduceOp::Min, f32::min),
        ] {
            let mut v: Vec<f32> = (0..len).map(|i| wiggle(r, i)).collect();
            c.all_reduce((&mut v).into(), op)?;
            let want: Vec<f32> = (0..len)
                .map(|i| (1..n).fold(wiggle(0, i), |a, q| pick(a, wiggle(q, i))))
                .collect();
            expect_eq(&format!("{op:?} {len}"), &v, &want)?;
        }

        let mut p: Vec<i64> = (0..len).map(|i| ((r + i) % 3 + 1) as i64).collect();
        c.all_reduce((&mut p).into(), ReduceOp::Product)?;
        let want: Vec<i64> = (0..len)
            .map(|i| (0..n).map(|q| ((q + i) % 3 + 1) as i64).product())
            .collect();
        expect_eq(&format!("product {len}"), &p, &want)?;

        let mut b: Vec<u8> = (0..len).map(|i| (i * 31 + r * 101) as u8).collect();
        c.all_reduce((&mut b).into(), ReduceOp::Sum)?;
        let want: Vec<u8> = (0..len)
            .map(|i| (0..n).fold(0u8, |a, q| a.wrapping_add((i * 31 + q * 101) as u8)))
            .collect();
        expect_eq(&format!("u8 sum {len}"), &b, &want)?;

        let mut h: Vec<bf16> = (0..len)
            .map(|i| bf16::from_f32((i % 16 + r) as f32))
            .collect();
        c.all_reduce((&mut h).into(), ReduceOp::Sum)?;
        let want: Vec<bf16> = (0..len)
            .map(|i| bf16::from_f32((0..n).map(|q| (i % 16 + q) as f32).sum()))
            .collect();
        expect_eq(&format!("bf16 sum {len}"), &h, &want)?;
        checks += 7;

        let input: Vec<u32> = (0..len).map(|i| (r * 1_000_000 + i) as u32).collect();
        let mut out = vec![0u32; len * n];
        c.all_gather((&input).into(), (&mut out).into())?;
        let want: Vec<u32> = (0..n)
            .flat_map(|q| (0..len).map(move |i| (q * 1_000_000 + i) as u32))
            .collect();
        expect_eq(&format!("all_gather {len}"), &out, &want)?;

        let input: Vec<f64> = (0..len * n).map(|j| (r * 3 + j) as f64).collect();
        let mut out = vec![0f64; len];
        c.reduce_scatter((&input).into(), (&mut out).into(), ReduceOp::Sum)?;
        let want: Vec<f64> = (0..len)
            .map(|i| (0..n).map(|q| (q * 3 + r * len + i) as f64).sum())
            .collect();
        expect_eq(&format!("reduce_scatter {len}"), &out, &want)?;

        for root in 0..n {
            let mut v: Vec<f32> = if r == root {
                (0..len).map(|i| (root * 7 + i) as f32).collect()
            } else {
                vec![-1.0; len]
            };
            c.broadcast((&mut v).into(), root)?;
            expect_eq(
                &format!("broadcast {len} from {root}"),
                &v,
                &(0..len).map(|i| (root * 7 + i) as f32).collect::<Vec<_>>(),
            )?;
        }
        checks += 2 + n;
    }

    for _ in 0..3 {
        c.barrier()?;
    }
    checks += 1;

    for len in [0usize, 10, 300_001] {
        let (to, from) = ((r + 1) % n, (r + n - 1) % n);
        let msg: Vec<i64> = (0..len).map(|i| (r * 10 + i) as i64).collect();
        let mut got = vec![0i64; len];
        if r == 0 {
            c.send((&msg).into(), to)?;
            c.recv((&mut got).into(), from)?;
        } else {
            c.recv((&mut got).into(), from)?;
            c.send((&msg).into(), to)?;
        }
        expect_eq(
            "send/recv",
            &got,
            &(0..len).map(|i| (from * 10 + i) as i64).collect::<Vec<_>>(),
        )?;
    }
    checks += 1;

    #[derive(serde::Serialize, serde::Deserialize, PartialEq, Debug)]
    struct Info {
        rank: usize,
        name: String,
        vals: Vec<usize>,
    }
    let info = |q: usize| Info {
        rank: q,
        name: format!("r{q}"),
        vals: vec![q; q],
    };
    let all = c.gather_object(&info(r))?;
    expect_eq("gather_object", &all, &(0..n).map(info).collect::<Vec<_>>())?;
    let mut list = if r == n - 1 {
        vec!["a".to_string(), "bc".into()]
    } else {
        Vec::new()
    };
    c.broadcast_object_list(&mut list, n - 1)?;
    expect_eq(
        "broadcast_object_list",
        &list,
        &["a".to_string(), "bc".into()],
    )?;
    checks += 2;

    let dev = Device::Cpu;
    let t = (Tensor::arange(0f32, 6.0, &dev)?.reshape((2, 3))? + r as f64)?;
    let s = c.all_reduce_tensor(&t, ReduceOp::Sum)?;
    let base = Tensor::arange(0f32, 6.0, &dev)?.reshape((2, 3))?;
    let offset = (0..n).sum::<usize>() as f64;
    let want = ((base.clone() * n as f64)? + offset)?;
    expect_eq(
        "all_reduce_tensor",
        &s.flatten_all()?.to_vec1::<f32>()?,
        &want.flatten_all()?.to_vec1::<f32>()?,
    )?;
    c.all_reduce_tensor_inplace(&t, ReduceOp::Sum)?;
    expect_eq(
        "all_reduce_tensor_inplace",
        &t.flatten_all()?.to_vec1::<f32>()?,
        &want.flatten_all()?.to_vec1::<f32>()?,
    )?;
    let g = c.all_gather_tensor(&Tensor::new(&[r as u32, 7], &dev)?)?;
    expect_eq("all_gather_tensor", g.dims(), &[2 * n])?;
    let x = Tensor::ones((2 * n, 2), candle_core::DType::F64, &dev)?;
    let rs = c.reduce_scatter_tensor(&x, ReduceOp::Sum)?;
    expect_eq(
        "reduce_scatter_tensor",
        &rs.flatten_all()?.to_vec1::<f64>()?,
        &[n as f64; 4],
    )?;
    let b = c.broadcast_tensor(&Tensor::new(&[r as i64], &dev)?, 1)?;
    expect_eq("broadcast_tensor", &b.to_vec1::<i64>()?, &[1])?;
    checks += 5;
    c.barrier()?;
    Ok(checks)
}

/// Rank `world-1` goes away after one successful call; the others report what they see.
fn failure(c: &TcpCommunicator, scenario: &str) -> Result<()> {
    let (r, n) = (c.rank(), c.world_size());
    let victim = n - 1;
    let mut v = vec![1.0f32; 1 << 20];
    c.all_reduce((&mut v).into(), ReduceOp::Sum)?;
    if r == victim {
        match scenario {
            // The test SIGKILLs this process while the others wait in the next call.
            "killed" | "stall" => {
                println!("READY");
                std::thread::sleep(Duration::from_secs(120));
            }
            // Die in the middle of a large all-reduce, sockets torn down by the kernel.
            _ => {
                std::thread::spawn(|| {
                    std::thread::sleep(Duration::from_millis(30));
                    std::process::abort();
                });
                loop {
                    c.all_reduce((&mut v).into(), ReduceOp::Sum)?;
                }
            }
        }
        return Ok(());
    }
    let start = Instant::now();
    let mut result = Ok(());
    for _ in 0..1000 {
        result = c.all_reduce((&mut v).into(), ReduceOp::Sum);
        if result.is_err() {
            break;
        }
    }
    report(c, start, result)
}

/// Prints what a call returned and how long it took, as JSON.
fn report(c: &TcpCommunicator, start: Instant, result: Result<()>) -> Result<()> {
    let elapsed_ms = start.elapsed().as_secs_f64() * 1e3;
    let error = result.err().map(|e| e.to_string());
    let line = serde_json::json!({ "rank": c.rank(), "error": error, "elapsed_ms": elapsed_ms });
    println!("{line}");
    // A later call must fail at once instead of touching the broken mesh.
    if error.is_some() {
        let after = c
            .barrier()
            .expect_err("a failed communicator refuses calls");
        assert!(matches!(after, Error::Poisoned { .. }), "{after}");
    }
    Ok(())
}

/// Hosts a store on a free loopback port until standard input closes.
fn host_store() -> Result<()> {
    let token = std::env::var(accel_dist::process::ENV_JOB_TOKEN).unwrap_or_default();
    let server = accel_dist::StoreServer::bind(([127, 0, 0, 1], 0).into(), &token)?;
    println!("{}", server.local_addr().port());
    let _ = std::io::Read::read_to_end(&mut std::io::stdin(), &mut Vec::new());
    Ok(())
}
