//! [`Block`]: a model's unit, kept as its constructor over a swappable
//! weights handle, with a [`ModelHook`] run around its forward.

use std::sync::{Arc, Mutex, MutexGuard};

use candle_core::{DType, Device, Tensor};
use candle_nn::{Module, VarBuilder, VarMap};

use accel_bigmodel::{init_empty_weights, placeholder, ModuleWeights};

use super::record::{child, record_and_fetch};
use super::Activations;
use crate::hooks::ModelHook;
use crate::{Error, Result};

/// What a block computes: its forward on the activations, returning the new
/// hidden states (or, for a head block given labels, the loss).
pub trait BlockForward: Send + Sync + 'static {
    /// The block's forward.
    ///
    /// # Errors
    /// Whatever the computation returns.
    fn forward(&self, x: &Activations) -> candle_core::Result<Tensor>;
}

/// Any candle module is a block on the hidden states.
impl BlockForward for Box<dyn Module + Send + Sync> {
    fn forward(&self, x: &Activations) -> candle_core::Result<Tensor> {
        Module::forward(&**self, &x.hidden)
    }
}

/// A block constructor: candle code that builds the block from a `VarBuilder`.
pub type BuildFn<B> = dyn Fn(VarBuilder) -> candle_core::Result<B> + Send + Sync;

/// Runs a block on given weights: what a hook calls to run the computation it
/// wraps (FSDP calls it on gathered weights, and again in backward).
pub type ForwardFn = dyn Fn(&ModuleWeights, &Activations) -> Result<Tensor> + Send + Sync;

/// The built block and the weights generation it was built from.
type Built<B> = Arc<Mutex<Option<(u64, Arc<B>)>>>;

/// One unit of a model: an embedding, a transformer layer, a head. Every
/// model-level feature acts on blocks, never on a model's forward:
/// data-parallel and sharded training (FSDP gathers a block's weights before
/// its forward and frees them after), activation checkpointing, dispatch with
/// CPU/disk offload, layerwise casting. A model keeps one struct and one
/// forward that calls its blocks.
///
/// A block is kept as its *constructor* (candle code taking a `VarBuilder`)
/// over a [`ModuleWeights`] handle holding its tensors under their full
/// names. The built value is reused while the weights stay put and rebuilt
/// after a hook replaced them; building only clones tensor handles.
///
/// Why not hooks on layers: candle layers capture their weight `Tensor`s when
/// built, and a `Var` can neither grow from a one-element placeholder into a
/// real weight nor shrink back (`Var::set` copies into same-size storage), so
/// weights are replaced in the handle and the block rebuilt.
pub struct Block<B> {
    weights: ModuleWeights,
    class_name: String,
    build: Arc<BuildFn<B>>,
    built: Built<B>,
    hook: Mutex<Option<Box<dyn ModelHook>>>,
}

