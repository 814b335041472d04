//! Accelerate's `load_and_quantize_model`: a full-precision folder loaded
//! quantized and dispatched by a device map, with CPU and disk offload.

use std::path::Path;

use accel_bigmodel::quant::BnbQuantizationConfig;
use accel_bigmodel::{DeviceMap, Placement};
use accel_models::AutoModel;
use accel_nn::{DeviceMapChoice, LoadDispatchOptions};
use candle_core::DType;

use crate::{Error, Result};

/// Loads `weights_location` (a full-precision Hugging Face folder) with its
/// linear layers quantized as `config` says, placed as `opts` says: a
/// device map, or Accelerate's planning under `max_memory` over the
/// *quantized* sizes (packed codes, as Accelerate plans with its int4/int8
/// target dtype), parts on disk read from an offload folder.
///
/// The weights are quantized one at a time into transformers' pre-quantized
/// layout (what [`super::quantize_pretrained`] writes) under
/// `{offload_folder}/quantized`, where disk parts stay and are read as they
/// run, as Accelerate writes the quantized weights it offloads; without an
/// offload folder a temporary one serves, and a map with disk parts is
/// refused. Unlike Accelerate on a GPU machine, modules placed on the CPU
/// stay quantized: quantized products run on the CPU here.
///
/// Returns the model and the device map it was dispatched with.
///
/// # Errors
/// Those of [`super::quantize_pretrained`] and of dispatching; disk parts
/// without `offload_folder`; an adapter in `opts` (on a quantized base it
/// runs unmerged, which dispatching does not build: load the model whole
/// with `AutoModel::load_quantized`).
pub fn load_and_quantize_model(
    weights_location: &Path,
    config: &BnbQuantizationConfig,
    opts: &LoadDispatchOptions,
) -> Result<(AutoModel, DeviceMap)> {
    if let Some(adapter) = &opts.adapter {
        return Err(Error::Config {
            key: "adapter".into(),
            reason: format!(
                "{}: an adapter on a quantized base runs unmerged, as PEFT runs it, and a \
                 dispatched model cannot hold it yet; load the quantized model whole with its \
                 adapter (no device map)",
                adapter.display()
            ),
        });
    }
    let (folder, _temp) = match &opts.offload_folder {
        Some(f) => (f.join("quantized"), None),
        None => {
            let t = tempfile::tempdir().map_err(|e| Error::io("creating", "a temp dir", e))?;
            (t.path().to_path_buf(), Some(t))
        }
    };
    super::quantize_pretrained(weights_location, &folder, config, "10GB")?;
    let empty = AutoModel::empty(&folder, opts.dtype.unwrap_or(DType::F32))?;
    let map = match &opts.device_map {
        DeviceMapChoice::Map(m) => m.clone(),
        DeviceMapChoice::Auto(plan) => empty.plan_device_map(plan)?,
    };
    if opts.offload_folder.is_none() {
        if let Some((module, _)) = map.iter().find(|(_, p)| *p == Placement::Disk) {
            return Err(Error::Config {
                key: "offload_folder".into(),
                reason: format!(
                    "the device map puts `{module}` on disk: loading {} quantized with disk \
                     offload needs an offload folder to write the quantized weights to",
                    weights_location.display()
                ),
            });
        }
    }
    let mut opts = opts.clone();
    opts.device_map = DeviceMapChoice::Map(empty.weights_only(&map));
    drop(empty);
    let (model, _) = AutoModel::load_dispatched(&folder, &opts)?;
    Ok((model, map))
}
