//! LoRA adapters in PEFT's format: the configuration (`adapter_config.json`),
//! the names of the adapter tensors, and adapters read back from a PEFT
//! folder and merged into a checkpoint's weights as they are read.
//!
//! A LoRA layer computes `W x + scaling * B (A dropout(x))` with `A [r, in]`
//! drawn Kaiming-uniform and `B [out, r]` zero, so training starts from the
//! base model exactly; `scaling` is `lora_alpha / r` (`lora_alpha / sqrt(r)`
//! with rsLoRA). The tensors are named as PEFT saves them:
//! `{module}.lora_A.weight` and `{module}.lora_B.weight`, prefixed by
//! `base_model.model.` in `adapter_model.safetensors`.

mod adapter;

use serde::{Deserialize, Serialize};
use serde_json::Value;

pub use adapter::LoraAdapter;

/// The suffix of a module's `A` matrix (`[r, in]`).
pub const LORA_A: &str = "lora_A.weight";
/// The suffix of a module's `B` matrix (`[out, r]`).
pub const LORA_B: &str = "lora_B.weight";
/// The prefix PEFT's `PeftModel` puts before the base model's names.
pub const PEFT_PREFIX: &str = "base_model.model.";
/// The adapter's configuration file in a PEFT folder.
pub const ADAPTER_CONFIG_NAME: &str = "adapter_config.json";
/// The adapter's weights in a PEFT folder.
pub const ADAPTER_WEIGHTS_NAME: &str = "adapter_model.safetensors";

/// Whether `name` is a LoRA adapter tensor (`….lora_A.weight` or `….lora_B.weight`).
pub fn is_adapter_weight(name: &str) -> bool {
    adapter_module(name).is_some()
}

/// The module an adapter tensor belongs to (`m.lora_A.weight` gives `m`).
pub fn adapter_module(name: &str) -> Option<&str> {
    [LORA_A, LORA_B]
        .iter()
        .find_map(|s| name.strip_suffix(s)?.strip_suffix('.'))
}

/// Which modules get adapters (PEFT's `target_modules`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LoraTargets {
    /// Modules whose name is one of these or ends with `.{name}`.
    Modules(Vec<String>),
    /// Every linear layer but the output head (`"all-linear"`).
    AllLinear,
}

impl LoraTargets {
    /// `q_proj,v_proj` or `all-linear`, as the command line takes them.
    ///
    /// # Errors
    /// An empty list or an empty name in it.
    pub fn parse(s: &str) -> Result<Self, String> {
        if s.trim() == "all-linear" {
            return Ok(Self::AllLinear);
        }
        let names: Vec<String> = s.split(',').map(|n| n.trim().to_string()).collect();
        if names.iter().any(String::is_empty) {
            return Err(format!(
                "`{s}`: target modules are comma-separated module names such as \
                 q_proj,v_proj, or all-linear"
            ));
        }
        Ok(Self::Modules(names))
    }
}

/// A LoRA adapter's settings, with the fields and defaults of PEFT's
/// `LoraConfig` that change what the adapter computes.
#[derive(Debug, Clone, PartialEq)]
pub struct LoraConfig {
    /// Rank of `A` and `B`.
    pub r: usize,
    /// `lora_alpha`: the update is scaled by `alpha / r`.
    pub alpha: f64,
    /// Dropout on the adapter's input, in training only.
    pub dropout: f32,
    /// Which modules get adapters.
    pub targets: LoraTargets,
    /// rsLoRA: scale by `alpha / sqrt(r)`.
    pub use_rslora: bool,
    /// The base weights are stored `[in, out]` (GPT-2's `Conv1D`).
    pub fan_in_fan_out: bool,
}

impl LoraConfig {
    /// PEFT's defaults (`lora_alpha` 8, no dropout) with rank `r` on `targets`.
    pub fn new(r: usize, targets: LoraTargets) -> Self {
        Self {
            r,
            alpha: 8.0,
            dropout: 0.0,
            targets,
            use_rslora: false,
            fan_in_fan_out: false,
        }
    }

    /// The factor of the adapter's update.
    pub fn scaling(&self) -> f64 {
        if self.use_rslora {
            self.alpha / (self.r as f64).sqrt()
        } else {
            self.alpha / self.r as f64
        }
    }

    /// Whether the linear layer `module` (its full name) gets an adapter,
    /// as PEFT matches a list: the name itself or a `.{target}` suffix.
    pub fn targets_module(&self, module: &str) -> bool {
        match &self.targets {
            LoraTargets::AllLinear => true,
            LoraTargets::Modules(names) => names
                .iter()
                .any(|t| module == t || module.ends_with(&format!(".{t}"))),
        }
    }

    /// Checks the settings make an adapter.
    ///
    /// # Errors
    /// A zero rank, a dropout outside `[0, 1)`, a non-finite alpha.
    pub fn validate(&self) -> Result<(), String> {
        if self.r == 0 {
            return Err("r (--lora-r) must be at least 1".into());
        }
        if !(0.0..1.0).contains(&self.dropout) {
            return Err(format!("lora_dropout {} must be in [0, 1)", self.dropout));
        }
        if !self.alpha.is_finite() {
            return Err(format!("lora_alpha {} is not finite", self.alpha));
        }
        Ok(())
    }

