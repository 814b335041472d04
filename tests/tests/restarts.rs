//! Faults survived: under `accel launch --max_restarts` a rank killed mid-run
//! restarts the whole group, the main job resumes from its newest
//! checkpoint, and the run ends with the same weights, to the bit, as one
//! that was never interrupted; a SIGTERM to the launcher makes every rank
//! save at its next step and exit, and `--resume` then ends the same way.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use accel_tests::{saved_model, wait_for_checkpoint};

/// How long a test waits for a checkpoint of a run.
const CHECKPOINT_WAIT: Duration = Duration::from_secs(300);
const LAUNCH: &str = env!("CARGO_BIN_EXE_accel_launch");
const GPT: &str = env!("CARGO_BIN_EXE_train_gpt_worker");

/// `accel launch` of 2 ranks of the main job: 60 steps, a checkpoint every
/// `every`, then `extra` arguments.
fn launch(out: &Path, max_restarts: usize, every: u64, extra: &[&str]) -> Child {
    launch_with(&[], out, max_restarts, every, extra)
}

/// [`launch`] with more flags for the launcher.
fn launch_with(
    flags: &[&str],
    out: &Path,
    max_restarts: usize,
    every: u64,
    extra: &[&str],
) -> Child {
    Command::new(LAUNCH)
        .args(["launch", "--num_processes", "2", "--cpu", "--max_restarts"])
        .arg(max_restarts.to_string())
        .args(flags)
        .arg(GPT)
        .args(["--steps", "60", "--batch-size", "8", "--checkpoint-every"])
        .arg(every.to_string())
        .args(extra)
        .arg("--out")
        .arg(out)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

fn finish(child: Child) -> Output {
    let out = child.wait_with_output().unwrap();
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    assert!(
        out.status.success(),
        "launch failed: {}\n{}",
        text(&out.stdout),
        text(&out.stderr)
    );
    out
}

/// The pid of the child of `parent` whose environment has `RANK=rank`.
fn rank_pid(parent: u32, rank: usize) -> Option<i32> {
    for entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // The parent pid is the second field after the command's ")".
        let after = &stat[stat.rfind(')').map_or(0, |i| i + 1)..];
        let ppid: u32 = after.split_whitespace().nth(1)?.parse().ok()?;
        if ppid != parent {
            continue;
        }
        let env = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
        let want = format!("RANK={rank}");
        if env.split(|&b| b == 0).any(|v| v == want.as_bytes()) {
            return Some(pid);
        }
    }
    None
}

/// Sends `signal` (`KILL`, `STOP`, `TERM`) to process `pid`.
fn signal(pid: impl std::fmt::Display, signal: &str) {
    let sent = Command::new("kill")
        .arg(format!("-{signal}"))
        .arg(pid.to_string())
        .status()
        .unwrap();
    assert!(sent.success(), "kill -{signal} {pid}");
}

/// After a restart: the resume line, and the weights of an uninterrupted run.
fn assert_resumed_bitwise(out: &Output, calm: &Path, hit: &Path) {
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("resumed from"), "{stdout}");
    assert!(
        saved_model(calm) == saved_model(hit),
        "the interrupted run's weights differ"
    );
}

#[test]
fn a_rank_killed_mid_run_restarts_the_group_and_the_weights_match_an_uninterrupted_run() {
    let dir = tempfile::tempdir().unwrap();
    let (calm, hit) = (dir.path().join("calm"), dir.path().join("hit"));
    finish(launch(&calm, 0, 10, &[]));

    let child = launch(&hit, 1, 10, &[]);
    // Past the checkpoint of step 30, rank 1 is killed (near step 35).
    wait_for_checkpoint(&hit, 2, CHECKPOINT_WAIT);
    std::thread::sleep(Duration::from_millis(200));
    let pid = rank_pid(child.id(), 1).expect("rank 1 is running");
    signal(pid, "KILL");
    let out = finish(child);
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(
        log.contains("rank 1 failed with signal 9") && log.contains("restart 1 of 1"),
        "{log}"
    );
    assert_resumed_bitwise(&out, &calm, &hit);
}

