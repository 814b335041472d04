//! transformers' `fsdp` and `fsdp_config` training arguments, read as
//! transformers 5 reads them (`TrainingArguments._process_fsdp_args`):
//! `fsdp` true, or the legacy words; `fsdp_config` a JSON object or the path
//! of one, its `fsdp_`-prefixed keys stripped; FSDP2 by default.

use serde::{Deserialize, Deserializer, Serialize};
use serde_json::Value;

use crate::fsdp::{
    AutoWrapPolicy, BackwardPrefetch, FullyShardedDataParallelPlugin, ShardingStrategy,
    StateDictType,
};
use crate::{Error, Result};

/// transformers' `fsdp_config`: every key of its FSDP1 and FSDP2 paths.
///
/// Deserializes from a JSON object (keys with or without the `fsdp_` prefix
/// that `accelerate config` and older recipes write) or from a string, the
/// path of a JSON file holding one; a key transformers does not know is an
/// error naming it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(default, deny_unknown_fields)]
pub struct FsdpConfigFields {
    /// 1 (FSDP1) or 2 (FSDP2, transformers' default).
    pub version: Option<u8>,
    /// Size-based auto wrap: the smallest unit, in parameters.
    pub min_num_params: Option<usize>,
    /// Transformer-based auto wrap: block class names (`LlamaDecoderLayer`)
    /// or module-name patterns (`h.*`); a string is one name. Empty: every
    /// block whose class repeats (the decoder layers, what transformers'
    /// `_no_split_modules` names).
    #[serde(deserialize_with = "one_or_many")]
    pub transformer_layer_cls_to_wrap: Vec<String>,
    /// `TRANSFORMER_BASED_WRAP` (default), `SIZE_BASED_WRAP` or `NO_WRAP`.
    pub auto_wrap_policy: Option<String>,
    /// FSDP2: free parameters after forward (`true`, FULL_SHARD) or keep
    /// them (`false`, SHARD_GRAD_OP); FSDP1: a strategy name.
    pub reshard_after_forward: Option<Value>,
    /// Keep the shards and optimizer state in host memory.
    #[serde(deserialize_with = "loose_bool")]
    pub cpu_offload: Option<bool>,
    /// Recompute wrapped units in backward.
    #[serde(deserialize_with = "loose_bool")]
    pub activation_checkpointing: Option<bool>,
    /// Rank 0 alone reads a full checkpoint (transformers' default: false).
    #[serde(deserialize_with = "loose_bool")]
    pub cpu_ram_efficient_loading: Option<bool>,
    /// `FULL_STATE_DICT` (default) or `SHARDED_STATE_DICT`.
    pub state_dict_type: Option<String>,
    /// FSDP1: start every rank from rank 0's weights.
    #[serde(deserialize_with = "loose_bool")]
    pub sync_module_states: Option<bool>,
    /// FSDP1: `BACKWARD_PRE`, `BACKWARD_POST` or `NO_PREFETCH`.
    pub backward_prefetch: Option<String>,
    /// FSDP1: gather the next unit during forward.
    #[serde(deserialize_with = "loose_bool")]
    pub forward_prefetch: Option<bool>,
    /// FSDP1: the optimizer sees the original parameters.
    #[serde(deserialize_with = "loose_bool")]
    pub use_orig_params: Option<bool>,
    /// FSDP1: rate-limit all-gathers.
    #[serde(deserialize_with = "loose_bool")]
    pub limit_all_gathers: Option<bool>,
    /// PyTorch/XLA FSDP (refused: there is no XLA here).
    #[serde(deserialize_with = "loose_bool")]
    pub xla: Option<bool>,
    /// PyTorch/XLA FSDP v2 (refused when true).
    #[serde(deserialize_with = "loose_bool")]
    pub xla_fsdp_v2: Option<bool>,
    /// PyTorch/XLA's gradient checkpointing (refused when true).
    #[serde(deserialize_with = "loose_bool")]
    pub xla_fsdp_grad_ckpt: Option<bool>,
    /// PyTorch/XLA settings (refused when present).
    pub xla_fsdp_settings: Option<Value>,
}

/// [`FsdpConfigFields`] read from a JSON object or a file's path.
#[derive(Debug, Clone, PartialEq, Serialize, Default)]
#[serde(transparent)]
pub struct FsdpConfig(pub FsdpConfigFields);

impl std::ops::Deref for FsdpConfig {
    type Target = FsdpConfigFields;
    fn deref(&self) -> &FsdpConfigFields {
        &self.0
    }
}

impl std::ops::DerefMut for FsdpConfig {
    fn deref_mut(&mut self) -> &mut FsdpConfigFields {
        &mut self.0
    }
}

