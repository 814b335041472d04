//! What a resolved DeepSpeed configuration asks of accel-rs.

use serde_json::Value;

use super::DeepSpeedConfig;
use crate::optim::{AdamWConfig, SgdConfig};
use crate::precision::{GradScalerConfig, PrecisionType};
use crate::scheduler::Schedule;
use crate::Result;

/// The optimizer of a configuration's `optimizer` section.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum DeepSpeedOptimizer {
    /// `AdamW`, or `Adam` in DeepSpeed's default `adam_w_mode` (decoupled
    /// weight decay), over every trainable parameter alike.
    AdamW(AdamWConfig),
    /// `SGD`.
    Sgd(SgdConfig),
}

/// The schedule of a configuration's `scheduler` section, over the rate
/// `base_lr`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DeepSpeedScheduler {
    /// DeepSpeed's schedule as factors of `base_lr`.
    pub schedule: Schedule,
    /// `warmup_max_lr` for `WarmupLR`/`WarmupDecayLR`; `None` for
    /// `WarmupCosineLR`, which scales the optimizer's own rate.
    pub base_lr: Option<f64>,
}

/// A configuration mapped onto accel-rs' settings.
#[derive(Debug, Clone, PartialEq)]
pub struct DeepSpeedPlan {
    /// `zero_optimization.stage`: 0 plain data parallel, 1 optimizer state
    /// sharded (`ShardOptimizer`), 2 gradients too (`ShardGradOp`), 3
    /// parameters too (`FullShard`).
    pub zero_stage: u64,
    /// `offload_optimizer.device: cpu`.
    pub offload_optimizer: bool,
    /// `offload_param.device: cpu`.
    pub offload_param: bool,
    /// From `bf16.enabled` / `fp16.enabled`; `None` when neither section is
    /// there (the arguments' precision then applies, as Accelerate's
    /// DeepSpeed plugin adds the section).
    pub precision: Option<PrecisionType>,
    /// fp16's loss scale (`initial_scale_power`, `loss_scale_window`, or a
    /// static `loss_scale`).
    pub scaler: Option<GradScalerConfig>,
    /// `gradient_clipping` (0 clips nothing).
    pub gradient_clipping: Option<f64>,
    /// `train_micro_batch_size_per_gpu`.
    pub micro_batch_size: Option<usize>,
    /// `gradient_accumulation_steps`.
    pub gradient_accumulation_steps: Option<usize>,
    /// `train_batch_size`.
    pub train_batch_size: Option<usize>,
    /// The `optimizer` section.
    pub optimizer: Option<DeepSpeedOptimizer>,
    /// `stage3_gather_16bit_weights_on_model_save`: the final model saved
    /// as a 16-bit folder.
    pub save_16bit_model: bool,
    /// One line per key that has no effect here, said at start-up.
    pub notices: Vec<String>,
}

impl DeepSpeedPlan {
    /// The FSDP strategy of the ZeRO stage (`None` for stage 0).
    pub fn sharding_strategy(&self) -> Option<accel_dist::fsdp::ShardingStrategy> {
        use accel_dist::fsdp::ShardingStrategy as S;
        match self.zero_stage {
            1 => Some(S::ShardOptimizer),
            2 => Some(S::ShardGradOp),
            3 => Some(S::FullShard),
            _ => None,
        }
    }
}

/// A number at `key`, refusing an `"auto"` nobody filled.
fn number(c: &DeepSpeedConfig, key: &str) -> Result<Option<f64>> {
    match c.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(n)) => Ok(n.as_f64()),
        Some(v) if v == "auto" => Err(c.error(
            key,
            "is \"auto\", which the Trainer fills from TrainingArguments; outside the Trainer set a value",
        )),
        Some(other) => Err(c.error(key, format!("expected a number, found {other}"))),
    }
}

fn count(c: &DeepSpeedConfig, key: &str) -> Result<Option<usize>> {
    match number(c, key)? {
        Some(x) if x >= 0.0 && x.fract() == 0.0 => Ok(Some(x as usize)),
        Some(x) => Err(c.error(key, format!("expected a whole number, found {x}"))),
        None => Ok(None),
    }
}

fn flag(c: &DeepSpeedConfig, key: &str) -> Result<Option<bool>> {
    match c.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(v) if v == "auto" => {
            Err(c.error(key, "is \"auto\" but no TrainingArguments filled it"))
        }
        Some(other) => Err(c.error(key, format!("expected true or false, found {other}"))),
    }
}

/// `device` of an offload section: `cpu` or `none`; NVMe refused by name.
fn offload(c: &DeepSpeedConfig, key: &str) -> Result<bool> {
    match c.get(key).and_then(Value::as_str).map(str::to_ascii_lowercase) {
        None => Ok(false),
        Some(d) if d == "none" => Ok(false),
        Some(d) if d == "cpu" => Ok(true),
        Some(d) if d == "nvme" => Err(c.error(
            key,
            "NVMe offload is not built in accel-rs: use `cpu` (the optimizer state and parameters in host memory)",
        )),
        Some(d) => Err(c.error(key, format!("unknown device {d:?} (expected cpu or none)"))),
    }
}

