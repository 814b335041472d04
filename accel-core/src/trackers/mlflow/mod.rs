//! A tracker logging to an MLflow tracking server through its REST API 2.0,
//! configured by the `MLFLOW_*` variables Accelerate and transformers read.
//!
//! Why REST and not MLflow's local stores: a `file:` or database store is
//! written by the Python client's own code; the REST API is the one stable
//! interface, and `mlflow server` serves every store behind it.
//!
//! Why the tracker never fails a run because the server left: a run of
//! hours should not die because the dashboard restarted. Start-up is the
//! exception: an unreachable server there is a misconfiguration, reported at
//! once with the URI. After that, points that cannot be sent wait in a
//! bounded buffer (the oldest dropped past [`MlflowConfig::buffer_cap`], and
//! counted) and go out with the next call that reaches the server, or at
//! [`Tracker::finish`]. A server that answers "no" (4xx) is different: that
//! is an error, naming the run and the keys, since retrying cannot help.

mod config;
mod outbox;
mod rest;

pub use config::{MlflowAuth, MlflowConfig};

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use super::{finished_error, LogValue, StepCounter, Tracker};
use crate::notice::warn;
use crate::{Error, Result};
use outbox::{
    flatten_params, name_problem, truncate, MetricPoint, Outbox, MAX_PARAM_VALUE_CHARS,
    MAX_TAG_VALUE_CHARS,
};
use rest::{RestClient, RestError};

/// What the tracker has not delivered (see [`MlflowTracker::unsent`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Unsent {
    /// Params, tags and metric points waiting for the server.
    pub pending: usize,
    /// Metric points dropped because the buffer was full.
    pub dropped: u64,
    /// Failed attempts since the server last answered (0: it is up).
    pub failed_attempts: u64,
}

/// Logs one MLflow run: params from [`Tracker::store_init_configuration`],
/// numbers from [`Tracker::log`] as metrics at their step, status
/// `FINISHED` at [`Tracker::finish`].
///
/// Text values are not sent: MLflow metrics are numbers, and Accelerate's
/// `MLflowTracker` and transformers' `MLflowCallback` skip them with a
/// warning too; here the warning comes once per key. NaN is sent as
/// protobuf's `"NaN"` and stored as NaN; the server's SQL store clamps
/// ±infinity to ±`f64::MAX`. Integers become doubles (exact below 2^53).
///
/// Dropped without `finish`, the run ends `FAILED` when the thread is
/// panicking and `FINISHED` otherwise, as MLflow's Python client ends an
/// open run at exit: Rust cannot tell a `?` return from a normal end, and
/// the Trainer leaves its trackers open after `train` so `evaluate` can
/// still log.
pub struct MlflowTracker {
    client: RestClient,
    uri: String,
    run_id: String,
    experiment_id: String,
    steps: StepCounter,
    outbox: Outbox,
    cap: usize,
    /// Text keys already warned about.
    skipped_text: BTreeSet<String>,
    finished: bool,
}

impl std::fmt::Debug for MlflowTracker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MlflowTracker")
            .field("uri", &self.uri)
            .field("run_id", &self.run_id)
            .field("experiment_id", &self.experiment_id)
            .field("unsent", &self.unsent())
            .finish()
    }
}

impl MlflowTracker {
    /// Reads the `MLFLOW_*` variables (see [`MlflowConfig::from_env`]) and
    /// starts a run, in the experiment `project_name` unless
    /// `MLFLOW_EXPERIMENT_NAME` names another.
    ///
    /// # Errors
    /// As [`MlflowConfig::from_env`] and [`MlflowTracker::new`].
    pub fn from_env(project_name: &str) -> Result<Self> {
        Self::new(MlflowConfig::from_env(project_name)?)
    }

    /// Finds or creates the experiment and creates the run (or, with
    /// `run_id`, checks the run exists and marks it `RUNNING` again).
    ///
    /// # Errors
    /// [`Error::TrackerServer`] naming the URI when the server cannot be
    /// reached within the connect timeout, or refuses.
    pub fn new(config: MlflowConfig) -> Result<Self> {
        let client = RestClient::new(&config);
        let uri = config.tracking_uri.clone();
        let fail = |what: &str, e: RestError| {
            let reason = match e {
                RestError::Unreachable(why) => format!(
                    "cannot reach the MLflow server ({why}) while {what}; is `mlflow server` \
                     running there? (MLFLOW_TRACKING_URI)"
                ),
                refused => format!("{what}: {refused}"),
            };
            server_error(&uri, config.run_id.as_deref(), reason)
        };
        let (experiment_id, run_id) = match &config.run_id {
            Some(run_id) => {
                let experiment = client
                    .run_experiment(run_id)
                    .map_err(|e| fail(&format!("looking up MLFLOW_RUN_ID `{run_id}`"), e))?;
                client
                    .update_run(run_id, "RUNNING", None)
                    .map_err(|e| fail("resuming the run", e))?;
                (experiment, run_id.clone())
            }
            None => {
                let name = &config.experiment_name;
                let experiment = client
                    .experiment_id(name)
                    .map_err(|e| fail(&format!("finding experiment `{name}`"), e))?;
                let tags = run_tags(&config.tags);
                let run = client
                    .create_run(&experiment, config.run_name.as_deref(), &tags, now_ms())
                    .map_err(|e| fail(&format!("creating a run in experiment `{name}`"), e))?;
                (experiment, run)
            }
        };
        tracing::info!(%uri, run = %run_id, experiment = %experiment_id, "mlflow run started");
        Ok(Self {
            client,
            uri,
            run_id,
            experiment_id,
            steps: StepCounter::default(),
            outbox: Outbox::new(config.buffer_cap),
            cap: config.buffer_cap,
            skipped_text: BTreeSet::new(),
            finished: false,
        })
    }