#[test]
fn sigterm_to_the_launcher_saves_the_step_on_every_rank_and_resume_ends_bitwise() {
    let dir = tempfile::tempdir().unwrap();
    let (calm, hit) = (dir.path().join("calm"), dir.path().join("hit"));
    finish(launch(&calm, 0, 0, &[]));

    // A checkpoint at step 25, then SIGTERM to the launcher a few steps on.
    let child = launch(&hit, 0, 25, &[]);
    wait_for_checkpoint(&hit, 0, CHECKPOINT_WAIT);
    std::thread::sleep(Duration::from_millis(150));
    signal(child.id(), "TERM");
    let out = child.wait_with_output().unwrap();
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "an interrupted launch reports it: {log}"
    );
    assert!(log.contains("passing SIGTERM to every rank"), "{log}");
    // Every rank saved and left by itself (not killed after the timeout),
    // at the same step, into the preemption checkpoint past step 25's.
    for rank in 0..2 {
        let said = format!("[rank{rank}]: stopped by a termination signal after step");
        assert!(log.contains(&said), "{log}");
    }
    assert!(
        hit.join("checkpoints").join("checkpoint_1").is_dir(),
        "{log}"
    );

    let out = finish(launch(&hit, 0, 25, &["--resume"]));
    assert_resumed_bitwise(&out, &calm, &hit);
}

#[test]
fn a_stopped_rank_is_named_by_the_collective_timeout_and_the_group_restarts() {
    let dir = tempfile::tempdir().unwrap();
    let (calm, hit) = (dir.path().join("calm"), dir.path().join("hit"));
    finish(launch(&calm, 0, 10, &[]));

    // Collectives wait 5 s for a missing rank; rank 1 is frozen (SIGSTOP)
    // past step 30 and never answers again.
    let child = launch_with(&["--timeout", "5"], &hit, 1, 10, &[]);
    wait_for_checkpoint(&hit, 2, CHECKPOINT_WAIT);
    std::thread::sleep(Duration::from_millis(200));
    let pid = rank_pid(child.id(), 1).expect("rank 1 is running");
    signal(pid, "STOP");
    let started = Instant::now();
    let out = finish(child);
    let log = String::from_utf8_lossy(&out.stderr);
    // Rank 0 names the rank it waited for; the launcher counts rank 0's
    // exit as the failure and restarts the group.
    assert!(log.contains("rank 1 did not arrive within"), "{log}");
    assert!(log.contains("restart 1 of 1"), "{log}");
    assert!(
        saved_model(&calm) == saved_model(&hit),
        "the restarted run's weights differ"
    );
    // The timeout plus the grace before SIGKILL, plus the rest of the run.
    assert!(started.elapsed() < Duration::from_secs(120), "{log}");
}

#[test]
fn a_rank_killed_during_a_save_restarts_from_the_last_complete_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let (calm, hit) = (dir.path().join("calm"), dir.path().join("hit"));
    finish(launch(&calm, 0, 10, &[]));

    let child = launch(&hit, 1, 10, &[]);
    // The save of step 30 in progress: its hidden temporary folder exists
    // (`AtomicDir`); rank 1 is killed the moment it is seen.
    wait_for_checkpoint(&hit, 1, CHECKPOINT_WAIT);
    let ckpts = hit.join("checkpoints");
    let deadline = Instant::now() + Duration::from_secs(300);
    let saving = || {
        std::fs::read_dir(&ckpts)
            .into_iter()
            .flatten()
            .flatten()
            .any(|e| {
                e.file_name()
                    .to_string_lossy()
                    .starts_with(".checkpoint_2.tmp-")
            })
    };
    while !saving() {
        assert!(
            Instant::now() < deadline,
            "the save of step 30 was not seen"
        );
        std::thread::sleep(Duration::from_micros(200));
    }
    let pid = rank_pid(child.id(), 1).expect("rank 1 is running");
    signal(pid, "KILL");
    let out = finish(child);
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(log.contains("restart 1 of 1"), "{log}");
    // No partial checkpoint is ever listed, so the restart reads a whole one.
    assert_resumed_bitwise(&out, &calm, &hit);
}

