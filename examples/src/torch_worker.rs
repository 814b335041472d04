//! PyTorch's side of `bench_train`: `scripts/bench_train_torch.py --serve`
//! in a child process that times one round per request line, so its rounds
//! take their turn among the Rust rows' (machine noise then hits both sides
//! alike).

use std::io::{BufRead, BufReader, Lines, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};

use anyhow::{anyhow, bail, Result};
use candle_core::Device;
use serde_json::Value;

/// The script, for messages.
pub const TORCH_SCRIPT: &str = "scripts/bench_train_torch.py";

/// A running worker; dropping it ends the process.
pub struct TorchWorker {
    child: Child,
    requests: ChildStdin,
    replies: Lines<BufReader<ChildStdout>>,
    /// `torch.__version__`.
    pub version: String,
}

impl TorchWorker {
    /// The worker on `device`'s kind (CPU with 2 threads, or cuda:0), with
    /// `extra` arguments for the script (the gpt2_124m sizes), or `None`
    /// when `python3 -c "import torch"` fails.
    ///
    /// # Errors
    /// The script cannot start or its first line is not its greeting.
    pub fn start(device: &Device, extra: &[String]) -> Result<Option<Self>> {
        let ok = Command::new("python3")
            .args(["-c", "import torch"])
            .output()
            .is_ok_and(|o| o.status.success());
        if !ok {
            return Ok(None);
        }
        let script = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../scripts/bench_train_torch.py"
        );
        let kind = if device.is_cpu() { "cpu" } else { "cuda" };
        let mut child = Command::new("python3")
            .args([script, "--serve", "--threads", "2", "--device", kind])
            .args(extra)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()?;
        let requests = child.stdin.take().expect("piped stdin");
        let stdout = child.stdout.take().expect("piped stdout");
        let mut worker = Self {
            child,
            requests,
            replies: BufReader::new(stdout).lines(),
            version: String::new(),
        };
        let hello = worker.reply()?;
        worker.version = hello["torch_version"].as_str().unwrap_or("?").to_string();
        Ok(Some(worker))
    }

    fn reply(&mut self) -> Result<Value> {
        let line = self
            .replies
            .next()
            .ok_or_else(|| anyhow!("{TORCH_SCRIPT} exited early"))??;
        Ok(serde_json::from_str(&line)?)
    }

    /// Runs one timed round of the request `line` (`gpt`, `gpt bf16`,
    /// `gpt2_124m bf16 compile`, ...) and returns the worker's reply, which
    /// holds `steps_per_s` (and `peak_mem_mib` on CUDA).
    ///
    /// # Errors
    /// The worker exited, or it answered with an error or without
    /// `steps_per_s`.
    pub fn round(&mut self, line: &str) -> Result<Value> {
        writeln!(self.requests, "{line}")?;
        self.requests.flush()?;
        let reply = self.reply()?;
        if reply["steps_per_s"].as_f64().is_none() {
            bail!("{TORCH_SCRIPT}: unexpected reply {reply} to {line:?}")
        }
        Ok(reply)
    }

    /// [`Self::round`]'s steps per second.
    ///
    /// # Errors
    /// As [`Self::round`].
    pub fn steps_per_s(&mut self, line: &str) -> Result<f64> {
        Ok(self.round(line)?["steps_per_s"].as_f64().unwrap_or(0.0))
    }
}

impl Drop for TorchWorker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
