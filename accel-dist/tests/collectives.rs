//! Collectives between real processes on loopback.
//!
//! Each test hosts a store on port 0 (as a launcher would), spawns
//! `dist_worker` once per rank and reads one JSON line per rank. A watchdog
//! kills the world if it runs past its deadline, so a hang fails the test
//! instead of stalling the suite.

use std::io::Read;
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use accel_dist::StoreServer;

/// What peers on one host use by default.
const LOCAL_TRANSPORT: &str = if cfg!(target_os = "linux") {
    "unix"
} else {
    "tcp"
};

/// A running world of worker processes.
struct World {
    children: Vec<Child>,
    _store: StoreServer,
}

/// What one rank printed and how it exited.
#[derive(Debug)]
struct RankOutput {
    rank: usize,
    success: bool,
    stdout: String,
    stderr: String,
}

impl RankOutput {
    fn json(&self) -> serde_json::Value {
        let line = self.stdout.lines().last().unwrap_or_default();
        serde_json::from_str(line).unwrap_or_else(|e| {
            panic!(
                "rank {} printed {line:?} ({e}); stderr: {}",
                self.rank, self.stderr
            )
        })
    }
}

fn spawn(world: usize, scenario: &str, timeout_s: f64, env: &[(&str, &str)]) -> World {
    let token = format!("test-{scenario}-{}", std::process::id());
    let store = StoreServer::bind(SocketAddr::from(([127, 0, 0, 1], 0)), &token).unwrap();
    let port = store.local_addr().port().to_string();
    let children = (0..world)
        .map(|rank| {
            let mut cmd = Command::new(env!("CARGO_BIN_EXE_dist_worker"));
            cmd.arg(scenario)
                .env("RANK", rank.to_string())
                .env("WORLD_SIZE", world.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", &port)
                .env("ACCEL_JOB_TOKEN", &token)
                .env("ACCEL_USE_AGENT_STORE", "1")
                .env("ACCEL_DIST_TIMEOUT", timeout_s.to_string())
                .envs(env.iter().copied())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            cmd.spawn().expect("spawning dist_worker")
        })
        .collect();
    World {
        children,
        _store: store,
    }
}

impl World {
    /// Reads a line from `rank`'s stdout (blocking), e.g. its READY signal.
    fn read_line(&mut self, rank: usize) -> String {
        let out = self.children[rank].stdout.as_mut().unwrap();
        let mut line = Vec::new();
        let mut byte = [0u8; 1];
        let mut open = false;
        while out.read(&mut byte).unwrap() == 1 {
            open = true;
            if byte[0] == b'\n' {
                break;
            }
            line.push(byte[0]);
        }
        if !open {
            let mut err = String::new();
            let _ = self.children[rank]
                .stderr
                .as_mut()
                .unwrap()
                .read_to_string(&mut err);
            panic!("rank {rank} exited before printing a line; its stderr: {err}");
        }
        String::from_utf8_lossy(&line).into_owned()
    }

    fn kill(&mut self, rank: usize) {
        self.children[rank].kill().unwrap();
    }

    /// Waits for every rank to exit, killing them all after `limit`.
    fn wait(mut self, limit: Duration) -> Vec<RankOutput> {
        let start = Instant::now();
        let readers: Vec<_> = self
            .children
            .iter_mut()
            .map(|c| {
                let mut out = c.stdout.take().unwrap();
                let mut err = c.stderr.take().unwrap();
                std::thread::spawn(move || {
                    let (mut o, mut e) = (String::new(), String::new());
                    let _ = out.read_to_string(&mut o);
                    let _ = err.read_to_string(&mut e);
                    (o, e)
                })
            })
            .collect();
        let mut status = vec![None; self.children.len()];
        while status.iter().any(Option::is_none) {
            for (rank, child) in self.children.iter_mut().enumerate() {
                if status[rank].is_none() {
                    status[rank] = child.try_wait().unwrap();
                }
            }
            if start.elapsed() > limit {
                for child in &mut self.children {
                    let _ = child.kill();
                }
                panic!("the world did not finish within {limit:?} (exited: {status:?})");
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        readers
            .into_iter()
            .zip(status)
            .enumerate()
            .map(|(rank, (reader, status))| {
                let (stdout, stderr) = reader.join().unwrap();
                RankOutput {
                    rank,
                    success: status.unwrap().success(),
                    stdout,
                    stderr,
                }
            })
            .collect()
    }
}

fn assert_all_ok(outputs: &[RankOutput], transport: &str, shm: bool) {
    for o in outputs {
        assert!(
            o.success,
            "rank {} failed: {}{}",
            o.rank, o.stdout, o.stderr
        );
        let json = o.json();
        assert_eq!(json["ok"], true, "rank {}: {json}", o.rank);
        assert_eq!(json["transport"], transport, "rank {}: {json}", o.rank);
        assert_eq!(json["shm"], shm, "rank {}: {json}", o.rank);
        assert!(
            json["checks"].as_u64().unwrap() > 50,
            "rank {}: {json}",
            o.rank
        );
    }
}

/// Whether ranks on one host get a shared-memory segment by default.
const LOCAL_SHM: bool = cfg!(target_os = "linux");

/// Turns shared memory off, so collectives stay on the sockets.
const NO_SHM: (&str, &str) = ("ACCEL_DIST_SHM", "0");

#[test]
fn collectives_give_exact_results_at_world_two_and_three() {
    for world in [2, 3] {
        let outputs = spawn(world, "collectives", 20.0, &[]).wait(Duration::from_secs(60));
        assert_all_ok(&outputs, LOCAL_TRANSPORT, LOCAL_SHM);
    }
}

/// DDP gradient buckets and the parameter broadcast on fp32, bf16 and f16
/// CPU tensors, with and without fp16/bf16 compression: the host path
/// (fp32) and the device path (packed tensors, in place) give exact means.
#[test]
fn ddp_buckets_average_every_dtype_in_place() {
    for world in [2, 3] {
        let outputs = spawn(world, "ddp", 20.0, &[]).wait(Duration::from_secs(60));
        for o in &outputs {
            let json = o.json();
            assert_eq!(json["ok"], true, "rank {}: {json}", o.rank);
            assert_eq!(json["checks"], 60, "rank {}: {json}", o.rank);
        }
    }
}

/// The same on CUDA tensors of one GPU shared by two processes over TCP:
/// the gradients are staged through host memory and written back in place.
#[test]
#[ignore = "needs a CUDA GPU and a build with --features accel-dist/cuda; run by scripts/gpu_check.sh"]
fn ddp_buckets_on_one_gpu_shared_by_two_processes_over_tcp() {
    let outputs = spawn(2, "ddp", 60.0, &[("ACCEL_TEST_CUDA", "1")]).wait(Duration::from_secs(120));
    for o in &outputs {
        let json = o.json();
        assert_eq!(json["ok"], true, "rank {}: {json}", o.rank);
        assert_eq!(json["checks"], 60, "rank {}: {json}", o.rank);
    }
}

/// The same checks with shared memory switched off: the socket paths.
#[test]
fn the_socket_paths_give_the_same_results() {
    for world in [2, 3] {
        let outputs = spawn(world, "collectives", 20.0, &[NO_SHM]).wait(Duration::from_secs(60));
        assert_all_ok(&outputs, LOCAL_TRANSPORT, false);
    }
}

/// Every size, even 1 element, goes through shared memory in tiny slots,
/// so step edge cases (empty sub-pieces, sizes not divisible by the world
/// or the slot, a last partial step) are hit for every collective.
#[test]
#[cfg(target_os = "linux")]
fn the_shared_memory_path_gives_the_same_results() {
    for (world, slot) in [(2, "64"), (3, "1000"), (3, "4096")] {
        let env = [("ACCEL_TCP_DIRECT_MAX", "0"), ("ACCEL_TCP_SHM_SLOT", slot)];
        let outputs = spawn(world, "collectives", 20.0, &env).wait(Duration::from_secs(60));
        assert_all_ok(&outputs, LOCAL_TRANSPORT, true);
    }
}

/// Every size, even 1 element, goes through the ring with tiny segments,
/// so chunk and segment edge cases (empty chunks, odd remainders) are hit.
#[test]
fn the_ring_path_gives_the_same_results() {
    for world in [2, 3] {
        let env = [
            ("ACCEL_TCP_DIRECT_MAX", "0"),
            ("ACCEL_TCP_SEGMENT", "12"),
            NO_SHM,
        ];
        let outputs = spawn(world, "collectives", 20.0, &env).wait(Duration::from_secs(60));
        assert_all_ok(&outputs, LOCAL_TRANSPORT, false);
    }
}

/// Local peers normally use Unix sockets; the TCP transport must agree.
#[test]
fn the_tcp_transport_gives_the_same_results() {
    for (world, env) in [
        (2, vec![("ACCEL_TCP_UNIX", "0"), NO_SHM]),
        (
            3,
            vec![
                ("ACCEL_TCP_UNIX", "0"),
                NO_SHM,
                ("ACCEL_TCP_DIRECT_MAX", "0"),
                ("ACCEL_TCP_SEGMENT", "1000"),
            ],
        ),
    ] {
        let outputs = spawn(world, "collectives", 20.0, &env).wait(Duration::from_secs(60));
        assert_all_ok(&outputs, "tcp", false);
    }
}

/// Checks that each survivor failed quickly with an error naming rank 2.
fn assert_survivors_blame_rank_two(outputs: &[RankOutput], max_ms: f64) {
    for o in &outputs[..2] {
        assert!(o.success, "rank {} crashed: {}", o.rank, o.stderr);
        let json = o.json();
        eprintln!("rank {}: {json}", o.rank);
        let error = json["error"]
            .as_str()
            .unwrap_or_else(|| panic!("rank {} saw no error: {json}", o.rank));
        assert!(error.contains("rank 2"), "rank {}: {error}", o.rank);
        assert!(error.contains("all_reduce"), "rank {}: {error}", o.rank);
        let ms = json["elapsed_ms"].as_f64().unwrap();
        assert!(ms < max_ms, "rank {} needed {ms} ms: {error}", o.rank);
    }
}

/// The 4 MiB all-reduce of the failure scenarios over shared memory (by
/// default on one host) and over the sockets.
const FAILURE_PATHS: [&[(&str, &str)]; 2] = [&[], &[NO_SHM]];

#[test]
fn survivors_name_a_rank_killed_while_they_wait() {
    for env in FAILURE_PATHS {
        let timeout_s = 10.0;
        let mut world = spawn(3, "killed", timeout_s, env);
        assert_eq!(world.read_line(2), "READY");
        // Ranks 0 and 1 are now inside the next all-reduce, waiting for rank 2.
        std::thread::sleep(Duration::from_millis(100));
        world.kill(2);
        let outputs = world.wait(Duration::from_secs(30));
        // A dead peer is seen at once, far below the timeout.
        assert_survivors_blame_rank_two(&outputs, timeout_s * 1e3 / 2.0);
    }
}

#[test]
fn survivors_name_a_rank_that_dies_mid_all_reduce() {
    for shm in [true, false] {
        let timeout_s = 10.0;
        // Small segments (slots) keep the victim inside a pipelined call when it aborts.
        let mut env = vec![
            ("ACCEL_TCP_SEGMENT", "65536"),
            ("ACCEL_TCP_SHM_SLOT", "65536"),
        ];
        if !shm {
            env.push(NO_SHM);
        }
        let outputs = spawn(3, "abort", timeout_s, &env).wait(Duration::from_secs(30));
        assert!(!outputs[2].success, "the victim should have aborted");
        assert_survivors_blame_rank_two(&outputs, timeout_s * 1e3 / 2.0);
    }
}

#[test]
fn survivors_time_out_on_a_silent_rank() {
    // The direct path: each survivor waits on rank 2 itself.
    survivors_time_out(&[("ACCEL_TCP_DIRECT_MAX", "16777216")]);
}

/// Over shared memory a silent peer is a counter that never moves.
#[test]
fn survivors_time_out_on_a_silent_rank_over_shared_memory() {
    survivors_time_out(&[]);
}

fn survivors_time_out(env: &[(&str, &str)]) {
    let timeout_s = 1.5;
    let mut world = spawn(3, "stall", timeout_s, env);
    assert_eq!(world.read_line(2), "READY");
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(30) {
        if world.children[..2]
            .iter_mut()
            .all(|c| c.try_wait().unwrap().is_some())
        {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    world.kill(2);
    let outputs = world.wait(Duration::from_secs(10));
    assert_survivors_blame_rank_two(&outputs, timeout_s * 1e3 * 2.0 + 1000.0);
    for o in &outputs[..2] {
        let json = o.json();
        assert!(
            json["error"]
                .as_str()
                .unwrap()
                .contains("did not arrive within 1.5s"),
            "{json}"
        );
        assert!(
            json["elapsed_ms"].as_f64().unwrap() >= timeout_s * 1e3 * 0.9,
            "{json}"
        );
    }
}

#[test]
fn ranks_calling_with_different_lengths_get_an_error_not_a_hang() {
    // The direct path; shared memory (descriptors compared per step); and
    // rank 0 on the direct path (16 bytes) while rank 1 (20 bytes) is on
    // shared memory, where rank 1 sees rank 0's frame and rank 0 then sees
    // rank 1 give up.
    for env in [
        &[][..],
        &[("ACCEL_TCP_DIRECT_MAX", "0")],
        &[("ACCEL_TCP_DIRECT_MAX", "16")],
    ] {
        let outputs = spawn(2, "mismatch", 10.0, env).wait(Duration::from_secs(30));
        for o in &outputs {
            let json = o.json();
            eprintln!("rank {}: {json}", o.rank);
            let error = json["error"]
                .as_str()
                .unwrap_or_else(|| panic!("rank {} saw no error: {json}", o.rank));
            assert!(
                error.contains("out of step")
                    || error.contains("failed")
                    || (o.rank == 0 && error.contains("connection to rank 1 closed")),
                "rank {}: {error}",
                o.rank
            );
            assert!(json["elapsed_ms"].as_f64().unwrap() < 5000.0, "{json}");
        }
    }
}
