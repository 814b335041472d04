//! Deterministic parameter initialisation: one candle `VarBuilder` backend
//! that draws each parameter from a seed and the parameter's name.
//!
//! candle's CPU device cannot be seeded, so `VarMap`'s own initialisation is
//! not reproducible. [`SeededBackend`] honours the same `Init` hints with our
//! generator, and what it keeps of a drawn value depends on how the model
//! will run ([`Keep`]): the whole variable for a replicated model, or only this
//! rank's piece for a sharded one. Both draw the very same values, so a
//! sharded run starts from exactly the pieces of the replicated run.
//!
//! With a checkpoint to start from ([`SeededBackend::from`]), each value is
//! read from it instead of drawn: a pretrained model never pays for a random
//! draw it would overwrite (Box-Muller on one thread: about 30 s per billion
//! parameters), as transformers' `from_pretrained` skips its init.

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::sync::{Arc, Mutex};

use candle_core::{DType, Device, Shape, Tensor, Var};
use candle_nn::init::{Init, NormalOrUniform};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::VarMap;

use accel_bigmodel::{placeholder, CheckpointSource};

use crate::fsdp::frozen::{tensor_bytes, FrozenPiece};
use crate::rng::{fnv1a, SplitMix64};

/// fp32 master weights drawn by [`SeededBackend`] for parameters created in a lower precision.
pub(crate) type MasterMap = Arc<Mutex<HashMap<String, Var>>>;

/// A parameter drawn for a sharded model: name, full shape and this rank's fp32 piece.
pub(crate) type DrawnPiece = (String, Shape, Tensor);

/// What [`SeededBackend`] keeps of each value it draws.
pub(crate) enum Keep {
    /// Replicated models: see [`FullVars`].
    Full(FullVars),
    /// Sharded models: see [`Pieces`].
    Piece(Pieces),
}

/// Keeps the whole variable in `varmap` (in the requested dtype), plus its
/// exact fp32 values in `masters` when that dtype is narrower, so the master
/// copy is not a re-widened bf16 value.
pub(crate) struct FullVars {
    pub varmap: VarMap,
    pub masters: MasterMap,
}

/// Keeps only this rank's fp32 piece of each parameter (split between
/// `world` ranks); the model gets a [`placeholder`] of the full shape.
/// The parts of a quantized weight (codes, block maxima, states) are kept
/// apart, as this rank's chunk of their bytes in `frozen`: they never train
/// (see `fsdp::frozen`).
pub(crate) struct Pieces {
    pub world: usize,
    pub rank: usize,
    pub master_device: Device,
    pub drawn: Arc<Mutex<Vec<DrawnPiece>>>,
    pub frozen: Arc<Mutex<Vec<FrozenPiece>>>,
}

/// Selects the parameters a model is prepared with frozen.
pub(crate) type FrozenFn = Arc<dyn Fn(&str) -> bool + Send + Sync>;

/// The seeded `VarBuilder` backend of the Accelerator (plain, DDP and FSDP models).
pub(crate) struct SeededBackend {
    pub seed: u64,
    pub keep: Keep,
    /// A checkpoint every parameter starts from, instead of the seed; LoRA
    /// adapter weights it does not hold are drawn.
    pub from: Option<Arc<Pretrained>>,
    /// Parameters that will not train (a LoRA model's base): a replicated
    /// model keeps them in the compute dtype only, with no fp32 master, and
    /// its layers get them detached, so no backward computes their gradient.
    pub frozen: Option<FrozenFn>,
}

/// A checkpoint parameters start from, and the names read from it so far.
pub(crate) struct Pretrained {
    pub source: CheckpointSource,
    pub used: Mutex<HashSet<String>>,
}

impl Pretrained {
    /// Opens `checkpoint` (see [`CheckpointSource::open`]).
    pub fn open(checkpoint: &Path) -> crate::Result<Self> {
        Ok(Pretrained {
            source: CheckpointSource::open(checkpoint)?,
            used: Mutex::default(),
        })
    }