pub(super) fn plan(c: &DeepSpeedConfig) -> Result<DeepSpeedPlan> {
    let zero_stage = match c.get("zero_optimization.stage") {
        None => 0,
        Some(v) => match v.as_u64() {
            Some(s @ 0..=3) => s,
            _ => {
                return Err(c.error(
                    "zero_optimization.stage",
                    format!("{v} (expected 0, 1, 2 or 3)"),
                ))
            }
        },
    };
    let offload_optimizer = offload(c, "zero_optimization.offload_optimizer.device")?;
    let offload_param = offload(c, "zero_optimization.offload_param.device")?;
    if offload_param && zero_stage != 3 {
        return Err(c.error(
            "zero_optimization.offload_param",
            format!("parameter offload needs ZeRO stage 3 (the stage is {zero_stage})"),
        ));
    }
    if offload_optimizer && zero_stage == 0 {
        return Err(c.error(
            "zero_optimization.offload_optimizer",
            "optimizer offload needs ZeRO stage 1, 2 or 3",
        ));
    }
    let bf16 = flag(c, "bf16.enabled")?;
    let fp16 = flag(c, "fp16.enabled")?;
    let precision = match (bf16, fp16) {
        (Some(true), Some(true)) => {
            return Err(c.error("bf16.enabled", "bf16 and fp16 are both enabled; enable one"))
        }
        (Some(true), _) => Some(PrecisionType::Bf16),
        (_, Some(true)) => Some(PrecisionType::Fp16),
        (None, None) => None,
        _ => Some(PrecisionType::No),
    };
    let scaler = if precision == Some(PrecisionType::Fp16) {
        let defaults = GradScalerConfig::default();
        Some(match number(c, "fp16.loss_scale")? {
            Some(s) if s > 0.0 => GradScalerConfig {
                init_scale: s,
                growth_factor: 1.0,
                backoff_factor: 1.0,
                growth_interval: u64::MAX,
            },
            _ => GradScalerConfig {
                init_scale: 2f64.powf(number(c, "fp16.initial_scale_power")?.unwrap_or(16.0)),
                growth_interval: count(c, "fp16.loss_scale_window")?.unwrap_or(1000) as u64,
                ..defaults
            },
        })
    } else {
        None
    };
    let save_16bit_model = flag(
        c,
        "zero_optimization.stage3_gather_16bit_weights_on_model_save",
    )?
    .or(flag(
        c,
        "zero_optimization.gather_16bit_weights_on_model_save",
    )?)
    .unwrap_or(false);
    let plan = DeepSpeedPlan {
        zero_stage,
        offload_optimizer,
        offload_param,
        precision,
        scaler,
        gradient_clipping: number(c, "gradient_clipping")?,
        micro_batch_size: count(c, "train_micro_batch_size_per_gpu")?,
        gradient_accumulation_steps: count(c, "gradient_accumulation_steps")?,
        train_batch_size: count(c, "train_batch_size")?,
        optimizer: optimizer(c)?,
        save_16bit_model,
        notices: super::keys::inert(c.as_json()),
    };
    // The schedule's type is checked now; its lengths once the run's are known.
    if let Some(t) = c.get("scheduler.type") {
        schedule_kind(c, t)?;
    }
    Ok(plan)
}

