//! candle-transformers' models train through the Accelerator on the
//! workspace's patched candle crates:
//!
//! * two implementations of one model agree: candle-transformers' Llama,
//!   whose RMS norms, softmax and rotary embeddings are candle-nn's fused
//!   ops, gives the same loss and the same gradient for every one of its
//!   21 parameters (within 1e-5, relative to the gradient's largest element)
//!   as accel-models' Llama on the repository's Llama fixture;
//! * the `finetune_candle` example trains every parameter of that Llama in
//!   fp32 and bf16 with a finite, falling loss (BERT needs the MiniLM
//!   checkpoint: `tests/minilm.rs`).

use std::path::{Path, PathBuf};

use accel_core::bigmodel::{load_checkpoint_in_varmap, LoadOptions};
use accel_core::models::ModelConfig;
use accel_core::PrecisionType;
use accel_examples::finetune_candle::{run, Args, Which};
use anyhow::{ensure, Result};
use candle_core::{DType, Device, IndexOp, Tensor};
use candle_nn::{VarBuilder, VarMap};
use candle_transformers::models::llama;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures/hf")
        .join(name)
}

/// Sets every variable of `varmap` to the checkpoint tensor of its name
/// (none may be missing); returns the names, sorted.
fn load_into(varmap: &VarMap, dir: &Path) -> Result<Vec<String>> {
    let report = load_checkpoint_in_varmap(varmap, dir, &LoadOptions::default())?;
    ensure!(
        report.missing_keys.is_empty(),
        "{}: lacks {:?}",
        dir.display(),
        report.missing_keys
    );
    Ok(report.loaded)
}

#[test]
fn candle_transformers_llama_gradients_equal_accel_models_llama() -> Result<()> {
    let dir = fixture("llama");
    let cpu = Device::Cpu;
    let ids = Tensor::new(
        &[[1u32, 17, 93, 5, 64, 2, 110], [3, 3, 48, 127, 0, 9, 71]],
        &cpu,
    )?;
    let next = Tensor::new(&[42u32, 7], &cpu)?;

    let text = std::fs::read_to_string(dir.join("config.json"))?;
    let theirs_cfg = serde_json::from_str::<llama::LlamaConfig>(&text)?.into_config(false);
    let theirs_map = VarMap::new();
    let theirs = llama::Llama::load(
        VarBuilder::from_varmap(&theirs_map, DType::F32, &cpu),
        &theirs_cfg,
    )?;
    let theirs_names = load_into(&theirs_map, &dir)?;
    let mut cache = llama::Cache::new(false, DType::F32, &theirs_cfg, &cpu)?;
    let theirs_loss = candle_nn::loss::cross_entropy(&theirs.forward(&ids, 0, &mut cache)?, &next)?;

    let ModelConfig::Llama(ours_cfg) = ModelConfig::from_path(&dir)? else {
        anyhow::bail!("the fixture is a Llama");
    };
    let ours_map = VarMap::new();
    let ours = accel_core::models::Llama::new(
        &ours_cfg,
        VarBuilder::from_varmap(&ours_map, DType::F32, &cpu),
    )?;
    let ours_names = load_into(&ours_map, &dir)?;
    let last = ours.forward(&ids)?.i((.., ids.dim(1)? - 1, ..))?;
    let ours_loss = candle_nn::loss::cross_entropy(&last, &next)?;

    assert_eq!(theirs_names, ours_names);
    assert_eq!(theirs_names.len(), 21);
    let (a, b) = (
        theirs_loss.to_scalar::<f32>()?,
        ours_loss.to_scalar::<f32>()?,
    );
    ensure!((a - b).abs() <= 1e-5, "losses {a} vs {b}");

    let (theirs_grads, ours_grads) = (theirs_loss.backward()?, ours_loss.backward()?);
    let theirs_vars = theirs_map.data().lock().unwrap();
    let ours_vars = ours_map.data().lock().unwrap();
    for name in &theirs_names {
        let g1 = theirs_grads
            .get(theirs_vars[name].as_tensor())
            .unwrap_or_else(|| panic!("candle-transformers' {name} got no gradient"));
        let g2 = ours_grads
            .get(ours_vars[name].as_tensor())
            .unwrap_or_else(|| panic!("accel-models' {name} got no gradient"));
        let diff = (g1 - g2)?
            .abs()?
            .flatten_all()?
            .max(0)?
            .to_scalar::<f32>()?;
        let scale = g2.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
        ensure!(scale > 0.0, "{name}: a zero gradient proves nothing");
        // f32 sums in another order: within 1e-5 of the gradient's largest
        // element (this fixture's weights make some gradients ~100).
        ensure!(
            diff <= 1e-5 * scale.max(1.0),
            "{name}: gradients differ by {diff} (largest {scale})"
        );
    }
    Ok(())
}

#[test]
fn finetune_candle_trains_every_llama_parameter_in_fp32_and_bf16() -> Result<()> {
    for precision in [PrecisionType::No, PrecisionType::Bf16] {
        let args = Args {
            model: Which::Llama,
            model_dir: Some(fixture("llama")),
            steps: 4,
            lr: 1e-3,
            mixed_precision: Some(precision),
            seed: 0,
            json: true,
        };
        let mut out = vec![];
        let steps = run(&args, &mut out)?;
        assert_eq!(steps.len(), 4);
        for s in &steps {
            assert_eq!((s.with_grad, s.params), (21, 21), "{precision:?}: {s:?}");
            assert!(s.loss.is_finite(), "{precision:?}: {s:?}");
        }
        assert!(
            steps[3].loss < 0.8 * steps[0].loss,
            "{precision:?}: the loss did not fall: {steps:?}"
        );
        // One JSON object per step.
        let text = String::from_utf8(out)?;
        assert_eq!(text.lines().count(), 4);
        let first: serde_json::Value = serde_json::from_str(text.lines().next().unwrap())?;
        assert_eq!(first["with_grad"], 21);
    }
    Ok(())
}

