//! Mixtral's and Qwen3-MoE's gradients against transformers' autograd: the
//! router, every expert (zero, not missing, for one that got no token) and
//! the load-balancing loss, on the fixtures `scripts/make_hf_arch_fixtures.py`
//! wrote with `labels=input_ids, output_router_logits=True`.

use accel_models::{Llama, ModelConfig};
use candle_core::{DType, Device, Var};
use candle_nn::{VarBuilder, VarMap};

mod common;

use common::*;

/// The model over variables holding the checkpoint's tensors.
fn trainable(name: &str) -> (Llama, VarMap) {
    let dir = fixture(name);
    let ModelConfig::Llama(cfg) = ModelConfig::from_path(&dir).unwrap() else {
        panic!("{name} is not of the Llama family")
    };
    let tensors =
        candle_core::safetensors::load(dir.join("model.safetensors"), &Device::Cpu).unwrap();
    let varmap = VarMap::new();
    {
        let mut data = varmap.data().lock().unwrap();
        for (k, t) in tensors {
            data.insert(k, Var::from_tensor(&t).unwrap());
        }
    }
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    (Llama::new(&cfg, vb).unwrap(), varmap)
}

#[test]
fn router_experts_and_aux_loss_get_transformers_gradients() {
    for name in ["mixtral", "qwen3_moe"] {
        let r = reference(name);
        let (model, varmap) = trainable(name);
        let ids = ids_tensor(&r["input_ids"]);
        let (loss, aux) = model.loss_and_aux(&ids, &ids).unwrap();
        let coef = r["router_aux_loss_coef"].as_f64().unwrap();
        let total = (&loss + (&aux * coef).unwrap()).unwrap();
        let close = |got: f32, key: &str| {
            let want = r[key].as_f64().unwrap() as f32;
            assert!((got - want).abs() < 1e-5, "{name} {key}: {got} vs {want}");
        };
        close(aux.to_scalar().unwrap(), "aux_loss");
        close(total.to_scalar().unwrap(), "loss_with_aux");
        let grads = total.backward().unwrap();
        let data = varmap.data().lock().unwrap();
        let counts: Vec<u64> = serde_json::from_value(r["tokens_per_expert"].clone()).unwrap();
        for (key, want) in r["grads"].as_object().unwrap() {
            let var = data
                .get(key)
                .unwrap_or_else(|| panic!("{name}: no variable {key}"));
            let g = grads
                .get(var.as_tensor())
                .unwrap_or_else(|| panic!("{name}: no gradient for {key}"));
            let d = max_diff(g, want);
            assert!(d < 1e-5, "{name} {key}: gradient differs by {d}");
        }
        // An expert no token chose still gets its (zero) gradient.
        for (e, _) in counts.iter().enumerate().filter(|(_, &c)| c == 0) {
            let key = r["grads"]
                .as_object()
                .unwrap()
                .keys()
                .find(|k| k.contains(&format!(".experts.{e}.")))
                .unwrap();
            let g = grads.get(data[key].as_tensor()).unwrap();
            let m: f32 = g.abs().unwrap().max_all().unwrap().to_scalar().unwrap();
            assert_eq!(m, 0.0, "{name} {key}");
        }
    }
}
