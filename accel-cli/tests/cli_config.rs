//! Accelerate's config file: Python-written files load, `accel config`
//! (interactive and `default`) writes them, `accel env` shows them, and
//! `accel launch` takes its defaults from them.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use accel_cli::config_file::{ClusterConfig, FsdpFileConfig};
use accel_core::{AcceleratorConfig, PrecisionType, Result};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/accelerate_config")
        .join(name)
}

/// `accel` with `HF_HOME` in a fresh folder, so the user's own file is never read.
fn accel(hf_home: &Path) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_accel"));
    c.env("HF_HOME", hf_home);
    c
}

fn run_ok(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn files_written_by_python_accelerate_load() -> Result<()> {
    let gpu = ClusterConfig::load(&fixture("multi_gpu.yaml"))?;
    assert_eq!(gpu.distributed_type, "MULTI_GPU");
    assert_eq!(gpu.num_processes, Some(2));
    assert_eq!(gpu.gpu_ids.as_deref(), Some("all"));
    assert_eq!(gpu.precision()?, Some(PrecisionType::Fp16));
    // Kept though unused: the TPU keys and the 'no' string of downcast_bf16.
    assert!(gpu.unused.contains_key("tpu_env"));
    assert!(gpu.unused.contains_key("downcast_bf16"));

    let fsdp = ClusterConfig::load(&fixture("fsdp.yaml"))?;
    let f = fsdp.fsdp_config.clone().unwrap();
    assert_eq!(f.fsdp_version, Some(2));
    assert_eq!(
        f.fsdp_transformer_layer_cls_to_wrap.as_deref(),
        Some("LlamaDecoderLayer")
    );
    assert_eq!(f.fsdp_cpu_ram_efficient_loading, Some(true));
    assert_eq!(
        fsdp.distributed()?,
        accel_core::DistributedType::Fsdp,
        "FSDP is a kind accel-rs runs"
    );

    let cpu = ClusterConfig::load(&fixture("multi_cpu.yaml"))?;
    assert!(cpu.use_cpu);
    assert_eq!((cpu.num_machines, cpu.machine_rank), (2, 0));
    assert_eq!(cpu.main_process_ip.as_deref(), Some("192.168.0.10"));
    assert_eq!(cpu.main_process_port, Some(29500));
    assert!(cpu.unused.contains_key("mpirun_config"));

    // `write_basic_config` writes JSON into the .yaml file; JSON is YAML.
    let basic = ClusterConfig::load(&fixture("basic_config_from_python.json"))?;
    assert_eq!(basic.distributed_type, "NO");
    assert!(basic.use_cpu);
    Ok(())
}

#[test]
fn an_unknown_key_is_named_with_the_file() {
    // Accelerate's own tests/test_configs/invalid_keys.yaml.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("invalid_keys.yaml");
    std::fs::write(
        &path,
        "compute_environment: LOCAL_MACHINE\ndeepspeed_config: {}\ndistributed_type: 'NO'\n\
         downcast_bf16: 'no'\nfsdp_config: {}\nmachine_rank: 0\nmixed_precision: 'no'\n\
         num_machines: 1\nnum_processes: 1\nuse_cpu: false\n\
         invalid_key: \"invalid_value\"\nanother_invalid_key: \"another_invalid_value\"\n",
    )
    .unwrap();
    let e = ClusterConfig::load(&path).unwrap_err().to_string();
    assert!(e.contains("another_invalid_key"), "{e}");
    assert!(e.contains("invalid_key"), "{e}");
    assert!(e.contains("invalid_keys.yaml"), "{e}");
}

#[test]
fn a_saved_file_loads_back_equal_and_keeps_unused_keys() -> Result<()> {
    let dir = tempfile::tempdir().unwrap();
    for name in ["multi_gpu.yaml", "fsdp.yaml", "multi_cpu.yaml"] {
        let original = ClusterConfig::load(&fixture(name))?;
        let path = dir.path().join("nested").join(name);
        original.save(&path)?;
        let back = ClusterConfig::load(&path)?;
        assert_eq!(back, original, "{name}");
    }
    let text = std::fs::read_to_string(dir.path().join("nested/multi_cpu.yaml")).unwrap();
    assert!(
        text.contains("mpirun_hostfile: /home/user/hostfile"),
        "{text}"
    );
    // No temporary file is left next to it.
    assert_eq!(
        std::fs::read_dir(dir.path().join("nested"))
            .unwrap()
            .count(),
        3
    );

    let mut c = ClusterConfig {
        fsdp_config: Some(FsdpFileConfig::default()),
        ..ClusterConfig::default()
    };
    c.save(&dir.path().join("empty_fsdp.yaml"))?;
    c.fsdp_config = None;
    assert_eq!(ClusterConfig::load(&dir.path().join("empty_fsdp.yaml"))?, c);
    Ok(())
}

#[test]
fn config_default_writes_a_basic_file_once() {
    let home = tempfile::tempdir().unwrap();
    let out = run_ok(accel(home.path()).args(["config", "default", "--mixed_precision", "bf16"]));
    let path = home.path().join("accelerate/default_config.yaml");
    assert!(out.contains(&path.display().to_string()), "{out}");
    let text = std::fs::read_to_string(&path).unwrap();
    for key in [
        "compute_environment: LOCAL_MACHINE",
        "distributed_type:",
        "mixed_precision: bf16",
        "num_processes:",
        "use_cpu:",
        "debug: false",
        "enable_cpu_affinity: false",
    ] {
        assert!(text.contains(key), "missing {key:?} in:\n{text}");
    }
    // A second run leaves the file alone, as Accelerate's write_basic_config.
    let out = run_ok(accel(home.path()).args(["config", "default", "--mixed_precision", "fp16"]));
    assert!(out.contains("already exists"), "{out}");
    assert!(std::fs::read_to_string(&path).unwrap().contains("bf16"));

    let other = home.path().join("elsewhere.yaml");
    run_ok(
        accel(home.path())
            .args(["config", "default", "--config_file"])
            .arg(&other),
    );
    assert_eq!(
        ClusterConfig::load(&other).unwrap().precision().unwrap(),
        Some(PrecisionType::No)
    );
}

#[test]
fn interactive_config_reads_piped_answers() {
    let home = tempfile::tempdir().unwrap();
    let mut child = accel(home.path())
        .arg("config")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // environment, type, machines, rank, ip, port, same network, debug, processes, precision
    let answers = "\nMULTI_CPU\n2\n1\n10.1.2.3\n4000\nyes\nno\n4\nfp16\n";
    child
        .stdin
        .take()
        .unwrap()
        .write_all(answers.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("Which type of machine are you using?"),
        "{stdout}"
    );
    let c = ClusterConfig::load(&home.path().join("accelerate/default_config.yaml")).unwrap();
    assert_eq!(c.distributed_type, "MULTI_CPU");
    assert_eq!((c.num_machines, c.machine_rank), (2, 1));
    assert_eq!(c.main_process_ip.as_deref(), Some("10.1.2.3"));
    assert_eq!(c.main_process_port, Some(4000));
    assert_eq!(c.num_processes, Some(4));
    assert!(c.use_cpu && !c.debug);
    assert_eq!(c.mixed_precision.as_deref(), Some("fp16"));
}

#[test]
fn non_interactive_config_takes_the_defaults() {
    let home = tempfile::tempdir().unwrap();
    let path = home.path().join("mine.yaml");
    run_ok(
        accel(home.path())
            .args(["config", "--non-interactive", "--config_file"])
            .arg(&path)
            .stdin(Stdio::null()),
    );
    let c = ClusterConfig::load(&path).unwrap();
    assert_eq!(c.distributed_type, "NO");
    assert_eq!(c.num_processes, Some(1));
}

#[test]
fn env_prints_versions_and_the_active_config() {
    let home = tempfile::tempdir().unwrap();
    let out = run_ok(accel(home.path()).arg("env"));
    assert!(out.contains("- accel-rs version: "), "{out}");
    assert!(out.contains("- candle version: 0.11.1"), "{out}");
    assert!(out.contains("- CUDA available: "), "{out}");
    assert!(out.contains("Not found"), "{out}");

    let dest = home.path().join("accelerate/default_config.yaml");
    std::fs::create_dir_all(dest.parent().unwrap()).unwrap();
    std::fs::copy(fixture("multi_cpu.yaml"), &dest).unwrap();
    let out = run_ok(accel(home.path()).arg("env"));
    assert!(out.contains("\tdistributed_type: MULTI_CPU"), "{out}");
    assert!(out.contains("\tmain_process_ip: 192.168.0.10"), "{out}");

    let out = run_ok(
        accel(home.path())
            .args(["env", "--config_file"])
            .arg(fixture("fsdp.yaml")),
    );
    assert!(out.contains("config passed"), "{out}");
    assert!(
        out.contains("fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer"),
        "{out}"
    );
}

#[test]
fn launch_takes_defaults_from_the_config_file_and_flags_win() {
    let home = tempfile::tempdir().unwrap();
    let path = home.path().join("accelerate/default_config.yaml");
    let c = ClusterConfig {
        distributed_type: "MULTI_CPU".into(),
        num_processes: Some(2),
        use_cpu: true,
        mixed_precision: Some("bf16".into()),
        ..ClusterConfig::default()
    };
    c.save(&path).unwrap();
    let script = "echo world=$WORLD_SIZE mp=$ACCELERATE_MIXED_PRECISION cpu=$ACCELERATE_USE_CPU";

    let out = run_ok(accel(home.path()).args(["launch", "sh", "-c", script]));
    for r in 0..2 {
        let want = format!("[rank{r}]: world=2 mp=bf16 cpu=true");
        assert!(
            out.lines().any(|l| l == want),
            "missing {want:?} in:\n{out}"
        );
    }

    let out = run_ok(accel(home.path()).args([
        "launch",
        "--num_processes",
        "1",
        "--mixed_precision",
        "fp16",
        "sh",
        "-c",
        script,
    ]));
    assert!(
        out.lines()
            .any(|l| l == "[rank0]: world=1 mp=fp16 cpu=true"),
        "{out}"
    );
}

#[test]
fn the_config_files_rendezvous_backend_acts_or_says_it_has_no_effect() {
    let home = tempfile::tempdir().unwrap();
    let path = home.path().join("accelerate/default_config.yaml");
    // etcd acts: with no main process address it has no endpoint, and says so.
    let c = ClusterConfig {
        distributed_type: "MULTI_CPU".into(),
        num_processes: Some(1),
        use_cpu: true,
        rdzv_backend: Some("etcd".into()),
        ..ClusterConfig::default()
    };
    c.save(&path).unwrap();
    let out = accel(home.path())
        .args(["launch", "true"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("rdzv_endpoint"),
        "{err}"
    );
    for (backend, said) in [("static", false), ("c10d", true)] {
        let c = ClusterConfig {
            distributed_type: "MULTI_CPU".into(),
            num_processes: Some(1),
            use_cpu: true,
            rdzv_backend: Some(backend.into()),
            ..ClusterConfig::default()
        };
        c.save(&path).unwrap();
        let out = accel(home.path())
            .args(["launch", "true"])
            .output()
            .unwrap();
        assert!(out.status.success(), "{backend}");
        let err = String::from_utf8_lossy(&out.stderr);
        let note = format!("rdzv_backend: {backend} has no effect");
        assert_eq!(err.contains(&note), said, "{backend}: {err}");
    }
}

#[test]
fn a_missing_config_file_is_named_by_launch() {
    let home = tempfile::tempdir().unwrap();
    let out = accel(home.path())
        .args(["launch", "--config_file", "/no/such/config.yaml", "true"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("/no/such/config.yaml"));
}

#[test]
fn the_accelerator_config_picks_up_the_launched_precision() -> Result<()> {
    // Only this test in this binary reads or writes the variable in-process.
    std::env::set_var("ACCELERATE_MIXED_PRECISION", "bf16");
    assert_eq!(
        AcceleratorConfig::from_env()?.mixed_precision,
        Some(PrecisionType::Bf16)
    );
    // An explicit choice wins, `no` included (Accelerate's precedence).
    for p in [PrecisionType::Fp16, PrecisionType::No] {
        let explicit = AcceleratorConfig::default().with_mixed_precision(p);
        assert_eq!(explicit.with_env_precision()?.mixed_precision, Some(p));
    }
    std::env::set_var("ACCELERATE_MIXED_PRECISION", "fp64");
    let e = AcceleratorConfig::from_env().unwrap_err().to_string();
    assert!(e.contains("ACCELERATE_MIXED_PRECISION"), "{e}");
    std::env::remove_var("ACCELERATE_MIXED_PRECISION");
    assert_eq!(
        AcceleratorConfig::from_env()?.mixed_precision,
        Some(PrecisionType::No)
    );
    Ok(())
}

#[test]
fn a_json_file_written_by_python_accelerate_config_default_sets_the_launched_precision() {
    // What `accelerate config default --mixed_precision bf16` writes (JSON,
    // sorted keys, under the YAML name) on a machine without a GPU.
    let home = tempfile::tempdir().unwrap();
    let path = home.path().join("accelerate/default_config.yaml");
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(
        &path,
        r#"{
  "compute_environment": "LOCAL_MACHINE",
  "debug": false,
  "distributed_type": "NO",
  "downcast_bf16": false,
  "dynamo_config": {},
  "enable_cpu_affinity": false,
  "fp8_config": {},
  "fsdp_config": {},
  "machine_rank": 0,
  "main_training_function": "main",
  "megatron_lm_config": {},
  "mixed_precision": "bf16",
  "num_machines": 1,
  "num_processes": 1,
  "rdzv_backend": "static",
  "same_network": false,
  "tpu_use_cluster": false,
  "tpu_use_sudo": false,
  "use_cpu": true
}
"#,
    )
    .unwrap();
    let c = ClusterConfig::load(&path).unwrap();
    assert_eq!(c.precision().unwrap(), Some(PrecisionType::Bf16));
    let script = "echo mp=$ACCELERATE_MIXED_PRECISION";
    for args in [
        vec!["launch", "sh", "-c", script],
        vec![
            "launch",
            "--config_file",
            path.to_str().unwrap(),
            "sh",
            "-c",
            script,
        ],
    ] {
        let out = run_ok(accel(home.path()).args(&args));
        assert!(out.lines().any(|l| l.ends_with("mp=bf16")), "{out}");
    }
}

/// `accel env` says which engine started the process and the ranks it implies.
#[test]
fn env_reports_the_engine_that_started_the_process() {
    let dir = tempfile::tempdir().unwrap();
    let out = run_ok(
        accel(dir.path())
            .arg("env")
            .env("SLURM_PROCID", "1")
            .env("SLURM_NTASKS", "4")
            .env("SLURM_LOCALID", "1")
            .env("SLURM_JOB_NODELIST", "node[07-08]")
            .env("ACCEL_JOB_TOKEN_FILE", "/run/job.token")
            .env_remove("RANK")
            .env_remove("WORLD_SIZE")
            .env_remove("MASTER_ADDR")
            .env_remove("MASTER_PORT"),
    );
    assert!(
        out.contains("- Process engine: Slurm srun: rank 1 of 4, local rank 1 of 4, store node07:29500, job secret from ACCEL_JOB_TOKEN_FILE"),
        "{out}"
    );
}
