//! Shared helpers for the integration tests: a tiny GPT training job that the
//! worker binary and the in-process tests run identically.
//!
//! [`TinyJob`] is that job (a 2-layer GPT of width 32 on the embedded corpus,
//! prepared by an [`Accelerator`] however it is configured: plain, DDP,
//! FSDP, mixed precision); [`cosine`] its usual schedule; [`result_weights`]
//! reads back what the `train_worker` binary wrote. The tests in `tests/`
//! run it in one process and across real processes and compare the two.
//!
//! ```
//! use accel_core::{Accelerator, AcceleratorConfig};
//! use accel_tests::{cosine, TinyJob};
//!
//! let mut acc = Accelerator::new(AcceleratorConfig::default().with_seed(1))?;
//! let mut job = TinyJob::new(&mut acc, 2_000, 8, cosine())?;
//! let losses = job.train(&mut acc, 0, 3)?; // three optimizer steps
//! assert!(losses.iter().all(|l| l.is_finite()));
//! # Ok::<(), accel_core::Error>(())
//! ```

/// A real etcd for the rendezvous tests.
pub mod etcd;
/// Network-namespace hosts for the multi-machine tests.
pub mod hosts;

use accel_core::data::{DataLoader, TensorDataset};
use accel_core::optim::{AdamW, AdamWConfig, PreparedOptimizer};
use accel_core::scheduler::{LrScheduler, PreparedScheduler, Schedule};
use accel_core::{Accelerator, PreparedModel};
use accel_examples::text::{windows, CharTokenizer, CORPUS};
use accel_examples::{Gpt, GptConfig};
use candle_core::Tensor;

/// A small GPT with its prepared parameters, optimizer, scheduler and loader.
pub struct TinyJob {
    /// The model (under FSDP its blocks run on the sharded parameters).
    pub model: Gpt,
    /// Its prepared parameters.
    pub params: PreparedModel,
    /// AdamW over them.
    pub opt: PreparedOptimizer,
    /// A warm-up + cosine schedule.
    pub sched: PreparedScheduler,
    /// Shuffled windows of the corpus.
    pub loader: DataLoader<TensorDataset>,
}

/// Optimizer steps the tiny job's schedule spans.
pub const TOTAL_STEPS: u64 = 40;

/// The tiny job's usual schedule: 3 warm-up steps, then a cosine over [`TOTAL_STEPS`].
pub fn cosine() -> Schedule {
    Schedule::Cosine {
        warmup: 3,
        total: TOTAL_STEPS,
    }
}

impl TinyJob {
    /// Builds the job on `acc`; the first `corpus_chars` characters of the
    /// corpus are used so an epoch is a handful of batches of `batch_size`
    /// windows (per process), and `schedule` drives the learning rate (see
    /// [`cosine`] for the usual one).
    pub fn new(
        acc: &mut Accelerator,
        corpus_chars: usize,
        batch_size: usize,
        schedule: Schedule,
    ) -> accel_core::Result<Self> {
        let tok = CharTokenizer::new(CORPUS);
        let cfg = GptConfig {
            vocab_size: tok.vocab_size(),
            n_embd: 32,
            n_layer: 2,
            n_head: 2,
            block_size: 16,
        };
        let text: String = CORPUS.chars().take(corpus_chars).collect();
        let ids = tok
            .encode(&text)
            .map_err(|e| accel_core::Error::Usage(e.to_string()))?;
        let (x, y, n) = windows(&ids, cfg.block_size, 8);
        let x = Tensor::from_vec(x, (n, cfg.block_size), acc.device())?;
        let y = Tensor::from_vec(y, (n, cfg.block_size), acc.device())?;
        let loader = DataLoader::new(
            TensorDataset::new(vec![x, y])?,
            accel_core::data::DataLoaderConfig::new(batch_size).with_shuffle(true),
        );
        let (model, params) = acc.prepare(|vb| Gpt::new(cfg, vb))?;
        let opt = acc.prepare_optimizer(
            &params,
            AdamW::new(AdamWConfig {
                lr: 1e-2,
                ..Default::default()
            }),
        );
        let sched = acc.prepare_scheduler(LrScheduler::new(schedule, 1e-2), &opt);
        let loader = acc.prepare_data_loader(loader);
        Ok(Self {
            model,
            params,
            opt,
            sched,
            loader,
        })
    }

    /// Runs micro-batches until `until` optimizer steps have been taken in
    /// total (`done` counts those already taken); returns each micro-batch's loss.
    pub fn train(
        &mut self,
        acc: &mut Accelerator,
        mut done: u64,
        until: u64,
    ) -> accel_core::Result<Vec<f32>> {
        let mut losses = vec![];
        while done < until {
            for batch in self.loader.iter() {
                let batch = batch?;
                let (model, params, opt, sched) =
                    (&self.model, &self.params, &mut self.opt, &mut self.sched);
                let loss = acc.accumulate(|acc| {
                    let loss = model.loss(&batch[0], &batch[1])?;
                    acc.backward(&loss)?;
                    if acc.sync_gradients() {
                        acc.clip_grad_norm(params, 1.0)?;
                    }
                    opt.step()?;
                    sched.step();
                    opt.zero_grad();
                    Ok(loss.to_dtype(candle_core::DType::F32)?.to_scalar::<f32>()?)
                })?;
                losses.push(loss);
                if acc.sync_gradients() {
                    done += 1;
                    if done >= until {
                        break;
                    }
                }
            }
        }
        Ok(losses)
    }
}

