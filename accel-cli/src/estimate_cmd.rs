//! `accel estimate-memory`: what a checkpoint needs to load and to train, per
//! dtype, as Accelerate's `accelerate estimate-memory`.

use std::path::PathBuf;

use accel_core::bigmodel::{
    compute_module_sizes, get_max_layer_size, DTypeName, ModuleTree, SpecialDtypes,
};

use accel_core::{Error, Result};

/// Flags of `accel estimate-memory`.
#[derive(Debug, Clone, clap::Args)]
pub struct EstimateArgs {
    /// A safetensors checkpoint (file, index or folder); only headers are read.
    #[arg(long, required_unless_present = "model_tree")]
    pub checkpoint: Option<PathBuf>,
    /// Or a model tree JSON, as for `accel device-map`.
    #[arg(long, conflicts_with = "checkpoint")]
    pub model_tree: Option<PathBuf>,
    /// Dtypes to report (float32, float16, int8, int4).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "float32,float16,int8,int4"
    )]
    pub dtypes: Vec<String>,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// One row of the estimate, sizes in bytes.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct EstimateRow {
    /// The dtype the weights would be loaded in.
    pub dtype: String,
    /// The largest layer (what one device must hold at least).
    pub largest_layer: f64,
    /// All weights.
    pub total_size: f64,
    /// Peak memory of AdamW training at batch size 1; `None` where training
    /// in that dtype is not estimated (int8, int4).
    pub training_peak: Option<f64>,
}

/// Accelerate's `estimate_training_usage`, reduced to its peak: float32
/// training holds weights, gradients, two Adam moments (4x); mixed
/// precision peaks at the two fp32 moments (2x), above 1.5x of gradients.
fn training_peak(fp32_bytes: f64, dtype: &str) -> Option<f64> {
    match dtype {
        "float32" => Some(fp32_bytes * 4.0),
        "float16" | "bfloat16" => Some(fp32_bytes * 2.0),
        _ => None,
    }
}

/// Computes the rows for `tree`, sized as float32 first as Accelerate builds
/// the empty model in float32.
pub fn estimate_rows(tree: &ModuleTree, dtypes: &[String]) -> Result<Vec<EstimateRow>> {
    // Every floating tensor counts 4 bytes whatever the checkpoint stores
    // (compute_module_sizes' `dtype` would keep the smaller of the two sizes);
    // integer and bool tensors keep their own size, as they are never converted.
    let as_fp32: SpecialDtypes = tree
        .parameters()
        .into_iter()
        .chain(tree.buffers())
        .map(|id| tree.tensor(id))
        .filter(|t| !t.dtype.keeps_own_size())
        .map(|t| (t.name.clone(), DTypeName::FLOAT32))
        .collect();
    let sizes = compute_module_sizes(tree, None, Some(&as_fp32));
    let largest = get_max_layer_size(tree, &tree.root_items(), &sizes, &[])
        .size
        .as_f64();
    let total = sizes.get("").as_f64();
    dtypes
        .iter()
        .map(|d| {
            let divisor = match d.as_str() {
                "float32" => 1.0,
                "float16" | "bfloat16" => 2.0,
                "int8" => 4.0,
                "int4" => 8.0,
                other => {
                    return Err(Error::Config {
                        key: "--dtypes".into(),
                        reason: format!(
                            "{other:?} is not one of float32, float16, bfloat16, int8, int4"
                        ),
                    })
                }
            };
            Ok(EstimateRow {
                dtype: d.clone(),
                largest_layer: largest / divisor,
                total_size: total / divisor,
                training_peak: training_peak(total, d),
            })
        })
        .collect()
}

/// Accelerate's `convert_bytes`: the largest unit below 1024, rounded to 2 decimals.
pub fn convert_bytes(size: f64) -> String {
    let mut size = size;
    for unit in ["bytes", "KB", "MB", "GB", "TB"] {
        if size < 1024.0 {
            return format!("{} {unit}", python_round2(size));
        }
        size /= 1024.0;
    }
    format!("{} PB", python_round2(size))
}

