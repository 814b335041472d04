//! The MLflow tracker's settings, read from the same `MLFLOW_*` variables as
//! Accelerate's `MLflowTracker` and transformers' `MLflowCallback`.

use std::collections::BTreeMap;
use std::time::Duration;

use crate::{Error, Result};

/// How the tracker proves who it is to the server.
#[derive(Clone, PartialEq, Eq, Default)]
pub enum MlflowAuth {
    /// No `Authorization` header (a local `mlflow server`).
    #[default]
    None,
    /// `Authorization: Bearer <token>` (`MLFLOW_TRACKING_TOKEN`).
    Bearer(String),
    /// HTTP basic auth (`MLFLOW_TRACKING_USERNAME` and `MLFLOW_TRACKING_PASSWORD`,
    /// or `user:password@` in the URI).
    Basic {
        /// The user name.
        username: String,
        /// The password.
        password: String,
    },
}

// Secrets never reach logs or error messages through `{:?}`.
impl std::fmt::Debug for MlflowAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            MlflowAuth::None => f.write_str("None"),
            MlflowAuth::Bearer(_) => f.write_str("Bearer(***)"),
            MlflowAuth::Basic { username, .. } => write!(f, "Basic({username}:***)"),
        }
    }
}

impl MlflowAuth {
    /// The `Authorization` header value, if any.
    pub(super) fn header(&self) -> Option<String> {
        match self {
            MlflowAuth::None => None,
            MlflowAuth::Bearer(token) => Some(format!("Bearer {token}")),
            MlflowAuth::Basic { username, password } => Some(format!(
                "Basic {}",
                base64(format!("{username}:{password}").as_bytes())
            )),
        }
    }
}

/// Where and how the tracker logs. [`MlflowConfig::new`] for code,
/// [`MlflowConfig::from_env`] for what `log_with = ["mlflow"]` does.
#[derive(Debug, Clone)]
pub struct MlflowConfig {
    /// The server's base URL (`http://host:port`, maybe with a path), with no
    /// trailing slash and no credentials.
    pub tracking_uri: String,
    /// The experiment the run belongs to; created when missing.
    pub experiment_name: String,
    /// The run's name (`MLFLOW_RUN_NAME`); `None` lets the server pick one.
    pub run_name: Option<String>,
    /// An existing run to log into instead of creating one (`MLFLOW_RUN_ID`).
    pub run_id: Option<String>,
    /// Tags set on the run when it is created (`MLFLOW_TAGS`).
    pub tags: BTreeMap<String, String>,
    /// Credentials.
    pub auth: MlflowAuth,
    /// How long to wait for a TCP connection. Short: an unreachable server
    /// must fail start-up quickly, and must not stall training for long.
    pub connect_timeout: Duration,
    /// How long one request may take to send and answer.
    pub request_timeout: Duration,
    /// How many metric points to keep while the server cannot be reached;
    /// past it the oldest are dropped, and counted.
    pub buffer_cap: usize,
}

impl MlflowConfig {
    /// A configuration for the server at `tracking_uri`, logging into
    /// `experiment_name`, with no credentials and the default timeouts
    /// (connect 3 s, request 15 s) and buffer (10 000 points).
    ///
    /// # Errors
    /// [`Error::Config`] when the URI is not an `http(s)://` URL.
    pub fn new(tracking_uri: &str, experiment_name: &str) -> Result<Self> {
        let (tracking_uri, auth) = parse_uri(tracking_uri)?;
        Ok(Self {
            tracking_uri,
            experiment_name: experiment_name.to_owned(),
            run_name: None,
            run_id: None,
            tags: BTreeMap::new(),
            auth: auth.unwrap_or_default(),
            connect_timeout: Duration::from_secs(3),
            request_timeout: Duration::from_secs(15),
            buffer_cap: 10_000,
        })
    }

    /// Reads `MLFLOW_TRACKING_URI` (required), `MLFLOW_EXPERIMENT_NAME`
    /// (default: `project_name`), `MLFLOW_RUN_NAME` (default:
    /// `project_name`, which the Trainer passes as its `run_name`),
    /// `MLFLOW_RUN_ID`, `MLFLOW_TAGS` (a JSON object), and
    /// `MLFLOW_TRACKING_TOKEN` or `MLFLOW_TRACKING_USERNAME` + `_PASSWORD`.
    ///
    /// # Errors
    /// [`Error::Config`] naming the variable that is missing or malformed.
    pub fn from_env(project_name: &str) -> Result<Self> {
        Self::from_lookup(project_name, |k| std::env::var(k).ok())
    }

