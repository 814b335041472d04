//! The MLflow tracker against a real `mlflow server` (PyPI's `mlflow`, on
//! loopback with a SQLite store): a Trainer run with `report_to = ["jsonl",
//! "mlflow"]` lands in the right experiment with its params, tags, status and
//! every metric the JSONL file holds, at its step and value; a server killed
//! mid-run costs warnings, never the training, and what was buffered arrives
//! once it is back; an unreachable URI fails at start-up naming it.
//!
//! Skipped, with the reason printed, where `mlflow` cannot be started
//! (`pip install mlflow` provides it).

use std::collections::BTreeMap;
use std::io::Write;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use accel_core::data::TensorDataset;
use accel_core::nn::{AnyBlock, Block, Model};
use accel_core::trackers::{LogValue, MlflowConfig, MlflowTracker, Tracker, Trackers};
use accel_core::trainer::{IntervalStrategy, TrainModel, Trainer, TrainingArguments};
use accel_core::{Error, Result};
use candle_core::{Device, Tensor};
use candle_nn::{Module, VarBuilder};
use serde_json::{json, Value};
use tracing_subscriber::util::SubscriberInitExt;

/// Tests that set `MLFLOW_*` variables hold this, so none reads another's.
static ENV: Mutex<()> = Mutex::new(());

// === the server ===

/// An `mlflow server` in its own process group, killed with its workers on drop.
struct MlflowServer {
    child: Child,
    port: u16,
    dir: PathBuf,
}

impl MlflowServer {
    /// Starts a server storing in `dir` on a free port; `Err` is the reason
    /// to skip.
    fn start(dir: &Path) -> std::result::Result<Self, String> {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map_err(|e| format!("no free port: {e}"))?
            .port();
        Self::start_on(dir, port)
    }

    fn start_on(dir: &Path, port: u16) -> std::result::Result<Self, String> {
        let launcher = mlflow_launcher()?;
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(dir.join("server.log"))
            .map_err(|e| e.to_string())?;
        let mut cmd = Command::new(&launcher[0]);
        cmd.args(&launcher[1..])
            .args(["server", "--host", "127.0.0.1", "--port", &port.to_string()])
            .args(["--workers", "1", "--backend-store-uri"])
            .arg(format!("sqlite:///{}", dir.join("mlflow.db").display()))
            .arg("--default-artifact-root")
            .arg(dir.join("artifacts"))
            .stdin(Stdio::null())
            .stdout(log.try_clone().map_err(|e| e.to_string())?)
            .stderr(log)
            .process_group(0);
        let child = cmd
            .spawn()
            .map_err(|e| format!("cannot spawn {launcher:?}: {e}"))?;
        let mut server = Self {
            child,
            port,
            dir: dir.to_owned(),
        };
        let deadline = Instant::now() + Duration::from_secs(120);
        let health = format!("{}/health", server.uri());
        loop {
            if let Ok(Some(status)) = server.child.try_wait() {
                return Err(format!(
                    "mlflow server exited ({status}): {}",
                    server.log_tail()
                ));
            }
            let up = ureq::get(&health)
                .timeout(Duration::from_secs(2))
                .call()
                .is_ok();
            if up {
                return Ok(server);
            }
            if Instant::now() > deadline {
                return Err(format!("no /health within 120 s: {}", server.log_tail()));
            }
            std::thread::sleep(Duration::from_millis(300));
        }
    }