    /// Warns, as `load_checkpoint` does, when some of the checkpoint's
    /// tensors went to no parameter.
    pub fn warn_unused(&self) {
        let used = self.used.lock().unwrap_or_else(|e| e.into_inner());
        let extra = self.source.names().filter(|n| !used.contains(*n)).count();
        if extra > 0 {
            tracing::warn!(
                checkpoint = %self.source.checkpoint().display(),
                extra,
                "checkpoint tensors the model does not use were ignored"
            );
        }
    }
}

impl SeededBackend {
    fn is_frozen(&self, name: &str) -> bool {
        self.frozen.as_ref().is_some_and(|f| f(name))
    }

    /// The fp32 starting value of parameter `name` on `dev`: the
    /// checkpoint's tensor (which must exist and have `shape`), else drawn.
    fn initial(
        &self,
        name: &str,
        h: Init,
        shape: &Shape,
        dev: &Device,
    ) -> candle_core::Result<Tensor> {
        self.initial_as(name, h, shape, dev, DType::F32)
    }

    /// [`SeededBackend::initial`] in `dtype` (a checkpoint tensor read in
    /// its own dtype is not widened first).
    fn initial_as(
        &self,
        name: &str,
        h: Init,
        shape: &Shape,
        dev: &Device,
        dtype: DType,
    ) -> candle_core::Result<Tensor> {
        let draw = || Tensor::from_vec(init_values(self.seed, name, h, shape), shape, dev);
        let Some(from) = &self.from else {
            return draw();
        };
        let source = &from.source;
        if accel_bigmodel::lora::is_adapter_weight(name) && !source.contains(name) {
            // A new adapter on a pretrained model: drawn as PEFT inits it.
            return draw();
        }
        // The shape it is served in: a quantized weight's parts (quantized on
        // load) have theirs, not the full-precision weight's.
        let Some(got) = source.shape_of(name, Some(dtype)) else {
            candle_core::bail!(
                "parameter `{name}` is not in the checkpoint {}",
                source.checkpoint().display()
            )
        };
        if got != shape.dims() {
            let file = source
                .locate(name)
                .map_or(source.checkpoint().to_path_buf(), |at| {
                    at.file.to_path_buf()
                });
            candle_core::bail!(
                "{}: tensor `{name}` has shape {got:?}, the model's parameter {:?}",
                file.display(),
                shape.dims()
            )
        }
        let t = source
            .tensor(name, dev, Some(dtype))
            .map_err(candle_core::Error::wrap)?;
        from.used
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(name.to_string());
        Ok(t)
    }
}

/// Draws the fp32 values of `init` for a tensor of `shape`, seeded by `seed` and `name`.
pub fn init_values(seed: u64, name: &str, init: Init, shape: &Shape) -> Vec<f32> {
    let n = shape.elem_count();
    let mut rng = SplitMix64::new(seed ^ fnv1a(name.as_bytes()));
    let uniform = |rng: &mut SplitMix64, lo: f64, up: f64| (lo + (up - lo) * rng.next_f64()) as f32;
    match init {
        Init::Const(c) => vec![c as f32; n],
        Init::Uniform { lo, up } => (0..n).map(|_| uniform(&mut rng, lo, up)).collect(),
        Init::Randn { mean, stdev } => (0..n)
            .map(|_| (mean + stdev * rng.next_normal()) as f32)
            .collect(),
        Init::Kaiming {
            dist,
            fan,
            non_linearity,
        } => {
            let std = non_linearity.gain() / (fan.for_shape(shape) as f64).sqrt();
            match dist {
                NormalOrUniform::Uniform => {
                    let bound = 3f64.sqrt() * std;
                    (0..n).map(|_| uniform(&mut rng, -bound, bound)).collect()
                }
                NormalOrUniform::Normal => {
                    (0..n).map(|_| (std * rng.next_normal()) as f32).collect()
                }
            }
        }
    }
}