    /// `adapter_config.json` as PEFT writes it, for the modules that got
    /// adapters (`adapted`, their last name component: PEFT records
    /// `all-linear` expanded to those names too).
    pub fn to_peft_json(&self, base_model: &str, task_type: &str, adapted: &[String]) -> Value {
        let mut targets: Vec<&String> = adapted.iter().collect();
        targets.sort();
        targets.dedup();
        serde_json::json!({
            "alpha_pattern": {},
            "auto_mapping": null,
            "base_model_name_or_path": base_model,
            "bias": "none",
            "fan_in_fan_out": self.fan_in_fan_out,
            "inference_mode": true,
            "init_lora_weights": true,
            "layer_replication": null,
            "layers_pattern": null,
            "layers_to_transform": null,
            "loftq_config": {},
            // PEFT writes an integer alpha as one.
            "lora_alpha": if self.alpha.fract() == 0.0 && self.alpha.abs() < 1e15 {
                serde_json::json!(self.alpha as i64)
            } else {
                serde_json::json!(self.alpha)
            },
            "lora_dropout": self.dropout,
            "megatron_config": null,
            "megatron_core": "megatron.core",
            "modules_to_save": null,
            "peft_type": "LORA",
            "r": self.r,
            "rank_pattern": {},
            "revision": null,
            "target_modules": targets,
            "task_type": task_type,
            "use_dora": false,
            "use_rslora": self.use_rslora,
        })
    }

    /// Reads PEFT's `adapter_config.json` text.
    ///
    /// # Errors
    /// Bad JSON, another `peft_type`, or a PEFT feature that would change
    /// the result and is not supported here (DoRA, per-module ranks,
    /// trained biases, extra saved modules, layer selection), each named.
    pub fn from_peft_json(text: &str) -> Result<Self, String> {
        let raw: RawPeftConfig =
            serde_json::from_str(text).map_err(|e| format!("not a PEFT adapter config: {e}"))?;
        if raw.peft_type.as_deref() != Some("LORA") {
            return Err(format!(
                "peft_type is {:?}; only LORA adapters are supported",
                raw.peft_type
            ));
        }
        let unsupported = [
            ("use_dora", raw.use_dora == Some(true)),
            ("rank_pattern", non_empty(&raw.rank_pattern)),
            ("alpha_pattern", non_empty(&raw.alpha_pattern)),
            ("modules_to_save", non_empty(&raw.modules_to_save)),
            ("layers_to_transform", non_empty(&raw.layers_to_transform)),
            ("layer_replication", non_empty(&raw.layer_replication)),
            ("bias", raw.bias.as_deref().is_some_and(|b| b != "none")),
        ];
        if let Some((key, _)) = unsupported.iter().find(|(_, set)| *set) {
            return Err(format!(
                "`{key}` is set; this LoRA implementation does not support it"
            ));
        }
        let targets = match raw.target_modules {
            Value::Array(names) => LoraTargets::Modules(
                names
                    .into_iter()
                    .map(|n| match n {
                        Value::String(s) => Ok(s),
                        other => Err(format!("target_modules holds {other}, not a module name")),
                    })
                    .collect::<Result<_, _>>()?,
            ),
            Value::String(s) if s == "all-linear" => LoraTargets::AllLinear,
            Value::String(s) => {
                return Err(format!(
                    "target_modules is the pattern {s:?}; only a list of module names or \
                     \"all-linear\" is supported"
                ))
            }
            other => return Err(format!("target_modules is {other}, not a list of names")),
        };
        let cfg = Self {
            r: raw.r,
            alpha: raw.lora_alpha,
            dropout: raw.lora_dropout,
            targets,
            use_rslora: raw.use_rslora,
            fan_in_fan_out: raw.fan_in_fan_out,
        };
        cfg.validate()?;
        Ok(cfg)
    }
}

fn non_empty(v: &Value) -> bool {
    match v {
        Value::Null => false,
        Value::Object(m) => !m.is_empty(),
        Value::Array(a) => !a.is_empty(),
        _ => true,
    }
}

fn default_r() -> usize {
    8
}

fn default_alpha() -> f64 {
    8.0
}

/// The fields of `adapter_config.json` read here.
#[derive(Deserialize, Serialize)]
struct RawPeftConfig {
    peft_type: Option<String>,
    #[serde(default = "default_r")]
    r: usize,
    #[serde(default = "default_alpha")]
    lora_alpha: f64,
    #[serde(default)]
    lora_dropout: f32,
    #[serde(default)]
    target_modules: Value,
    #[serde(default)]
    use_rslora: bool,
    #[serde(default)]
    fan_in_fan_out: bool,
    use_dora: Option<bool>,
    bias: Option<String>,
    #[serde(default)]
    rank_pattern: Value,
    #[serde(default)]
    alpha_pattern: Value,
    #[serde(default)]
    modules_to_save: Value,
    #[serde(default)]
    layers_to_transform: Value,
    #[serde(default)]
    layer_replication: Value,
    lora_bias: Option<bool>,
    #[serde(default)]
    target_parameters: Value,
    #[serde(default)]
    trainable_token_indices: Value,
    #[serde(default)]
    alora_invocation_tokens: Value,
    use_qalora: Option<bool>,
    #[serde(default)]
    use_bdlora: Value,
}

#[cfg(test)]
mod tests;
