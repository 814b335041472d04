//! Experiment trackers: JSONL and TensorBoard event files, and MLflow runs.
//!
//! The counterpart of Accelerate's `Accelerator(log_with=...)`,
//! `init_trackers`, `log` and `end_training`:
//!
//! ```no_run
//! use accel_core::trackers::{LogValue, Trackers};
//! # fn main() -> accel_core::Result<()> {
//! let mut trackers = Trackers::from_names(&["all"], "my_run", "runs")?;
//! trackers.store_init_configuration(&serde_json::json!({ "lr": 1e-3, "batch_size": 32 }))?;
//! for step in 0..10u64 {
//!     let loss = 1.0 / (step as f64 + 1.0);
//!     trackers.log([("loss", LogValue::from(loss)), ("epoch", LogValue::from(0usize))], Some(step))?;
//! }
//! trackers.finish()?;
//! # Ok(())
//! # }
//! ```
//!
//! The file trackers write under `{logging_dir}/{project_name}/` and flush
//! after each call, so a crash loses nothing already logged. The MLflow
//! tracker sends each call to a tracking server and keeps what it could not
//! send for the next call (`mlflow/mod.rs`).

mod event;
mod jsonl;
mod kind;
mod mlflow;
mod tensorboard;
mod tfrecord;

pub use jsonl::JsonlTracker;
pub use kind::TrackerKind;
pub use mlflow::{MlflowAuth, MlflowConfig, MlflowTracker, Unsent};
pub use tensorboard::TensorBoardTracker;

use std::collections::BTreeMap;
use std::path::{Component, Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use crate::{Error, Result};

/// One logged value.
///
/// Integers stay exact where the format allows it (JSONL); TensorBoard
/// scalars are 32-bit floats, so there every number is rounded to `f32`.
#[derive(Debug, Clone, PartialEq)]
pub enum LogValue {
    /// A floating-point metric such as a loss or a learning rate.
    Float(f64),
    /// An integer such as an epoch or a token count.
    Int(i64),
    /// Free text, such as a sample generation.
    Text(String),
}

impl LogValue {
    /// The value as JSON. JSON has no NaN or infinities, so those become the
    /// strings `"NaN"`, `"Infinity"` and `"-Infinity"` (which Python's
    /// `float()` parses) rather than `null`, which would hide a diverged loss.
    pub fn to_json(&self) -> serde_json::Value {
        match self {
            LogValue::Float(f) if f.is_nan() => "NaN".into(),
            LogValue::Float(f) if f.is_infinite() => {
                if *f > 0.0 {
                    "Infinity".into()
                } else {
                    "-Infinity".into()
                }
            }
            LogValue::Float(f) => (*f).into(),
            LogValue::Int(i) => (*i).into(),
            LogValue::Text(s) => s.as_str().into(),
        }
    }
}

impl From<f64> for LogValue {
    fn from(v: f64) -> Self {
        LogValue::Float(v)
    }
}

impl From<f32> for LogValue {
    fn from(v: f32) -> Self {
        LogValue::Float(v as f64)
    }
}

impl From<i64> for LogValue {
    fn from(v: i64) -> Self {
        LogValue::Int(v)
    }
}

impl From<i32> for LogValue {
    fn from(v: i32) -> Self {
        LogValue::Int(v as i64)
    }
}

impl From<u32> for LogValue {
    fn from(v: u32) -> Self {
        LogValue::Int(v as i64)
    }
}

impl From<usize> for LogValue {
    /// Counts above `i64::MAX` (not reachable in practice) saturate.
    fn from(v: usize) -> Self {
        LogValue::Int(i64::try_from(v).unwrap_or(i64::MAX))
    }
}

impl From<u64> for LogValue {
    /// Counts above `i64::MAX` (not reachable in practice) saturate.
    fn from(v: u64) -> Self {
        LogValue::Int(i64::try_from(v).unwrap_or(i64::MAX))
    }
}

impl From<&str> for LogValue {
    fn from(v: &str) -> Self {
        LogValue::Text(v.to_owned())
    }
}

impl From<String> for LogValue {
    fn from(v: String) -> Self {
        LogValue::Text(v)
    }
}

impl From<&LogValue> for LogValue {
    /// Lets [`Trackers::log`] take `&BTreeMap<String, LogValue>` directly.
    fn from(v: &LogValue) -> Self {
        v.clone()
    }
}

/// A destination for metrics, like Accelerate's `GeneralTracker`.
///
/// `Send` so the collection can live inside an `Accelerator` moved across threads.
pub trait Tracker: Send {
    /// The tracker's name, as accepted by [`Trackers::from_names`].
    fn name(&self) -> &str;

    /// Records the run's hyperparameters (Accelerate's `init_trackers(config=...)`).
    fn store_init_configuration(&mut self, config: &serde_json::Value) -> Result<()>;

    /// Records one set of values at `step`.
    ///
    /// A map rather than a slice: keys are unique by construction and their
    /// order is deterministic. When `step` is `None` the tracker uses one past
    /// the last step it logged (0 at first), so successive unstepped calls
    /// still plot as a line instead of piling onto step 0.
    fn log(&mut self, values: &BTreeMap<String, LogValue>, step: Option<u64>) -> Result<()>;

    /// Flushes and closes the tracker (Accelerate's `end_training`).
    /// Calling it again does nothing; logging after it is an [`Error::Usage`].
    fn finish(&mut self) -> Result<()>;
}

/// Several trackers driven as one, like the `Accelerator`'s tracker list.
///
/// Every call reaches every tracker even if an earlier one fails (a full disk
/// under one folder should not silence the others); the first error is returned.
#[derive(Default)]
pub struct Trackers {
    trackers: Vec<Box<dyn Tracker>>,
}

impl std::fmt::Debug for Trackers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Trackers")
            .field("names", &self.names())
            .finish()
    }
}

