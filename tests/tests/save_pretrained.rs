//! `PreparedModel::save_pretrained`: a fine-tuned model written back as a
//! Hugging Face folder that loads as the source did. The weights keep the
//! source checkpoint's dtype of each tensor, shard with an index past the
//! size given, and the source's config, generation config and tokenizer
//! files come along byte for byte.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use accel_core::bigmodel::CheckpointSource;
use accel_core::models::{AutoModel, ModelConfig};
use accel_core::optim::{AdamW, AdamWConfig};
use accel_core::{Accelerator, AcceleratorConfig, PreparedModel};
use candle_core::{DType, Device, Tensor};

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/hf/llama")
}

/// The fixture rewritten with every tensor in `dtype`, one file, plus a
/// generation config.
fn source_in(dtype: DType, dir: &Path) {
    let src = CheckpointSource::open(fixture()).unwrap();
    let tensors: std::collections::HashMap<String, Tensor> = src
        .names()
        .map(|n| {
            (
                n.to_string(),
                src.tensor(n, &Device::Cpu, Some(dtype)).unwrap(),
            )
        })
        .collect();
    candle_core::safetensors::save(&tensors, dir.join("model.safetensors")).unwrap();
    for f in ["config.json", "tokenizer.json"] {
        std::fs::copy(fixture().join(f), dir.join(f)).unwrap();
    }
    std::fs::write(
        dir.join("generation_config.json"),
        "{\n  \"bos_token_id\": 1,\n  \"eos_token_id\": 2\n}\n",
    )
    .unwrap();
}

/// Prepares the model from `dir` and takes one AdamW step, so the saved
/// weights are not the source's.
fn fine_tuned(acc: &mut Accelerator, dir: &Path) -> (AutoModel, PreparedModel, Tensor) {
    let ModelConfig::Llama(cfg) = ModelConfig::from_path(dir).unwrap() else {
        panic!("a Llama fixture")
    };
    let cfg = ModelConfig::Llama(cfg);
    let (model, params) = acc
        .prepare_pretrained(dir, |vb| {
            AutoModel::new(&cfg, vb).map_err(accel_core::Error::from)
        })
        .unwrap();
    let mut opt = acc.prepare_optimizer(&params, AdamW::new(AdamWConfig::default()));
    let ids = Tensor::new(&[[1u32, 40, 21, 99, 7, 3]], acc.device()).unwrap();
    let loss = model.loss(&ids, &ids).unwrap();
    acc.backward(&loss).unwrap();
    opt.step().unwrap();
    opt.zero_grad();
    (model, params, ids)
}

fn dtypes(dir: &Path) -> BTreeMap<String, DType> {
    let src = CheckpointSource::open(dir).unwrap();
    src.names()
        .map(|n| (n.to_string(), src.locate(n).unwrap().dtype().unwrap()))
        .collect()
}

#[test]
fn a_saved_folder_loads_with_the_fine_tuned_logits_and_the_sources_files() {
    let tmp = tempfile::tempdir().unwrap();
    let (src, out) = (tmp.path().join("src"), tmp.path().join("out"));
    std::fs::create_dir(&src).unwrap();
    source_in(DType::F32, &src);
    let mut acc = Accelerator::new(AcceleratorConfig::default().with_seed(1)).unwrap();
    let (model, params, ids) = fine_tuned(&mut acc, &src);
    assert_eq!(params.pretrained_dir().as_deref(), Some(src.as_path()));
    // Shards of at most 20 KB: several files and an index.
    let written = params.save_pretrained(&acc, &out, "20KB").unwrap();
    assert!(
        out.join("model.safetensors.index.json").is_file(),
        "{written:?}"
    );
    assert!(!out.join("model.safetensors").exists());
    for f in ["config.json", "tokenizer.json", "generation_config.json"] {
        assert_eq!(
            std::fs::read(out.join(f)).unwrap(),
            std::fs::read(src.join(f)).unwrap(),
            "{f} is carried over byte for byte"
        );
        assert!(written.contains(&out.join(f)), "{f} is reported written");
    }
    let reloaded = AutoModel::load(&out, DType::F32, &Device::Cpu).unwrap();
    let (want, got) = (
        model.forward(&ids).unwrap(),
        reloaded.forward(&ids).unwrap(),
    );
    let diff = (want - got)
        .unwrap()
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    assert!(diff <= 1e-6, "reloaded logits differ by {diff}");
    // The step changed the weights: the logits are not the source's.
    let source_model = AutoModel::load(&src, DType::F32, &Device::Cpu).unwrap();
    let before = source_model.forward(&ids).unwrap();
    let moved = (before - reloaded.forward(&ids).unwrap())
        .unwrap()
        .abs()
        .unwrap()
        .sum_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    assert!(moved > 0.0, "the saved weights are the fine-tuned ones");
}