    fn uri(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(self.dir.join("server.log")).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(15)..].join("\n")
    }

    /// Kills the whole group (the CLI, its uvicorn workers) and reaps the CLI.
    fn kill(&mut self) {
        if self.child.try_wait().is_ok_and(|s| s.is_some()) {
            return; // reaped already: its group id may be someone else's now
        }
        let _ = Command::new("kill")
            .args(["-KILL", "--", &format!("-{}", self.child.id())])
            .stderr(Stdio::null())
            .status();
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// GET on the REST API.
    fn get(&self, endpoint: &str, query: &[(&str, &str)]) -> Value {
        let mut req = ureq::get(&format!("{}/api/2.0/mlflow/{endpoint}", self.uri()));
        for (k, v) in query {
            req = req.query(k, v);
        }
        req.call()
            .unwrap_or_else(|e| panic!("{endpoint}: {e}"))
            .into_json()
            .unwrap()
    }

    /// The only run of an experiment, as `runs/get` returns it.
    fn only_run(&self, experiment: &str) -> Value {
        let exp = self.get(
            "experiments/get-by-name",
            &[("experiment_name", experiment)],
        );
        let id = exp["experiment"]["experiment_id"]
            .as_str()
            .unwrap()
            .to_owned();
        let found: Value = ureq::post(&format!("{}/api/2.0/mlflow/runs/search", self.uri()))
            .send_json(json!({ "experiment_ids": [id] }))
            .unwrap()
            .into_json()
            .unwrap();
        let runs = found["runs"].as_array().expect("runs/search lists runs");
        assert_eq!(runs.len(), 1, "one run in `{experiment}`: {found}");
        let run_id = runs[0]["info"]["run_id"].as_str().unwrap();
        self.get("runs/get", &[("run_id", run_id)])["run"].clone()
    }

    /// `metrics/get-history` as step -> value (NaN arrives as "NaN"); a
    /// key logged twice at one step with one value (the Trainer's `epoch`
    /// in its last log and its summary) is one point.
    fn history(&self, run_id: &str, key: &str) -> BTreeMap<i64, f64> {
        let v = self.get(
            "metrics/get-history",
            &[("run_id", run_id), ("metric_key", key)],
        );
        let mut out = BTreeMap::new();
        for m in v["metrics"].as_array().cloned().unwrap_or_default() {
            let value = match &m["value"] {
                Value::String(s) if s == "NaN" => f64::NAN,
                other => other.as_f64().unwrap(),
            };
            let step = m["step"].as_i64().unwrap_or(0);
            if let Some(before) = out.insert(step, value) {
                assert_eq!(before.to_bits(), value.to_bits(), "{key} at step {step}");
            }
        }
        out
    }
}

impl Drop for MlflowServer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// `mlflow` on PATH, else `python3 -m mlflow`; when neither runs, the
/// PyPI package is installed once (as the project's rule for real
/// components says: the tests start them, and skip only where they cannot).
fn mlflow_launcher() -> std::result::Result<Vec<String>, String> {
    static INSTALL: std::sync::OnceLock<std::result::Result<(), String>> =
        std::sync::OnceLock::new();
    let find = || {
        for launcher in [vec!["mlflow"], vec!["python3", "-m", "mlflow"]] {
            let ok = Command::new(launcher[0])
                .args(&launcher[1..])
                .arg("--version")
                .output()
                .is_ok_and(|o| o.status.success());
            if ok {
                return Some(launcher.into_iter().map(String::from).collect());
            }
        }
        None
    };
    if let Some(l) = find() {
        return Ok(l);
    }
    INSTALL
        .get_or_init(|| {
            eprintln!("mlflow is not installed: pip install mlflow (once, up to 10 minutes)");
            let out = Command::new("timeout")
                .args([
                    "600", "python3", "-m", "pip", "install", "--quiet", "mlflow",
                ])
                .output()
                .map_err(|e| format!("cannot run pip: {e}"))?;
            if out.status.success() {
                Ok(())
            } else {
                Err(format!(
                    "pip install mlflow failed: {}",
                    String::from_utf8_lossy(&out.stderr)
                        .lines()
                        .last()
                        .unwrap_or("")
                ))
            }
        })
        .clone()?;
    find().ok_or_else(|| {
        "mlflow was installed but neither `mlflow` nor `python3 -m mlflow` runs".into()
    })
}

macro_rules! server_or_skip {
    ($dir:expr) => {
        match MlflowServer::start($dir) {
            Ok(server) => server,
            Err(reason) => {
                eprintln!("skipped: {reason}");
                return Ok(());
            }
        }
    };
}

fn params_of(run: &Value) -> BTreeMap<String, String> {
    kv(&run["data"]["params"])
}

fn tags_of(run: &Value) -> BTreeMap<String, String> {
    kv(&run["data"]["tags"])
}

fn kv(list: &Value) -> BTreeMap<String, String> {
    list.as_array()
        .cloned()
        .unwrap_or_default()
        .iter()
        .map(|p| {
            let k = p["key"].as_str().unwrap().to_owned();
            (k, p["value"].as_str().unwrap().to_owned())
        })
        .collect()
}

