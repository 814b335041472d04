//! Against transformers' `TrainingArguments._process_fsdp_args`
//! (tests/fixtures/fsdp_args/reference.json, written by
//! scripts/make_fsdp_args_fixtures.py).

use serde_json::{json, Value};

use super::*;

fn reference() -> Vec<Value> {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/fsdp_args/reference.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// The case's `fsdp` and `fsdp_config` as TrainingArguments takes them from JSON.
fn arguments(case: &Value) -> (String, FsdpConfig) {
    #[derive(serde::Deserialize)]
    struct Args {
        #[serde(deserialize_with = "fsdp_words")]
        fsdp: String,
        fsdp_config: FsdpConfig,
    }
    let a: Args =
        serde_json::from_value(json!({"fsdp": case["fsdp"], "fsdp_config": case["fsdp_config"]}))
            .unwrap();
    (a.fsdp, a.fsdp_config)
}

#[test]
fn fsdp_arguments_become_the_plugin_transformers_asks_accelerate_for() {
    for case in reference() {
        let (words, config) = arguments(&case);
        let what = format!("fsdp={} fsdp_config={}", case["fsdp"], case["fsdp_config"]);
        let got = fsdp_plugin(&words, &config);
        let Some(want) = case.get("plugin_args") else {
            let err = got.unwrap_err().to_string();
            assert!(err.contains("hybrid_shard"), "{what}: {err}");
            continue;
        };
        let p = got.unwrap().unwrap();
        let strategy = match &want["reshard_after_forward"] {
            Value::Bool(true) => ShardingStrategy::FullShard,
            Value::Bool(false) => ShardingStrategy::ShardGradOp,
            Value::String(s) => match s.as_str() {
                "full_shard" => ShardingStrategy::FullShard,
                "shard_grad_op" => ShardingStrategy::ShardGradOp,
                other => panic!("{other}"),
            },
            other => panic!("{other}"),
        };
        assert_eq!(p.sharding_strategy, strategy, "{what}");
        assert_eq!(
            p.cpu_offload,
            want["cpu_offload"].as_bool().unwrap_or(false),
            "{what}"
        );
        assert_eq!(
            p.cpu_ram_efficient_loading,
            want["cpu_ram_efficient_loading"].as_bool().unwrap(),
            "{what}"
        );
        assert_eq!(
            p.activation_checkpointing,
            want["activation_checkpointing"].as_bool().unwrap_or(false),
            "{what}"
        );
        assert_eq!(
            p.state_dict_type,
            want["state_dict_type"].as_str().unwrap().parse().unwrap(),
            "{what}"
        );
        let policy = match want["auto_wrap_policy"].as_str().unwrap() {
            "TRANSFORMER_BASED_WRAP" => AutoWrapPolicy::Transformer {
                patterns: want["transformer_cls_names_to_wrap"]
                    .as_str()
                    .map(|s| s.split(',').map(String::from).collect())
                    .unwrap_or_default(),
            },
            "SIZE_BASED_WRAP" => AutoWrapPolicy::Size {
                min_num_params: want["min_num_params"].as_u64().unwrap() as usize,
            },
            _ => AutoWrapPolicy::NoWrap,
        };
        assert_eq!(p.auto_wrap_policy, policy, "{what}");
        if want["fsdp_version"] == 1 {
            assert_eq!(
                p.backward_prefetch,
                want["backward_prefetch"].as_str().unwrap().parse().unwrap(),
                "{what}"
            );
            assert_eq!(
                p.forward_prefetch,
                want["forward_prefetch"].as_bool().unwrap(),
                "{what}"
            );
            assert_eq!(
                p.sync_module_states,
                want["sync_module_states"].as_bool().unwrap(),
                "{what}"
            );
            assert_eq!(
                p.use_orig_params,
                want["use_orig_params"].as_bool().unwrap(),
                "{what}"
            );
        }
    }
}

#[test]
fn a_config_file_path_loads_and_bad_keys_or_xla_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("fsdp.json");
    std::fs::write(
        &path,
        r#"{"fsdp_transformer_layer_cls_to_wrap": ["h.*"], "fsdp_reshard_after_forward": false}"#,
    )
    .unwrap();
    let c = FsdpConfig::from_json(json!(path.display().to_string())).unwrap();
    let p = fsdp_plugin("true", &c).unwrap().unwrap();
    assert_eq!(p.sharding_strategy, ShardingStrategy::ShardGradOp);
    assert_eq!(
        p.auto_wrap_policy,
        AutoWrapPolicy::Transformer {
            patterns: vec!["h.*".into()]
        }
    );
    let err = FsdpConfig::from_json(json!({"fsdp_min_num_param": 3}))
        .unwrap_err()
        .to_string();
    assert!(err.contains("min_num_param"), "{err}");
    std::fs::write(&path, "{").unwrap();
    let err = FsdpConfig::from_json(json!(path.display().to_string()))
        .unwrap_err()
        .to_string();
    assert!(err.contains("fsdp.json"), "{err}");
    let xla = FsdpConfig::from_json(json!({"xla": true})).unwrap();
    assert!(fsdp_plugin("true", &xla)
        .unwrap_err()
        .to_string()
        .contains("XLA"));
    for words in ["", "false"] {
        assert_eq!(fsdp_plugin(words, &FsdpConfig::default()).unwrap(), None);
    }
    let err = fsdp_plugin("full_shard no_shard", &FsdpConfig::default())
        .unwrap_err()
        .to_string();
    assert!(err.contains("no_shard"), "{err}");
    let err = fsdp_plugin("full_shard hybrid", &FsdpConfig::default())
        .unwrap_err()
        .to_string();
    assert!(err.contains("hybrid"), "{err}");
}
