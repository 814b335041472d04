//! `accel quantize`: a Hugging Face folder written as transformers saves a
//! model loaded in 4 or 8 bits, which `from_pretrained` loads as it is.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use accel_bigmodel::quant::{names, BnbQuantizationConfig};
use accel_bigmodel::CheckpointSource;
use accel_models::AutoModel;
use accel_nn::Model;
use candle_core::{DType, Device, Tensor};
use serde_json::Value;

use crate::{Error, Result};

/// Writes `model_dir` quantized as `config` says to `out`: each linear
/// layer's weight as bitsandbytes' parts under transformers' names (packed
/// codes in `weight`, `weight.absmax`, `weight.quant_state.bitsandbytes__*`,
/// ...; or an int8 `weight` and its `SCB`), the other tensors as the
/// checkpoint has them, `config.json` with transformers'
/// `quantization_config`, and the generation config and tokenizer files.
/// Weights are read and quantized one at a time.
///
/// # Errors
/// A bad setting, a folder already quantized, an unknown architecture, a
/// bad shard size, a failed write; each named.
pub fn quantize_pretrained(
    model_dir: &Path,
    out: &Path,
    config: &BnbQuantizationConfig,
    max_shard_size: &str,
) -> Result<Vec<PathBuf>> {
    let limit = crate::checkpoint::parse_size(max_shard_size)?;
    config.method()?;
    let dtype = stored_dtype(model_dir)?;
    let model = AutoModel::load_quantized(model_dir, Some(config), None, dtype, &Device::Cpu)?;
    let tensors: BTreeMap<String, Tensor> = model.named_tensors().into_iter().collect();
    // LLM.int8 weights: the int8 bytes beside an `SCB`.
    let int8: BTreeSet<String> = tensors
        .keys()
        .filter_map(|n| n.strip_suffix(&format!(".{}", names::SCB)))
        .map(|m| format!("{m}.weight"))
        .collect();
    std::fs::create_dir_all(out).map_err(|e| Error::io("creating", out, e))?;
    let written =
        crate::checkpoint::save_sharded_as(out, "model", &tensors, limit, &|n| int8.contains(n))?;
    let mut cfg = crate::checkpoint::read_json(model_dir.join("config.json"))?;
    if let Value::Object(map) = &mut cfg {
        map.insert("quantization_config".into(), config.to_transformers_json());
    }
    finish_folder(model_dir, out, &cfg, written)
}

/// The float dtype holding most of a checkpoint's values: what its
/// unquantized tensors stay in (transformers keeps them in the load dtype).
fn stored_dtype(dir: &Path) -> Result<DType> {
    let source = CheckpointSource::open(dir)?;
    let mut count: BTreeMap<&'static str, (usize, DType)> = BTreeMap::new();
    for name in source.names() {
        let Some(at) = source.locate(name) else {
            continue;
        };
        if let Some(d @ (DType::F32 | DType::BF16 | DType::F16)) = at.dtype() {
            let e = count.entry(d.as_str()).or_insert((0, d));
            e.0 += at.shape().iter().product::<usize>();
        }
    }
    Ok(count
        .into_values()
        .max_by_key(|(n, _)| *n)
        .map_or(DType::F32, |(_, d)| d))
}

/// [`super::merge_lora`] onto a base saved quantized: PEFT cannot merge into
/// 4-bit weights, so each quantized weight is dequantized (as bitsandbytes
/// dequantizes it), the adapter's update added in f32, and the model written
/// in full precision: in `bnb_4bit_compute_dtype` for a 4-bit base, the
/// dtype of its unquantized tensors for an 8-bit one. Says so in a warning.
pub(super) fn merge_into_quantized(
    model_dir: &Path,
    adapter: &accel_bigmodel::lora::LoraAdapter,
    q: &BnbQuantizationConfig,
    mut cfg: Value,
    out: &Path,
    limit: u64,
) -> Result<Vec<PathBuf>> {
    let source = CheckpointSource::open(model_dir)?;
    let dtype = match q.method()? {
        accel_bigmodel::quant::QuantMethod::FourBit => q.bnb_4bit_compute_dtype,
        accel_bigmodel::quant::QuantMethod::EightBit => stored_dtype(model_dir)?,
    };
    tracing::warn!(
        base = %model_dir.display(),
        dtype = accel_bigmodel::quant::torch_dtype_name(dtype),
        "the base is quantized: its weights are dequantized, merged with the adapter and \
         written in full precision (the compute dtype), without quantization_config"
    );
    let cpu = Device::Cpu;
    let mut tensors = BTreeMap::new();
    for name in source.names() {
        if accel_bigmodel::quant::is_quant_part(name) {
            continue;
        }
        let dense = match name.strip_suffix(".weight") {
            Some(module) => accel_bigmodel::quant::dequantize_stored(&source, module)?,
            None => None,
        };
        let t = match dense {
            Some((w, _)) => adapter.merge(name, w)?,
            None => adapter.merge(name, source.tensor(name, &cpu, None)?)?,
        };
        let t = if t.dtype().is_float() {
            t.to_dtype(dtype)?
        } else {
            t
        };
        tensors.insert(name.to_string(), t);
    }
    std::fs::create_dir_all(out).map_err(|e| Error::io("creating", out, e))?;
    let written = crate::checkpoint::save_model(out, &tensors, limit)?;
    if let Value::Object(map) = &mut cfg {
        map.remove("quantization_config");
        map.insert(
            "dtype".into(),
            accel_bigmodel::quant::torch_dtype_name(dtype).into(),
        );
    }
    finish_folder(model_dir, out, &cfg, written)
}

/// Writes `cfg` as `out`'s `config.json` and copies the tokenizer and
/// generation files from `model_dir`: the rest of a Hugging Face folder
/// after its weights (`written`, to which the new paths are added).
fn finish_folder(
    model_dir: &Path,
    out: &Path,
    cfg: &Value,
    mut written: Vec<PathBuf>,
) -> Result<Vec<PathBuf>> {
    let config_path = out.join("config.json");
    crate::checkpoint::write_json(&config_path, cfg)?;
    written.push(config_path);
    let carried: Vec<&str> = super::CARRIED_FILES
        .iter()
        .copied()
        .filter(|f| *f != "config.json")
        .collect();
    written.extend(super::pretrained::copy_files(model_dir, out, &carried)?);
    Ok(written)
}
