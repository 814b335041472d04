//! What the MLflow tracker still has to send: params, tags and metric points
//! cut into batches within MLflow's request limits, kept (up to a cap) while
//! the server cannot be reached, with the back-off and warning bookkeeping.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use super::super::LogValue;

/// MLflow's limits per `runs/log-batch` request (`MAX_METRICS_PER_BATCH`,
/// `MAX_PARAMS_TAGS_PER_BATCH`, `MAX_ENTITIES_PER_BATCH`).
pub(super) const MAX_METRICS_PER_BATCH: usize = 1000;
pub(super) const MAX_PARAMS_TAGS_PER_BATCH: usize = 100;
/// The longest param value the server stores (`MAX_PARAM_VAL_LENGTH`, in characters).
pub(super) const MAX_PARAM_VALUE_CHARS: usize = 6000;
/// The longest tag value (`MAX_TAG_VAL_LENGTH`).
pub(super) const MAX_TAG_VALUE_CHARS: usize = 8000;
/// The longest metric, param or tag name (`MAX_ENTITY_KEY_LENGTH`).
const MAX_KEY_CHARS: usize = 250;

/// One metric value at one step.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct MetricPoint {
    pub key: String,
    /// `Float` or `Int`; sent as a double, non-finite values as the strings
    /// protobuf's JSON mapping uses (see [`LogValue::to_json`]).
    pub value: LogValue,
    /// When it was logged, not when it was finally sent.
    pub timestamp_ms: i64,
    pub step: i64,
}

/// One `runs/log-batch` request's worth.
#[derive(Debug, Default, Clone, PartialEq)]
pub(super) struct Batch {
    pub params: Vec<(String, String)>,
    pub tags: Vec<(String, String)>,
    pub metrics: Vec<MetricPoint>,
}

impl Batch {
    fn len(&self) -> usize {
        self.params.len() + self.tags.len() + self.metrics.len()
    }

    /// The keys it holds, shortened, for an error message.
    pub(super) fn describe(&self) -> String {
        let mut keys: Vec<&str> = self.params.iter().map(|(k, _)| k.as_str()).collect();
        keys.extend(self.tags.iter().map(|(k, _)| k.as_str()));
        keys.extend(self.metrics.iter().map(|m| m.key.as_str()));
        let mut seen = std::collections::BTreeSet::new();
        keys.retain(|k| seen.insert(*k));
        let shown: Vec<&str> = keys.iter().take(5).copied().collect();
        let more = keys.len().saturating_sub(shown.len());
        let tail = if more > 0 {
            format!(" and {more} more")
        } else {
            String::new()
        };
        format!("`{}`{tail}", shown.join("`, `"))
    }
}

/// The queue of unsent entities, and the state of the current outage.
#[derive(Debug)]
pub(super) struct Outbox {
    params: VecDeque<(String, String)>,
    tags: VecDeque<(String, String)>,
    metrics: VecDeque<MetricPoint>,
    cap: usize,
    /// Points dropped (oldest first) because the buffer was full.
    pub dropped: u64,
    /// Failed attempts since the last success; 0 when the server is up.
    pub failures: u64,
    retry_at: Option<Instant>,
    last_warning: Option<Instant>,
}

/// The first retry waits this long; each failure doubles it up to the max,
/// so a server that is gone costs one timed-out request now and then, not
/// one per logged step.
const FIRST_BACKOFF: Duration = Duration::from_secs(1);
const MAX_BACKOFF: Duration = Duration::from_secs(60);
/// During an outage, at most one warning line this often.
pub(super) const WARNING_EVERY: Duration = Duration::from_secs(60);

impl Outbox {
    pub(super) fn new(cap: usize) -> Self {
        Self {
            params: VecDeque::new(),
            tags: VecDeque::new(),
            metrics: VecDeque::new(),
            cap: cap.max(1),
            dropped: 0,
            failures: 0,
            retry_at: None,
            last_warning: None,
        }
    }

    pub(super) fn push_params(&mut self, params: impl IntoIterator<Item = (String, String)>) {
        self.params.extend(params);
    }

    pub(super) fn push_tags(&mut self, tags: impl IntoIterator<Item = (String, String)>) {
        self.tags.extend(tags);
    }

    /// Queues points, dropping the oldest past the cap (counted in `dropped`).
    pub(super) fn push_metrics(&mut self, points: impl IntoIterator<Item = MetricPoint>) {
        for p in points {
            if self.metrics.len() == self.cap {
                self.metrics.pop_front();
                self.dropped += 1;
            }
            self.metrics.push_back(p);
        }
    }

    /// How many entities wait to be sent.
    pub(super) fn pending(&self) -> usize {
        self.params.len() + self.tags.len() + self.metrics.len()
    }