/// The final weights `train_worker` wrote to `path` (`--out`), by name, as f32.
pub fn result_weights(path: &std::path::Path) -> Vec<(String, Vec<f32>)> {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let v: serde_json::Value = serde_json::from_str(&text).expect("worker result is JSON");
    v["weights"]
        .as_object()
        .expect("a weights object")
        .iter()
        .map(|(k, bits)| {
            let w = bits
                .as_array()
                .expect("an array of f32 bit patterns")
                .iter()
                .map(|b| f32::from_bits(b.as_u64().unwrap_or(0) as u32))
                .collect();
            (k.clone(), w)
        })
        .collect()
}

/// Eight sequences of seven token ids within the test Llama's vocabulary of
/// 128, written as a `--data-ids` file into `dir`.
pub fn llama_ids_file(dir: &std::path::Path) -> std::path::PathBuf {
    let rows: Vec<Vec<u32>> = (0..8u32)
        .map(|r| (0..7).map(|k| (r * 37 + k * 11 + 1) % 128).collect())
        .collect();
    let path = dir.join("ids.json");
    std::fs::write(&path, serde_json::to_string(&rows).unwrap()).unwrap();
    path
}

/// `finetune_hf`'s flags for `steps` steps on the test Llama over the ids in
/// `ids` (learning rate 1e-2, JSON lines out).
pub fn finetune_hf_args(ids: &std::path::Path, steps: usize) -> Vec<String> {
    let model = hf_fixture("llama").display().to_string();
    let (ids, steps) = (ids.display().to_string(), steps.to_string());
    [
        "--model",
        &model,
        "--data-ids",
        &ids,
        "--steps",
        &steps,
        "--lr",
        "1e-2",
        "--json",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

/// The transformers-written checkpoint fixture `name` (`tests/fixtures/hf/NAME`).
pub fn hf_fixture(name: &str) -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures/hf")
        .join(name)
}

/// The fixture's `reference.json`: transformers' outputs for fixed inputs.
pub fn hf_reference(name: &str) -> serde_json::Value {
    let path = hf_fixture(name).join("reference.json");
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Runs `cmd` to completion within 120 s with `ACCELERATE_MIXED_PRECISION`
/// set to `precision` (a launcher's), else unset; returns (success, stdout, stderr).
pub fn run_program(
    mut cmd: std::process::Command,
    precision: Option<&str>,
) -> (bool, String, String) {
    // A precision left in the test's environment must not leak into the runs.
    cmd.env_remove("ACCELERATE_MIXED_PRECISION");
    if let Some(p) = precision {
        cmd.env("ACCELERATE_MIXED_PRECISION", p);
    }
    cmd.stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let mut child = cmd.spawn().unwrap();
    let (mut out, mut err) = (child.stdout.take().unwrap(), child.stderr.take().unwrap());
    let out = std::thread::spawn(move || {
        let mut s = String::new();
        std::io::Read::read_to_string(&mut out, &mut s).unwrap();
        s
    });
    let err = std::thread::spawn(move || {
        let mut s = String::new();
        std::io::Read::read_to_string(&mut err, &mut s).unwrap();
        s
    });
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if std::time::Instant::now() > deadline {
            child.kill().unwrap();
            panic!("{cmd:?} ran past 120 s");
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    (status.success(), out.join().unwrap(), err.join().unwrap())
}

/// The setup object and the per-step losses of one run's output (rank 0's
/// lines under the launcher, whose prefix is dropped).
pub fn parse_run(stdout: &str) -> (serde_json::Value, Vec<f64>) {
    let lines: Vec<serde_json::Value> = stdout
        .lines()
        .map(|l| l.strip_prefix("[rank0]: ").unwrap_or(l))
        .filter(|l| l.starts_with('{'))
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l}: {e}")))
        .collect();
    assert!(!lines.is_empty(), "no JSON lines in {stdout}");
    let setup = lines[0]["setup"].clone();
    assert!(
        setup.is_object(),
        "first line is not the setup: {}",
        lines[0]
    );
    let losses = lines[1..]
        .iter()
        .enumerate()
        .map(|(i, l)| {
            assert_eq!(l["step"].as_u64(), Some(i as u64 + 1), "{l}");
            l["loss"].as_f64().unwrap()
        })
        .collect();
    (setup, losses)
}

/// A loopback port free at the time of asking (the kernel picks it).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Waits up to `within` until automatic checkpoint `n` of the run in `out`
/// exists (`out/checkpoints/checkpoint_{n}`), panicking past it.
pub fn wait_for_checkpoint(out: &std::path::Path, n: u64, within: std::time::Duration) {
    let deadline = std::time::Instant::now() + within;
    let dir = out.join("checkpoints").join(format!("checkpoint_{n}"));
    while !dir.is_dir() {
        assert!(std::time::Instant::now() < deadline, "no {}", dir.display());
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}

/// The bytes of the final model a run in `out` saved
/// (`out/model/model.safetensors`).
pub fn saved_model(out: &std::path::Path) -> Vec<u8> {
    let path = out.join("model").join("model.safetensors");
    std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}
