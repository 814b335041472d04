//! `accel launch` starts real processes with torchrun's variables, prefixes
//! their output, and stops the job when one rank fails.

use std::process::Command;
use std::time::{Duration, Instant};

fn accel() -> Command {
    Command::new(env!("CARGO_BIN_EXE_accel"))
}

/// The standard output of a command that must succeed (else its stderr is the failure).
fn stdout_ok(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn every_rank_gets_torchrun_variables_and_prefixed_output() {
    let text = stdout_ok(
        accel().args(["launch", "--num_processes", "3", "--cpu", "sh", "-c"])
        .arg("echo rank=$RANK local=$LOCAL_RANK world=$WORLD_SIZE lws=$LOCAL_WORLD_SIZE addr=$MASTER_ADDR cpu=$ACCELERATE_USE_CPU token=${#ACCEL_JOB_TOKEN}"),
    );
    for r in 0..3 {
        let want =
            format!("[rank{r}]: rank={r} local={r} world=3 lws=3 addr=127.0.0.1 cpu=true token=64");
        assert!(
            text.lines().any(|l| l == want),
            "missing {want:?} in:\n{text}"
        );
    }
}

#[test]
fn a_failing_rank_stops_the_others_and_is_named() {
    let started = Instant::now();
    let out = accel()
        .args(["launch", "--num_processes", "3", "sh", "-c"])
        .arg("if [ \"$RANK\" = 1 ]; then echo boom >&2; exit 3; fi; sleep 60")
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "the other ranks were not stopped"
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("[rank1]: boom"), "{err}");
    assert!(
        err.contains("rank 1") && err.contains("exit status 3"),
        "{err}"
    );
}

#[test]
fn a_program_that_does_not_exist_is_named() {
    let out = accel()
        .args(["launch", "--num_processes", "2", "/no/such/program"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("/no/such/program"));
}

#[test]
fn enable_cpu_affinity_reaches_every_rank() {
    let text = stdout_ok(
        accel()
            .args([
                "launch",
                "--num_processes",
                "2",
                "--cpu",
                "--enable_cpu_affinity",
                "sh",
                "-c",
            ])
            .arg("echo affinity=$ACCELERATE_CPU_AFFINITY"),
    );
    assert_eq!(
        text.lines().filter(|l| l.ends_with("affinity=1")).count(),
        2,
        "{text}"
    );
}

#[test]
fn every_rank_gets_its_thread_count_flag_then_launcher_environment() {
    let run = |flags: &[&str], omp: Option<&str>| {
        let mut cmd = accel();
        cmd.args(["launch", "--num_processes", "2", "--cpu"])
            .args(flags)
            .args([
                "sh",
                "-c",
                "echo threads=$OMP_NUM_THREADS/$RAYON_NUM_THREADS",
            ])
            .env_remove("RAYON_NUM_THREADS")
            .env_remove("OMP_NUM_THREADS");
        if let Some(v) = omp {
            cmd.env("OMP_NUM_THREADS", v);
        }
        stdout_ok(&mut cmd)
    };
    let count = |text: &str, want: &str| text.lines().filter(|l| l.ends_with(want)).count();
    let text = run(&["--num_cpu_threads_per_process", "3"], Some("5"));
    assert_eq!(count(&text, "threads=3/3"), 2, "{text}");
    let text = run(&[], Some("5"));
    assert_eq!(count(&text, "threads=5/5"), 2, "{text}");
}