    /// The next request: params and tags first (100 each at most), then up to
    /// 1000 metric points; MLflow also caps the whole request at 1000.
    pub(super) fn next_batch(&self) -> Option<Batch> {
        let params: Vec<_> = self
            .params
            .iter()
            .take(MAX_PARAMS_TAGS_PER_BATCH)
            .cloned()
            .collect();
        let tags: Vec<_> = self
            .tags
            .iter()
            .take(MAX_PARAMS_TAGS_PER_BATCH)
            .cloned()
            .collect();
        let room = MAX_METRICS_PER_BATCH - params.len() - tags.len();
        let metrics: Vec<_> = self.metrics.iter().take(room).cloned().collect();
        let batch = Batch {
            params,
            tags,
            metrics,
        };
        (batch.len() > 0).then_some(batch)
    }

    /// Removes a batch returned by [`Outbox::next_batch`]: sent, or refused.
    pub(super) fn remove(&mut self, batch: &Batch) {
        self.params.drain(..batch.params.len());
        self.tags.drain(..batch.tags.len());
        self.metrics.drain(..batch.metrics.len());
    }

    /// Whether a send should be tried now (false while backing off).
    pub(super) fn may_try(&self, now: Instant) -> bool {
        self.retry_at.is_none_or(|t| now >= t)
    }

    /// Records a failed attempt; returns whether to print a warning now
    /// (the first failure of an outage, then once per [`WARNING_EVERY`]).
    pub(super) fn failed(&mut self, now: Instant) -> bool {
        self.failures += 1;
        let shift = (self.failures - 1).min(6) as u32;
        self.retry_at = Some(now + (FIRST_BACKOFF * 2u32.pow(shift)).min(MAX_BACKOFF));
        let warn = self
            .last_warning
            .is_none_or(|t| now.duration_since(t) >= WARNING_EVERY);
        if warn {
            self.last_warning = Some(now);
        }
        warn
    }

    /// Records a successful send; returns the failed attempts of the outage
    /// it ends (0 if there was none).
    pub(super) fn succeeded(&mut self) -> u64 {
        self.retry_at = None;
        self.last_warning = None;
        std::mem::take(&mut self.failures)
    }
}

/// The run's params from a configuration: nested objects flattened with `.`
/// (transformers' `flatten_dict`), values as text, `None`/`True`/`False`
/// spelled as Python's `str()` does so runs compare with Python's. A
/// configuration that is not an object is one param, `config`.
pub(super) fn flatten_params(config: &serde_json::Value) -> Vec<(String, String)> {
    fn walk(prefix: &str, v: &serde_json::Value, out: &mut Vec<(String, String)>) {
        match v {
            serde_json::Value::Object(map) => {
                for (k, v) in map {
                    let key = if prefix.is_empty() {
                        k.clone()
                    } else {
                        format!("{prefix}.{k}")
                    };
                    walk(&key, v, out);
                }
            }
            serde_json::Value::Null => out.push((prefix.to_owned(), "None".into())),
            serde_json::Value::Bool(b) => {
                out.push((prefix.to_owned(), if *b { "True" } else { "False" }.into()))
            }
            serde_json::Value::String(s) => out.push((prefix.to_owned(), s.clone())),
            other => out.push((prefix.to_owned(), other.to_string())),
        }
    }
    let mut out = Vec::new();
    match config {
        serde_json::Value::Object(_) => walk("", config, &mut out),
        other => walk("config", other, &mut out),
    }
    out
}

/// Cuts `value` to `max` characters; returns whether it did.
pub(super) fn truncate(value: &mut String, max: usize) -> bool {
    match value.char_indices().nth(max) {
        Some((byte, _)) => {
            value.truncate(byte);
            true
        }
        None => false,
    }
}

