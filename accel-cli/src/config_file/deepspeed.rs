//! The `deepspeed_config` section of `default_config.yaml` (what
//! `accelerate config` writes for `distributed_type: DEEPSPEED`) and the
//! `ACCELERATE_DEEPSPEED_*` variables `accel launch` exports from it, as
//! Accelerate's `prepare_deepspeed_cmd_env` names them; each rank's
//! Accelerator reads them back (`accel_core::deepspeed::from_vars`).

use serde_yaml_ng::{Mapping, Value};

use accel_core::{Error, Result};

/// `(name, value)` pairs for the ranks' environment.
pub type EnvVars = Vec<(String, String)>;

/// `(key of deepspeed_config, variable)`: the settings exported as written.
const EXPORTED: &[(&str, &str)] = &[
    ("deepspeed_config_file", "ACCELERATE_DEEPSPEED_CONFIG_FILE"),
    ("zero_stage", "ACCELERATE_DEEPSPEED_ZERO_STAGE"),
    (
        "offload_optimizer_device",
        "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE",
    ),
    (
        "offload_param_device",
        "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE",
    ),
    (
        "gradient_accumulation_steps",
        "ACCELERATE_GRADIENT_ACCUMULATION_STEPS",
    ),
    ("gradient_clipping", "ACCELERATE_GRADIENT_CLIPPING"),
    ("zero3_init_flag", "ACCELERATE_DEEPSPEED_ZERO3_INIT"),
    (
        "zero3_save_16bit_model",
        "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL",
    ),
];

/// Keys `accelerate config` writes that change nothing for a job on one
/// host's CPUs or GPUs here, and why.
const INERT: &[(&str, &str)] = &[
    (
        "deepspeed_multinode_launcher",
        "accel launch starts every rank itself",
    ),
    (
        "deepspeed_hostfile",
        "accel launch starts every rank itself",
    ),
    (
        "deepspeed_exclusion_filter",
        "accel launch starts every rank itself",
    ),
    (
        "deepspeed_inclusion_filter",
        "accel launch starts every rank itself",
    ),
    (
        "deepspeed_moe_layer_cls_names",
        "mixture-of-experts layers need no marking here",
    ),
];

/// The variables of `section` (`deepspeed_config`, absent: DeepSpeed's
/// defaults), plus one line per key that has no effect. `zero3_init_flag`
/// is exported and said to be inert: parameters are already drawn piece by
/// piece as FSDP prepares the model.
///
/// # Errors
/// [`Error::Config`] naming a key that is not one of Accelerate's, or a
/// value that is not text, a number or a boolean.
pub fn launch_env(section: Option<&Value>) -> Result<(EnvVars, Vec<String>)> {
    let mut env = vec![("ACCELERATE_USE_DEEPSPEED".to_string(), "true".to_string())];
    let mut notes = vec![];
    let empty = Mapping::new();
    let map = match section {
        None | Some(Value::Null) => &empty,
        Some(Value::Mapping(m)) => m,
        Some(other) => {
            return Err(Error::Config {
                key: "deepspeed_config".into(),
                reason: format!("expected a mapping, found {other:?}"),
            })
        }
    };
    for (k, v) in map {
        let key = k.as_str().unwrap_or_default();
        let text = match v {
            Value::String(s) => s.clone(),
            Value::Number(n) => n.to_string(),
            Value::Bool(b) => b.to_string(),
            Value::Null => continue,
            other => {
                return Err(Error::Config {
                    key: format!("deepspeed_config.{key}"),
                    reason: format!("expected text, a number or a boolean, found {other:?}"),
                })
            }
        };
        if let Some((_, var)) = EXPORTED.iter().find(|(k, _)| *k == key) {
            let init = key == "zero3_init_flag" && text == "true";
            env.push((var.to_string(), text));
            if init {
                notes.push("deepspeed_config.zero3_init_flag has no effect in accel-rs: FSDP draws each rank's pieces as it prepares the model".to_string());
            }
        } else if let Some((_, why)) = INERT.iter().find(|(k, _)| *k == key) {
            notes.push(format!(
                "deepspeed_config.{key} has no effect in accel-rs: {why}"
            ));
        } else {
            let known: Vec<&str> = EXPORTED.iter().chain(INERT).map(|(k, _)| *k).collect();
            return Err(Error::Config {
                key: format!("deepspeed_config.{key}"),
                reason: format!("not one of Accelerate's keys ({})", known.join(", ")),
            });
        }
    }
    Ok((env, notes))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accelerates_keys_become_its_variables_and_a_typo_is_named() {
        let section: Value = serde_yaml_ng::from_str(
            "gradient_accumulation_steps: 2\ngradient_clipping: 1.0\noffload_optimizer_device: cpu\nzero_stage: 3\nzero3_init_flag: true\ndeepspeed_multinode_launcher: standard\n",
        )
        .unwrap();
        let (env, notes) = launch_env(Some(&section)).unwrap();
        let get = |k: &str| env.iter().find(|(v, _)| v == k).map(|(_, x)| x.as_str());
        assert_eq!(get("ACCELERATE_USE_DEEPSPEED"), Some("true"));
        assert_eq!(get("ACCELERATE_DEEPSPEED_ZERO_STAGE"), Some("3"));
        assert_eq!(get("ACCELERATE_GRADIENT_ACCUMULATION_STEPS"), Some("2"));
        assert_eq!(get("ACCELERATE_GRADIENT_CLIPPING"), Some("1.0"));
        assert_eq!(
            get("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE"),
            Some("cpu")
        );
        assert_eq!(notes.len(), 2, "{notes:?}");
        // The round trip the ranks make.
        let ds = accel_core::deepspeed::from_vars(|k| get(k).map(String::from))
            .unwrap()
            .unwrap();
        let plan = ds.plan().unwrap();
        assert_eq!(
            (
                plan.zero_stage,
                plan.offload_optimizer,
                plan.gradient_clipping
            ),
            (3, true, Some(1.0))
        );
        let bad: Value = serde_yaml_ng::from_str("zero_stag: 2\n").unwrap();
        let err = launch_env(Some(&bad)).unwrap_err().to_string();
        assert!(err.contains("deepspeed_config.zero_stag"), "{err}");
    }
}
