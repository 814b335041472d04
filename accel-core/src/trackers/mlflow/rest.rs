//! The few calls of MLflow's REST API 2.0 the tracker makes, with a timeout
//! on each, and their failures sorted into "try again later" and "refused".

use serde_json::{json, Value};

use super::config::MlflowConfig;
use super::outbox::Batch;

/// Why a request failed, sorted by what the tracker does next.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum RestError {
    /// No answer (connection refused, timeout, reset) or a server-side
    /// failure (5xx, 429): the same request may succeed later.
    Unreachable(String),
    /// The server answered and said no (4xx): sending it again will not help.
    Refused {
        /// The HTTP status.
        status: u16,
        /// MLflow's `error_code`, e.g. `RESOURCE_DOES_NOT_EXIST`.
        code: String,
        /// MLflow's `message`.
        message: String,
    },
}

impl std::fmt::Display for RestError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RestError::Unreachable(why) => f.write_str(why),
            RestError::Refused {
                status,
                code,
                message,
            } => write!(f, "HTTP {status} {code}: {message}"),
        }
    }
}

/// A blocking client for one tracking server.
pub(super) struct RestClient {
    agent: ureq::Agent,
    base: String,
    auth: Option<String>,
}

impl RestClient {
    pub(super) fn new(config: &MlflowConfig) -> Self {
        let agent = ureq::AgentBuilder::new()
            .timeout_connect(config.connect_timeout)
            .timeout(config.connect_timeout + config.request_timeout)
            .user_agent(concat!("accel-rs/", env!("CARGO_PKG_VERSION")))
            .build();
        Self {
            agent,
            base: format!("{}/api/2.0/mlflow", config.tracking_uri),
            auth: config.auth.header(),
        }
    }

    fn get(&self, endpoint: &str, query: &[(&str, &str)]) -> Result<Value, RestError> {
        let mut req = self.agent.get(&format!("{}/{endpoint}", self.base));
        for (k, v) in query {
            req = req.query(k, v);
        }
        if let Some(auth) = &self.auth {
            req = req.set("Authorization", auth);
        }
        answer(req.call())
    }

    fn post(&self, endpoint: &str, body: Value) -> Result<Value, RestError> {
        // The server insists on this content type (400 without it).
        let mut req = self.agent.post(&format!("{}/{endpoint}", self.base));
        if let Some(auth) = &self.auth {
            req = req.set("Authorization", auth);
        }
        answer(req.send_json(body))
    }

    /// The experiment's id, creating it when missing.
    pub(super) fn experiment_id(&self, name: &str) -> Result<String, RestError> {
        match self.get("experiments/get-by-name", &[("experiment_name", name)]) {
            Ok(v) => return string_at(&v, "/experiment/experiment_id"),
            Err(RestError::Refused { code, .. }) if code == "RESOURCE_DOES_NOT_EXIST" => {}
            Err(e) => return Err(e),
        }
        match self.post("experiments/create", json!({ "name": name })) {
            Ok(v) => string_at(&v, "/experiment_id"),
            // Another process created it between our two calls.
            Err(RestError::Refused { code, .. }) if code == "RESOURCE_ALREADY_EXISTS" => {
                let v = self.get("experiments/get-by-name", &[("experiment_name", name)])?;
                string_at(&v, "/experiment/experiment_id")
            }
            Err(e) => Err(e),
        }
    }

    /// Creates a run and returns its id.
    pub(super) fn create_run(
        &self,
        experiment_id: &str,
        run_name: Option<&str>,
        tags: &[(String, String)],
        start_time_ms: i64,
    ) -> Result<String, RestError> {
        let mut body = json!({
            "experiment_id": experiment_id,
            "start_time": start_time_ms,
            "tags": key_values(tags),
        });
        if let Some(name) = run_name {
            body["run_name"] = name.into();
        }
        let v = self.post("runs/create", body)?;
        string_at(&v, "/run/info/run_id")
    }

