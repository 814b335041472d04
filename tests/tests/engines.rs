//! Ranks started by a cluster's engine instead of `accel launch`: Slurm's
//! `srun` variables (set by the test, as srun sets them) and a real Open MPI
//! `mpirun` (Debian's `openmpi-bin`, installed when missing and possible)
//! give the `accel launch` run's losses bit for bit; the job's secret comes
//! from a file the user names, and a job without one is told how to set it.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use serde_json::Value;

const WORKER: &str = env!("CARGO_BIN_EXE_finetune_hf_worker");
const LAUNCH: &str = env!("CARGO_BIN_EXE_accel_launch");

/// Eight sequences of the test Llama's vocabulary.
fn ids(dir: &Path) -> PathBuf {
    accel_tests::llama_ids_file(dir)
}

fn worker_args(dir: &Path) -> Vec<String> {
    accel_tests::finetune_hf_args(&ids(dir), 4)
}

/// One thread per rank, as `accel launch` gives two ranks on two cores here.
fn single_threaded(cmd: &mut Command) {
    cmd.env("OMP_NUM_THREADS", "1")
        .env("RAYON_NUM_THREADS", "1");
    for var in [
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "ACCEL_JOB_TOKEN",
    ] {
        cmd.env_remove(var);
    }
}

fn launched(dir: &Path) -> (Value, Vec<f64>) {
    let mut cmd = Command::new(LAUNCH);
    cmd.args([
        "launch",
        "--num_processes",
        "2",
        "--cpu",
        "--num_cpu_threads_per_process",
        "1",
        WORKER,
    ])
    .args(worker_args(dir));
    let (ok, out, err) = accel_tests::run_program(cmd, None);
    assert!(ok, "accel launch: {err}\n{out}");
    accel_tests::parse_run(&out)
}

fn token_file(dir: &Path) -> PathBuf {
    let path = dir.join("job.token");
    std::fs::write(&path, "a-secret-every-rank-reads\n").unwrap();
    path
}

#[test]
fn srun_variables_join_the_job_as_accel_launch_does() {
    let tmp = tempfile::tempdir().unwrap();
    let (_, want) = launched(tmp.path());
    let (port, token) = (accel_tests::free_port(), token_file(tmp.path()));
    // Written once: writing the ids file again for the second rank could
    // truncate it under the first one's read.
    let args = worker_args(tmp.path());
    let mut children = vec![];
    for rank in 0..2 {
        let mut cmd = Command::new(WORKER);
        single_threaded(&mut cmd);
        // A rank whose peer failed gives up within minutes, not 30.
        cmd.env("ACCEL_DIST_TIMEOUT", "120");
        cmd.args(&args)
            .env("SLURM_PROCID", rank.to_string())
            .env("SLURM_NTASKS", "2")
            .env("SLURM_LOCALID", rank.to_string())
            .env("SLURM_NTASKS_PER_NODE", "2")
            .env("SLURM_JOB_NODELIST", "localhost")
            .env("MASTER_PORT", port.to_string())
            .env("ACCEL_JOB_TOKEN_FILE", &token)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        children.push(cmd.spawn().unwrap());
    }
    let outs: Vec<_> = children
        .into_iter()
        .map(|c| c.wait_with_output().unwrap())
        .collect();
    for (r, o) in outs.iter().enumerate() {
        assert!(
            o.status.success(),
            "rank {r}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
    }
    let (setup, got) = accel_tests::parse_run(&String::from_utf8_lossy(&outs[0].stdout));
    assert_eq!(setup["world_size"], 2, "{setup}");
    assert_eq!(got, want, "srun-started ranks vs accel launch");
}

/// `mpirun` on PATH, installing Debian's `openmpi-bin` once when it is not
/// and this process may (root); `Err` says why it cannot run.
fn mpirun() -> Result<(), String> {
    let runs = || {
        Command::new("mpirun")
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success())
    };
    if runs() {
        return Ok(());
    }
    let root = Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| o.stdout.starts_with(b"0"));
    if !root {
        return Err("mpirun is not installed and this user cannot install openmpi-bin".into());
    }
    eprintln!("mpirun is not installed: apt-get install openmpi-bin (once)");
    let installed = Command::new("timeout")
        .args([
            "600",
            "apt-get",
            "install",
            "-y",
            "--no-install-recommends",
            "openmpi-bin",
        ])
        .env("DEBIAN_FRONTEND", "noninteractive")
        .output()
        .is_ok_and(|o| o.status.success());
    if installed && runs() {
        Ok(())
    } else {
        Err("apt-get install openmpi-bin failed (no network or no Debian mirror)".into())
    }
}

#[test]
fn a_real_mpirun_joins_the_job_as_accel_launch_does() {
    if let Err(reason) = mpirun() {
        eprintln!("skipped: {reason}");
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let (_, want) = launched(tmp.path());
    let (port, token) = (accel_tests::free_port(), token_file(tmp.path()));
    let mut cmd = Command::new("mpirun");
    single_threaded(&mut cmd);
    cmd.args(["--allow-run-as-root", "--oversubscribe", "-np", "2"])
        .args([
            "-x",
            "ACCEL_JOB_TOKEN_FILE",
            "-x",
            "MASTER_PORT",
            "-x",
            "OMP_NUM_THREADS",
            "-x",
            "RAYON_NUM_THREADS",
        ])
        .arg(WORKER)
        .args(worker_args(tmp.path()))
        .env("MASTER_PORT", port.to_string())
        .env("ACCEL_JOB_TOKEN_FILE", &token)
        .env("OMPI_MCA_btl_vader_single_copy_mechanism", "none");
    let (ok, out, err) = accel_tests::run_program(cmd, None);
    assert!(ok, "mpirun: {err}\n{out}");
    let (setup, got) = accel_tests::parse_run(&out);
    assert_eq!(setup["world_size"], 2, "{setup}");
    assert_eq!(got, want, "mpirun-started ranks vs accel launch");
}

#[test]
fn an_engine_started_job_without_a_secret_is_told_how_to_set_one() {
    let tmp = tempfile::tempdir().unwrap();
    let mut cmd = Command::new(WORKER);
    single_threaded(&mut cmd);
    cmd.args(worker_args(tmp.path()))
        .env("OMPI_COMM_WORLD_RANK", "0")
        .env("OMPI_COMM_WORLD_SIZE", "2")
        .env("OMPI_COMM_WORLD_LOCAL_RANK", "0")
        .env("OMPI_COMM_WORLD_LOCAL_SIZE", "2")
        .env_remove("ACCEL_JOB_TOKEN_FILE");
    let (ok, _, err) = accel_tests::run_program(cmd, None);
    assert!(!ok);
    assert!(
        err.contains("ACCEL_JOB_TOKEN") && err.contains("mpirun -x"),
        "{err}"
    );
}
