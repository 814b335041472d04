//! A tracker writing one JSON object per line: easy to `tail -f`, `jq` or
//! load with `pandas.read_json(path, lines=True)`.

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use super::{
    finished_error, run_dir, unix_time, write_config_json, LogValue, StepCounter, Tracker,
};
use crate::{Error, Result};

/// Writes `{logging_dir}/{project_name}/metrics.jsonl`.
///
/// Each [`Tracker::log`] call appends one line,
///
/// ```json
/// {"step": 3, "wall_time": 1700000000.25, "values": {"loss": 0.5, "epoch": 1, "note": "text"}}
/// ```
///
/// The values are nested under `"values"` rather than flattened so a metric
/// named `step` or `wall_time` cannot collide with the bookkeeping fields.
/// Integers are written exactly; non-finite floats as strings (see
/// [`LogValue::to_json`]). The file is opened for appending, so a resumed
/// run continues the same file. [`Tracker::store_init_configuration`] writes
/// `config.json` beside it.
#[derive(Debug)]
pub struct JsonlTracker {
    dir: PathBuf,
    path: PathBuf,
    // `None` once finished.
    out: Option<BufWriter<File>>,
    steps: StepCounter,
}

impl JsonlTracker {
    /// Creates `{logging_dir}/{project_name}/` and opens `metrics.jsonl` in it.
    pub fn new(project_name: &str, logging_dir: impl AsRef<Path>) -> Result<Self> {
        let dir = run_dir(project_name, logging_dir.as_ref())?;
        let path = dir.join("metrics.jsonl");
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .map_err(|e| Error::io("opening", &path, e))?;
        Ok(Self {
            dir,
            path,
            out: Some(BufWriter::new(file)),
            steps: StepCounter::default(),
        })
    }

    /// The `metrics.jsonl` file.
    pub fn metrics_path(&self) -> &Path {
        &self.path
    }

    /// The folder holding `metrics.jsonl` and `config.json`.
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

impl Tracker for JsonlTracker {
    fn name(&self) -> &str {
        "jsonl"
    }

    fn store_init_configuration(&mut self, config: &serde_json::Value) -> Result<()> {
        if self.out.is_none() {
            return Err(finished_error("jsonl"));
        }
        write_config_json(&self.dir.join("config.json"), config)
    }

    fn log(&mut self, values: &BTreeMap<String, LogValue>, step: Option<u64>) -> Result<()> {
        let out = self.out.as_mut().ok_or_else(|| finished_error("jsonl"))?;
        let step = self.steps.resolve(step);
        let values: serde_json::Map<String, serde_json::Value> = values
            .iter()
            .map(|(k, v)| (k.clone(), v.to_json()))
            .collect();
        let line = serde_json::json!({
            "step": step,
            "wall_time": unix_time(),
            "values": values,
        });
        // One write of the whole line, then a flush: a crash can lose at most
        // the line being written, never one already returned from `log`.
        let mut text = line.to_string();
        text.push('\n');
        out.write_all(text.as_bytes())
            .and_then(|()| out.flush())
            .map_err(|e| Error::io("writing", &self.path, e))
    }

    fn finish(&mut self) -> Result<()> {
        if let Some(mut out) = self.out.take() {
            out.flush()
                .map_err(|e| Error::io("writing", &self.path, e))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(pairs: &[(&str, LogValue)]) -> BTreeMap<String, LogValue> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.clone()))
            .collect()
    }

    #[test]
    fn each_log_call_is_one_line_holding_exact_values() {
        let dir = tempfile::tempdir().unwrap();
        let mut t = JsonlTracker::new("proj", dir.path()).unwrap();
        t.log(
            &values(&[
                ("loss", LogValue::Float(0.1)),
                ("tokens", LogValue::Int(9_007_199_254_740_993)), // 2^53 + 1: not an f64
                ("note", LogValue::Text("a \"quoted\"\nline".into())),
            ]),
            Some(5),
        )
        .unwrap();
        t.log(&values(&[("loss", LogValue::Float(f64::NAN))]), None)
            .unwrap();

        // Flushed already: readable before `finish`.
        let text = std::fs::read_to_string(dir.path().join("proj/metrics.jsonl")).unwrap();
        let lines: Vec<serde_json::Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(lines.len(), 2);

        assert_eq!(lines[0]["step"], 5);
        assert!(lines[0]["wall_time"].as_f64().unwrap() > 1.6e9);
        assert_eq!(lines[0]["values"]["loss"].as_f64(), Some(0.1));
        assert_eq!(
            lines[0]["values"]["tokens"].as_i64(),
            Some(9_007_199_254_740_993)
        );
        assert_eq!(lines[0]["values"]["note"], "a \"quoted\"\nline");

        assert_eq!(lines[1]["step"], 6);
        assert_eq!(lines[1]["values"]["loss"], "NaN");
        t.finish().unwrap();
    }

    #[test]
    fn a_reopened_file_is_appended_to() {
        let dir = tempfile::tempdir().unwrap();
        for step in 0..2 {
            let mut t = JsonlTracker::new("proj", dir.path()).unwrap();
            t.log(&values(&[("x", LogValue::Int(step))]), Some(step as u64))
                .unwrap();
            t.finish().unwrap();
        }
        let text = std::fs::read_to_string(dir.path().join("proj/metrics.jsonl")).unwrap();
        assert_eq!(text.lines().count(), 2);
    }

    #[test]
    fn the_configuration_goes_to_config_json() {
        let dir = tempfile::tempdir().unwrap();
        let mut t = JsonlTracker::new("proj", dir.path()).unwrap();
        let config = serde_json::json!({"lr": 3e-4, "layers": [1, 2], "name": "gpt"});
        t.store_init_configuration(&config).unwrap();
        let read: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(t.dir().join("config.json")).unwrap())
                .unwrap();
        assert_eq!(read, config);
        assert!(!t.dir().join("config.json.tmp").exists());
    }

    #[test]
    fn logging_after_finish_is_a_usage_error() {
        let dir = tempfile::tempdir().unwrap();
        let mut t = JsonlTracker::new("proj", dir.path()).unwrap();
        t.finish().unwrap();
        t.finish().unwrap();
        let err = t.log(&BTreeMap::new(), None).unwrap_err();
        assert!(matches!(err, Error::Usage(_)), "{err}");
    }
}