impl Trackers {
    /// Wraps already-built trackers, including user-defined ones.
    pub fn new(trackers: Vec<Box<dyn Tracker>>) -> Self {
        Self { trackers }
    }

    /// Creates trackers by name (`"jsonl"`, `"tensorboard"`, `"mlflow"`, or
    /// `"all"` for every available kind, see [`TrackerKind::resolve`]); the
    /// file trackers write under `{logging_dir}/{project_name}/`, MLflow uses
    /// `project_name` as the default experiment. Repeated names create one
    /// tracker. An unknown name is an [`Error::Config`]; an unreachable
    /// MLflow server an [`Error::TrackerServer`] naming its URI.
    pub fn from_names(
        names: &[&str],
        project_name: &str,
        logging_dir: impl AsRef<Path>,
    ) -> Result<Self> {
        // Resolve every name before creating any file, so a typo leaves no
        // half-made run folder behind (and servers are tried first).
        let kinds = TrackerKind::resolve(names, |k| std::env::var(k).ok())?;
        validate_project_name(project_name)?;
        let trackers = kinds
            .into_iter()
            .map(|kind| kind.create(project_name, logging_dir.as_ref()))
            .collect::<Result<Vec<_>>>()?;
        Ok(Self::new(trackers))
    }

    /// Adds a tracker.
    pub fn push(&mut self, tracker: Box<dyn Tracker>) {
        self.trackers.push(tracker);
    }

    /// Whether there are no trackers (logging is then a no-op).
    pub fn is_empty(&self) -> bool {
        self.trackers.is_empty()
    }

    /// How many trackers there are.
    pub fn len(&self) -> usize {
        self.trackers.len()
    }

    /// The trackers' names, in order.
    pub fn names(&self) -> Vec<&str> {
        self.trackers.iter().map(|t| t.name()).collect()
    }

