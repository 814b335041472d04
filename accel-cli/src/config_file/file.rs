//! Accelerate's `default_config.yaml`: where it lives, its keys, and loading
//! and saving it.
//!
//! Files written by Python's `accelerate config` load unchanged. Keys that
//! Accelerate knows but accel-rs does not act on (DeepSpeed, Megatron-LM, TPU,
//! dynamo, fp8, mpirun, parallelism, IPEX) are accepted and kept verbatim, so
//! a file saved back keeps them; `accel launch` ignores them. A key Accelerate
//! does not know is an error naming the key and the file, as in Accelerate.

use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use serde_yaml_ng::{Mapping, Value};

use accel_core::{DistributedType, Error, PrecisionType, Result};

use super::fsdp::FsdpFileConfig;

/// `$HF_HOME/accelerate/default_config.yaml`, where `HF_HOME` defaults to
/// `$XDG_CACHE_HOME/huggingface`, then `~/.cache/huggingface`, as in
/// Accelerate's `config_args.py`.
///
/// Accelerate has no `ACCELERATE_CONFIG_FILE` variable; `--config_file`
/// is the only way to point at another file, so we honour none either.
pub fn default_config_path() -> PathBuf {
    let var = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty());
    let hf_home = var("HF_HOME").map(PathBuf::from).unwrap_or_else(|| {
        let cache = var("XDG_CACHE_HOME").map(PathBuf::from).unwrap_or_else(|| {
            let home = var("HOME").map(PathBuf::from).unwrap_or_default();
            home.join(".cache")
        });
        cache.join("huggingface")
    });
    hf_home.join("accelerate").join("default_config.yaml")
}

/// The keys of Accelerate's `ClusterConfig` (plus the legacy `fp16`,
/// `dynamo_backend` and `ipex_config` of older files); any other key is rejected.
pub const KNOWN_KEYS: &[&str] = &[
    "compute_environment",
    "distributed_type",
    "mixed_precision",
    "use_cpu",
    "debug",
    "num_processes",
    "machine_rank",
    "num_machines",
    "gpu_ids",
    "main_process_ip",
    "main_process_port",
    "rdzv_backend",
    "same_network",
    "main_training_function",
    "enable_cpu_affinity",
    "max_restarts",
    "monitor_interval",
    "fsdp_config",
    "fp8_config",
    "deepspeed_config",
    "parallelism_config",
    "megatron_lm_config",
    "mpirun_config",
    "dynamo_config",
    "ipex_config",
    "downcast_bf16",
    "tpu_name",
    "tpu_zone",
    "tpu_use_cluster",
    "tpu_use_sudo",
    "command_file",
    "commands",
    "tpu_vm",
    "tpu_env",
    "fp16",
    "dynamo_backend",
];

/// One `default_config.yaml` (Accelerate's `ClusterConfig`).
///
/// Fields accel-rs acts on are typed; the rest are kept as raw YAML values.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ClusterConfig {
    /// `LOCAL_MACHINE` (the only one supported; `AMAZON_SAGEMAKER` is rejected).
    #[serde(default = "local_machine")]
    pub compute_environment: String,
    /// `NO`, `MULTI_CPU`, `MULTI_GPU`, `FSDP`, or another Accelerate type
    /// (`DEEPSPEED`, `XLA`, ...) that loads but cannot be launched.
    pub distributed_type: String,
    /// `no`, `fp16`, `bf16` (or `fp8`, which loads but cannot be launched).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mixed_precision: Option<String>,
    /// Train on the CPU even where a GPU is present.
    #[serde(default)]
    pub use_cpu: bool,
    /// Check collectives for mismatches (`ACCELERATE_DEBUG_MODE`).
    #[serde(default)]
    pub debug: bool,
    /// Processes over all machines; `-1` means "pass `--num_processes`".
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_processes: Option<i64>,
    /// This machine's index.
    #[serde(default)]
    pub machine_rank: usize,
    /// Machines taking part.
    #[serde(default = "one")]
    pub num_machines: usize,
    /// GPUs to use (`all` or `0,1`); numbers are read as text.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "text_or_number"
    )]
    pub gpu_ids: Option<String>,
    /// Address of machine 0.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub main_process_ip: Option<String>,
    /// Port of the rendezvous on machine 0.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub main_process_port: Option<u16>,
    /// torchrun's rendezvous backend (`static`, `c10d`); kept. `accel launch`
    /// says at start-up that any but `static` has no effect.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rdzv_backend: Option<String>,
    /// All machines on one network; kept, not used.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub same_network: Option<bool>,
    /// Notebook launcher's entry point; kept, not used.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub main_training_function: Option<String>,
    /// Pin each rank to the CPUs near its GPU; kept, not used.
    #[serde(default)]
    pub enable_cpu_affinity: bool,
    /// Group restarts after a failed rank (`accel launch --max_restarts`;
    /// not one of Accelerate's keys, read when present).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_restarts: Option<usize>,
    /// Seconds between the launcher's checks of its ranks
    /// (`--monitor_interval`; read when present).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub monitor_interval: Option<f64>,
    /// FSDP settings, exported as `FSDP_*` when `distributed_type` is `FSDP`.
    #[serde(default, skip_serializing_if = "skip_fsdp")]
    pub fsdp_config: Option<FsdpFileConfig>,
    /// Keys accel-rs does not act on, kept as written (see [`KNOWN_KEYS`]).
    #[serde(flatten)]
    pub unused: Mapping,
}