    /// [`MlflowConfig::from_env`] over any lookup, so tests need not touch
    /// the process environment.
    pub(crate) fn from_lookup(
        project_name: &str,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Self> {
        let var = |k: &str| env(k).filter(|v| !v.trim().is_empty());
        let uri = var("MLFLOW_TRACKING_URI").ok_or_else(|| uri_error("is not set", ""))?;
        let experiment = var("MLFLOW_EXPERIMENT_NAME").unwrap_or_else(|| project_name.to_owned());
        let mut config = Self::new(&uri, &experiment)?;
        config.run_name = Some(var("MLFLOW_RUN_NAME").unwrap_or_else(|| project_name.to_owned()));
        config.run_id = var("MLFLOW_RUN_ID");
        if let Some(tags) = var("MLFLOW_TAGS") {
            config.tags = parse_tags(&tags)?;
        }
        if let Some(token) = var("MLFLOW_TRACKING_TOKEN") {
            config.auth = MlflowAuth::Bearer(token);
        } else if let Some(username) = var("MLFLOW_TRACKING_USERNAME") {
            let password = env("MLFLOW_TRACKING_PASSWORD").ok_or_else(|| Error::Config {
                key: "MLFLOW_TRACKING_PASSWORD".into(),
                reason: "MLFLOW_TRACKING_USERNAME is set but the password is not".into(),
            })?;
            config.auth = MlflowAuth::Basic { username, password };
        }
        Ok(config)
    }
}

fn uri_error(what: &str, uri: &str) -> Error {
    Error::Config {
        key: "MLFLOW_TRACKING_URI".into(),
        reason: format!(
            "{what}{uri}; the mlflow tracker speaks MLflow's REST API and needs a tracking \
             server, e.g. `mlflow server --host 127.0.0.1 --port 5000 --backend-store-uri \
             sqlite:///mlflow.db` and MLFLOW_TRACKING_URI=http://127.0.0.1:5000 (local `file:` \
             and database stores are only reachable from Python)"
        ),
    }
}

/// Checks the URI is `http(s)://host...` and moves `user:password@` out of it
/// into basic auth, so the URI can be printed in messages.
fn parse_uri(uri: &str) -> Result<(String, Option<MlflowAuth>)> {
    let uri = uri.trim();
    let lower = uri.to_ascii_lowercase();
    let Some(scheme_len) = ["http://", "https://"]
        .iter()
        .find(|s| lower.starts_with(*s))
        .map(|s| s.len())
    else {
        return Err(uri_error("`", &format!("{uri}` is not an http(s):// URL")));
    };
    let rest = &uri[scheme_len..];
    let (authority, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
    let (auth, host) = match authority.rsplit_once('@') {
        Some((userinfo, host)) => {
            let (user, password) = userinfo.split_once(':').unwrap_or((userinfo, ""));
            let auth = MlflowAuth::Basic {
                username: user.to_owned(),
                password: password.to_owned(),
            };
            (Some(auth), host)
        }
        None => (None, authority),
    };
    if host.is_empty() {
        return Err(uri_error("`", &format!("{uri}` has no host")));
    }
    let base = format!("{}{host}{}", &uri[..scheme_len], path.trim_end_matches('/'));
    Ok((base, auth))
}

/// `MLFLOW_TAGS` is a JSON object; non-string values are kept as JSON text.
fn parse_tags(text: &str) -> Result<BTreeMap<String, String>> {
    let bad = |reason: String| Error::Config {
        key: "MLFLOW_TAGS".into(),
        reason,
    };
    let value: serde_json::Value =
        serde_json::from_str(text).map_err(|e| bad(format!("`{text}` is not JSON: {e}")))?;
    let serde_json::Value::Object(map) = value else {
        return Err(bad(format!("`{text}` is not a JSON object")));
    };
    Ok(map
        .into_iter()
        .map(|(k, v)| match v {
            serde_json::Value::String(s) => (k, s),
            other => (k, other.to_string()),
        })
        .collect())
}

/// Standard base64 with padding, for the basic-auth header (a few lines
/// rather than a dependency).
fn base64(bytes: &[u8]) -> String {
    const TABLE: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let b = [
            chunk[0],
            *chunk.get(1).unwrap_or(&0),
            *chunk.get(2).unwrap_or(&0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(TABLE[(n >> (18 - 6 * i)) as usize & 63] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env<'a>(pairs: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |k| {
            pairs
                .iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
        }
    }

    fn config_reason(err: Error) -> (String, String) {
        match err {
            Error::Config { key, reason } => (key, reason),
            other => panic!("expected Config, got {other}"),
        }
    }

    #[test]
    fn an_unset_or_file_uri_explains_how_to_start_a_server() {
        let (key, reason) = config_reason(MlflowConfig::from_lookup("p", env(&[])).unwrap_err());
        assert_eq!(key, "MLFLOW_TRACKING_URI");
        assert!(reason.contains("is not set"), "{reason}");
        assert!(reason.contains("mlflow server --host"), "{reason}");
        for uri in [
            "file:./mlruns",
            "./mlruns",
            "sqlite:///x.db",
            "databricks",
            "http://",
        ] {
            let pairs = [("MLFLOW_TRACKING_URI", uri)];
            let (_, reason) =
                config_reason(MlflowConfig::from_lookup("p", env(&pairs)).unwrap_err());
            assert!(reason.contains(uri), "{reason}");
            assert!(reason.contains("REST API"), "{reason}");
        }
    }

    #[test]
    fn the_environment_sets_experiment_run_tags_and_token() {
        let pairs = [
            ("MLFLOW_TRACKING_URI", "HTTP://127.0.0.1:5000/prefix/"),
            ("MLFLOW_EXPERIMENT_NAME", "exp"),
            ("MLFLOW_TAGS", r#"{"team": "nlp", "try": 3}"#),
            ("MLFLOW_TRACKING_TOKEN", "secret"),
        ];
        let c = MlflowConfig::from_lookup("proj", env(&pairs)).unwrap();
        assert_eq!(c.tracking_uri, "HTTP://127.0.0.1:5000/prefix");
        assert_eq!(c.experiment_name, "exp");
        assert_eq!(c.run_name.as_deref(), Some("proj"));
        assert_eq!(c.tags["team"], "nlp");
        assert_eq!(c.tags["try"], "3");
        assert_eq!(c.auth.header().unwrap(), "Bearer secret");
        assert!(!format!("{c:?}").contains("secret"));

        let c = MlflowConfig::from_lookup("proj", env(&pairs[..1])).unwrap();
        assert_eq!(c.experiment_name, "proj");
        assert_eq!(c.auth, MlflowAuth::None);
    }

    #[test]
    fn basic_auth_comes_from_the_variables_or_the_uri_and_leaves_the_uri() {
        let pairs = [
            ("MLFLOW_TRACKING_URI", "http://localhost:5000"),
            ("MLFLOW_TRACKING_USERNAME", "Aladdin"),
            ("MLFLOW_TRACKING_PASSWORD", "open sesame"),
        ];
        let c = MlflowConfig::from_lookup("p", env(&pairs)).unwrap();
        // RFC 7617's example.
        assert_eq!(
            c.auth.header().unwrap(),
            "Basic QWxhZGRpbjpvcGVuIHNlc2FtZQ=="
        );
        let (key, _) = config_reason(MlflowConfig::from_lookup("p", env(&pairs[..2])).unwrap_err());
        assert_eq!(key, "MLFLOW_TRACKING_PASSWORD");

        let c = MlflowConfig::new("https://u:pw@mlflow.example.com/", "e").unwrap();
        assert_eq!(c.tracking_uri, "https://mlflow.example.com");
        assert_eq!(
            c.auth.header().unwrap(),
            format!("Basic {}", base64(b"u:pw"))
        );
    }

    #[test]
    fn malformed_tags_name_the_variable() {
        for tags in ["{not json", "[1, 2]"] {
            let pairs = [("MLFLOW_TRACKING_URI", "http://h"), ("MLFLOW_TAGS", tags)];
            let (key, reason) =
                config_reason(MlflowConfig::from_lookup("p", env(&pairs)).unwrap_err());
            assert_eq!(key, "MLFLOW_TAGS");
            assert!(reason.contains(tags), "{reason}");
        }
    }

    #[test]
    fn base64_pads_like_the_standard() {
        assert_eq!(base64(b""), "");
        assert_eq!(base64(b"f"), "Zg==");
        assert_eq!(base64(b"fo"), "Zm8=");
        assert_eq!(base64(b"foo"), "Zm9v");
        assert_eq!(base64(b"foobar"), "Zm9vYmFy");
    }
}
