//! DeepSpeed configuration files, run as what accel-rs already does: ZeRO
//! stages 1/2/3 are the FSDP strategies (`ShardOptimizer`, `ShardGradOp`,
//! `FullShard`), `offload_*` with `device: cpu` the CPU offload, `bf16` /
//! `fp16` the mixed precision and loss scaler, `optimizer` / `scheduler`
//! the optimizers and DeepSpeed's schedules.
//!
//! Why a mapping and not DeepSpeed: people arrive with the `ds_config.json`
//! of a transformers recipe, and the point is that it runs unchanged. So
//! the file is read as transformers' `HfTrainerDeepSpeedConfig` reads it:
//! `"auto"` values are filled from [`TrainingArguments`], an explicit value
//! that contradicts them is an error listing every mismatch (transformers'
//! words), and every key is either acted on, refused by name (NVMe offload,
//! an optimizer or schedule not built here), or listed at start-up as having
//! no effect (bucket sizes, ZeRO++ quantization, monitors, ...).
//!
//! ```
//! use accel_core::deepspeed::DeepSpeedConfig;
//! use accel_core::trainer::TrainingArguments;
//! let args = TrainingArguments::new("out").with_batch_size(4);
//! let mut ds = DeepSpeedConfig::from_value(serde_json::json!({
//!     "zero_optimization": {"stage": 2},
//!     "train_micro_batch_size_per_gpu": "auto",
//!     "gradient_clipping": "auto",
//! })).unwrap();
//! ds.fill_from_args(&args, 1);
//! let plan = ds.plan().unwrap();
//! assert_eq!(plan.zero_stage, 2);
//! assert_eq!(plan.micro_batch_size, Some(4));
//! ```

mod keys;
mod launcher;
mod plan;

use std::path::{Path, PathBuf};

use serde_json::Value;

pub(crate) use launcher::apply as apply_to_accelerator;
pub use launcher::{from_vars, ENV_USE_DEEPSPEED};
pub use plan::{DeepSpeedOptimizer, DeepSpeedPlan, DeepSpeedScheduler};

use crate::trainer::TrainingArguments;
use crate::{Error, Result};

/// A DeepSpeed configuration (`ds_config.json`) being resolved against the
/// training arguments.
#[derive(Debug, Clone, PartialEq)]
pub struct DeepSpeedConfig {
    config: Value,
    /// The file it came from, for messages.
    source: Option<PathBuf>,
    /// transformers' mismatch lines, in its order.
    mismatches: Vec<String>,
}