    /// The first tracker with this name (Accelerate's `get_tracker`).
    pub fn get_mut(&mut self, name: &str) -> Option<&mut (dyn Tracker + 'static)> {
        self.trackers
            .iter_mut()
            .find(|t| t.name() == name)
            .map(|t| t.as_mut())
    }

    /// Records the run's hyperparameters in every tracker.
    pub fn store_init_configuration(&mut self, config: &serde_json::Value) -> Result<()> {
        self.each(|t| t.store_init_configuration(config))
    }

    /// Logs values in every tracker. Takes any `(key, value)` pairs, e.g.
    /// `[("loss", LogValue::from(0.5))]` or a `&BTreeMap<String, LogValue>`;
    /// a repeated key keeps its last value.
    pub fn log<K, V>(
        &mut self,
        values: impl IntoIterator<Item = (K, V)>,
        step: Option<u64>,
    ) -> Result<()>
    where
        K: Into<String>,
        V: Into<LogValue>,
    {
        let values: BTreeMap<String, LogValue> = values
            .into_iter()
            .map(|(k, v)| (k.into(), v.into()))
            .collect();
        self.each(|t| t.log(&values, step))
    }

    /// Flushes and closes every tracker (Accelerate's `end_training`).
    pub fn finish(&mut self) -> Result<()> {
        self.each(|t| t.finish())
    }

    fn each(&mut self, mut f: impl FnMut(&mut dyn Tracker) -> Result<()>) -> Result<()> {
        let mut first_err = None;
        for tracker in &mut self.trackers {
            if let Err(e) = f(tracker.as_mut()) {
                tracing::error!(tracker = tracker.name(), error = %e, "tracker failed");
                first_err.get_or_insert(e);
            }
        }
        first_err.map_or(Ok(()), Err)
    }
}

/// Rejects project names that would write outside `logging_dir`.
fn validate_project_name(project_name: &str) -> Result<()> {
    let path = Path::new(project_name);
    let escapes = path
        .components()
        .any(|c| !matches!(c, Component::Normal(_) | Component::CurDir));
    if project_name.trim().is_empty() || escapes {
        return Err(Error::Config {
            key: "project_name".into(),
            reason: format!("`{project_name}` must be a non-empty relative path without `..`"),
        });
    }
    Ok(())
}

/// Validates the project name and creates `{logging_dir}/{project_name}/`.
fn run_dir(project_name: &str, logging_dir: &Path) -> Result<PathBuf> {
    validate_project_name(project_name)?;
    let dir = logging_dir.join(project_name);
    std::fs::create_dir_all(&dir).map_err(|e| Error::io("creating", &dir, e))?;
    Ok(dir)
}

