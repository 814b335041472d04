//! What the benchmarks that run each side in a process of its own share:
//! reading the process's memory figures and a side's one-line JSON result.

use std::process::Command;

use anyhow::{bail, Context, Result};
use serde_json::Value;

/// A `/proc/self/status` figure in KiB (`"VmHWM"` is the peak RSS, `"VmRSS"`
/// the current one); 0 where it cannot be read.
pub fn status_kib(field: &str) -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let line = status.lines().find(|l| l.starts_with(field)).unwrap_or("");
    line.split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// Runs `cmd` (one benchmark side) and returns the last line of its
/// standard output as JSON.
///
/// # Errors
/// A side that cannot start, fails (the end of its standard error, where a
/// Python traceback or a Rust error says what failed, is in the message) or
/// prints no JSON; each names `what`.
pub fn run_side(cmd: &mut Command, what: &str) -> Result<Value> {
    let out = cmd
        .output()
        .with_context(|| format!("starting the {what} side"))?;
    if !out.status.success() {
        let stderr = String::from_utf8_lossy(&out.stderr);
        let tail: Vec<&str> = stderr.lines().rev().take(20).collect();
        let tail: Vec<&str> = tail.into_iter().rev().collect();
        bail!(
            "the {what} side failed ({}):\n{}",
            out.status,
            tail.join("\n")
        );
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    let last = stdout.lines().last().unwrap_or("");
    serde_json::from_str(last).with_context(|| format!("the {what} side printed {last:?}"))
}

/// The benchmark checkpoint `target/{name}`, written by `python3 {script}
/// write DIR` when it lacks `marker` (a file the finished write leaves), as
/// a canonical path.
///
/// # Errors
/// The script cannot start or fails; the message names it and `needs`
/// (the pip packages it imports).
pub fn script_checkpoint(
    name: &str,
    marker: &str,
    script: &str,
    needs: &str,
) -> Result<std::path::PathBuf> {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../target")
        .join(name);
    if !dir.join(marker).is_file() {
        eprintln!("writing the checkpoint to {} ...", dir.display());
        let ok = Command::new("python3")
            .args([script, "write"])
            .arg(&dir)
            .status()
            .with_context(|| format!("starting python3 {script} write"))?;
        if !ok.success() {
            bail!(
                "no checkpoint at {} and `python3 {script} write` could not write it \
                 (pip install {needs}), or pass --model DIR",
                dir.display()
            );
        }
    }
    // Canonical, so the JSON names the folder without `examples/..`.
    Ok(dir.canonicalize().unwrap_or(dir))
}