impl DeepSpeedConfig {
    /// Reads a JSON file.
    ///
    /// # Errors
    /// The file cannot be read, or is not a JSON object.
    pub fn from_path(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|e| Error::io("reading", path, e))?;
        let config: Value = serde_json::from_str(&text).map_err(|e| Error::Json {
            path: path.into(),
            reason: e.to_string(),
        })?;
        let mut c = Self::from_value(config).map_err(|e| match e {
            Error::Config { reason, .. } => Error::Json {
                path: path.into(),
                reason,
            },
            other => other,
        })?;
        c.source = Some(path.into());
        Ok(c)
    }

    /// Takes a parsed configuration (transformers' `deepspeed=dict`).
    ///
    /// # Errors
    /// Not a JSON object.
    pub fn from_value(config: Value) -> Result<Self> {
        if !config.is_object() {
            return Err(Error::Config {
                key: "deepspeed".into(),
                reason: "a DeepSpeed configuration is a JSON object".into(),
            });
        }
        Ok(Self {
            config,
            source: None,
            mismatches: vec![],
        })
    }

    /// `TrainingArguments::deepspeed`: a JSON string is a file's path, an
    /// object the configuration itself.
    ///
    /// # Errors
    /// As [`DeepSpeedConfig::from_path`] and [`DeepSpeedConfig::from_value`].
    pub fn from_argument(v: &Value) -> Result<Self> {
        match v {
            Value::String(path) => Self::from_path(path),
            other => Self::from_value(other.clone()),
        }
    }

    /// The configuration as it stands (after filling, the values used).
    pub fn as_json(&self) -> &Value {
        &self.config
    }

    /// Where it was read from.
    pub fn source(&self) -> Option<&Path> {
        self.source.as_deref()
    }

    /// The value at a dotted key (`zero_optimization.stage`).
    pub fn get(&self, key: &str) -> Option<&Value> {
        key.split('.').try_fold(&self.config, |v, k| v.get(k))
    }

    /// Whether the value at `key` is `"auto"`.
    pub fn is_auto(&self, key: &str) -> bool {
        self.get(key).is_some_and(|v| v == "auto")
    }

    /// transformers' `fill_match`: an `"auto"` value becomes `hf`; another
    /// value that differs from it is a mismatch (when `must_match`). Nothing
    /// happens when the key's parent section is absent.
    fn fill(&mut self, key: &str, hf: Value, hf_key: &str, must_match: bool) {
        let (parent, last) = match key.rsplit_once('.') {
            Some((p, l)) => (Some(p), l),
            None => (None, key),
        };
        let node = match parent {
            None => Some(&mut self.config),
            Some(p) => p.split('.').try_fold(&mut self.config, |v, k| v.get_mut(k)),
        };
        let Some(Value::Object(node)) = node else {
            return;
        };
        match node.get(last) {
            Some(v) if v == "auto" => {
                node.insert(last.into(), hf);
            }
            Some(v) if must_match && !v.is_null() && !same(v, &hf) => {
                self.mismatches.push(format!(
                    "- ds {key}={} vs hf {hf_key}={}",
                    python(v),
                    python(&hf)
                ));
            }
            _ => {}
        }
    }

    /// transformers' `trainer_config_process`: the values known when the
    /// arguments are, for `world` processes.
    pub fn fill_from_args(&mut self, args: &TrainingArguments, world: usize) {
        let micro = args.per_device_train_batch_size;
        let gas = args.gradient_accumulation_steps;
        self.fill(
            "train_micro_batch_size_per_gpu",
            micro.into(),
            "per_device_train_batch_size",
            true,
        );
        self.fill(
            "gradient_accumulation_steps",
            gas.into(),
            "gradient_accumulation_steps",
            true,
        );
        let total = world * micro * gas;
        self.fill(
            "train_batch_size",
            total.into(),
            "train_batch_size (calculated)",
            true,
        );
        self.fill(
            "gradient_clipping",
            args.max_grad_norm.into(),
            "max_grad_norm",
            true,
        );
        self.fill(
            "optimizer.params.lr",
            args.learning_rate.into(),
            "learning_rate",
            true,
        );
        let betas = Value::from(vec![args.adam_beta1, args.adam_beta2]);
        self.fill(
            "optimizer.params.betas",
            betas,
            "adam_beta1+adam_beta2",
            true,
        );
        self.fill(
            "optimizer.params.eps",
            args.adam_epsilon.into(),
            "adam_epsilon",
            true,
        );
        self.fill(
            "optimizer.params.weight_decay",
            args.weight_decay.into(),
            "weight_decay",
            true,
        );
        self.fill("scheduler.params.warmup_min_lr", 0.into(), "", false);
        self.fill(
            "scheduler.params.warmup_max_lr",
            args.learning_rate.into(),
            "learning_rate",
            true,
        );
        self.fill(
            "fp16.enabled",
            args.fp16.into(),
            "fp16|fp16_full_eval",
            true,
        );
        self.fill(
            "bf16.enabled",
            args.bf16.into(),
            "bf16|bf16_full_eval",
            true,
        );
    }

    /// transformers' `trainer_config_finalize`: the values known once the
    /// run's length and the model are; then every mismatch, as one error in
    /// transformers' words.
    ///
    /// # Errors
    /// [`Error::Config`] listing the mismatches.
    pub fn finalize(
        &mut self,
        args: &TrainingArguments,
        hidden_size: Option<usize>,
        num_training_steps: u64,
    ) -> Result<()> {
        let sized = [
            "zero_optimization.reduce_bucket_size",
            "zero_optimization.stage3_prefetch_bucket_size",
            "zero_optimization.stage3_param_persistence_threshold",
        ];
        // Sized by the model's width in DeepSpeed; they size nothing here (the
        // start-up notice says so), so without a width they stay `"auto"`.
        if let Some(h) = hidden_size {
            self.fill(sized[0], (h * h).into(), "", false);
            if self.zero_stage() == 3 {
                self.fill(sized[1], ((0.9 * (h * h) as f64) as u64).into(), "", false);
                self.fill(sized[2], (10 * h).into(), "", false);
            }
        }
        let total = num_training_steps;
        self.fill(
            "scheduler.params.total_num_steps",
            total.into(),
            "num_training_steps (calculated)",
            true,
        );
        let warmup = args.num_warmup_steps(total).max(1);
        self.fill(
            "scheduler.params.warmup_num_steps",
            warmup.into(),
            "warmup_steps",
            true,
        );
        self.check_mismatches()
    }

    /// The mismatches found so far as one error, as transformers raises it.
    ///
    /// # Errors
    /// [`Error::Config`] when there are any.
    pub fn check_mismatches(&self) -> Result<()> {
        if self.mismatches.is_empty() {
            return Ok(());
        }
        Err(Error::Config {
            key: format!("deepspeed{}", self.file_suffix()),
            reason: format!(
                "Please correct the following DeepSpeed config values that mismatch TrainingArguments values:\n{}\nThe easiest method is to set these DeepSpeed config values to 'auto'.",
                self.mismatches.join("\n")
            ),
        })
    }

    /// ` (file)` when read from one.
    fn file_suffix(&self) -> String {
        self.source
            .as_ref()
            .map(|p| format!(" ({})", p.display()))
            .unwrap_or_default()
    }

    /// `zero_optimization.stage`, 0 when absent.
    pub fn zero_stage(&self) -> u64 {
        self.get("zero_optimization.stage")
            .and_then(Value::as_u64)
            .unwrap_or(0)
    }

    /// What the configuration asks of accel-rs, and what of it has no effect.
    ///
    /// # Errors
    /// [`Error::Config`] naming the key for a value that cannot be run here
    /// (NVMe offload, an unknown optimizer or schedule, an `"auto"` left
    /// unfilled) or that contradicts another.
    pub fn plan(&self) -> Result<DeepSpeedPlan> {
        plan::plan(self)
    }

    /// The `scheduler` section as a schedule, after [`DeepSpeedConfig::finalize`]
    /// filled its lengths; `optimizer_lr` is the optimizer's starting rate.
    ///
    /// # Errors
    /// A schedule not built here, or a length left `"auto"`.
    pub fn scheduler(&self, optimizer_lr: f64) -> Result<Option<DeepSpeedScheduler>> {
        plan::scheduler(self, optimizer_lr)
    }

    /// An [`Error::Config`] for `key` of this configuration.
    pub(crate) fn error(&self, key: &str, reason: impl Into<String>) -> Error {
        Error::Config {
            key: format!("deepspeed{} {key}", self.file_suffix()),
            reason: reason.into(),
        }
    }
}