    /// The run's id on the server.
    pub fn run_id(&self) -> &str {
        &self.run_id
    }

    /// The id of the run's experiment.
    pub fn experiment_id(&self) -> &str {
        &self.experiment_id
    }

    /// The server's URI, without credentials.
    pub fn tracking_uri(&self) -> &str {
        &self.uri
    }

    /// What has not reached the server yet, and what was dropped.
    pub fn unsent(&self) -> Unsent {
        Unsent {
            pending: self.outbox.pending(),
            dropped: self.outbox.dropped,
            failed_attempts: self.outbox.failures,
        }
    }

    fn error(&self, reason: String) -> Error {
        server_error(&self.uri, Some(&self.run_id), reason)
    }

    /// Sends what waits, unless backing off (`force` ignores the back-off).
    /// Only a refusal is an error; an unreachable server is a warning.
    fn flush(&mut self, force: bool) -> Result<()> {
        let now = Instant::now();
        if !force && !self.outbox.may_try(now) {
            return Ok(());
        }
        while let Some(batch) = self.outbox.next_batch() {
            match self.client.log_batch(&self.run_id, &batch) {
                Ok(()) => {
                    self.outbox.remove(&batch);
                    let failures = self.outbox.succeeded();
                    if failures > 0 {
                        warn(&format!(
                            "mlflow: {} answers again (run {}) after {failures} failed \
                             attempts; sending the {} buffered entries",
                            self.uri,
                            self.run_id,
                            self.outbox.pending() + batch.metrics.len()
                        ));
                    }
                }
                Err(RestError::Unreachable(why)) => {
                    if self.outbox.failed(now) {
                        warn(&self.outage_message(&why));
                    }
                    return Ok(());
                }
                Err(refused) => {
                    // Sending it again cannot help; keep the rest flowing.
                    self.outbox.remove(&batch);
                    return Err(self.error(format!(
                        "the server refused {}: {refused}",
                        batch.describe()
                    )));
                }
            }
        }
        Ok(())
    }

    fn outage_message(&self, why: &str) -> String {
        let Unsent {
            pending,
            dropped,
            failed_attempts,
        } = self.unsent();
        if failed_attempts <= 1 {
            format!(
                "mlflow: cannot reach {} (run {}): {why}; training goes on and {pending} \
                 entries wait to be retried (up to {} points, the oldest dropped past that)",
                self.uri, self.run_id, self.cap
            )
        } else {
            format!(
                "mlflow: {} still unreachable (run {}): {failed_attempts} attempts failed, \
                 {pending} entries waiting, {dropped} points dropped",
                self.uri, self.run_id
            )
        }
    }
}

impl Tracker for MlflowTracker {
    fn name(&self) -> &str {
        "mlflow"
    }

    fn store_init_configuration(&mut self, config: &serde_json::Value) -> Result<()> {
        if self.finished {
            return Err(finished_error("mlflow"));
        }
        let mut params = flatten_params(config);
        for (key, value) in &mut params {
            if let Some(problem) = name_problem(key) {
                return Err(self.error(format!("param `{key}` {problem}")));
            }
            if truncate(value, MAX_PARAM_VALUE_CHARS) {
                warn(&format!(
                    "mlflow: param `{key}` is longer than MLflow's {MAX_PARAM_VALUE_CHARS} \
                     characters; its value is cut there"
                ));
            }
        }
        self.outbox.push_params(params);
        self.flush(false)
    }

    fn log(&mut self, values: &BTreeMap<String, LogValue>, step: Option<u64>) -> Result<()> {
        if self.finished {
            return Err(finished_error("mlflow"));
        }
        let step = i64::try_from(self.steps.resolve(step)).unwrap_or(i64::MAX);
        let timestamp_ms = now_ms();
        let mut points = Vec::with_capacity(values.len());
        for (key, value) in values {
            if let LogValue::Text(_) = value {
                if self.skipped_text.insert(key.clone()) {
                    warn(&format!(
                        "mlflow: `{key}` is text, and MLflow metrics are numbers; it is not \
                         sent to MLflow (as Accelerate's MLflowTracker skips it)"
                    ));
                }
                continue;
            }
            if let Some(problem) = name_problem(key) {
                return Err(self.error(format!("metric `{key}` {problem}")));
            }
            points.push(MetricPoint {
                key: key.clone(),
                value: value.clone(),
                timestamp_ms,
                step,
            });
        }
        self.outbox.push_metrics(points);
        self.flush(false)
    }