impl FullVars {
    /// The parameter `name` if it was made already, in `dtype` (checked to
    /// have shape `s` when one is asked for); a tied weight asked for again
    /// stays as frozen as the first time.
    fn existing(
        data: &HashMap<String, Var>,
        init: &SeededBackend,
        name: &str,
        s: Option<&Shape>,
        dtype: DType,
    ) -> candle_core::Result<Option<Tensor>> {
        let Some(v) = data.get(name) else {
            return Ok(None);
        };
        let t = v.as_tensor();
        if let Some(s) = s.filter(|s| t.shape() != *s) {
            candle_core::bail!(
                "parameter `{name}` requested with shape {s:?} but it exists with shape {:?}",
                t.shape()
            );
        }
        let t = t.to_dtype(dtype)?;
        Ok(Some(if init.is_frozen(name) { t.detach() } else { t }))
    }

    fn get(
        &self,
        init: &SeededBackend,
        s: Shape,
        name: &str,
        h: Init,
        dtype: DType,
        dev: &Device,
    ) -> candle_core::Result<Tensor> {
        let mut data = self.varmap.data().lock().unwrap_or_else(|e| e.into_inner());
        if let Some(t) = Self::existing(&data, init, name, Some(&s), dtype)? {
            return Ok(t);
        }
        if init.is_frozen(name) {
            let value = init.initial_as(name, h, &s, dev, dtype)?;
            // Taken as read: a weight converted or quantized on load is held
            // once, not copied again into its variable.
            let value = if value.dtype() == dtype {
                value
            } else {
                value.to_dtype(dtype)?
            };
            let var = Var::from_tensor_owned(value)?;
            let t = var.as_tensor().detach();
            data.insert(name.to_string(), var);
            return Ok(t);
        }
        let master = init.initial(name, h, &s, dev)?;
        let var = if dtype == DType::F32 {
            Var::from_tensor(&master)?
        } else {
            let var = Var::from_tensor(&master.to_dtype(dtype)?)?;
            self.masters
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(name.to_string(), Var::from_tensor(&master)?);
            var
        };
        let t = var.as_tensor().clone();
        data.insert(name.to_string(), var);
        Ok(t)
    }
}

impl Pieces {
    fn get(
        &self,
        init: &SeededBackend,
        s: Shape,
        name: &str,
        h: Init,
        dtype: DType,
        dev: &Device,
    ) -> candle_core::Result<Tensor> {
        let mut drawn = self.drawn.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, shape, _)) = drawn.iter().find(|(n, _, _)| n == name) {
            if shape != &s {
                candle_core::bail!("parameter `{name}` requested with shape {s:?} but it exists with shape {shape:?}");
            }
            return placeholder(s, dtype, dev);
        }
        if !dtype.is_float() || accel_bigmodel::quant::is_quant_part(name) {
            return self.frozen_part(init, s, name, h, dtype, dev);
        }
        // Every rank draws the same full values (seed and name only, or the
        // checkpoint), so the pieces are exactly those a replicated run
        // would start from.
        let full = init
            .initial(name, h, &s, &self.master_device)?
            .flatten_all()?;
        let r = accel_dist::fsdp::piece_range(full.elem_count(), self.world, self.rank);
        let piece = full.narrow(0, r.start, r.len())?.copy()?;
        drawn.push((name.to_string(), s.clone(), piece));
        placeholder(s, dtype, dev)
    }
}

impl Pieces {
    /// A quantized weight's part: its bytes cut as any parameter's elements,
    /// this rank's chunk kept in its own dtype's bytes (never as an fp32
    /// piece: a code is no float, and an absmax must not be rounded).
    fn frozen_part(
        &self,
        init: &SeededBackend,
        s: Shape,
        name: &str,
        h: Init,
        dtype: DType,
        dev: &Device,
    ) -> candle_core::Result<Tensor> {
        let mut frozen = self.frozen.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, shape, _, _)) = frozen.iter().find(|(n, ..)| n == name) {
            if shape != &s {
                candle_core::bail!("parameter `{name}` requested with shape {s:?} but it exists with shape {shape:?}");
            }
            return placeholder(s, dtype, dev);
        }
        if init.from.is_none() {
            candle_core::bail!(
                "parameter `{name}` is {dtype:?}, a quantized weight's part: it can only be read \
                 from a checkpoint, not drawn"
            )
        }
        let bytes = tensor_bytes(&init.initial_as(name, h, &s, &Device::Cpu, dtype)?)?;
        let r = accel_dist::fsdp::piece_range(bytes.len(), self.world, self.rank);
        let piece = Tensor::from_vec(bytes[r.clone()].to_vec(), r.len(), &Device::Cpu)?;
        frozen.push((name.to_string(), s.clone(), dtype, piece));
        placeholder(s, dtype, dev)
    }
}