    /// The experiment id of an existing run (for `MLFLOW_RUN_ID`).
    pub(super) fn run_experiment(&self, run_id: &str) -> Result<String, RestError> {
        let v = self.get("runs/get", &[("run_id", run_id)])?;
        string_at(&v, "/run/info/experiment_id")
    }

    /// Sends one batch (within MLflow's per-request limits).
    pub(super) fn log_batch(&self, run_id: &str, batch: &Batch) -> Result<(), RestError> {
        let metrics: Vec<Value> = batch
            .metrics
            .iter()
            .map(|m| {
                json!({ "key": m.key, "value": m.value.to_json(), "timestamp": m.timestamp_ms, "step": m.step })
            })
            .collect();
        let body = json!({
            "run_id": run_id,
            "metrics": metrics,
            "params": key_values(&batch.params),
            "tags": key_values(&batch.tags),
        });
        self.post("runs/log-batch", body).map(drop)
    }

    /// Sets the run's status (`RUNNING`, `FINISHED`, `FAILED`) and end time.
    pub(super) fn update_run(
        &self,
        run_id: &str,
        status: &str,
        end_time_ms: Option<i64>,
    ) -> Result<(), RestError> {
        let mut body = json!({ "run_id": run_id, "status": status });
        if let Some(t) = end_time_ms {
            body["end_time"] = t.into();
        }
        self.post("runs/update", body).map(drop)
    }
}

fn key_values(pairs: &[(String, String)]) -> Vec<Value> {
    pairs
        .iter()
        .map(|(k, v)| json!({ "key": k, "value": v }))
        .collect()
}

/// Reads a JSON answer, sorting failures.
fn answer(result: Result<ureq::Response, ureq::Error>) -> Result<Value, RestError> {
    match result {
        Ok(resp) => resp
            .into_json()
            .map_err(|e| RestError::Unreachable(format!("reading the answer: {e}"))),
        Err(ureq::Error::Status(status, resp)) => {
            let text = resp.into_string().unwrap_or_default();
            let body: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
            let code = body["error_code"].as_str().unwrap_or("").to_owned();
            let message = match body["message"].as_str() {
                Some(m) => m.to_owned(),
                None => text.chars().take(300).collect(),
            };
            if status >= 500 || status == 429 {
                Err(RestError::Unreachable(format!(
                    "HTTP {status} {code}: {message}"
                )))
            } else {
                Err(RestError::Refused {
                    status,
                    code,
                    message,
                })
            }
        }
        Err(ureq::Error::Transport(t)) => Err(RestError::Unreachable(t.to_string())),
    }
}

/// A string field of an answer; a missing one means this is not an MLflow
/// server (a proxy page, another service on the port).
fn string_at(v: &Value, pointer: &str) -> Result<String, RestError> {
    v.pointer(pointer)
        .and_then(Value::as_str)
        .map(str::to_owned)
        .ok_or_else(|| RestError::Refused {
            status: 200,
            code: "UNEXPECTED_ANSWER".into(),
            message: format!("no `{pointer}` in {}", truncate_chars(&v.to_string(), 200)),
        })
}

fn truncate_chars(s: &str, n: usize) -> String {
    s.chars().take(n).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_field_is_a_refusal_naming_it() {
        let err = string_at(&json!({"run": {}}), "/run/info/run_id").unwrap_err();
        assert!(matches!(&err, RestError::Refused { code, .. } if code == "UNEXPECTED_ANSWER"));
        assert!(err.to_string().contains("/run/info/run_id"), "{err}");
        assert_eq!(
            string_at(&json!({"experiment_id": "7"}), "/experiment_id").unwrap(),
            "7"
        );
    }

    #[test]
    fn a_closed_port_is_unreachable_not_refused() {
        // Bind then drop a listener: the port is free and nothing answers.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let config = MlflowConfig::new(&format!("http://127.0.0.1:{port}"), "e").unwrap();
        let err = RestClient::new(&config).experiment_id("e").unwrap_err();
        assert!(matches!(err, RestError::Unreachable(_)), "{err:?}");
    }
}