impl<B> std::fmt::Debug for Block<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Block")
            .field("name", &self.weights.prefix())
            .field("class_name", &self.class_name)
            .field("hooked", &self.has_hook())
            .finish()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl<B: BlockForward> Block<B> {
    /// Builds the block `name` (a dotted module name such as `model.layers.3`,
    /// relative to `vb`'s prefix) of class `class_name` (`LlamaDecoderLayer`:
    /// what `no_split_module_classes` and `fsdp_transformer_layer_cls_to_wrap`
    /// match). `build` receives a `VarBuilder` at the block's prefix and is
    /// asked once from `vb` for each tensor, with its init hints, so a
    /// `VarMap`, a seeded or sharded initialiser, a checkpoint or an empty
    /// model each give the block exactly what they give a candle layer.
    ///
    /// # Errors
    /// Whatever `build` or the weight source return.
    pub fn new<F>(vb: &VarBuilder, name: &str, class_name: &str, build: F) -> Result<Self>
    where
        F: Fn(VarBuilder) -> candle_core::Result<B> + Send + Sync + 'static,
    {
        let prefix = join(&vb.prefix(), name);
        let vars = record_and_fetch(vb, &prefix, &build)?;
        Self::from_weights(ModuleWeights::new(prefix, vars)?, class_name, build)
    }

    /// A block over an existing weights handle; `build` runs once now to
    /// check that it finds every weight it asks for.
    ///
    /// # Errors
    /// Whatever `build` returns on the handle.
    pub fn from_weights<F>(weights: ModuleWeights, class_name: &str, build: F) -> Result<Self>
    where
        F: Fn(VarBuilder) -> candle_core::Result<B> + Send + Sync + 'static,
    {
        let block = Block {
            weights,
            class_name: class_name.to_string(),
            build: Arc::new(build),
            built: Arc::default(),
            hook: Mutex::new(None),
        };
        block.built()?;
        Ok(block)
    }

    /// An empty block at `prefix`: every weight `build` asks for becomes a
    /// placeholder of `dtype` on `device` (Accelerate's `init_empty_weights`).
    ///
    /// # Errors
    /// Whatever `build` returns.
    pub fn empty<F>(
        prefix: &str,
        class_name: &str,
        dtype: DType,
        device: &Device,
        build: F,
    ) -> Result<Self>
    where
        F: Fn(VarBuilder) -> candle_core::Result<B> + Send + Sync + 'static,
    {
        let (recorder, vb) = init_empty_weights(dtype, device);
        build(child(&vb, prefix))?;
        let vars = recorder
            .tensors()
            .into_iter()
            .map(|t| Ok((t.name, placeholder(t.shape, t.dtype, device)?)))
            .collect::<Result<Vec<_>>>()?;
        Self::from_weights(ModuleWeights::new(prefix, vars)?, class_name, build)
    }

    /// A block built on a candle `VarMap` (initialising the `Var`s it asks
    /// for, as `VarBuilder::from_varmap` does); the handle shares those `Var`s
    /// until a hook replaces them.
    ///
    /// # Errors
    /// Whatever `build` returns.
    pub fn from_varmap<F>(
        prefix: &str,
        class_name: &str,
        varmap: &VarMap,
        dtype: DType,
        device: &Device,
        build: F,
    ) -> Result<Self>
    where
        F: Fn(VarBuilder) -> candle_core::Result<B> + Send + Sync + 'static,
    {
        let vb = VarBuilder::from_varmap(varmap, dtype, device);
        Self::new(&vb, prefix, class_name, build)
    }

    /// The block built from its current weights, rebuilt when they changed.
    fn built(&self) -> Result<Arc<B>> {
        built_from(&self.built, &self.build, &self.weights)
    }

    /// Runs the block: the hook's `pre_forward`, the computation (wrapped by
    /// the hook when it wraps forwards, as FSDP and checkpointing do), then
    /// `post_forward`.
    ///
    /// # Errors
    /// Whatever the hook or the computation return.
    pub fn forward(&self, x: &Activations) -> Result<Tensor> {
        let mut hook = lock(&self.hook);
        let Some(h) = hook.as_mut() else {
            return Ok(self.built()?.forward(x)?);
        };
        let args = h.pre_forward(&self.weights, x.clone())?;
        let out = if h.wraps_forward() {
            h.run_forward(&self.weights, args, &self.forward_fn())?
        } else {
            self.built()?.forward(&args)?
        };
        let out = h.post_forward(&self.weights, out)?;
        // The cached block holds the tensors it was built from; when the hook
        // released them, drop it too, or offloaded weights would stay resident.
        let generation = self.weights.generation();
        let mut built = lock(&self.built);
        if built.as_ref().is_some_and(|(g, _)| *g != generation) {
            *built = None;
        }
        Ok(out)
    }

    /// Runs the block on the hidden states `xs` alone.
    ///
    /// # Errors
    /// As [`Block::forward`].
    pub fn forward_hidden(&self, xs: &Tensor) -> Result<Tensor> {
        self.forward(&Activations::new(xs.clone()))
    }

    /// The computation as a function of weights: on this block's own handle
    /// it reuses the built block, on another handle (gathered or recomputed
    /// weights) it builds a fresh one.
    pub fn forward_fn(&self) -> Arc<ForwardFn> {
        let (own, built, build) = (self.weights.clone(), self.built.clone(), self.build.clone());
        Arc::new(move |weights: &ModuleWeights, x: &Activations| {
            if weights.same_handle(&own) {
                return Ok(built_from(&built, &build, &own)?.forward(x)?);
            }
            // Another handle (a unit's gathered weights) may hold more than
            // this block; the block is built at its own name either way.
            let block = build(child(&weights.root_var_builder(), &own.prefix()))?;
            Ok(block.forward(x)?)
        })
    }
}

