//! Checkpoints of sharded models: full state dicts (gathered, the files a
//! DDP run writes) and sharded ones (each rank its pieces), and the merge of
//! a sharded checkpoint into `model.safetensors`.
//!
//! ```text
//! checkpoint/                       FULL_STATE_DICT: as without FSDP
//!   model.safetensors, optimizer.safetensors/.json, ...
//! checkpoint/                       SHARDED_STATE_DICT
//!   model_fsdp_0/index.json         world size and every parameter's full shape
//!   model_fsdp_0/rank_{r}.safetensors   rank r's piece of each parameter (flat)
//!   optimizer_rank{r}.safetensors/.json rank r's optimizer state
//! ```
//!
//! Rank `r` holds elements `piece_range(numel, world, r)` of each flattened
//! parameter, so the pieces of all ranks concatenate to the parameter.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Shape, Tensor};
use serde_json::json;

use accel_dist::CommunicatorExt;

use super::sharding::Sharding;
use crate::checkpoint::{self, StateDict};
use crate::model::PreparedModel;
use crate::optim::parse_state_key;
use crate::{Error, Result};

/// Folder of the sharded state of model `i`.
pub(crate) fn sharded_model_dir(dir: &Path, i: usize) -> PathBuf {
    dir.join(format!("model_fsdp_{i}"))
}

/// Stem of rank `rank`'s sharded optimizer state for optimizer stem `stem`.
pub(crate) fn rank_stem(stem: &str, rank: usize) -> String {
    format!("{stem}_rank{rank}")
}

/// Converts an optimizer state over pieces into the state over full
/// parameters: every `state.{id}.*` tensor is gathered (collective).
pub(crate) fn full_optimizer_state(s: &Sharding, state: StateDict) -> Result<StateDict> {
    map_parameter_state(s, state, |id, _, t| s.gather_full(id, &t))
}

/// This rank's pieces of an optimizer state over full parameters.
pub(crate) fn optimizer_pieces(s: &Sharding, state: StateDict) -> Result<StateDict> {
    map_parameter_state(s, state, |id, key, t| s.piece_of(id, &t, key))
}

/// Applies `f(id, key, tensor)` to every per-parameter `state.{id}.*`
/// tensor of `state`, keeping the others and the metadata.
fn map_parameter_state(
    s: &Sharding,
    state: StateDict,
    f: impl Fn(usize, &str, Tensor) -> Result<Tensor>,
) -> Result<StateDict> {
    let mut tensors = BTreeMap::new();
    for (key, t) in state.tensors {
        let t = match parse_state_key(&key) {
            Some((id, _)) if id < s.slot_of.len() => f(id, &key, t)?,
            _ => t,
        };
        tensors.insert(key, t);
    }
    Ok(StateDict {
        tensors,
        meta: state.meta,
    })
}

/// Writes this rank's pieces of `model` into `model_fsdp_{i}/` (and, on
/// rank 0, the index).
pub(crate) fn write_sharded_model(
    model: &PreparedModel,
    s: &Sharding,
    dir: &Path,
    i: usize,
) -> Result<()> {
    // Under NO_SHARD every rank holds the same whole parameters: the main
    // process writes them once, as the single piece of a world of one.
    let (world, rank) = s.shard_group();
    if world == 1 && s.comm.rank() != 0 {
        return Ok(());
    }
    let folder = sharded_model_dir(dir, i);
    std::fs::create_dir_all(&folder).map_err(|e| Error::io("creating", &folder, e))?;
    let pieces: BTreeMap<String, Tensor> = model.master_weights().into_iter().collect();
    let meta: std::collections::HashMap<String, String> = [
        ("world_size".to_string(), world.to_string()),
        ("rank".to_string(), rank.to_string()),
    ]
    .into();
    checkpoint::write_safetensors(
        folder.join(format!("rank_{rank}.safetensors")),
        &pieces,
        Some(meta),
    )?;
    if rank == 0 {
        let shapes: serde_json::Map<String, serde_json::Value> = s
            .units
            .iter()
            .flat_map(|u| u.layout.slots())
            .map(|slot| (slot.name.clone(), json!(slot.shape.dims())))
            .collect();
        let index = json!({ "world_size": world, "shapes": shapes });
        checkpoint::write_json(folder.join("index.json"), &index)?;
    }
    Ok(())
}

