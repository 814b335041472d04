//! More than one machine, for real: hosts made of network namespaces
//! (`accel_tests::hosts`), one `accel launch` per host with
//! `--num_machines 2`, two CPU ranks each. The job gives the one-host run's
//! losses bit for bit, also over links with 5 ms of delay and a 1 Gbit/s
//! rate (the rate alone where the kernel has no `netem`); a host cut off mid-run makes every surviving rank fail within its
//! timeout naming a rank it lost, and no launcher hangs. Skipped, with the
//! reason, where namespaces cannot be made (not root).

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use accel_tests::hosts::Hosts;

const WORKER: &str = env!("CARGO_BIN_EXE_finetune_hf_worker");
const LAUNCH: &str = env!("CARGO_BIN_EXE_accel_launch");

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

#[test]
fn a_host_cut_off_mid_run_is_named_within_the_timeout() {
    let hosts = hosts_or_skip!(2);
    let tmp = tempfile::tempdir().unwrap();
    let ids = accel_tests::llama_ids_file(tmp.path());
    let children = launch_on(&hosts, (&ids, tmp.path()), 100_000, &["--timeout", "10"]);
    // Let the job form and train a little, then cut host 1 off for 30 s.
    std::thread::sleep(Duration::from_secs(4));
    hosts.link(1, false).unwrap();
    let cut = Instant::now();
    let (runs, _) = wait_all(children, Duration::from_secs(90));
    let after = cut.elapsed();
    hosts.link(1, true).unwrap();
    // Every launcher ended (none hangs), in the timeout plus the launcher's
    // monitoring and teardown, not the 30 minutes of the default.
    assert!(
        after < Duration::from_secs(45),
        "the launchers took {after:?} after the cut"
    );
    let (ok0, out0, err0) = &runs[0];
    assert!(!ok0, "host 0 cannot finish without host 1's ranks:\n{out0}");
    let named = ["rank 2", "rank 3"].iter().any(|r| err0.contains(r));
    assert!(named, "host 0 should name a rank of host 1:\n{err0}");
}
