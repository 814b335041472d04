//! The `fsdp_config` section of `default_config.yaml` and the `FSDP_*`
//! variables `accel launch` exports from it.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_yaml_ng::Value;

/// Accelerate's `fsdp_config` mapping, as `accelerate config` writes it.
///
/// Accelerate does not validate the keys inside this mapping (it copies each
/// one onto a `--fsdp_*` flag), so neither do we: the keys below are typed,
/// any other (`fsdp_ignored_modules`, the old `fsdp_backward_prefetch_policy`,
/// ...) is kept in [`FsdpFileConfig::other`] and written back unchanged.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct FsdpFileConfig {
    /// 1 (PyTorch FSDP1) or 2 (FSDP2); Accelerate assumes 1 when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fsdp_version: Option<u8>,
    /// FSDP1 sharding: `FULL_SHARD`, `SHARD_GRAD_OP`, `NO_SHARD`, `HYBRID_SHARD`
    /// (old files store the number 1..=5 instead).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fsdp_sharding_strategy: Option<Value>,
    /// FSDP2 sharding: free parameters after forward (`true`), or an FSDP1 strategy name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fsdp_reshard_after_forward: Option<Value>,
    /// `TRANSFORMER_BASED_WRAP`, `SIZE_BASED_WRAP` or `NO_WRAP`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fsdp_auto_wrap_policy: Option<String>,
    /// Comma-separated layer names wrapped as units (transformer-based wrap).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fsdp_transformer_layer_cls_to_wrap: Option<String>,
    /// Smallest unit, in parameters, of the size-based wrap.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fsdp_min_num_params: Option<u64>,
    /// Keep parameters and gradients on the CPU between uses.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fsdp_offload_params: Option<bool>,
    /// FSDP2's spelling of `fsdp_offload_params` (exported the same way).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fsdp_cpu_offload: Option<bool>,
    /// `FULL_STATE_DICT` or `SHARDED_STATE_DICT`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fsdp_state_dict_type: Option<String>,
    /// Load weights on rank 0 only, then broadcast.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fsdp_cpu_ram_efficient_loading: Option<bool>,
    /// Recompute activations in backward.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fsdp_activation_checkpointing: Option<bool>,
    /// `BACKWARD_PRE`, `BACKWARD_POST` or `NO_PREFETCH` (FSDP1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fsdp_backward_prefetch: Option<String>,
    /// Gather the next unit's parameters during forward (FSDP1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fsdp_forward_prefetch: Option<bool>,
    /// Keep the original parameters visible to the optimizer (FSDP1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fsdp_use_orig_params: Option<bool>,
    /// Broadcast rank 0's parameters when wrapping.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fsdp_sync_module_states: Option<bool>,
    /// Keys we do not type, kept as written.
    #[serde(flatten)]
    pub other: BTreeMap<String, Value>,
}

impl FsdpFileConfig {
    /// True when no key is set (Accelerate writes `fsdp_config: {}` then).
    pub fn is_empty(&self) -> bool {
        *self == Self::default()
    }

    /// The variables Accelerate's launcher exports for FSDP
    /// (`prepare_multi_gpu_env`): `ACCELERATE_USE_FSDP` and `FSDP_*`, with the
    /// same defaults for unset keys.
    pub fn launch_env(&self) -> Vec<(String, String)> {
        let flag = |v: Option<bool>, default: bool| v.unwrap_or(default).to_string();
        let mut env = vec![
            ("ACCELERATE_USE_FSDP", "true".to_string()),
            ("FSDP_VERSION", self.fsdp_version.unwrap_or(1).to_string()),
            (
                "FSDP_RESHARD_AFTER_FORWARD",
                self.fsdp_reshard_after_forward
                    .as_ref()
                    .map_or_else(|| "true".to_string(), |v| scalar_text(v).to_lowercase()),
            ),
            (
                "FSDP_OFFLOAD_PARAMS",
                flag(self.fsdp_offload_params.or(self.fsdp_cpu_offload), false),
            ),
            (
                "FSDP_MIN_NUM_PARAMS",
                self.fsdp_min_num_params.unwrap_or(100_000_000).to_string(),
            ),
        ];
        // Only when written: newer files give the FSDP1 strategy under
        // `fsdp_reshard_after_forward`, which a default here would override.
        if let Some(s) = &self.fsdp_sharding_strategy {
            env.push(("FSDP_SHARDING_STRATEGY", scalar_text(s)));
        }
        let optional = [
            ("FSDP_AUTO_WRAP_POLICY", &self.fsdp_auto_wrap_policy),
            (
                "FSDP_TRANSFORMER_CLS_TO_WRAP",
                &self.fsdp_transformer_layer_cls_to_wrap,
            ),
            ("FSDP_BACKWARD_PREFETCH", &self.fsdp_backward_prefetch),
            ("FSDP_STATE_DICT_TYPE", &self.fsdp_state_dict_type),
        ];
        for (name, value) in optional {
            if let Some(v) = value {
                env.push((name, v.clone()));
            }
        }
        env.extend([
            (
                "FSDP_FORWARD_PREFETCH",
                flag(self.fsdp_forward_prefetch, false),
            ),
            (
                "FSDP_USE_ORIG_PARAMS",
                flag(self.fsdp_use_orig_params, true),
            ),
            (
                "FSDP_CPU_RAM_EFFICIENT_LOADING",
                flag(self.fsdp_cpu_ram_efficient_loading, true),
            ),
            (
                "FSDP_SYNC_MODULE_STATES",
                flag(self.fsdp_sync_module_states, true),
            ),
            (
                "FSDP_ACTIVATION_CHECKPOINTING",
                flag(self.fsdp_activation_checkpointing, false),
            ),
        ]);
        env.into_iter().map(|(k, v)| (k.to_string(), v)).collect()
    }
}