/// The world size and full shapes recorded in a sharded model folder.
fn read_index(folder: &Path) -> Result<(usize, BTreeMap<String, Shape>)> {
    let path = folder.join("index.json");
    let index = checkpoint::read_json(&path)?;
    let bad = |reason: &str| Error::Json {
        path: path.clone(),
        reason: reason.to_string(),
    };
    let world = index["world_size"]
        .as_u64()
        .ok_or_else(|| bad("missing unsigned integer `world_size`"))? as usize;
    let shapes = index["shapes"]
        .as_object()
        .ok_or_else(|| bad("missing object `shapes`"))?
        .iter()
        .map(|(name, dims)| {
            let dims: Vec<usize> = serde_json::from_value(dims.clone())
                .map_err(|_| bad(&format!("shape of `{name}` is not a list of sizes")))?;
            Ok((name.clone(), Shape::from(dims)))
        })
        .collect::<Result<_>>()?;
    Ok((world, shapes))
}

/// True when checkpoint `dir` holds model `i` sharded; an error when it was
/// sharded over another number of ranks.
pub(crate) fn check_sharded_world(s: &Sharding, dir: &Path, i: usize) -> Result<bool> {
    let folder = sharded_model_dir(dir, i);
    if !folder.join("index.json").is_file() {
        return Ok(false);
    }
    let (world, _) = read_index(&folder)?;
    let (ours, _) = s.shard_group();
    if world != ours {
        return Err(Error::Config {
            key: folder.display().to_string(),
            reason: format!(
                "its parameters are split {world} ways but this run splits them {ours} ways ({} ranks): merge it with `accel merge-weights` or save with FULL_STATE_DICT",
                s.comm.world_size()
            ),
        });
    }
    Ok(true)
}

/// Restores `model`'s pieces from a checkpoint folder: from its sharded
/// state when it has one (same world size only), else by cutting this
/// rank's pieces out of the full `model.safetensors`-style file `full`.
pub(crate) fn restore_sharded(
    model: &PreparedModel,
    s: &Sharding,
    dir: &Path,
    i: usize,
    full: &Path,
) -> Result<()> {
    if !check_sharded_world(s, dir, i)? {
        return load_full_into_pieces(model, s, full);
    }
    let path = sharded_model_dir(dir, i).join(format!("rank_{}.safetensors", s.shard_group().1));
    let vars = model.named_masters();
    let specs: Vec<_> = vars
        .iter()
        .map(|(n, v)| checkpoint::TensorSpec::of(n, v.as_tensor()))
        .collect();
    let tensors = checkpoint::load_into(&path, &specs, true, &s.master_device)?;
    // Everything was read and checked before any weight changes.
    for (name, var) in &vars {
        var.set(&tensors[name].to_device(var.device())?)?;
    }
    model.refresh_model_weights()
}