/// Warnings sent through `tracing` on this thread, as text.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Captured {
    fn install(&self) -> tracing::dispatcher::DefaultGuard {
        let sink = self.clone();
        tracing_subscriber::fmt()
            .with_writer(move || sink.clone())
            .with_ansi(false)
            .finish()
            .set_default()
    }

    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }
}

// === a tiny Trainer job ===

type Dyn = Box<dyn Module + Send + Sync>;

/// y = x · w + b with a squared error, as in accel-core's Trainer tests.
struct Regression(Block<Dyn>);

impl Model for Regression {
    fn blocks(&self) -> Vec<&dyn AnyBlock> {
        vec![&self.0]
    }
}

impl TrainModel for Regression {
    type Batch = Vec<Tensor>;

    fn loss(&self, b: &Vec<Tensor>) -> Result<Tensor> {
        let diff = self.0.forward_hidden(&b[0])?.sub(&b[1])?;
        Ok(diff.sqr()?.mean_all()?)
    }
}

fn build(vb: VarBuilder<'static>) -> Result<Regression> {
    let block = Block::new(&vb, "", "Linear", |vb| {
        Ok(Box::new(candle_nn::linear(3, 1, vb)?) as Dyn)
    })?;
    Ok(Regression(block))
}

fn dataset(n: usize) -> TensorDataset {
    let xs: Vec<f32> = (0..n * 3).map(|i| (i as f32 * 0.37).sin()).collect();
    let ys: Vec<f32> = xs.chunks(3).map(|r| 2.0 * r[0] - r[1] + 0.3).collect();
    let x = Tensor::from_vec(xs, (n, 3), &Device::Cpu).unwrap();
    let y = Tensor::from_vec(ys, (n, 1), &Device::Cpu).unwrap();
    TensorDataset::new(vec![x, y]).unwrap()
}

fn trainer_args(dir: &Path, run_name: &str, steps: i64) -> TrainingArguments {
    let mut a = TrainingArguments::new(dir)
        .with_batch_size(8)
        .with_learning_rate(0.05)
        .with_max_steps(steps)
        .with_logging_steps(1);
    a.use_cpu = true;
    a.disable_tqdm = true;
    a.save_strategy = IntervalStrategy::No;
    a.run_name = run_name.into();
    a.report_to = vec!["jsonl".into(), "mlflow".into()];
    a
}

/// Every `(step, key, value)` number of the JSONL file.
fn jsonl_points(path: &Path) -> Vec<(i64, String, f64)> {
    let text = std::fs::read_to_string(path).unwrap();
    let mut out = Vec::new();
    for line in text.lines() {
        let v: Value = serde_json::from_str(line).unwrap();
        let step = v["step"].as_i64().unwrap();
        for (k, x) in v["values"].as_object().unwrap() {
            out.push((step, k.clone(), x.as_f64().expect("numeric value")));
        }
    }
    out
}

/// Asserts MLflow holds exactly the JSONL file's points, key by key.
fn assert_same_points(server: &MlflowServer, run_id: &str, jsonl: &Path) -> usize {
    let points = jsonl_points(jsonl);
    let mut by_key: BTreeMap<String, BTreeMap<i64, f64>> = BTreeMap::new();
    for (step, key, value) in &points {
        let before = by_key.entry(key.clone()).or_default().insert(*step, *value);
        assert!(before.is_none_or(|b| b == *value), "{key} at step {step}");
    }
    for (key, expected) in &by_key {
        let got = server.history(run_id, key);
        assert_eq!(&got, expected, "metric `{key}` of run {run_id}");
    }
    points.len()
}

/// transformers' `flatten_dict` with `.`, values as Python's `str()`.
fn flatten(prefix: &str, v: &Value, out: &mut BTreeMap<String, String>) {
    if let Value::Object(map) = v {
        for (k, v) in map {
            let key = if prefix.is_empty() {
                k.clone()
            } else {
                format!("{prefix}.{k}")
            };
            flatten(&key, v, out);
        }
    } else {
        out.insert(prefix.to_owned(), python_str(v));
    }
}

