//! Tracker names, as `log_with` and `report_to` spell them (Accelerate's
//! `LoggerType`), and how a list of names becomes a list of kinds.

use std::path::Path;

use super::{JsonlTracker, MlflowTracker, TensorBoardTracker, Tracker};
use crate::{Error, Result};

/// Trackers Accelerate or transformers know that are not built here. They
/// get their own message, so a recipe naming one learns it is not a typo.
const NOT_BUILT: [&str; 10] = [
    "wandb",
    "comet_ml",
    "aim",
    "clearml",
    "dvclive",
    "swanlab",
    "trackio",
    "neptune",
    "azure_ml",
    "codecarbon",
];

/// The trackers this crate provides.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum TrackerKind {
    /// [`JsonlTracker`]: `metrics.jsonl`, one JSON object per `log` call.
    Jsonl,
    /// [`TensorBoardTracker`]: a TensorBoard event file.
    TensorBoard,
    /// [`MlflowTracker`]: a run on an MLflow tracking server (REST API).
    Mlflow,
}

impl TrackerKind {
    /// Every kind. `"all"` takes the file trackers always and MLflow when
    /// `MLFLOW_TRACKING_URI` is set (see [`TrackerKind::resolve`]).
    pub const ALL: [TrackerKind; 3] = [
        TrackerKind::Jsonl,
        TrackerKind::TensorBoard,
        TrackerKind::Mlflow,
    ];

    /// The name used in `log_with` lists: `"jsonl"`, `"tensorboard"` or `"mlflow"`.
    pub fn name(self) -> &'static str {
        match self {
            TrackerKind::Jsonl => "jsonl",
            TrackerKind::TensorBoard => "tensorboard",
            TrackerKind::Mlflow => "mlflow",
        }
    }

    /// Parses a name, ignoring ASCII case (Accelerate lower-cases them too).
    /// An unknown name is an [`Error::Config`] naming it and the known ones.
    pub fn from_name(name: &str) -> Result<Self> {
        Self::ALL
            .into_iter()
            .find(|kind| kind.name().eq_ignore_ascii_case(name.trim()))
            .ok_or_else(|| unknown_tracker(name))
    }

    /// Whether the tracker talks to a server. Those start first, so an
    /// unreachable server fails before any run folder is created.
    pub fn is_remote(self) -> bool {
        self == TrackerKind::Mlflow
    }

    /// Creates the tracker. File trackers write under
    /// `{logging_dir}/{project_name}/`; MLflow reads its `MLFLOW_*`
    /// variables and uses `project_name` as the default experiment.
    pub fn create(self, project_name: &str, logging_dir: &Path) -> Result<Box<dyn Tracker>> {
        Ok(match self {
            TrackerKind::Jsonl => Box::new(JsonlTracker::new(project_name, logging_dir)?),
            TrackerKind::TensorBoard => {
                Box::new(TensorBoardTracker::new(project_name, logging_dir)?)
            }
            TrackerKind::Mlflow => Box::new(MlflowTracker::from_env(project_name)?),
        })
    }

    /// Turns `log_with` names into kinds, without repeats, in the order they
    /// should start (server trackers first).
    ///
    /// `"all"` is Accelerate's "every available tracker": the file trackers,
    /// which need nothing, and MLflow only when `env("MLFLOW_TRACKING_URI")`
    /// is set, since without a server it cannot run. A set but unusable URI
    /// (a `file:` store) still selects it and fails with its explanation,
    /// rather than quietly leaving out a tracker the user configured.
    pub fn resolve(names: &[&str], env: impl Fn(&str) -> Option<String>) -> Result<Vec<Self>> {
        let mlflow_configured = env("MLFLOW_TRACKING_URI").is_some_and(|u| !u.trim().is_empty());
        let mut kinds: Vec<TrackerKind> = Vec::new();
        for name in names {
            if name.trim().eq_ignore_ascii_case("all") {
                kinds.extend([TrackerKind::Jsonl, TrackerKind::TensorBoard]);
                if mlflow_configured {
                    kinds.push(TrackerKind::Mlflow);
                }
            } else {
                kinds.push(TrackerKind::from_name(name)?);
            }
        }
        let mut seen = Vec::new();
        kinds.retain(|k| {
            let first = !seen.contains(k);
            seen.push(*k);
            first
        });
        // Stable: the file trackers keep their order after the remote ones.
        kinds.sort_by_key(|k| !k.is_remote());
        Ok(kinds)
    }
}