impl FsdpConfig {
    /// From a JSON value: an object (`fsdp_` prefixes stripped, as
    /// transformers does) or a string naming a JSON file.
    ///
    /// # Errors
    /// An unreadable file, or a key or value transformers would not accept,
    /// named.
    pub fn from_json(v: Value) -> Result<Self> {
        let (v, from) = match v {
            Value::String(path) => {
                let text =
                    std::fs::read_to_string(&path).map_err(|e| Error::io("reading", &path, e))?;
                let v = serde_json::from_str(&text).map_err(|e| Error::Json {
                    path: path.clone().into(),
                    reason: e.to_string(),
                })?;
                (v, Some(path))
            }
            other => (other, None),
        };
        let Value::Object(map) = v else {
            return Err(bad(
                "fsdp_config",
                "expected a JSON object or the path of one",
            ));
        };
        let stripped: serde_json::Map<String, Value> = map
            .into_iter()
            .map(|(k, v)| (k.strip_prefix("fsdp_").map_or(k.clone(), str::to_string), v))
            .collect();
        serde_json::from_value(Value::Object(stripped))
            .map(Self)
            .map_err(|e| {
                let at = from.map(|p| format!(" ({p})")).unwrap_or_default();
                bad(&format!("fsdp_config{at}"), &e.to_string())
            })
    }
}

impl<'de> Deserialize<'de> for FsdpConfig {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let v = Value::deserialize(d)?;
        if v.is_null() {
            return Ok(Self::default());
        }
        Self::from_json(v).map_err(serde::de::Error::custom)
    }
}

fn one_or_many<'de, D: Deserializer<'de>>(d: D) -> std::result::Result<Vec<String>, D::Error> {
    Ok(match Value::deserialize(d)? {
        Value::Null => vec![],
        Value::String(s) => s
            .split(',')
            .map(|s| s.trim().to_string())
            .filter(|s| !s.is_empty())
            .collect(),
        Value::Array(xs) => xs
            .into_iter()
            .map(|x| match x {
                Value::String(s) => Ok(s),
                other => Err(serde::de::Error::custom(format!(
                    "expected a class name, found {other}"
                ))),
            })
            .collect::<std::result::Result<_, _>>()?,
        other => {
            return Err(serde::de::Error::custom(format!(
                "expected a class name or a list, found {other}"
            )))
        }
    })
}

/// transformers' `str_to_bool(str(x).lower())`: `true`, `"true"`, `1`, ...
fn loose_bool<'de, D: Deserializer<'de>>(d: D) -> std::result::Result<Option<bool>, D::Error> {
    Ok(match Value::deserialize(d)? {
        Value::Null => None,
        Value::Bool(b) => Some(b),
        Value::Number(n) if n.as_f64() == Some(1.0) => Some(true),
        Value::Number(n) if n.as_f64() == Some(0.0) => Some(false),
        Value::String(s) => match s.to_ascii_lowercase().as_str() {
            "y" | "yes" | "t" | "true" | "on" | "1" => Some(true),
            "n" | "no" | "f" | "false" | "off" | "0" => Some(false),
            other => {
                return Err(serde::de::Error::custom(format!(
                    "{other:?} is not a boolean"
                )))
            }
        },
        other => {
            return Err(serde::de::Error::custom(format!(
                "{other} is not a boolean"
            )))
        }
    })
}

/// `fsdp` as transformers takes it: `true`/`false`, the legacy words as one
/// string, or a list of them (joined).
pub(super) fn fsdp_words<'de, D: Deserializer<'de>>(d: D) -> std::result::Result<String, D::Error> {
    Ok(match Value::deserialize(d)? {
        Value::Null | Value::Bool(false) => String::new(),
        Value::Bool(true) => "true".into(),
        Value::String(s) => s,
        Value::Array(xs) => xs
            .iter()
            .filter_map(Value::as_str)
            .collect::<Vec<_>>()
            .join(" "),
        other => {
            return Err(serde::de::Error::custom(format!(
                "fsdp: expected true, words or a list, found {other}"
            )))
        }
    })
}

