//! `accel env`: the versions, machine and config to paste into a bug report,
//! like `accelerate env`.

use std::path::PathBuf;

use accel_core::config::{
    is_bf16_available, is_cuda_available, is_nccl_available, total_ram_bytes, CANDLE_VERSION,
};
use accel_core::Result;

use crate::config_file::{default_config_path, ClusterConfig};

/// Flags of `accel env`.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct EnvArgs {
    /// The config file to show (default: the default file, when it exists).
    #[arg(long = "config_file", visible_alias = "config-file")]
    pub config_file: Option<PathBuf>,
}

/// What started this process and the ranks it implies (`mpirun`, `srun`,
/// a launcher's `RANK`, or nothing), and where the job's secret comes from.
fn process_engine() -> String {
    let env = |k: &str| std::env::var(k).ok();
    let d = match accel_core::dist::engine::detect(&env) {
        Ok(d) => d,
        Err(e) => return format!("unreadable: {e}"),
    };
    let get = |k: &str| d.lookup(k, &env).unwrap_or_else(|| "-".into());
    let token = if env("ACCEL_JOB_TOKEN").is_some() {
        "ACCEL_JOB_TOKEN"
    } else if env("ACCEL_JOB_TOKEN_FILE").is_some() {
        "ACCEL_JOB_TOKEN_FILE"
    } else {
        "none"
    };
    match (d.engine, env("RANK")) {
        (accel_core::dist::engine::Engine::Launcher, None) => "none (a single process)".into(),
        (engine, _) => format!(
            "{}: rank {} of {}, local rank {} of {}, store {}:{}, job secret from {token}",
            engine.name(),
            get("RANK"),
            get("WORLD_SIZE"),
            get("LOCAL_RANK"),
            get("LOCAL_WORLD_SIZE"),
            get("MASTER_ADDR"),
            get("MASTER_PORT"),
        ),
    }
}

/// The report `accel env` prints: one `- name: value` line per fact, then the
/// config file's keys indented below it.
///
/// # Errors
/// When the config file exists but cannot be read or parsed.
pub fn env_report(args: &EnvArgs) -> Result<String> {
    let yes_no = |b: bool| if b { "yes" } else { "no" };
    let rustc =
        std::process::Command::new(std::env::var_os("RUSTC").unwrap_or_else(|| "rustc".into()))
            .arg("--version")
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
            .unwrap_or_else(|| "not found".to_string());
    let ram = total_ram_bytes()
        .map(|b| format!("{:.2} GB", b as f64 / 1024f64.powi(3)))
        .unwrap_or_else(|| "unknown".to_string());
    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
    let features: Vec<&str> = [
        ("cuda", cfg!(feature = "cuda")),
        ("nccl", cfg!(feature = "nccl")),
    ]
    .into_iter()
    .filter_map(|(name, on)| on.then_some(name))
    .collect();
    let info = [
        ("accel-rs version", env!("CARGO_PKG_VERSION").to_string()),
        (
            "accel-rs features",
            if features.is_empty() {
                "none".into()
            } else {
                features.join(", ")
            },
        ),
        ("candle version", CANDLE_VERSION.to_string()),
        ("rustc version", rustc),
        (
            "Platform",
            format!("{} {}", std::env::consts::OS, std::env::consts::ARCH),
        ),
        ("CPU count", cpus.to_string()),
        ("System RAM", ram),
        ("CUDA available", yes_no(is_cuda_available()).to_string()),
        ("NCCL available", yes_no(is_nccl_available()).to_string()),
        ("bf16 available", yes_no(is_bf16_available()).to_string()),
        ("Process engine", process_engine()),
    ];
    let mut out = String::from("\nCopy-and-paste the text below in your bug report\n\n");
    for (name, value) in info {
        out.push_str(&format!("- {name}: {value}\n"));
    }
    let path = args.config_file.clone().unwrap_or_else(default_config_path);
    let heading = if args.config_file.is_some() {
        "config passed"
    } else {
        "default config"
    };
    out.push_str(&format!("- accel-rs {heading} ({}):\n", path.display()));
    match ClusterConfig::load_or_default(args.config_file.as_deref())? {
        None => out.push_str("\tNot found\n"),
        Some(c) => {
            for line in c.to_yaml_string()?.lines() {
                out.push('\t');
                out.push_str(line);
                out.push('\n');
            }
        }
    }
    Ok(out)
}