/// What the Trainer's and the launcher's paths apply alike: every line of
/// `notes` and of the plan's own notices said once (rank 0), the ZeRO stage
/// as its FSDP plugin (CPU offload when either offload section asks for
/// it, each repeated block a unit, so that ZeRO-3 gathers a layer at a time
/// as DeepSpeed gathers module by module), and the fp16 loss scale.
pub(crate) fn apply_zero(
    plan: &DeepSpeedPlan,
    notes: &[String],
    config: &mut crate::accelerator::AcceleratorConfig,
) -> Result<()> {
    if crate::state::env_usize("RANK")?.unwrap_or(0) == 0 {
        for n in notes.iter().chain(&plan.notices) {
            crate::notice::warn(n);
        }
    }
    if let Some(strategy) = plan.sharding_strategy() {
        config.fsdp = Some(
            crate::fsdp::FullyShardedDataParallelPlugin::new(strategy)
                .with_cpu_offload(plan.offload_optimizer || plan.offload_param)
                .with_auto_wrap_policy(crate::fsdp::AutoWrapPolicy::Transformer {
                    patterns: vec![],
                }),
        );
    }
    if let Some(scaler) = plan.scaler {
        config.scaler = scaler;
    }
    Ok(())
}

/// JSON equality with numbers compared as numbers (`1` equals `1.0`).
fn same(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Number(x), Value::Number(y)) => x.as_f64() == y.as_f64(),
        (Value::Array(x), Value::Array(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(a, b)| same(a, b))
        }
        _ => a == b,
    }
}

/// A value as Python prints it in transformers' message (`True`, `0.0001`,
/// `[0.9, 0.999]`).
fn python(v: &Value) -> String {
    match v {
        Value::Bool(true) => "True".into(),
        Value::Bool(false) => "False".into(),
        Value::Null => "None".into(),
        Value::Number(n) => match (n.as_i64(), n.as_f64()) {
            (Some(i), _) => i.to_string(),
            (None, Some(f)) => python_float(f),
            _ => n.to_string(),
        },
        Value::Array(xs) => format!("[{}]", xs.iter().map(python).collect::<Vec<_>>().join(", ")),
        Value::String(s) => s.clone(),
        Value::Object(_) => v.to_string(),
    }
}

/// A float as Python's `repr` writes it: the shortest round-tripping digits,
/// scientific below 1e-4 and from 1e16.
fn python_float(f: f64) -> String {
    if f == f.trunc() && f.abs() < 1e16 {
        return format!("{f:.1}");
    }
    let a = f.abs();
    if (1e-4..1e16).contains(&a) {
        format!("{f}")
    } else {
        // Rust writes `1e-5`; Python `1e-05`.
        let s = format!("{f:e}");
        match s.split_once('e') {
            Some((m, e)) => {
                let (sign, digits) = e.strip_prefix('-').map_or(("+", e), |d| ("-", d));
                format!("{m}e{sign}{digits:0>2}")
            }
            None => s,
        }
    }
}

#[cfg(test)]
mod tests;