/// Sets `model`'s pieces from the full tensors of `checkpoint` (a
/// `.safetensors` file, a folder, or a sharded `*.index.json`), one tensor at
/// a time so no rank ever holds the whole model. With rank-0 loading
/// (`cpu_ram_efficient_loading`) only rank 0 opens the checkpoint and
/// broadcasts each tensor. Names and shapes are all checked (by the reading
/// ranks, from the headers) before any weight changes; every rank gets the error.
pub(crate) fn load_full_into_pieces(
    model: &PreparedModel,
    s: &Sharding,
    checkpoint: &Path,
) -> Result<()> {
    let comm = &*s.comm;
    let vars = model.named_masters();
    let shape_of = |id: usize| {
        let (u, k) = s.slot_of[id];
        s.units[u].layout.slots()[k].shape.clone()
    };
    let reads = !s.rank0_loading || comm.rank() == 0 || comm.world_size() == 1;
    let source = if reads {
        let checked = accel_bigmodel::CheckpointSource::open(checkpoint)
            .map_err(Error::from)
            .and_then(|src| {
                for (id, (name, _)) in vars.iter().enumerate() {
                    let want = shape_of(id);
                    match src.locate(name) {
                        None => {
                            return Err(Error::KeyMismatch {
                                path: checkpoint.to_path_buf(),
                                missing: vec![name.clone()],
                                unexpected: vec![],
                            })
                        }
                        Some(loc) if loc.shape() != want.dims() => {
                            return Err(Error::ShapeMismatch {
                                path: checkpoint.to_path_buf(),
                                tensor: name.clone(),
                                expected: want.dims().to_vec(),
                                got: loc.shape().to_vec(),
                            })
                        }
                        Some(_) => {}
                    }
                }
                Ok(src)
            });
        Some(checked)
    } else {
        None
    };
    // Every rank learns every reader's verdict before anything moves.
    let verdict = match &source {
        Some(Err(e)) => e.to_string(),
        _ => String::new(),
    };
    let verdicts = if comm.world_size() > 1 {
        comm.gather_object(&verdict)?
    } else {
        vec![verdict]
    };
    if let Some((rank, reason)) = verdicts.iter().enumerate().find(|(_, v)| !v.is_empty()) {
        return Err(Error::Config {
            key: checkpoint.display().to_string(),
            reason: format!("rank {rank} could not load it: {reason}"),
        });
    }
    let source = source.map(|s| s.expect("verdict checked"));
    let broadcast = s.rank0_loading && comm.world_size() > 1;
    let mut staged = Vec::with_capacity(vars.len());
    for (id, (name, _)) in vars.iter().enumerate() {
        let full = match &source {
            Some(src) => src.tensor(name, &Device::Cpu, Some(DType::F32))?,
            None => Tensor::zeros(shape_of(id), DType::F32, &Device::Cpu)?,
        };
        let full = if broadcast {
            comm.broadcast_tensor(&full.contiguous()?, 0)?
        } else {
            full
        };
        let what = format!("{}: tensor `{name}`", checkpoint.display());
        staged.push(s.piece_of(id, &full, &what)?);
    }
    for ((_, var), piece) in vars.iter().zip(staged) {
        var.set(&piece.to_device(var.device())?)?;
    }
    // The ranks that read it (rank 0 at least, which writes `save_pretrained`).
    if let Some(src) = &source {
        model.set_source(crate::model::PretrainedSource::of(src));
    }
    model.refresh_model_weights()
}

/// Merges the sharded model state in `folder` (a `model_fsdp_{i}` folder,
/// or a checkpoint folder holding `model_fsdp_0`) into full tensors.
pub fn merge_sharded_weights(folder: &Path) -> Result<BTreeMap<String, Tensor>> {
    let folder = if folder.join("index.json").is_file() {
        folder.to_path_buf()
    } else {
        sharded_model_dir(folder, 0)
    };
    let (world, shapes) = read_index(&folder)?;
    let ranks: Vec<BTreeMap<String, Tensor>> = (0..world)
        .map(|r| {
            checkpoint::read_safetensors(folder.join(format!("rank_{r}.safetensors")), &Device::Cpu)
        })
        .collect::<Result<_>>()?;
    let mut out = BTreeMap::new();
    for (name, shape) in shapes {
        let mut parts = Vec::with_capacity(world);
        for (r, pieces) in ranks.iter().enumerate() {
            let piece = pieces.get(&name).ok_or_else(|| Error::KeyMismatch {
                path: folder.join(format!("rank_{r}.safetensors")),
                missing: vec![name.clone()],
                unexpected: vec![],
            })?;
            let want = accel_dist::fsdp::piece_range(shape.elem_count(), world, r).len();
            if piece.elem_count() != want {
                return Err(Error::ShapeMismatch {
                    path: folder.join(format!("rank_{r}.safetensors")),
                    tensor: name.clone(),
                    expected: vec![want],
                    got: piece.dims().to_vec(),
                });
            }
            parts.push(piece.flatten_all()?);
        }
        out.insert(name, Tensor::cat(&parts, 0)?.reshape(shape)?);
    }
    Ok(out)
}
