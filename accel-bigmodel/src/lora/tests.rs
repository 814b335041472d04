use super::*;

#[test]
fn targets_match_as_peft_matches_a_list() {
    let cfg = LoraConfig::new(8, LoraTargets::parse("q_proj,v_proj").unwrap());
    assert!(cfg.targets_module("model.layers.0.self_attn.q_proj"));
    assert!(cfg.targets_module("v_proj"));
    assert!(!cfg.targets_module("model.layers.0.self_attn.k_proj"));
    assert!(!cfg.targets_module("model.layers.0.self_attn.xq_proj"));
    assert_eq!(
        LoraTargets::parse("all-linear").unwrap(),
        LoraTargets::AllLinear
    );
    assert!(LoraTargets::parse("q_proj,,v_proj").is_err());
}

#[test]
fn scaling_is_alpha_over_r_or_sqrt_r() {
    let mut cfg = LoraConfig::new(4, LoraTargets::AllLinear);
    cfg.alpha = 16.0;
    assert_eq!(cfg.scaling(), 4.0);
    cfg.use_rslora = true;
    assert_eq!(cfg.scaling(), 8.0);
}

#[test]
fn adapter_names_give_their_module() {
    assert_eq!(adapter_module("a.b.lora_A.weight"), Some("a.b"));
    assert_eq!(adapter_module("a.b.lora_B.weight"), Some("a.b"));
    assert_eq!(adapter_module("a.b.weight"), None);
    assert!(!is_adapter_weight("lora_A.weight"));
}

#[test]
fn peft_json_round_trips_and_refuses_what_it_cannot_do() {
    let mut cfg = LoraConfig::new(8, LoraTargets::parse("q_proj,v_proj").unwrap());
    cfg.alpha = 16.0;
    cfg.dropout = 0.05;
    let json = cfg.to_peft_json("base", "CAUSAL_LM", &["v_proj".into(), "q_proj".into()]);
    assert_eq!(
        json["target_modules"],
        serde_json::json!(["q_proj", "v_proj"])
    );
    let back = LoraConfig::from_peft_json(&json.to_string()).unwrap();
    assert_eq!(back, cfg);
    for (key, value) in [
        ("use_dora", serde_json::json!(true)),
        ("rank_pattern", serde_json::json!({"q_proj": 4})),
        ("modules_to_save", serde_json::json!(["lm_head"])),
        ("bias", serde_json::json!("all")),
        ("peft_type", serde_json::json!("IA3")),
        ("target_modules", serde_json::json!(".*proj")),
        ("r", serde_json::json!(0)),
    ] {
        let mut bad = json.clone();
        bad[key] = value;
        let e = LoraConfig::from_peft_json(&bad.to_string()).unwrap_err();
        assert!(
            e.contains(key) || e.contains("r (--lora-r)") || e.contains("IA3"),
            "{key}: {e}"
        );
    }
}