/// Four CPU ranks of one thread each.
const FOUR_RANKS: [&str; 5] = [
    "--num_processes",
    "4",
    "--cpu",
    "--num_cpu_threads_per_process",
    "1",
];

/// The main job's 60 steps, a checkpoint every 25.
const EVERY_25: [&str; 6] = [
    "--steps",
    "60",
    "--batch-size",
    "8",
    "--checkpoint-every",
    "25",
];

/// One launcher per "machine" on loopback, each in its own folder, so a
/// relative `--out` is that machine's own disk: 2 machines of 2 ranks, with
/// `--save-on-each-node`.
fn launch_machines(root: &Path, port: u16, extra: &[&str]) -> Vec<Child> {
    (0..2)
        .map(|m| {
            let node = root.join(format!("node{m}"));
            std::fs::create_dir_all(&node).unwrap();
            let log = |s: &str| std::fs::File::create(node.join(format!("launch.{s}"))).unwrap();
            Command::new(LAUNCH)
                .current_dir(&node)
                .args(["launch", "--num_machines", "2", "--machine_rank"])
                .arg(m.to_string())
                .args(["--main_process_ip", "127.0.0.1", "--main_process_port"])
                .arg(port.to_string())
                .args(FOUR_RANKS)
                .arg(GPT)
                .args(EVERY_25)
                .args(["--save-on-each-node", "--out", "out"])
                .args(extra)
                .env("ACCEL_JOB_TOKEN", "both-machines-share-it")
                .stdout(Stdio::from(log("out")))
                .stderr(Stdio::from(log("err")))
                .spawn()
                .unwrap()
        })
        .collect()
}

#[test]
fn save_on_each_node_keeps_a_copy_on_every_machine_and_a_resume_reads_its_own() {
    let dir = tempfile::tempdir().unwrap();
    let calm = dir.path().join("calm");
    let calm_run = Command::new(LAUNCH)
        .arg("launch")
        .args(FOUR_RANKS)
        .arg(GPT)
        .args(EVERY_25)
        .arg("--out")
        .arg(&calm)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    finish(calm_run);

    // Both machines are stopped (SIGTERM to each launcher) past the
    // checkpoint of step 25: every rank saves the step it is at.
    let port = accel_tests::free_port();
    let hit = launch_machines(dir.path(), port, &[]);
    let nodes: Vec<PathBuf> = (0..2)
        .map(|m| dir.path().join(format!("node{m}/out")))
        .collect();
    for node in &nodes {
        wait_for_checkpoint(node, 0, CHECKPOINT_WAIT);
    }
    std::thread::sleep(Duration::from_millis(150));
    for child in &hit {
        signal(child.id(), "TERM");
    }
    for mut child in hit {
        assert!(
            !child.wait().unwrap().success(),
            "an interrupted launch reports it"
        );
    }
    // Each machine's copy holds the shared state and its own ranks' files
    // only (ranks 0-1 on machine 0, 2-3 on machine 1).
    for (m, node) in nodes.iter().enumerate() {
        let ckpt = node.join("checkpoints").join("checkpoint_1");
        let err = std::fs::read_to_string(node.join("../launch.err")).unwrap_or_default();
        assert!(
            ckpt.join("model.safetensors").is_file(),
            "machine {m}: {err}"
        );
        for rank in 0..4 {
            let file = ckpt.join(format!("random_states_{rank}.json"));
            assert_eq!(
                file.is_file(),
                rank / 2 == m,
                "{} on machine {m}",
                file.display()
            );
        }
    }
    let saved = |m: usize| {
        std::fs::read(nodes[m].join("checkpoints/checkpoint_1/model.safetensors")).unwrap()
    };
    assert!(saved(0) == saved(1), "the machines' copies differ");

    // Resumed, each machine from its own copy: the weights of a run never
    // interrupted.
    for mut child in launch_machines(dir.path(), accel_tests::free_port(), &["--resume"]) {
        assert!(child.wait().unwrap().success());
    }
    let log = std::fs::read_to_string(dir.path().join("node0/launch.out")).unwrap();
    assert!(log.contains("resumed from"), "{log}");
    assert!(
        saved_model(&calm) == saved_model(&nodes[0]),
        "the resumed run's weights differ"
    );
}