/// `str(round(x, 2))` for a Python float: at most two decimals, at least one.
fn python_round2(x: f64) -> String {
    let r = (x * 100.0).round() / 100.0;
    let s = format!("{r:.2}");
    let s = s.trim_end_matches('0');
    if s.ends_with('.') {
        format!("{s}0")
    } else {
        s.to_string()
    }
}

/// Runs the estimate and renders it as a table or JSON.
pub fn estimate_memory(args: &EstimateArgs) -> Result<String> {
    let tree = match (&args.checkpoint, &args.model_tree) {
        (Some(c), _) => ModuleTree::from_safetensors(c)?,
        (None, Some(t)) => super::device_map_cmd::read_model_tree(t)?,
        (None, None) => {
            return Err(Error::Config {
                key: "--checkpoint".into(),
                reason: "give --checkpoint or --model-tree".into(),
            })
        }
    };
    let rows = estimate_rows(&tree, &args.dtypes)?;
    if args.json {
        return Ok(serde_json::to_string(&rows).expect("rows serialize"));
    }
    let headers = [
        "dtype",
        "Largest Layer",
        "Total Size",
        "Training using Adam (Peak vRAM)",
    ];
    let cells: Vec<[String; 4]> = rows
        .iter()
        .map(|r| {
            [
                r.dtype.clone(),
                convert_bytes(r.largest_layer),
                convert_bytes(r.total_size),
                r.training_peak.map_or("N/A".into(), convert_bytes),
            ]
        })
        .collect();
    let widths: Vec<usize> = (0..4)
        .map(|i| {
            cells
                .iter()
                .map(|c| c[i].len())
                .chain([headers[i].len()])
                .max()
                .unwrap_or(0)
        })
        .collect();
    let line = |cols: [&str; 4]| {
        let padded: Vec<String> = cols
            .iter()
            .zip(&widths)
            .map(|(c, w)| format!("{c:^w$}"))
            .collect();
        format!("| {} |", padded.join(" | "))
    };
    let mut out = vec![line(headers)];
    out.push(format!(
        "|{}|",
        widths
            .iter()
            .map(|w| "-".repeat(w + 2))
            .collect::<Vec<_>>()
            .join("|")
    ));
    for c in &cells {
        out.push(line([&c[0], &c[1], &c[2], &c[3]]));
    }
    Ok(out.join("\n"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_are_shown_like_accelerate() {
        assert_eq!(convert_bytes(512.0), "512.0 bytes");
        assert_eq!(convert_bytes(1536.0), "1.5 KB");
        assert_eq!(convert_bytes(2.0 * 1024.0 * 1024.0 * 1024.0), "2.0 GB");
        assert_eq!(convert_bytes(1234567.0), "1.18 MB");
    }

    #[test]
    fn training_peaks_follow_estimate_training_usage() {
        let tree = ModuleTree::from_tensors([
            ("a.weight", vec![256, 256], DTypeName::BFLOAT16),
            ("b.weight", vec![256, 128], DTypeName::FLOAT32),
        ])
        .unwrap();
        let dtypes: Vec<String> = ["float32", "float16", "int4"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let rows = estimate_rows(&tree, &dtypes).unwrap();
        let total = ((256 * 256 + 256 * 128) * 4) as f64;
        assert_eq!(rows[0].total_size, total);
        assert_eq!(rows[0].largest_layer, (256 * 256 * 4) as f64);
        assert_eq!(rows[0].training_peak, Some(total * 4.0));
        assert_eq!(rows[1].total_size, total / 2.0);
        assert_eq!(rows[1].training_peak, Some(total * 2.0));
        assert_eq!(rows[2].total_size, total / 8.0);
        assert_eq!(rows[2].training_peak, None);
    }
}