/// A YAML scalar as Python's `str()` would print it, for an env value.
pub(crate) fn scalar_text(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Bool(b) => if *b { "True" } else { "False" }.to_string(),
        Value::Number(n) => n.to_string(),
        Value::Null => "None".to_string(),
        other => serde_yaml_ng::to_string(other)
            .unwrap_or_default()
            .trim()
            .to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_fsdp_keys_are_kept_and_typed_ones_become_env() {
        let yaml = "fsdp_sharding_strategy: 1\nfsdp_offload_params: true\nfsdp_ignored_modules: null\nfsdp_auto_wrap_policy: NO_WRAP\n";
        let c: FsdpFileConfig = serde_yaml_ng::from_str(yaml).unwrap();
        assert!(c.other.contains_key("fsdp_ignored_modules"));
        let env = c.launch_env();
        let get = |k: &str| env.iter().find(|(n, _)| n == k).map(|(_, v)| v.as_str());
        assert_eq!(get("FSDP_SHARDING_STRATEGY"), Some("1"));
        assert_eq!(get("FSDP_OFFLOAD_PARAMS"), Some("true"));
        assert_eq!(get("FSDP_AUTO_WRAP_POLICY"), Some("NO_WRAP"));
        assert_eq!(get("FSDP_VERSION"), Some("1"));
        assert_eq!(get("FSDP_STATE_DICT_TYPE"), None);
        let back = serde_yaml_ng::to_string(&c).unwrap();
        assert!(back.contains("fsdp_ignored_modules: null"), "{back}");
    }

    fn plugin_of(yaml: &str) -> accel_core::fsdp::FullyShardedDataParallelPlugin {
        let c: FsdpFileConfig = serde_yaml_ng::from_str(yaml).unwrap();
        let env = c.launch_env();
        let get = |k: &str| env.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone());
        accel_core::fsdp::FullyShardedDataParallelPlugin::from_vars(&get)
            .unwrap()
            .unwrap()
    }

    #[test]
    fn every_exported_fsdp_key_reaches_the_plugin() {
        use accel_core::dist::fsdp::ShardingStrategy::*;
        // Accelerate 1.6+ writes the FSDP1 strategy under fsdp_reshard_after_forward.
        let p = plugin_of("fsdp_version: 1\nfsdp_reshard_after_forward: SHARD_GRAD_OP\n");
        assert_eq!(p.sharding_strategy, ShardGradOp);
        let p =
            plugin_of("fsdp_sharding_strategy: FULL_SHARD\nfsdp_reshard_after_forward: false\n");
        assert_eq!(p.sharding_strategy, ShardGradOp);
        assert_eq!(plugin_of("{}").sharding_strategy, FullShard);
        let p = plugin_of(
            "fsdp_version: 2\nfsdp_reshard_after_forward: false\nfsdp_cpu_offload: true\n",
        );
        assert_eq!((p.sharding_strategy, p.cpu_offload), (ShardGradOp, true));
        let p = plugin_of(
            "fsdp_backward_prefetch: BACKWARD_PRE\nfsdp_forward_prefetch: true\n\
             fsdp_use_orig_params: false\nfsdp_sync_module_states: false\n",
        );
        assert_eq!(
            p.backward_prefetch,
            accel_core::fsdp::BackwardPrefetch::BackwardPre
        );
        assert!(p.forward_prefetch && !p.use_orig_params && !p.sync_module_states);
        let d = plugin_of("{}");
        assert!(!d.forward_prefetch && d.use_orig_params && d.sync_module_states);
    }
}