fn local_machine() -> String {
    "LOCAL_MACHINE".to_string()
}

fn one() -> usize {
    1
}

fn skip_fsdp(f: &Option<FsdpFileConfig>) -> bool {
    f.as_ref().is_none_or(FsdpFileConfig::is_empty)
}

fn text_or_number<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> std::result::Result<Option<String>, D::Error> {
    Ok(match Option::<Value>::deserialize(d)? {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s),
        Some(Value::Number(n)) => Some(n.to_string()),
        Some(other) => {
            return Err(serde::de::Error::custom(format!(
                "gpu_ids: expected text or a number, found {other:?}"
            )))
        }
    })
}

/// Quotes bare `NO`, `no`, `yes`, `on`, `off`, `y`, `n` values.
///
/// serde_yaml_ng writes YAML 1.2, where these are strings, but PyYAML reads
/// YAML 1.1, where they are booleans: `distributed_type: NO` would load as
/// `False` in Python. Real booleans are written `true`/`false`, so a bare
/// word here is always a string; quote it as PyYAML's `safe_dump` does.
fn quote_yaml11_bools(text: &str) -> String {
    const WORDS: &[&str] = &["y", "n", "yes", "no", "on", "off"];
    let mut out = String::with_capacity(text.len());
    for line in text.lines() {
        let split = line.rfind(": ").map(|i| i + 2).or_else(|| {
            line.trim_start()
                .starts_with("- ")
                .then(|| line.find("- ").unwrap_or(0) + 2)
        });
        match split {
            Some(i) if WORDS.contains(&line[i..].to_ascii_lowercase().as_str()) => {
                out.push_str(&line[..i]);
                out.push('\'');
                out.push_str(&line[i..]);
                out.push('\'');
            }
            _ => out.push_str(line),
        }
        out.push('\n');
    }
    out
}

impl Default for ClusterConfig {
    fn default() -> Self {
        Self {
            compute_environment: local_machine(),
            distributed_type: "NO".to_string(),
            mixed_precision: Some("no".to_string()),
            use_cpu: false,
            debug: false,
            num_processes: Some(1),
            machine_rank: 0,
            num_machines: 1,
            gpu_ids: None,
            main_process_ip: None,
            main_process_port: None,
            rdzv_backend: None,
            same_network: None,
            main_training_function: None,
            enable_cpu_affinity: false,
            max_restarts: None,
            monitor_interval: None,
            fsdp_config: None,
            unused: Mapping::new(),
        }
    }
}

impl ClusterConfig {
    /// Parses YAML text; `path` only names the file in errors.
    ///
    /// # Errors
    /// [`Error::Config`] for an unknown key (named, with the file) or a
    /// SageMaker config; [`Error::Yaml`] for text that is not a mapping or a
    /// value of the wrong type.
    pub fn from_yaml_str(text: &str, path: &Path) -> Result<Self> {
        let yaml_err = |e: serde_yaml_ng::Error| Error::Yaml {
            path: path.to_path_buf(),
            reason: e.to_string(),
        };
        let map: Mapping =
            match serde_yaml_ng::from_str::<Option<Mapping>>(text).map_err(yaml_err)? {
                Some(m) => m,
                None => Mapping::new(),
            };
        let mut unknown: Vec<String> = map
            .keys()
            .map(|k| k.as_str().map_or_else(|| format!("{k:?}"), str::to_string))
            .filter(|k| !KNOWN_KEYS.contains(&k.as_str()))
            .collect();
        unknown.sort();
        if let Some(first) = unknown.first() {
            return Err(Error::Config {
                key: first.clone(),
                reason: format!(
                    "unknown key in {} (all unknown keys: {unknown:?}); fix or remove it",
                    path.display()
                ),
            });
        }
        if map.get("compute_environment").and_then(Value::as_str) == Some("AMAZON_SAGEMAKER") {
            return Err(Error::Config {
                key: "compute_environment".into(),
                reason: format!(
                    "{}: SageMaker configs are not supported by accel-rs",
                    path.display()
                ),
            });
        }
        let mut config: ClusterConfig =
            serde_yaml_ng::from_value(Value::Mapping(map)).map_err(yaml_err)?;
        // Accelerate's `process_config`: a single-process file may omit num_processes,
        // and the legacy `fp16: true` means mixed_precision fp16.
        if config.num_processes.is_none() && config.distributed_type == "NO" {
            config.num_processes = Some(1);
        }
        if config.mixed_precision.is_none()
            && config.unused.get("fp16").and_then(Value::as_bool) == Some(true)
        {
            config.mixed_precision = Some("fp16".into());
        }
        Ok(config)
    }