fn python_str(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Bool(true) => "True".into(),
        Value::Bool(false) => "False".into(),
        Value::Null => "None".into(),
        other => other.to_string(),
    }
}

// === the tests ===

#[test]
fn a_trainer_run_reaches_mlflow_with_every_metric_at_its_step() -> Result<()> {
    let tmp = tempfile::tempdir().unwrap();
    let server = server_or_skip!(tmp.path());
    let out = tmp.path().join("out");
    let args = trainer_args(&out, "mlflow-trainer", 24);
    let mut expected_params = BTreeMap::new();
    flatten(
        "",
        &serde_json::to_value(&args).unwrap(),
        &mut expected_params,
    );
    assert!(expected_params.contains_key("accelerator_config.even_batches"));
    {
        let _env = ENV.lock().unwrap_or_else(|e| e.into_inner());
        std::env::set_var("MLFLOW_TRACKING_URI", server.uri());
        std::env::set_var("MLFLOW_EXPERIMENT_NAME", "accel-rs trainer");
        std::env::set_var("MLFLOW_TAGS", r#"{"team": "accel", "attempt": 2}"#);
        let result = (|| {
            let mut t = Trainer::new(args, build, dataset(64), None)?;
            let output = t.train()?;
            // `train` ends the run (transformers' `on_train_end`), while the
            // Trainer is still alive.
            let run = server.only_run("accel-rs trainer");
            assert_eq!(run["info"]["status"], "FINISHED", "{run}");
            Ok::<_, Error>(output)
        })();
        for k in [
            "MLFLOW_TRACKING_URI",
            "MLFLOW_EXPERIMENT_NAME",
            "MLFLOW_TAGS",
        ] {
            std::env::remove_var(k);
        }
        assert_eq!(result?.global_step, 24);
    }

    let run = server.only_run("accel-rs trainer");
    let run_id = run["info"]["run_id"].as_str().unwrap();
    assert_eq!(run["info"]["status"], "FINISHED", "{run}");
    assert_eq!(run["info"]["run_name"], "mlflow-trainer");
    assert!(
        run["info"]["end_time"].as_i64().unwrap() >= run["info"]["start_time"].as_i64().unwrap()
    );
    assert_eq!(params_of(&run), expected_params);
    let tags = tags_of(&run);
    assert_eq!(tags["team"], "accel");
    assert_eq!(tags["attempt"], "2");
    assert_eq!(tags["mlflow.runName"], "mlflow-trainer");
    assert_eq!(tags["mlflow.source.type"], "LOCAL");

    let n = assert_same_points(&server, run_id, &out.join("mlflow-trainer/metrics.jsonl"));
    // 24 logging steps of loss, learning_rate and epoch, then the summary.
    assert!(n >= 24 * 3 + 4, "{n} points");
    assert_eq!(server.history(run_id, "loss").len(), 24);
    Ok(())
}

#[test]
fn a_server_killed_mid_run_never_fails_training() -> Result<()> {
    let tmp = tempfile::tempdir().unwrap();
    let mut server = server_or_skip!(tmp.path());
    let port = server.port;
    let warnings = Captured::default();
    let _guard = warnings.install();

    let mut config = MlflowConfig::new(&server.uri(), "outage")?;
    config.run_name = Some("outage-run".into());
    config.buffer_cap = 50;
    let mut tracker = MlflowTracker::new(config)?;
    tracker.store_init_configuration(&json!({ "lr": 0.1, "optim": { "betas": [0.9, 0.99] } }))?;
    let log = |t: &mut MlflowTracker, step: u64| {
        let values = BTreeMap::from([
            (
                "loss".to_string(),
                LogValue::Float(1.0 / (step as f64 + 1.0)),
            ),
            ("tokens".to_string(), LogValue::Int(step as i64 * 64)),
            ("sample".to_string(), LogValue::Text("a generation".into())),
        ]);
        t.log(&values, Some(step))
    };
    for step in 0..5 {
        log(&mut tracker, step)?;
    }
    assert_eq!(tracker.unsent().pending, 0);

    server.kill();
    for step in 5..40 {
        log(&mut tracker, step)?; // never an error
    }
    let unsent = tracker.unsent();
    // 35 steps of two numbers: the newest 50 wait, 20 are dropped.
    assert_eq!((unsent.pending, unsent.dropped), (50, 20), "{unsent:?}");
    assert!(unsent.failed_attempts >= 1, "{unsent:?}");
    let text = warnings.text();
    assert_eq!(text.matches("cannot reach").count(), 1, "one line: {text}");
    assert!(text.contains(&format!("127.0.0.1:{port}")), "{text}");
    assert!(text.contains("`sample` is text"), "{text}");

    // Back on the same port and store: finish sends the buffer, keeping the
    // newest 50 points and counting the 20 dropped.
    let server = MlflowServer::start_on(tmp.path(), port).expect("restart");
    tracker.finish()?;
    assert_eq!(tracker.unsent().pending, 0);
    let run = server.only_run("outage");
    assert_eq!(run["info"]["status"], "FINISHED");
    assert_eq!(params_of(&run)["optim.betas"], "[0.9,0.99]");
    assert_eq!(tags_of(&run)["accel_rs.dropped_points"], "20");
    let loss = server.history(tracker.run_id(), "loss");
    let tokens = server.history(tracker.run_id(), "tokens");
    let kept: Vec<i64> = (0..5).chain(15..40).collect();
    assert_eq!(loss.keys().copied().collect::<Vec<_>>(), kept);
    assert_eq!(tokens.keys().copied().collect::<Vec<_>>(), kept);
    assert_eq!(loss[&39], 1.0 / 40.0);
    assert_eq!(tokens[&39], 39.0 * 64.0);
    assert!(
        warnings.text().contains("answers again"),
        "{}",
        warnings.text()
    );
    assert!(server.history(tracker.run_id(), "sample").is_empty());

    // Dropped without finish and without a panic: the run ends FINISHED,
    // with what was logged.
    let mut dropped = MlflowTracker::new(MlflowConfig::new(&server.uri(), "outage 3")?)?;
    log(&mut dropped, 7)?;
    let dropped_id = dropped.run_id().to_owned();
    drop(dropped);
    assert_eq!(server.only_run("outage 3")["info"]["status"], "FINISHED");
    assert_eq!(server.history(&dropped_id, "loss")[&7], 1.0 / 8.0);

    // Gone for good: finish warns and succeeds, the run stays RUNNING.
    let mut second = MlflowTracker::new(MlflowConfig::new(&server.uri(), "outage 2")?)?;
    log(&mut second, 0)?;
    drop(server);
    log(&mut second, 1)?;
    let started = Instant::now();
    second.finish()?;
    assert!(started.elapsed() < Duration::from_secs(20));
    assert_eq!(second.unsent().pending, 2);
    assert!(
        warnings.text().contains("unreachable at finish"),
        "{}",
        warnings.text()
    );
    Ok(())
}

#[test]
fn an_unreachable_tracking_uri_fails_at_start_up_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let uri = format!("http://127.0.0.1:{port}");
    let err = {
        let _env = ENV.lock().unwrap_or_else(|e| e.into_inner());
        std::env::set_var("MLFLOW_TRACKING_URI", &uri);
        let started = Instant::now();
        let err = Trackers::from_names(&["jsonl", "mlflow"], "run", dir.path()).unwrap_err();
        std::env::remove_var("MLFLOW_TRACKING_URI");
        assert!(started.elapsed() < Duration::from_secs(10));
        err
    };
    let text = err.to_string();
    assert!(matches!(err, Error::TrackerServer { .. }), "{text}");
    assert!(text.contains(&uri), "{text}");
    assert!(text.contains("mlflow server"), "{text}");
    // The server is tried before any file tracker makes its folder.
    assert!(!dir.path().join("run").exists());

    // Unset or a file store: the error says how to start a server.
    let _env = ENV.lock().unwrap_or_else(|e| e.into_inner());
    std::env::set_var("MLFLOW_TRACKING_URI", "file:./mlruns");
    let err = Trackers::from_names(&["all"], "run", dir.path()).unwrap_err();
    std::env::remove_var("MLFLOW_TRACKING_URI");
    let text = err.to_string();
    assert!(
        text.contains("file:./mlruns") && text.contains("mlflow server"),
        "{text}"
    );
}