#[test]
fn a_bf16_source_is_saved_in_bf16_and_a_model_from_scratch_in_fp32() {
    let tmp = tempfile::tempdir().unwrap();
    let (src, out) = (tmp.path().join("src"), tmp.path().join("out"));
    std::fs::create_dir(&src).unwrap();
    source_in(DType::BF16, &src);
    let mut acc = Accelerator::new(AcceleratorConfig::default().with_seed(1)).unwrap();
    let (_model, params, _) = fine_tuned(&mut acc, &src);
    params.save_pretrained(&acc, &out, "5GB").unwrap();
    assert!(out.join("model.safetensors").is_file());
    let saved = dtypes(&out);
    assert_eq!(saved.len(), params.len());
    assert!(saved.values().all(|&d| d == DType::BF16), "{saved:?}");
    // The fp32 masters rounded once.
    let file = CheckpointSource::open(&out).unwrap();
    for (name, master) in params.master_weights() {
        let got = file.tensor(&name, &Device::Cpu, None).unwrap();
        let want = master.to_dtype(DType::BF16).unwrap();
        let eq = got.eq(&want).unwrap().to_dtype(DType::F32).unwrap();
        let all = eq.sum_all().unwrap().to_scalar::<f32>().unwrap();
        assert_eq!(all as usize, want.elem_count(), "{name}");
    }

    // Built from scratch: fp32, no config to carry.
    let scratch = tmp.path().join("scratch");
    let varmap = candle_nn::VarMap::new();
    let _layer = candle_nn::linear(4, 2, acc.var_builder(&varmap)).unwrap();
    let params = acc.prepare_model(&varmap).unwrap();
    assert_eq!(params.pretrained_dir(), None);
    params.save_pretrained(&acc, &scratch, "5GB").unwrap();
    assert!(dtypes(&scratch).values().all(|&d| d == DType::F32));
    assert!(!scratch.join("config.json").exists());
}

/// The newer architectures round-trip too: each fixture prepared and saved
/// holds the source's tensor names and shapes (transformers' own layout, so
/// `from_pretrained` reads it), and loads back to transformers' logits.
#[test]
fn the_newer_architectures_save_folders_with_transformers_names() {
    for name in ["qwen3", "gemma2", "gemma3", "phi3", "mixtral", "qwen3_moe"] {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("fixtures/hf")
            .join(name);
        let mut acc = Accelerator::new(AcceleratorConfig::default()).unwrap();
        let cfg = ModelConfig::from_path(&dir).unwrap();
        let (_, params) = acc
            .prepare_pretrained(&dir, |vb| {
                AutoModel::new(&cfg, vb).map_err(accel_core::Error::from)
            })
            .unwrap();
        let out = tempfile::tempdir().unwrap();
        params.save_pretrained(&acc, out.path(), "5GB").unwrap();
        let shapes = |d: &Path| -> BTreeMap<String, Vec<usize>> {
            let src = CheckpointSource::open(d).unwrap();
            src.names()
                .map(|n| (n.to_string(), src.locate(n).unwrap().shape().to_vec()))
                .collect()
        };
        assert_eq!(shapes(out.path()), shapes(&dir), "{name}");
        let r: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap())
                .unwrap();
        let rows: Vec<Vec<u32>> = serde_json::from_value(r["input_ids"].clone()).unwrap();
        let ids =
            Tensor::from_vec(rows.concat(), (rows.len(), rows[0].len()), &Device::Cpu).unwrap();
        let model = AutoModel::load(out.path(), DType::F32, &Device::Cpu).unwrap();
        let got: Vec<f32> = model
            .forward(&ids)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let want: Vec<f32> = serde_json::from_value::<Vec<Vec<Vec<f32>>>>(r["logits"].clone())
            .unwrap()
            .concat()
            .concat();
        let d = got
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f32::max);
        assert!(d < 1e-4, "{name}: saved folder's logits differ by {d}");
    }
}