/// Why MLflow would refuse `name` as a metric, param or tag name, checked
/// here so one bad name fails at once with its own message instead of
/// taking a whole batch of good points down with it at the server.
pub(super) fn name_problem(name: &str) -> Option<String> {
    let allowed = |c: char| c.is_alphanumeric() || "_-. :/".contains(c);
    if name.is_empty() {
        Some("is empty".into())
    } else if name.chars().count() > MAX_KEY_CHARS {
        Some(format!("is longer than {MAX_KEY_CHARS} characters"))
    } else if let Some(c) = name.chars().find(|c| !allowed(*c)) {
        Some(format!(
            "contains `{c}`; MLflow names may only hold letters, digits, `_`, `-`, `.`, ` `, `:` and `/`"
        ))
    } else if name
        .split('/')
        .any(|s| s.is_empty() || s == "." || s == "..")
    {
        // MLflow keeps names as file paths in some stores: they must be
        // already normalized (`posixpath.normpath(name) == name`).
        Some("is not a normalized path (an empty, `.` or `..` part between slashes)".into())
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn point(i: usize) -> MetricPoint {
        MetricPoint {
            key: format!("m{}", i % 3),
            value: LogValue::Float(i as f64),
            timestamp_ms: 1_700_000_000_000 + i as i64,
            step: i as i64,
        }
    }

    #[test]
    fn nested_configs_flatten_with_dots_and_python_spellings() {
        let config = serde_json::json!({
            "lr": 0.001, "name": "run", "fp16": false, "seed": null,
            "optim": {"betas": [0.9, 0.999], "inner": {"eps": 1e-8}},
        });
        let params = flatten_params(&config);
        let get = |k: &str| params.iter().find(|(n, _)| n == k).map(|(_, v)| v.as_str());
        assert_eq!(get("lr"), Some("0.001"));
        assert_eq!(get("name"), Some("run"));
        assert_eq!(get("fp16"), Some("False"));
        assert_eq!(get("seed"), Some("None"));
        assert_eq!(get("optim.betas"), Some("[0.9,0.999]"));
        assert_eq!(get("optim.inner.eps"), Some("1e-8"));
        assert_eq!(params.len(), 6);
        assert_eq!(
            flatten_params(&serde_json::json!(3)),
            [("config".into(), "3".into())]
        );
    }

    #[test]
    fn long_values_are_cut_on_a_character_boundary() {
        let mut s = "é".repeat(MAX_PARAM_VALUE_CHARS + 5);
        assert!(truncate(&mut s, MAX_PARAM_VALUE_CHARS));
        assert_eq!(s.chars().count(), MAX_PARAM_VALUE_CHARS);
        let mut short = "abc".to_string();
        assert!(!truncate(&mut short, 3));
        assert_eq!(short, "abc");
    }

    #[test]
    fn batches_respect_mlflows_request_limits() {
        let mut o = Outbox::new(10_000);
        o.push_params((0..250).map(|i| (format!("p{i}"), i.to_string())));
        o.push_tags([("t".to_string(), "v".to_string())]);
        o.push_metrics((0..2500).map(point));
        let mut sizes = Vec::new();
        let mut sent = Vec::new();
        while let Some(b) = o.next_batch() {
            assert!(b.params.len() <= 100 && b.tags.len() <= 100);
            assert!(b.params.len() + b.tags.len() + b.metrics.len() <= 1000);
            sizes.push((b.params.len(), b.tags.len(), b.metrics.len()));
            sent.extend(b.metrics.iter().map(|m| m.step));
            o.remove(&b);
        }
        assert_eq!(sizes, [(100, 1, 899), (100, 0, 900), (50, 0, 701)]);
        // Every point once, in order.
        assert_eq!(sent, (0..2500).collect::<Vec<i64>>());
        assert_eq!(o.pending(), 0);
    }

    #[test]
    fn the_buffer_keeps_the_newest_points_and_counts_the_rest() {
        let mut o = Outbox::new(100);
        o.push_metrics((0..250).map(point));
        assert_eq!(o.pending(), 100);
        assert_eq!(o.dropped, 150);
        let b = o.next_batch().unwrap();
        assert_eq!(b.metrics.first().unwrap().step, 150);
        assert_eq!(b.metrics.last().unwrap().step, 249);
    }

    #[test]
    fn failures_back_off_and_warn_once_a_minute() {
        let mut o = Outbox::new(10);
        let t0 = Instant::now();
        assert!(o.may_try(t0));
        assert!(o.failed(t0), "the first failure warns");
        assert!(!o.may_try(t0));
        assert!(o.may_try(t0 + Duration::from_secs(1)));
        assert!(
            !o.failed(t0 + Duration::from_secs(1)),
            "then it stays quiet"
        );
        assert!(!o.may_try(t0 + Duration::from_secs(2)), "and waits 2 s");
        for _ in 0..10 {
            o.failed(t0 + Duration::from_secs(2));
        }
        assert!(!o.may_try(t0 + Duration::from_secs(61)), "capped at 60 s");
        assert!(o.may_try(t0 + Duration::from_secs(63)));
        assert!(o.failed(t0 + WARNING_EVERY), "a count line each minute");
        assert_eq!(o.succeeded(), 13);
        assert_eq!(o.failures, 0);
        assert!(o.may_try(t0));
    }

    #[test]
    fn names_mlflow_refuses_are_caught_here() {
        for ok in ["loss", "eval/loss", "train loss:1", "a.b-c_d", "精度"] {
            assert_eq!(name_problem(ok), None, "{ok}");
        }
        for bad in [
            "", "a*b", "acc@1", "/abs", "a//b", "a/", "./a", "a/../b", ".",
        ] {
            assert!(name_problem(bad).is_some(), "{bad}");
        }
        assert!(name_problem(&"x".repeat(251)).unwrap().contains("250"));
    }

    #[test]
    fn a_batch_describes_its_keys_briefly() {
        let b = Batch {
            metrics: (0..9)
                .map(|i| MetricPoint {
                    key: format!("k{i}"),
                    ..point(i)
                })
                .collect(),
            ..Batch::default()
        };
        assert_eq!(b.describe(), "`k0`, `k1`, `k2`, `k3`, `k4` and 4 more");
    }
}