/// A model's forward on token ids (candle-transformers' take `&mut self`).
type Forward = dyn FnMut(&Tensor) -> candle_core::Result<Tensor>;

/// candle-transformers' config for a fixture's `config.json`: transformers 5
/// writes `rope_parameters` and `num_local_experts`; candle reads the older keys.
fn candle_moe_config(dir: &Path, mixtral: bool) -> Result<serde_json::Value> {
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json"))?)?;
    cfg["rope_theta"] = cfg["rope_parameters"]["rope_theta"].clone();
    cfg["use_flash_attn"] = false.into();
    cfg["sliding_window"] = if mixtral {
        4096.into()
    } else {
        serde_json::Value::Null
    };
    cfg["num_experts"] = cfg["num_local_experts"].clone();
    cfg["max_window_layers"] = 2.into();
    cfg["use_sliding_window"] = false.into();
    if !mixtral {
        // candle's Qwen3-MoE has no `mlp_only_layers`; the fixture's dense
        // layer 0 and sparse layer 1 are its `decoder_sparse_step` 2.
        cfg["decoder_sparse_step"] = 2.into();
    }
    Ok(cfg)
}

/// candle-transformers' Mixtral and Qwen3-MoE, patched so their routing
/// weights keep the graph, give accel-models' (transformers-exact) loss on
/// the last position and the same gradient for every parameter, the router
/// and every expert that received tokens included.
#[test]
fn candle_transformers_moe_gradients_equal_accel_models() -> Result<()> {
    use candle_transformers::models::{mixtral, qwen3_moe};
    let cpu = Device::Cpu;
    for name in ["mixtral", "qwen3_moe"] {
        let dir = fixture(name);
        let r: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json"))?)?;
        let rows: Vec<Vec<u32>> = serde_json::from_value(r["input_ids"].clone())?;
        let t = rows[0].len();
        let ids = Tensor::from_vec(rows.concat(), (rows.len(), t), &cpu)?;
        let next = Tensor::new(&[42u32, 7], &cpu)?;
        let theirs_map = VarMap::new();
        let vb = VarBuilder::from_varmap(&theirs_map, DType::F32, &cpu);
        let cfg = candle_moe_config(&dir, name == "mixtral")?;
        let mut forward: Box<Forward> = match name {
            "mixtral" => {
                let mut m = mixtral::Model::new(&serde_json::from_value(cfg)?, vb)?;
                Box::new(move |ids| m.forward(ids, 0))
            }
            _ => {
                let mut m = qwen3_moe::ModelForCausalLM::new(&serde_json::from_value(cfg)?, vb)?;
                Box::new(move |ids| m.forward(ids, 0))
            }
        };
        let theirs_names = load_into(&theirs_map, &dir)?;
        let theirs_loss = candle_nn::loss::cross_entropy(&forward(&ids)?.squeeze(1)?, &next)?;

        let ModelConfig::Llama(ours_cfg) = ModelConfig::from_path(&dir)? else {
            anyhow::bail!("{name} is of the Llama family");
        };
        let ours_map = VarMap::new();
        let ours = accel_core::models::Llama::new(
            &ours_cfg,
            VarBuilder::from_varmap(&ours_map, DType::F32, &cpu),
        )?;
        let ours_names = load_into(&ours_map, &dir)?;
        let last = ours.forward(&ids)?.i((.., t - 1, ..))?;
        let ours_loss = candle_nn::loss::cross_entropy(&last, &next)?;
        assert_eq!(theirs_names, ours_names, "{name}");
        let (a, b) = (
            theirs_loss.to_scalar::<f32>()?,
            ours_loss.to_scalar::<f32>()?,
        );
        ensure!((a - b).abs() <= 1e-5, "{name}: losses {a} vs {b}");
        let (theirs_grads, ours_grads) = (theirs_loss.backward()?, ours_loss.backward()?);
        let theirs_vars = theirs_map.data().lock().unwrap();
        let ours_vars = ours_map.data().lock().unwrap();
        let mut compared = 0;
        for n in &theirs_names {
            let g2 = ours_grads.get(ours_vars[n].as_tensor()).unwrap();
            let scale = g2.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
            let Some(g1) = theirs_grads.get(theirs_vars[n].as_tensor()) else {
                // candle-transformers skips an expert no token chose; ours
                // gives it a zero gradient.
                ensure!(
                    scale == 0.0 && n.contains(".experts."),
                    "{name}: {n} got no gradient"
                );
                continue;
            };
            let diff = (g1 - g2)?
                .abs()?
                .flatten_all()?
                .max(0)?
                .to_scalar::<f32>()?;
            ensure!(
                diff <= 1e-5 * scale.max(1.0),
                "{name} {n}: gradients differ by {diff} (largest {scale})"
            );
            compared += 1;
        }
        ensure!(compared > 20, "{name}: only {compared} gradients compared");
        let router = theirs_names
            .iter()
            .find(|n| n.ends_with("gate.weight"))
            .unwrap();
        ensure!(
            theirs_grads.get(theirs_vars[router].as_tensor()).is_some(),
            "{name}: the router got no gradient"
        );
    }
    Ok(())
}
