//! More than one machine, for real: hosts made of network namespaces
//! (`accel_tests::hosts`), one `accel launch` per host, two CPU ranks each.
//! - Static (`--num_machines 2`): the job gives the one-host run's losses
//!   bit for bit, also over links with 5 ms of delay and a 1 Gbit/s rate
//!   (the rate alone where the kernel has no `netem`).
//! - Elastic (`--rdzv_backend etcd`, a real etcd on the switch): a host
//!   killed, or cut off for 20 s, restarts the job on every machine and it
//!   ends with the weights of an uninterrupted run; the cut-off host's ranks
//!   are named by the survivors within the collective timeout. With
//!   `--nnodes 2:3` the job goes on with two hosts when one of three dies.
//!
//! Skipped, with the reason, where namespaces cannot be made (not root) or
//! etcd is not installed.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use accel_tests::etcd::Server;
use accel_tests::hosts::Hosts;
use accel_tests::{saved_model, wait_for_checkpoint};

/// How long a test waits for a checkpoint of a run.
const CHECKPOINT_WAIT: Duration = Duration::from_secs(120);
const WORKER: &str = env!("CARGO_BIN_EXE_finetune_hf_worker");
const LAUNCH: &str = env!("CARGO_BIN_EXE_accel_launch");
const GPT: &str = env!("CARGO_BIN_EXE_train_gpt_worker");

fn worker_args(ids: &std::path::Path, steps: usize) -> Vec<String> {
    accel_tests::finetune_hf_args(ids, steps)
}

macro_rules! hosts_or_skip {
    ($n:expr) => {
        match Hosts::new($n) {
            Ok(h) => h,
            Err(reason) => {
                eprintln!("skipped: network namespaces cannot be made here: {reason}");
                return;
            }
        }
    };
}

/// One launcher on each host, host 0 the store; `extra` launch flags. Their
/// output goes to files in `dir` (a pipe nobody reads while they run would
/// fill and stall them).
fn launch_on(
    hosts: &Hosts,
    (ids, dir): (&std::path::Path, &std::path::Path),
    steps: usize,
    extra: &[&str],
) -> Vec<(Child, std::path::PathBuf)> {
    (0..2)
        .map(|i| {
            let (out, err) = (
                dir.join(format!("host{i}.out")),
                dir.join(format!("host{i}.err")),
            );
            let mut cmd = hosts.command(i, LAUNCH);
            cmd.args([
                "launch",
                "--num_machines",
                "2",
                "--machine_rank",
                &i.to_string(),
            ])
            .args([
                "--main_process_ip",
                &hosts.addr(0),
                "--main_process_port",
                "29611",
            ])
            .args([
                "--num_processes",
                "4",
                "--cpu",
                "--num_cpu_threads_per_process",
                "1",
            ])
            .args(extra)
            .arg(WORKER)
            .args(worker_args(ids, steps))
            .env("ACCEL_JOB_TOKEN", "a-secret-both-hosts-share")
            .env_remove("ACCELERATE_MIXED_PRECISION")
            .stdout(Stdio::from(std::fs::File::create(&out).unwrap()))
            .stderr(Stdio::from(std::fs::File::create(&err).unwrap()));
            (cmd.spawn().unwrap(), out)
        })
        .collect()
}

/// Waits for every child up to `limit`, killing what is left; returns each
/// one's (success, stdout, stderr) and how long the slowest took.
fn wait_all(
    children: Vec<(Child, std::path::PathBuf)>,
    limit: Duration,
) -> (Vec<(bool, String, String)>, Duration) {
    let start = Instant::now();
    let mut out = vec![];
    for (mut c, stdout) in children {
        loop {
            if c.try_wait().unwrap().is_some() || start.elapsed() > limit {
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        if c.try_wait().unwrap().is_none() {
            let _ = c.kill();
        }
        let status = c.wait().unwrap();
        let read = |p: &std::path::Path| std::fs::read_to_string(p).unwrap_or_default();
        out.push((
            status.success(),
            read(&stdout),
            read(&stdout.with_extension("err")),
        ));
    }
    (out, start.elapsed())
}

#[test]
fn two_hosts_train_as_one_host_does_also_over_slow_links() {
    let hosts = hosts_or_skip!(2);
    let tmp = tempfile::tempdir().unwrap();
    let ids = accel_tests::llama_ids_file(tmp.path());
    let mut cmd = Command::new(LAUNCH);
    cmd.args([
        "launch",
        "--num_processes",
        "4",
        "--cpu",
        "--num_cpu_threads_per_process",
        "1",
        WORKER,
    ])
    .args(worker_args(&ids, 4));
    let (ok, out, err) = accel_tests::run_program(cmd, None);
    assert!(ok, "{err}");
    let (_, one_host) = accel_tests::parse_run(&out);
    let slow: &[&str] = &["netem", "delay", "5ms", "rate", "1gbit"];
    let rate: &[&str] = &["tbf", "rate", "1gbit", "burst", "256kb", "latency", "50ms"];
    for netem in [None, Some(slow)] {
        if let Some(spec) = netem {
            for i in 0..2 {
                if let Err(e) = hosts.qdisc(i, spec) {
                    // A kernel without sch_netem: the rate limit alone.
                    eprintln!(
                        "no 5 ms delay on this kernel ({e}); the links are rate-limited only"
                    );
                    hosts.qdisc(i, rate).unwrap();
                }
            }
        }
        let (runs, _) = wait_all(
            launch_on(&hosts, (&ids, tmp.path()), 4, &[]),
            Duration::from_secs(120),
        );
        for (i, (ok, out, err)) in runs.iter().enumerate() {
            assert!(ok, "host {i} ({netem:?}): {err}\n{out}");
        }
        let (setup, two_hosts) = accel_tests::parse_run(&runs[0].1);
        assert_eq!(setup["world_size"], 4, "{setup}");
        assert_eq!(two_hosts, one_host, "two hosts ({netem:?}) vs one host");
    }
}

/// The main job of the elastic tests: 30 steps, a checkpoint every 5.
const JOB: [&str; 6] = [
    "--steps",
    "30",
    "--batch-size",
    "4",
    "--checkpoint-every",
    "5",
];

/// The job's weights when nothing interrupts it: 4 ranks on one host, run
/// once for all the tests of this binary.
fn calm_model() -> &'static [u8] {
    static MODEL: OnceLock<Vec<u8>> = OnceLock::new();
    MODEL.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        let mut cmd = Command::new(LAUNCH);
        cmd.args(["launch", "--num_processes", "4", "--cpu"])
            .args(["--num_cpu_threads_per_process", "1", GPT])
            .args(JOB)
            .arg("--out")
            .arg(dir.path());
        let (ok, out, err) = accel_tests::run_program(cmd, None);
        assert!(ok, "{out}\n{err}");
        saved_model(dir.path())
    })
}