impl SimpleBackend for SeededBackend {
    fn get(
        &self,
        s: Shape,
        name: &str,
        h: Init,
        dtype: DType,
        dev: &Device,
    ) -> candle_core::Result<Tensor> {
        match &self.keep {
            Keep::Full(full) => full.get(self, s, name, h, dtype, dev),
            Keep::Piece(pieces) => pieces.get(self, s, name, h, dtype, dev),
        }
    }

    fn get_unchecked(&self, name: &str, dtype: DType, dev: &Device) -> candle_core::Result<Tensor> {
        // A tensor that describes others (a quantized weight's JSON state,
        // its code book), read as the checkpoint holds it; asked for again
        // with its shape, it becomes a frozen parameter like its weight.
        if let Some(from) = self.from.as_ref().filter(|f| f.source.contains(name)) {
            return from
                .source
                .tensor(name, dev, Some(dtype))
                .map_err(candle_core::Error::wrap);
        }
        match &self.keep {
            // A parameter made earlier with its shape, as a `VarMap` would give it: a model that
            // reads a size off a tensor before making it (RWKV v7's LoRA widths) builds fresh
            // once its user has made that tensor.
            Keep::Full(full) => {
                let data = full.varmap.data().lock().unwrap_or_else(|e| e.into_inner());
                match FullVars::existing(&data, self, name, None, dtype)? {
                    Some(t) => Ok(t),
                    None => candle_core::bail!(
                        "parameter `{name}`: a seeded var builder needs a shape and an init"
                    ),
                }
            }
            Keep::Piece(_) => candle_core::bail!(
                "parameter `{name}`: a sharded var builder needs a shape and an init"
            ),
        }
    }

    fn contains_tensor(&self, name: &str) -> bool {
        // What the checkpoint holds, so a model that probes for optional
        // parts (a quantized weight's state, BERT's pooler, GPT-2's prefix)
        // builds the variant the checkpoint has.
        if self.from.as_ref().is_some_and(|f| f.source.contains(name)) {
            return true;
        }
        match &self.keep {
            Keep::Full(full) => full
                .varmap
                .data()
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .contains_key(name),
            Keep::Piece(pieces) => pieces
                .drawn
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .iter()
                .any(|(n, _, _)| n == name),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn init_depends_on_seed_and_name_only() {
        let s = Shape::from((4, 3));
        let a = init_values(1, "l.weight", candle_nn::init::DEFAULT_KAIMING_NORMAL, &s);
        assert_eq!(
            a,
            init_values(1, "l.weight", candle_nn::init::DEFAULT_KAIMING_NORMAL, &s)
        );
        assert_ne!(
            a,
            init_values(2, "l.weight", candle_nn::init::DEFAULT_KAIMING_NORMAL, &s)
        );
        assert_ne!(
            a,
            init_values(1, "l.bias", candle_nn::init::DEFAULT_KAIMING_NORMAL, &s)
        );
    }

    #[test]
    fn uniform_init_stays_in_bounds_and_const_is_exact() {
        let s = Shape::from(1000);
        let v = init_values(0, "x", Init::Uniform { lo: -0.5, up: 0.25 }, &s);
        assert!(v.iter().all(|x| (-0.5..0.25).contains(x)));
        assert_eq!(
            init_values(0, "x", Init::Const(1.5), &s),
            vec![1.5f32; 1000]
        );
    }
}