    /// Reads and parses a config file.
    ///
    /// # Errors
    /// [`Error::Io`] when it cannot be read, else as [`ClusterConfig::from_yaml_str`].
    pub fn load(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io("reading", path, e))?;
        Self::from_yaml_str(&text, path)
    }

    /// Loads `path`, or the default file when `path` is `None` and that file
    /// exists; `Ok(None)` when there is no default file.
    ///
    /// # Errors
    /// As [`ClusterConfig::load`]; an explicit `path` that does not exist is an error.
    pub fn load_or_default(path: Option<&Path>) -> Result<Option<Self>> {
        match path {
            Some(p) => Self::load(p).map(Some),
            None => {
                let p = default_config_path();
                if p.is_file() {
                    Self::load(&p).map(Some)
                } else {
                    Ok(None)
                }
            }
        }
    }

    /// The YAML text [`ClusterConfig::save`] writes (keys sorted, as PyYAML's `safe_dump`).
    ///
    /// # Errors
    /// [`Error::Yaml`] if a kept value cannot be written.
    pub fn to_yaml_string(&self) -> Result<String> {
        let value = serde_yaml_ng::to_value(self).map_err(|e| Error::Yaml {
            path: PathBuf::new(),
            reason: e.to_string(),
        })?;
        let mut map = match value {
            Value::Mapping(m) => m,
            _ => Mapping::new(),
        };
        let mut entries: Vec<(Value, Value)> = std::mem::take(&mut map).into_iter().collect();
        entries.sort_by(|a, b| a.0.as_str().cmp(&b.0.as_str()));
        let sorted: Mapping = entries.into_iter().collect();
        let text = serde_yaml_ng::to_string(&sorted).map_err(|e| Error::Yaml {
            path: PathBuf::new(),
            reason: e.to_string(),
        })?;
        Ok(quote_yaml11_bools(&text))
    }

    /// Writes the file atomically (a temporary file in the same folder, then a
    /// rename), creating the folder.
    ///
    /// # Errors
    /// [`Error::Io`] naming the step and path that failed.
    pub fn save(&self, path: &Path) -> Result<()> {
        let text = self.to_yaml_string().map_err(|e| match e {
            Error::Yaml { reason, .. } => Error::Yaml {
                path: path.to_path_buf(),
                reason,
            },
            other => other,
        })?;
        let dir = path
            .parent()
            .filter(|d| !d.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        std::fs::create_dir_all(dir).map_err(|e| Error::io("creating", dir, e))?;
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy())
            .unwrap_or_default();
        let tmp = dir.join(format!(".{name}.tmp{}", std::process::id()));
        let write = || -> std::io::Result<()> {
            let mut f = std::fs::File::create(&tmp)?;
            f.write_all(text.as_bytes())?;
            f.sync_all()
        };
        write().map_err(|e| Error::io("writing", &tmp, e))?;
        std::fs::rename(&tmp, path).map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            Error::io("renaming", path, e)
        })
    }

    /// `distributed_type` as the kinds accel-rs runs.
    ///
    /// # Errors
    /// [`Error::Config`] for an Accelerate type accel-rs does not run (`XLA`,
    /// `MEGATRON_LM`, ...). `DEEPSPEED` runs as FSDP: its ZeRO stage is a
    /// sharding strategy (the launcher exports its settings).
    pub fn distributed(&self) -> Result<DistributedType> {
        if self.distributed_type.eq_ignore_ascii_case("DEEPSPEED") {
            return Ok(DistributedType::Fsdp);
        }
        self.distributed_type.parse().map_err(|_| Error::Config {
            key: "distributed_type".into(),
            reason: format!(
                "{} is not supported by accel-rs (supported: NO, MULTI_CPU, MULTI_GPU, FSDP, DEEPSPEED)",
                self.distributed_type
            ),
        })
    }

    /// `mixed_precision` as a [`PrecisionType`] (`None` when unset).
    ///
    /// # Errors
    /// [`Error::Config`] for `fp8` or an unknown name.
    pub fn precision(&self) -> Result<Option<PrecisionType>> {
        self.mixed_precision.as_deref().map(str::parse).transpose()
    }
}

