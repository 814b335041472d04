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
