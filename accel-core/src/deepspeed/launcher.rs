//! `distributed_type: DEEPSPEED` under `accel launch`: the
//! `ACCELERATE_DEEPSPEED_*` variables the launcher exports from
//! `deepspeed_config` (Accelerate's names), read back into a configuration
//! and applied to the Accelerator as Accelerate's `DeepSpeedPlugin` would.

use serde_json::{json, Map, Value};

use super::DeepSpeedConfig;
use crate::accelerator::AcceleratorConfig;
use crate::{Error, Result};

/// `ACCELERATE_USE_DEEPSPEED`: a DeepSpeed job.
pub const ENV_USE_DEEPSPEED: &str = "ACCELERATE_USE_DEEPSPEED";

/// The configuration the launcher describes through `lookup` (the process
/// environment in [`crate::Accelerator::new`]), or `None` for another kind
/// of job: the `deepspeed_config_file` it names with its `"auto"` values
/// filled from the other variables, else one built from them (ZeRO stage
/// 2 by default, as Accelerate's plugin).
///
/// # Errors
/// An unreadable file, a variable that does not parse, or a file value
/// that contradicts a variable (every mismatch listed).
pub fn from_vars(lookup: impl Fn(&str) -> Option<String>) -> Result<Option<DeepSpeedConfig>> {
    let truthy = |k: &str| lookup(k).is_some_and(|v| v.eq_ignore_ascii_case("true") || v == "1");
    if !truthy(ENV_USE_DEEPSPEED) {
        return Ok(None);
    }
    let number = |k: &str| -> Result<Option<f64>> {
        lookup(k)
            .map(|v| {
                v.trim().parse::<f64>().map_err(|_| Error::Config {
                    key: k.into(),
                    reason: format!("{v:?} is not a number"),
                })
            })
            .transpose()
    };
    let gas = number("ACCELERATE_GRADIENT_ACCUMULATION_STEPS")?.map(|g| g as u64);
    let clip = number("ACCELERATE_GRADIENT_CLIPPING")?;
    if let Some(file) = lookup("ACCELERATE_DEEPSPEED_CONFIG_FILE") {
        let mut c = DeepSpeedConfig::from_path(&file)?;
        c.fill(
            "gradient_accumulation_steps",
            gas.unwrap_or(1).into(),
            "gradient_accumulation_steps",
            true,
        );
        if let Some(clip) = clip {
            c.fill("gradient_clipping", clip.into(), "gradient_clipping", true);
        }
        c.check_mismatches()?;
        return Ok(Some(c));
    }
    let stage = number("ACCELERATE_DEEPSPEED_ZERO_STAGE")?.unwrap_or(2.0) as u64;
    let device = |k: &str| lookup(k).unwrap_or_else(|| "none".into());
    let mut zero = Map::new();
    zero.insert("stage".into(), stage.into());
    zero.insert(
        "offload_optimizer".into(),
        json!({"device": device("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE")}),
    );
    zero.insert(
        "offload_param".into(),
        json!({"device": device("ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE")}),
    );
    if stage == 3 {
        zero.insert(
            "stage3_gather_16bit_weights_on_model_save".into(),
            truthy("ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL").into(),
        );
    }
    let mut config = Map::new();
    config.insert("zero_optimization".into(), Value::Object(zero));
    config.insert(
        "gradient_accumulation_steps".into(),
        gas.unwrap_or(1).into(),
    );
    if let Some(clip) = clip {
        config.insert("gradient_clipping".into(), clip.into());
    }
    DeepSpeedConfig::from_value(Value::Object(config)).map(Some)
}

/// Applies what `ds` asks of the Accelerator: the ZeRO stage as an FSDP
/// plugin, accumulation, automatic clipping at the optimizer step (as
/// DeepSpeed's engine clips), the precision of a `bf16`/`fp16` section and
/// the fp16 loss scale. The `optimizer`, `scheduler` and batch-size
/// sections are the Trainer's (the Accelerator steps the optimizer it is
/// given): said at start-up, like every key with no effect.
///
/// # Errors
/// As [`DeepSpeedConfig::plan`]; a precision or accumulation that
/// contradicts the Accelerator's.
pub(crate) fn apply(ds: &DeepSpeedConfig, config: &mut AcceleratorConfig) -> Result<()> {
    let mut trimmed = ds.clone();
    let mut notes = vec![];
    if let Value::Object(m) = &mut trimmed.config {
        for key in [
            "optimizer",
            "scheduler",
            "train_micro_batch_size_per_gpu",
            "train_batch_size",
        ] {
            if m.remove(key).is_some() {
                notes.push(format!(
                    "DeepSpeed setting `{key}` has no effect through the Accelerator: the Trainer (TrainingArguments::deepspeed) acts on it; here the optimizer, schedule and data loader you prepare are used"
                ));
            }
        }
    }
    let plan = trimmed.plan()?;
    super::apply_zero(&plan, &notes, config)?;
    if let Some(gas) = plan.gradient_accumulation_steps {
        let have = config.gradient_accumulation.num_steps;
        if have != 1 && have != gas {
            return Err(ds.error(
                "gradient_accumulation_steps",
                format!("{gas} contradicts the Accelerator's {have}"),
            ));
        }
        config.gradient_accumulation.num_steps = gas;
    }
    config.gradient_clipping = plan.gradient_clipping.filter(|c| *c > 0.0);
    config.save_16bit_model = plan.save_16bit_model;
    if let (Some(p), None) = (plan.precision, config.mixed_precision) {
        let launcher = std::env::var(crate::config::ENV_MIXED_PRECISION).ok();
        if let Some(l) = launcher
            .as_deref()
            .filter(|l| *l != "no" && *l != p.to_string())
        {
            return Err(ds.error(
                "bf16/fp16",
                format!("the file asks for {p} but the launcher's mixed_precision is {l}"),
            ));
        }
        config.mixed_precision = Some(p);
    }
    Ok(())
}