fn unknown_tracker(name: &str) -> Error {
    let known: Vec<&str> = TrackerKind::ALL.iter().map(|k| k.name()).collect();
    let known = known.join(", ");
    let trimmed = name.trim();
    let reason = if NOT_BUILT.iter().any(|n| n.eq_ignore_ascii_case(trimmed)) {
        format!(
            "tracker `{trimmed}` is not built into accel-rs; the trackers here are {known} or \
             `all` (a tracker of your own can implement `Tracker` and join with `Trackers::push`)"
        )
    } else {
        format!("unknown tracker `{name}`; known trackers are {known} or `all`")
    };
    Error::Config {
        key: "log_with".into(),
        reason,
    }
}

impl std::fmt::Display for TrackerKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for TrackerKind {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        Self::from_name(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env_with_uri(k: &str) -> Option<String> {
        (k == "MLFLOW_TRACKING_URI").then(|| "http://127.0.0.1:5000".to_string())
    }

    #[test]
    fn tracker_names_parse_ignoring_case() {
        assert_eq!(TrackerKind::from_name("JSONL").unwrap(), TrackerKind::Jsonl);
        assert_eq!(
            TrackerKind::from_name(" MLflow").unwrap(),
            TrackerKind::Mlflow
        );
        assert_eq!(
            "tensorboard".parse::<TrackerKind>().unwrap(),
            TrackerKind::TensorBoard
        );
    }

    #[test]
    fn all_takes_mlflow_only_when_a_tracking_uri_is_set() {
        let without = TrackerKind::resolve(&["all"], |_| None).unwrap();
        assert_eq!(without, [TrackerKind::Jsonl, TrackerKind::TensorBoard]);
        let with = TrackerKind::resolve(&["ALL", "jsonl"], env_with_uri).unwrap();
        assert_eq!(
            with,
            [
                TrackerKind::Mlflow,
                TrackerKind::Jsonl,
                TrackerKind::TensorBoard
            ]
        );
        let blank = TrackerKind::resolve(&["all"], |_| Some("  ".into())).unwrap();
        assert_eq!(blank.len(), 2);
    }

    #[test]
    fn server_trackers_start_before_file_trackers() {
        let kinds = TrackerKind::resolve(&["tensorboard", "mlflow", "jsonl"], |_| None).unwrap();
        assert_eq!(
            kinds,
            [
                TrackerKind::Mlflow,
                TrackerKind::TensorBoard,
                TrackerKind::Jsonl
            ]
        );
    }

    #[test]
    fn accelerate_trackers_not_built_here_are_refused_by_name() {
        for name in [
            "wandb", "comet_ml", "Aim", "clearml", "dvclive", "swanlab", "trackio",
        ] {
            let err = TrackerKind::resolve(&["jsonl", name], |_| None).unwrap_err();
            let Error::Config { key, reason } = &err else {
                panic!("expected Config, got {err}");
            };
            assert_eq!(key, "log_with");
            assert!(reason.contains(&format!("`{}`", name)), "{reason}");
            assert!(reason.contains("not built into accel-rs"), "{reason}");
            assert!(reason.contains("jsonl, tensorboard, mlflow"), "{reason}");
        }
        let err = TrackerKind::from_name("jsnol").unwrap_err().to_string();
        assert!(err.contains("unknown tracker `jsnol`"), "{err}");
    }
}