/// The FSDP plugin of `fsdp` (`"true"`, or the legacy words: `full_shard`,
/// `shard_grad_op`, `offload`, `auto_wrap`; `"shard_optimizer"` is ZeRO-1,
/// an accel-rs word) and `fsdp_config`; `None` when `fsdp` is empty or
/// `"false"`.
///
/// # Errors
/// [`Error::Config`] naming an unknown word, a strategy FSDP2 does not have,
/// `hybrid_shard` (one host's ranks sharded, replicated across hosts: not
/// built), an XLA setting, or two strategies.
pub fn fsdp_plugin(
    words: &str,
    config: &FsdpConfig,
) -> Result<Option<FullyShardedDataParallelPlugin>> {
    let words = words.trim();
    if words.is_empty() || words.eq_ignore_ascii_case("false") {
        return Ok(None);
    }
    if config.xla == Some(true)
        || config.xla_fsdp_v2 == Some(true)
        || config.xla_fsdp_grad_ckpt == Some(true)
        || config.xla_fsdp_settings.is_some()
    {
        return Err(bad(
            "fsdp_config.xla",
            "PyTorch/XLA FSDP is not built in accel-rs (there is no XLA device)",
        ));
    }
    let version = config.version.unwrap_or(2);
    if !(1..=2).contains(&version) {
        return Err(bad(
            "fsdp_config.version",
            &format!("{version} (expected 1 or 2)"),
        ));
    }
    // The legacy words, as transformers' `_apply_legacy_fsdp_to_config`.
    let (mut strategy, mut offload) = (None, false);
    for word in words.split_whitespace() {
        let w = word.to_ascii_lowercase();
        let s = match w.as_str() {
            "true" => None,
            "full_shard" => Some(ShardingStrategy::FullShard),
            "shard_grad_op" => Some(ShardingStrategy::ShardGradOp),
            "shard_optimizer" => Some(ShardingStrategy::ShardOptimizer),
            "no_shard" if version == 1 => Some(ShardingStrategy::NoShard),
            "hybrid_shard" | "hybrid_shard_zero2" => {
                return Err(bad("fsdp", &format!("{w:?} (sharding within a host, replicating across hosts) is not built in accel-rs; use full_shard or shard_grad_op")))
            }
            "no_shard" => {
                return Err(bad("fsdp", "`no_shard` is only available with FSDP1 (fsdp_config version 1)"))
            }
            "offload" => {
                offload = true;
                None
            }
            "auto_wrap" => None,
            other => {
                return Err(bad("fsdp", &format!("unknown option {other:?} (expected true, full_shard, shard_grad_op, offload, auto_wrap)")))
            }
        };
        if let Some(s) = s {
            if strategy.replace(s).is_some() {
                return Err(bad("fsdp", "names more than one sharding strategy"));
            }
        }
    }
    let strategy = match (&config.reshard_after_forward, strategy) {
        (_, Some(s)) => s,
        (None, None) => ShardingStrategy::FullShard,
        (Some(Value::Bool(true)), None) => ShardingStrategy::FullShard,
        (Some(Value::Bool(false)), None) => ShardingStrategy::ShardGradOp,
        (Some(Value::String(s)), None) => match s.to_ascii_lowercase().as_str() {
            "true" | "full_shard" => ShardingStrategy::FullShard,
            "false" | "shard_grad_op" => ShardingStrategy::ShardGradOp,
            "no_shard" if version == 1 => ShardingStrategy::NoShard,
            "hybrid_shard" | "hybrid_shard_zero2" => {
                return Err(bad(
                    "fsdp_config.reshard_after_forward",
                    &format!("{s:?} is not built in accel-rs; use full_shard or shard_grad_op"),
                ))
            }
            other => {
                return Err(bad(
                    "fsdp_config.reshard_after_forward",
                    &format!("{other:?}"),
                ))
            }
        },
        (Some(other), None) => {
            return Err(bad(
                "fsdp_config.reshard_after_forward",
                &format!("{other}"),
            ))
        }
    };
    let mut plugin = FullyShardedDataParallelPlugin::new(strategy)
        .with_cpu_offload(offload || config.cpu_offload.unwrap_or(false))
        .with_activation_checkpointing(config.activation_checkpointing.unwrap_or(false));
    plugin.cpu_ram_efficient_loading = config.cpu_ram_efficient_loading.unwrap_or(false);
    if let Some(t) = &config.state_dict_type {
        plugin.state_dict_type = t.parse::<StateDictType>()?;
    }
    if version == 1 {
        plugin.sync_module_states = config.sync_module_states.unwrap_or(true);
        plugin.forward_prefetch = config.forward_prefetch.unwrap_or(false);
        plugin.use_orig_params = config.use_orig_params.unwrap_or(true);
        if let Some(b) = &config.backward_prefetch {
            plugin.backward_prefetch = b.parse::<BackwardPrefetch>()?;
        }
        if config.limit_all_gathers.is_some() {
            crate::notice::warn("fsdp_config.limit_all_gathers has no effect in accel-rs: units gather one at a time already");
        }
    }
    // transformers 4's rule where no policy is named: a positive
    // `min_num_params` and no classes wrap by size.
    let by_size = config.min_num_params.is_some_and(|m| m > 0)
        && config.transformer_layer_cls_to_wrap.is_empty();
    let default = if by_size {
        "SIZE_BASED_WRAP"
    } else {
        "TRANSFORMER_BASED_WRAP"
    };
    let policy = config.auto_wrap_policy.as_deref().unwrap_or(default);
    plugin.auto_wrap_policy = match policy.to_ascii_uppercase().as_str() {
        "TRANSFORMER_BASED_WRAP" => AutoWrapPolicy::Transformer {
            patterns: config.transformer_layer_cls_to_wrap.clone(),
        },
        "SIZE_BASED_WRAP" => match config.min_num_params {
            Some(min) if min > 0 => AutoWrapPolicy::Size {
                min_num_params: min,
            },
            _ => AutoWrapPolicy::NoWrap,
        },
        "NO_WRAP" => AutoWrapPolicy::NoWrap,
        other => {
            return Err(bad(
                "fsdp_config.auto_wrap_policy",
                &format!("{other:?} (expected TRANSFORMER_BASED_WRAP, SIZE_BASED_WRAP or NO_WRAP)"),
            ))
        }
    };
    Ok(Some(plugin))
}

fn bad(key: &str, reason: &str) -> Error {
    Error::Config {
        key: key.into(),
        reason: reason.into(),
    }
}

#[cfg(test)]
mod tests;