/// etcd on the switch, where every host reaches it (and a host cut off
/// does not); `None` where etcd is not installed.
fn etcd_on_switch(hosts: &Hosts, dir: &Path) -> Option<Server> {
    let ports = (2379, 2380); // the switch's namespace has its own ports
    Server::start_with(dir, hosts.hub_command("etcd"), &hosts.hub_addr(), ports)
}

/// `accel launch --rdzv_backend etcd` of the main job on host `i` as machine
/// `k` of `nnodes`, one restart allowed; output into `dir/<tag>.{out,err}`.
fn elastic_on(
    hosts: &Hosts,
    (i, k, nnodes): (usize, usize, &str),
    (etcd, out): (&Server, &Path),
    (dir, tag): (&Path, &str),
    extra: &[&str],
) -> (Child, PathBuf) {
    let max: usize = nnodes.rsplit(':').next().unwrap().parse().unwrap();
    let (stdout, stderr) = (
        dir.join(format!("{tag}.out")),
        dir.join(format!("{tag}.err")),
    );
    let mut cmd = hosts.command(i, LAUNCH);
    cmd.args(["launch", "--cpu", "--num_cpu_threads_per_process", "1"])
        .args([
            "--num_processes",
            &(2 * max).to_string(),
            "--nnodes",
            nnodes,
        ])
        .args(["--machine_rank", &k.to_string(), "--max_restarts", "1"])
        .args(["--rdzv_backend", "etcd", "--rdzv_endpoint", &etcd.endpoint])
        .args([
            "--rdzv_id",
            "gpt",
            "--rdzv_last_call",
            "1",
            "--rdzv_timeout",
            "120",
        ])
        .args(extra)
        .arg(GPT)
        .args(JOB)
        .arg("--out")
        .arg(out)
        .env("ACCEL_JOB_TOKEN", "a-secret-the-hosts-share")
        .env_remove("ACCELERATE_MIXED_PRECISION")
        .stdout(Stdio::from(std::fs::File::create(&stdout).unwrap()))
        .stderr(Stdio::from(std::fs::File::create(stderr).unwrap()));
    (cmd.spawn().unwrap(), stdout)
}

macro_rules! etcd_or_skip {
    ($hosts:expr, $dir:expr) => {
        match etcd_on_switch(&$hosts, $dir) {
            Some(server) => server,
            None => return,
        }
    };
}

#[test]
fn a_host_killed_after_the_third_checkpoint_restarts_every_machine_and_ends_bitwise() {
    let hosts = hosts_or_skip!(2);
    let tmp = tempfile::tempdir().unwrap();
    let etcd = etcd_or_skip!(hosts, tmp.path());
    let calm = calm_model();
    let out = tmp.path().join("run");
    let on = |i: usize, tag: &str| {
        elastic_on(&hosts, (i, i, "2"), (&etcd, &out), (tmp.path(), tag), &[])
    };
    let first = on(0, "host0");
    let (mut doomed, _) = on(1, "host1");
    wait_for_checkpoint(&out, 2, CHECKPOINT_WAIT);
    // Host 1 dies whole (launcher and ranks), then comes back: a launcher
    // started there again joins the next round.
    hosts.kill_all(1);
    assert!(!doomed.wait().unwrap().success());
    let again = on(1, "host1-again");
    let (runs, _) = wait_all(vec![first, again], Duration::from_secs(240));
    for (i, (ok, out, err)) in runs.iter().enumerate() {
        assert!(ok, "host {i}: {err}\n{out}");
    }
    let (_, out0, err0) = &runs[0];
    assert!(err0.contains("restart 1 of 1"), "{err0}");
    assert!(out0.contains("resumed from"), "{out0}");
    assert!(
        saved_model(&out) == calm,
        "the restarted job's weights differ"
    );
}