fn optimizer(c: &DeepSpeedConfig) -> Result<Option<DeepSpeedOptimizer>> {
    let Some(kind) = c.get("optimizer.type") else {
        if c.get("optimizer").is_some() {
            return Err(c.error("optimizer.type", "the optimizer section names no type"));
        }
        return Ok(None);
    };
    let kind = kind.as_str().unwrap_or_default().to_ascii_lowercase();
    let p = |k: &str| number(c, &format!("optimizer.params.{k}"));
    let known: &[&str] = match kind.as_str() {
        "adam" | "adamw" => &[
            "lr",
            "betas",
            "eps",
            "weight_decay",
            "adam_w_mode",
            "torch_adam",
            "bias_correction",
            "amsgrad",
        ],
        "sgd" => &["lr", "momentum", "dampening", "weight_decay", "nesterov"],
        _ => {
            return Err(c.error(
                "optimizer.type",
                format!("{kind:?} is not built in accel-rs (Adam, AdamW and SGD are)"),
            ))
        }
    };
    if let Some(Value::Object(params)) = c.get("optimizer.params") {
        if let Some(k) = params.keys().find(|k| !known.contains(&k.as_str())) {
            return Err(c.error(
                &format!("optimizer.params.{k}"),
                format!("unknown parameter of {kind}"),
            ));
        }
    }
    if kind == "sgd" {
        return Ok(Some(DeepSpeedOptimizer::Sgd(SgdConfig {
            lr: p("lr")?.unwrap_or(1e-3),
            momentum: p("momentum")?.unwrap_or(0.0),
            dampening: p("dampening")?.unwrap_or(0.0),
            weight_decay: p("weight_decay")?.unwrap_or(0.0),
            nesterov: flag(c, "optimizer.params.nesterov")?.unwrap_or(false),
        })));
    }
    if flag(c, "optimizer.params.amsgrad")? == Some(true) {
        return Err(c.error(
            "optimizer.params.amsgrad",
            "AMSGrad is not built in accel-rs",
        ));
    }
    if flag(c, "optimizer.params.bias_correction")? == Some(false) {
        return Err(c.error(
            "optimizer.params.bias_correction",
            "Adam without bias correction is not built in accel-rs",
        ));
    }
    let weight_decay = p("weight_decay")?.unwrap_or(0.0);
    // DeepSpeed's Adam decouples the decay unless told otherwise (`adam_w_mode`).
    let decoupled = kind == "adamw" || flag(c, "optimizer.params.adam_w_mode")?.unwrap_or(true);
    if !decoupled && weight_decay != 0.0 {
        return Err(c.error(
            "optimizer.params.adam_w_mode",
            "Adam with L2 weight decay (adam_w_mode: false) is not built in accel-rs; use AdamW or weight_decay 0",
        ));
    }
    let betas = match c.get("optimizer.params.betas") {
        None => (0.9, 0.999),
        Some(Value::Array(b)) if b.len() == 2 && b.iter().all(Value::is_number) => (
            b[0].as_f64().unwrap_or_default(),
            b[1].as_f64().unwrap_or_default(),
        ),
        Some(v) => {
            return Err(c.error(
                "optimizer.params.betas",
                format!("expected two numbers, found {v}"),
            ))
        }
    };
    Ok(Some(DeepSpeedOptimizer::AdamW(AdamWConfig {
        lr: p("lr")?.unwrap_or(1e-3),
        beta1: betas.0,
        beta2: betas.1,
        eps: p("eps")?.unwrap_or(1e-8),
        weight_decay,
    })))
}

/// The three schedules built, by their DeepSpeed names.
#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Warmup,
    WarmupDecay,
    WarmupCosine,
}

fn schedule_kind(c: &DeepSpeedConfig, t: &Value) -> Result<Kind> {
    match t.as_str().unwrap_or_default() {
        "WarmupLR" => Ok(Kind::Warmup),
        "WarmupDecayLR" => Ok(Kind::WarmupDecay),
        "WarmupCosineLR" => Ok(Kind::WarmupCosine),
        other => Err(c.error(
            "scheduler.type",
            format!("{other:?} is not built in accel-rs (WarmupLR, WarmupDecayLR and WarmupCosineLR are)"),
        )),
    }
}

/// The `scheduler` section as a schedule, once its lengths are filled;
/// `optimizer_lr` is the rate the optimizer starts from.
pub(super) fn scheduler(
    c: &DeepSpeedConfig,
    optimizer_lr: f64,
) -> Result<Option<DeepSpeedScheduler>> {
    let Some(t) = c.get("scheduler.type") else {
        return Ok(None);
    };
    let kind = schedule_kind(c, t)?;
    let p = |k: &str| number(c, &format!("scheduler.params.{k}"));
    let warmup = count(c, "scheduler.params.warmup_num_steps")?.unwrap_or(1000) as u64;
    let log = match c
        .get("scheduler.params.warmup_type")
        .and_then(Value::as_str)
    {
        None | Some("log") => true,
        Some("linear") => false,
        Some(other) => {
            return Err(c.error(
                "scheduler.params.warmup_type",
                format!("{other:?} (expected log or linear)"),
            ))
        }
    };
    let total = count(c, "scheduler.params.total_num_steps")?.map(|t| t as u64);
    let need_total = || {
        total.ok_or_else(|| {
            c.error(
                "scheduler.params.total_num_steps",
                "is required by this schedule",
            )
        })
    };
    Ok(Some(match kind {
        Kind::Warmup | Kind::WarmupDecay => {
            let min = p("warmup_min_lr")?.unwrap_or(0.0);
            let max = p("warmup_max_lr")?.unwrap_or(optimizer_lr);
            let total = if kind == Kind::WarmupDecay {
                Some(need_total()?)
            } else {
                None
            };
            DeepSpeedScheduler {
                schedule: Schedule::DeepSpeedWarmup {
                    min_ratio: if max == 0.0 { 0.0 } else { min / max },
                    warmup,
                    log,
                    total,
                },
                base_lr: Some(max),
            }
        }
        Kind::WarmupCosine => DeepSpeedScheduler {
            schedule: Schedule::DeepSpeedWarmupCosine {
                warmup_min_ratio: p("warmup_min_ratio")?.unwrap_or(0.0),
                warmup,
                log,
                total: need_total()?,
                cos_min_ratio: p("cos_min_ratio")?.unwrap_or(1e-4),
            },
            base_lr: None,
        },
    }))
}