/// Accelerate's `write_basic_config`: a single-machine file using every GPU
/// (or the CPU when there is none), saved at `path`.
///
/// Returns `Ok(None)` without touching an existing file, as Accelerate does.
///
/// # Errors
/// [`Error::Config`] for an unknown precision; [`Error::Io`] when saving fails.
pub fn write_basic_config(mixed_precision: &str, path: &Path) -> Result<Option<ClusterConfig>> {
    if path.exists() {
        return Ok(None);
    }
    let precision: PrecisionType = mixed_precision.parse()?;
    let gpus = accel_core::config::cuda_device_count();
    let config = ClusterConfig {
        mixed_precision: Some(precision.to_string()),
        use_cpu: gpus == 0,
        num_processes: Some(gpus.max(1) as i64),
        distributed_type: if gpus > 1 { "MULTI_GPU" } else { "NO" }.to_string(),
        ..ClusterConfig::default()
    };
    config.save(path)?;
    Ok(Some(config))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_serialised_key_is_a_known_key() {
        let mut c = ClusterConfig {
            gpu_ids: Some("all".into()),
            main_process_ip: Some("10.0.0.1".into()),
            main_process_port: Some(29500),
            rdzv_backend: Some("static".into()),
            same_network: Some(true),
            main_training_function: Some("main".into()),
            max_restarts: Some(2),
            monitor_interval: Some(0.5),
            fsdp_config: Some(FsdpFileConfig {
                fsdp_version: Some(2),
                ..Default::default()
            }),
            ..ClusterConfig::default()
        };
        c.unused
            .insert("deepspeed_config".into(), Value::Mapping(Mapping::new()));
        let Value::Mapping(m) = serde_yaml_ng::to_value(&c).unwrap() else {
            panic!("not a mapping")
        };
        for k in m.keys() {
            assert!(KNOWN_KEYS.contains(&k.as_str().unwrap()), "{k:?}");
        }
    }

    #[test]
    fn yaml_1_1_booleans_are_quoted_for_pyyaml() -> Result<()> {
        let mut c = ClusterConfig::default();
        c.unused.insert("downcast_bf16".into(), "no".into());
        c.unused.insert(
            "tpu_env".into(),
            Value::Sequence(vec!["On".into(), "x".into()]),
        );
        let text = c.to_yaml_string()?;
        assert!(text.contains("distributed_type: 'NO'\n"), "{text}");
        assert!(text.contains("mixed_precision: 'no'\n"), "{text}");
        assert!(text.contains("downcast_bf16: 'no'\n"), "{text}");
        assert!(text.contains("- 'On'\n- x\n"), "{text}");
        assert!(text.contains("use_cpu: false\n"), "{text}");
        let back = ClusterConfig::from_yaml_str(&text, Path::new("q.yaml"))?;
        assert_eq!(back, c);
        Ok(())
    }

    #[test]
    fn a_missing_num_processes_means_one_for_a_single_process_file() {
        let c = ClusterConfig::from_yaml_str(
            "distributed_type: 'NO'\nfp16: true\n",
            Path::new("x.yaml"),
        )
        .unwrap();
        assert_eq!(c.num_processes, Some(1));
        assert_eq!(c.precision().unwrap(), Some(PrecisionType::Fp16));
    }

    #[test]
    fn sagemaker_and_xla_are_named_and_deepspeed_runs_as_sharding() {
        let e = ClusterConfig::from_yaml_str(
            "compute_environment: AMAZON_SAGEMAKER\ndistributed_type: 'NO'\n",
            Path::new("s.yaml"),
        )
        .unwrap_err();
        assert!(e.to_string().contains("SageMaker"), "{e}");
        let c = ClusterConfig::from_yaml_str("distributed_type: DEEPSPEED\n", Path::new("d.yaml"))
            .unwrap();
        assert_eq!(c.distributed().unwrap(), DistributedType::Fsdp);
        let c =
            ClusterConfig::from_yaml_str("distributed_type: XLA\n", Path::new("x.yaml")).unwrap();
        assert!(c.distributed().unwrap_err().to_string().contains("XLA"));
    }
}