#[test]
fn a_host_cut_off_for_20_s_is_named_within_the_timeout_and_the_restart_ends_bitwise() {
    let hosts = hosts_or_skip!(2);
    let tmp = tempfile::tempdir().unwrap();
    let etcd = etcd_or_skip!(hosts, tmp.path());
    let calm = calm_model();
    let out = tmp.path().join("run");
    let children: Vec<_> = (0..2)
        .map(|i| {
            let log = (tmp.path(), ["host0", "host1"][i]);
            elastic_on(
                &hosts,
                (i, i, "2"),
                (&etcd, &out),
                log,
                &["--timeout", "10"],
            )
        })
        .collect();
    wait_for_checkpoint(&out, 1, CHECKPOINT_WAIT);
    hosts.link(1, false).unwrap();
    let cut = Instant::now();
    // Host 0's ranks name a rank of host 1 within the timeout (plus the
    // launcher's teardown), long before the link comes back.
    let named = |err: &str| ["rank 2", "rank 3"].iter().any(|r| err.contains(r));
    let log0 = tmp.path().join("host0.err");
    while !named(&std::fs::read_to_string(&log0).unwrap_or_default()) {
        assert!(
            cut.elapsed() < Duration::from_secs(18),
            "no rank of host 1 named {:?} after the cut: {}",
            cut.elapsed(),
            std::fs::read_to_string(&log0).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    std::thread::sleep(Duration::from_secs(20).saturating_sub(cut.elapsed()));
    hosts.link(1, true).unwrap();
    let (runs, _) = wait_all(children, Duration::from_secs(240));
    for (i, (ok, out, err)) in runs.iter().enumerate() {
        assert!(ok, "host {i}: {err}\n{out}");
    }
    assert!(
        saved_model(&out) == calm,
        "the restarted job's weights differ"
    );
}

#[test]
fn with_nnodes_2_to_3_the_job_goes_on_with_two_hosts_when_one_of_three_dies() {
    let hosts = hosts_or_skip!(3);
    let tmp = tempfile::tempdir().unwrap();
    let etcd = etcd_or_skip!(hosts, tmp.path());
    let out = tmp.path().join("run");
    let mut children: Vec<_> = (0..3)
        .map(|i| {
            let log = (tmp.path(), ["host0", "host1", "host2"][i]);
            elastic_on(&hosts, (i, i, "2:3"), (&etcd, &out), log, &[])
        })
        .collect();
    wait_for_checkpoint(&out, 1, CHECKPOINT_WAIT);
    hosts.kill_all(2);
    let (mut dead, _) = children.pop().unwrap();
    assert!(!dead.wait().unwrap().success());
    let (runs, _) = wait_all(children, Duration::from_secs(240));
    for (i, (ok, out, err)) in runs.iter().enumerate() {
        assert!(ok, "host {i}: {err}\n{out}");
    }
    let (_, out0, err0) = &runs[0];
    assert!(
        err0.contains("round 1: node 0 of 2 (4 ranks)")
            && err0.contains("the world size is now 4 (it was 6)"),
        "{err0}"
    );
    assert!(out0.contains("resumed from"), "{out0}");
    assert!(saved_model(&out).len() > 1000);
}

#[test]
fn with_nnodes_2_to_3_a_host_that_arrives_mid_run_is_admitted_by_a_restart() {
    let hosts = hosts_or_skip!(3);
    let tmp = tempfile::tempdir().unwrap();
    let etcd = etcd_or_skip!(hosts, tmp.path());
    let out = tmp.path().join("run");
    let on = |i: usize| {
        let log = (tmp.path(), ["host0", "host1", "host2"][i]);
        elastic_on(&hosts, (i, i, "2:3"), (&etcd, &out), log, &[])
    };
    let mut children = vec![on(0), on(1)];
    wait_for_checkpoint(&out, 1, CHECKPOINT_WAIT);
    // Host 2 arrives while round 0 runs with 2 of up to 3 nodes: it waits,
    // the running launchers stop their ranks (which save the step they are
    // at), and all three meet in round 1.
    children.push(on(2));
    let (runs, _) = wait_all(children, Duration::from_secs(240));
    for (i, (ok, out, err)) in runs.iter().enumerate() {
        assert!(ok, "host {i}: {err}\n{out}");
    }
    let (_, out0, err0) = &runs[0];
    assert!(
        err0.contains("wait to join round 0")
            && err0.contains("not counted as a restart")
            && err0.contains("round 1: node 0 of 3 (6 ranks)")
            && err0.contains("the world size is now 6 (it was 4)"),
        "{err0}"
    );
    assert!(out0.contains("resumed from"), "{out0}");
}