fn built_from<B>(
    built: &Built<B>,
    build: &Arc<BuildFn<B>>,
    weights: &ModuleWeights,
) -> Result<Arc<B>> {
    let generation = weights.generation();
    let mut built = lock(built);
    if let Some((g, b)) = built.as_ref() {
        if *g == generation {
            return Ok(b.clone());
        }
    }
    let b = Arc::new(build(weights.var_builder())?);
    *built = Some((generation, b.clone()));
    Ok(b)
}

fn join(prefix: &str, name: &str) -> String {
    match (prefix.is_empty(), name.is_empty()) {
        (true, _) => name.to_string(),
        (_, true) => prefix.to_string(),
        _ => format!("{prefix}.{name}"),
    }
}

impl<B> Block<B> {
    /// The block's dotted module name.
    pub fn name(&self) -> String {
        self.weights.prefix()
    }

    /// The block's class name (`LlamaDecoderLayer`, `GPT2Block`, ...).
    pub fn class_name(&self) -> &str {
        &self.class_name
    }

    /// The weights handle.
    pub fn weights(&self) -> &ModuleWeights {
        &self.weights
    }

    /// Whether a hook is attached.
    pub fn has_hook(&self) -> bool {
        lock(&self.hook).is_some()
    }

    /// Runs `f` on the attached hook, if any (for inspecting its state).
    pub fn with_hook<R>(&self, f: impl FnOnce(Option<&dyn ModelHook>) -> R) -> R {
        let hook = lock(&self.hook);
        f(hook.as_deref())
    }

    pub(crate) fn take_hook(&self) -> Option<Box<dyn ModelHook>> {
        lock(&self.hook).take()
    }

    pub(crate) fn put_hook(&self, hook: Box<dyn ModelHook>) {
        *lock(&self.hook) = Some(hook);
    }
}

/// A block as model-level features see it, whatever it computes.
pub trait AnyBlock: Send + Sync {
    /// The dotted module name.
    fn name(&self) -> String;
    /// The class name.
    fn class_name(&self) -> &str;
    /// The weights handle.
    fn weights(&self) -> &ModuleWeights;
    /// Detaches and returns the hook, if any.
    fn take_hook(&self) -> Option<Box<dyn ModelHook>>;
    /// Sets the hook (callers run `init_hook` first).
    fn put_hook(&self, hook: Box<dyn ModelHook>);
    /// Whether a hook is attached.
    fn has_hook(&self) -> bool;
    /// Runs `f` on the attached hook, if any.
    fn inspect_hook(&self, f: &mut dyn FnMut(Option<&dyn ModelHook>));
}

impl<B: Send + Sync> AnyBlock for Block<B> {
    fn name(&self) -> String {
        Block::name(self)
    }
    fn class_name(&self) -> &str {
        Block::class_name(self)
    }
    fn weights(&self) -> &ModuleWeights {
        Block::weights(self)
    }
    fn take_hook(&self) -> Option<Box<dyn ModelHook>> {
        Block::take_hook(self)
    }
    fn put_hook(&self, hook: Box<dyn ModelHook>) {
        Block::put_hook(self, hook)
    }
    fn has_hook(&self) -> bool {
        Block::has_hook(self)
    }
    fn inspect_hook(&self, f: &mut dyn FnMut(Option<&dyn ModelHook>)) {
        self.with_hook(f)
    }
}

impl From<Error> for candle_core::Error {
    fn from(e: Error) -> Self {
        candle_core::Error::wrap(e)
    }
}