/// Seconds since the Unix epoch, the `wall_time` both formats use.
fn unix_time() -> f64 {
    // A clock before 1970 is a misconfigured machine; 0 keeps logging alive.
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// Resolves `step: None` to one past the last step logged.
#[derive(Debug, Default)]
struct StepCounter {
    next: u64,
}

impl StepCounter {
    fn resolve(&mut self, step: Option<u64>) -> u64 {
        let step = step.unwrap_or(self.next);
        self.next = step.saturating_add(1);
        step
    }
}

/// Writes `config` as pretty JSON to `path`, through a temporary file and a
/// rename so a crash never leaves a half-written `config.json`.
fn write_config_json(path: &Path, config: &serde_json::Value) -> Result<()> {
    let text = serde_json::to_string_pretty(config).map_err(|e| Error::Json {
        path: path.to_owned(),
        reason: e.to_string(),
    })?;
    let tmp = path.with_extension("json.tmp");
    std::fs::write(&tmp, text + "\n").map_err(|e| Error::io("writing", &tmp, e))?;
    std::fs::rename(&tmp, path).map_err(|e| Error::io("renaming", &tmp, e))
}

/// The error for logging into a finished tracker.
fn finished_error(name: &str) -> Error {
    Error::Usage(format!(
        "tracker `{name}` was finished; create a new one to log again"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_values_convert_from_common_types() {
        assert_eq!(LogValue::from(0.5f32), LogValue::Float(0.5));
        assert_eq!(LogValue::from(0.25f64), LogValue::Float(0.25));
        assert_eq!(LogValue::from(-3i64), LogValue::Int(-3));
        assert_eq!(LogValue::from(7usize), LogValue::Int(7));
        assert_eq!(LogValue::from(u64::MAX), LogValue::Int(i64::MAX));
        assert_eq!(LogValue::from("hi"), LogValue::Text("hi".into()));
        assert_eq!(
            LogValue::from(String::from("x")),
            LogValue::Text("x".into())
        );
    }

    #[test]
    fn non_finite_floats_become_strings_in_json() {
        assert_eq!(LogValue::Float(f64::NAN).to_json(), "NaN");
        assert_eq!(LogValue::Float(f64::INFINITY).to_json(), "Infinity");
        assert_eq!(LogValue::Float(f64::NEG_INFINITY).to_json(), "-Infinity");
        assert_eq!(LogValue::Float(0.1).to_json(), serde_json::json!(0.1));
    }

    #[test]
    fn an_unknown_tracker_name_is_a_config_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let err = Trackers::from_names(&["jsonl", "wandb"], "run", dir.path()).unwrap_err();
        match &err {
            Error::Config { key, reason } => {
                assert_eq!(key, "log_with");
                assert!(reason.contains("`wandb`"), "{reason}");
            }
            other => panic!("expected Config, got {other}"),
        }
        // Nothing was created for the valid name either.
        assert!(!dir.path().join("run").exists());
    }

    #[test]
    fn all_creates_every_tracker_once() {
        let dir = tempfile::tempdir().unwrap();
        let trackers = Trackers::from_names(&["all", "jsonl"], "run", dir.path()).unwrap();
        assert_eq!(trackers.names(), ["jsonl", "tensorboard"]);
        assert!(!trackers.is_empty());
        assert!(Trackers::default().is_empty());
    }

    #[test]
    fn a_project_name_escaping_the_logging_dir_is_rejected() {
        let dir = tempfile::tempdir().unwrap();
        for bad in ["", "../x", "/abs", "a/../../b"] {
            let err = Trackers::from_names(&["jsonl"], bad, dir.path()).unwrap_err();
            assert!(matches!(err, Error::Config { ref key, .. } if key == "project_name"));
        }
    }

    #[test]
    fn unstepped_logs_continue_from_the_last_step() {
        let mut c = StepCounter::default();
        assert_eq!(c.resolve(None), 0);
        assert_eq!(c.resolve(None), 1);
        assert_eq!(c.resolve(Some(10)), 10);
        assert_eq!(c.resolve(None), 11);
    }

    #[test]
    fn the_collection_fans_out_to_every_tracker() {
        let dir = tempfile::tempdir().unwrap();
        let mut trackers = Trackers::from_names(&["all"], "run", dir.path()).unwrap();
        trackers
            .store_init_configuration(&serde_json::json!({"lr": 0.001}))
            .unwrap();
        let mut map = BTreeMap::new();
        map.insert("loss".to_string(), LogValue::Float(0.5));
        trackers.log(&map, Some(1)).unwrap();
        trackers.log([("loss", 0.25)], None).unwrap();
        trackers.finish().unwrap();
        trackers.finish().unwrap(); // idempotent

        let run = dir.path().join("run");
        let lines = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
        assert_eq!(lines.lines().count(), 2);
        assert!(run.join("config.json").exists());
        let events = std::fs::read_dir(&run)
            .unwrap()
            .filter(|e| {
                let name = e.as_ref().unwrap().file_name();
                name.to_string_lossy().starts_with("events.out.tfevents.")
            })
            .count();
        assert_eq!(events, 1);

        let err = trackers.log([("loss", 0.1)], None).unwrap_err();
        assert!(matches!(err, Error::Usage(_)));
    }
}