    fn finish(&mut self) -> Result<()> {
        if self.finished {
            return Ok(());
        }
        self.finished = true;
        let dropped = self.outbox.dropped;
        if dropped > 0 {
            // Visible in the run itself, not only in this process's log.
            self.outbox
                .push_tags([("accel_rs.dropped_points".to_string(), dropped.to_string())]);
        }
        // A refused batch is dropped from the queue, so this ends; what stays
        // queued afterwards is what an unreachable server did not take.
        let mut flushed = Ok(());
        while let Err(e) = self.flush(true) {
            if flushed.is_ok() {
                flushed = Err(e);
            }
        }
        let Unsent { pending, .. } = self.unsent();
        if pending > 0 {
            warn(&format!(
                "mlflow: {} unreachable at finish (run {}): {pending} entries never sent, \
                 {dropped} points dropped before; the run stays RUNNING on the server",
                self.uri, self.run_id
            ));
            return flushed;
        }
        if dropped > 0 {
            warn(&format!(
                "mlflow: run {} lost {dropped} points while {} was unreachable (buffer of {})",
                self.run_id, self.uri, self.cap
            ));
        }
        let ended = match self
            .client
            .update_run(&self.run_id, "FINISHED", Some(now_ms()))
        {
            Ok(()) => Ok(()),
            Err(RestError::Unreachable(why)) => {
                warn(&format!(
                    "mlflow: cannot mark run {} FINISHED at {}: {why}",
                    self.run_id, self.uri
                ));
                Ok(())
            }
            Err(refused) => Err(self.error(format!("marking the run FINISHED: {refused}"))),
        };
        flushed.and(ended)
    }
}

impl Drop for MlflowTracker {
    fn drop(&mut self) {
        if self.finished {
            return;
        }
        self.finished = true;
        let status = if std::thread::panicking() {
            "FAILED"
        } else {
            "FINISHED"
        };
        // One try; a server already known to be gone costs no more timeouts.
        if self.outbox.failures == 0 {
            if let Err(e) = self.flush(true) {
                warn(&e.to_string());
            }
        }
        if self.outbox.failures > 0 {
            warn(&format!(
                "mlflow: run {} ended without finish while {} was unreachable: {} entries \
                 never sent",
                self.run_id,
                self.uri,
                self.outbox.pending()
            ));
        } else if let Err(e) = self.client.update_run(&self.run_id, status, Some(now_ms())) {
            warn(&format!(
                "mlflow: cannot mark run {} {status} at {}: {e}",
                self.run_id, self.uri
            ));
        }
    }
}

fn server_error(uri: &str, run: Option<&str>, reason: String) -> Error {
    Error::TrackerServer {
        tracker: "mlflow",
        uri: uri.to_owned(),
        run: run.map(str::to_owned),
        reason,
    }
}

/// The tags MLflow's Python client sets on a new run, then the user's.
fn run_tags(user: &BTreeMap<String, String>) -> Vec<(String, String)> {
    let mut tags = vec![("mlflow.source.type".to_string(), "LOCAL".to_string())];
    if let Some(program) = std::env::args().next() {
        tags.push(("mlflow.source.name".into(), program));
    }
    if let Ok(user) = std::env::var("USER") {
        tags.push(("mlflow.user".into(), user));
    }
    tags.retain(|(k, _)| !user.contains_key(k));
    tags.extend(user.iter().map(|(k, v)| {
        let mut v = v.clone();
        truncate(&mut v, MAX_TAG_VALUE_CHARS);
        (k.clone(), v)
    }));
    tags
}

/// Milliseconds since the Unix epoch, MLflow's timestamps.
fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unreachable_server_fails_start_up_naming_the_uri() {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let uri = format!("http://127.0.0.1:{port}");
        let err = MlflowTracker::new(MlflowConfig::new(&uri, "exp").unwrap()).unwrap_err();
        let text = err.to_string();
        assert!(matches!(err, Error::TrackerServer { .. }), "{text}");
        assert!(text.contains(&uri), "{text}");
        assert!(text.contains("mlflow server"), "{text}");
        assert!(text.contains("experiment `exp`"), "{text}");
    }

    #[test]
    fn user_tags_override_the_default_ones() {
        let user = BTreeMap::from([("mlflow.source.type".to_string(), "JOB".to_string())]);
        let tags = run_tags(&user);
        let types: Vec<&str> = tags
            .iter()
            .filter(|(k, _)| k == "mlflow.source.type")
            .map(|(_, v)| v.as_str())
            .collect();
        assert_eq!(types, ["JOB"]);
    }
}
