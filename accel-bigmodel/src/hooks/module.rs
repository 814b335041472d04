//! The hooked module: a candle layer built from a swappable weights handle,
//! with a [`ModelHook`] run around its forward.

use std::sync::{Arc, Mutex, RwLock};

use candle_core::{DType, Device, Shape, Tensor};
use candle_nn::var_builder::{SimpleBackend, VarBuilder};
use candle_nn::{Module, VarMap};

use super::ModelHook;
use crate::empty::{init_empty_weights, placeholder};
use crate::error::{Error, Result};
use crate::tree::ModuleTree;

/// Whether `t` is a placeholder: a broadcast view of fewer elements than it shows.
pub fn is_placeholder(t: &Tensor) -> bool {
    t.elem_count() > 1 && t.stride().contains(&0)
}

#[derive(Debug)]
struct Slot {
    name: String,
    tensor: Tensor,
}

#[derive(Debug)]
struct Slots {
    prefix: String,
    entries: Vec<Slot>,
    // Bumped by every replacement, so a [`HookedModule`] knows when the layer
    // it built holds stale tensors.
    generation: u64,
}

/// The weights handle of one hooked module: its tensor names (full dotted
/// names, e.g. `model.layers.3.mlp.weight`) and the tensor currently standing
/// for each.
///
/// Hooks move weights by *replacing* a name's tensor ([`ModuleWeights::set`],
/// [`ModuleWeights::release`]) rather than writing into it: a placeholder is
/// one element and a materialised weight is all of them, and a candle `Var`
/// can hold neither transition (`Var::set` copies into same-size contiguous
/// storage, and `Var::from_tensor` materialises a broadcast placeholder).
/// The slots therefore hold plain tensors; a module built on a `VarMap`
/// starts out sharing its `Var`s' storage. Clones share the slots.
#[derive(Clone, Debug)]
pub struct ModuleWeights {
    inner: Arc<RwLock<Slots>>,
}

impl ModuleWeights {
    /// A handle over `vars` for the module at `prefix` (`""` for a whole model).
    ///
    /// # Errors
    /// [`Error::DuplicateName`] for a name given twice.
    pub fn new(prefix: impl Into<String>, vars: Vec<(String, Tensor)>) -> Result<Self> {
        let mut seen = std::collections::HashSet::new();
        if let Some((name, _)) = vars.iter().find(|(n, _)| !seen.insert(n.clone())) {
            return Err(Error::DuplicateName { name: name.clone() });
        }
        let entries = vars
            .into_iter()
            .map(|(name, tensor)| Slot { name, tensor })
            .collect();
        Ok(ModuleWeights {
            inner: Arc::new(RwLock::new(Slots {
                prefix: prefix.into(),
                entries,
                generation: 0,
            })),
        })
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, Slots> {
        self.inner.read().expect("ModuleWeights lock poisoned")
    }

    /// The module's dotted name.
    pub fn prefix(&self) -> String {
        self.read().prefix.clone()
    }

    /// Tensor names, in the order the module asked for them.
    pub fn names(&self) -> Vec<String> {
        self.read().entries.iter().map(|s| s.name.clone()).collect()
    }

    /// The tensor standing for `name` now.
    pub fn tensor(&self, name: &str) -> Option<Tensor> {
        let slots = self.read();
        slots
            .entries
            .iter()
            .find(|s| s.name == name)
            .map(|s| s.tensor.clone())
    }

    /// Every name with its current tensor.
    pub fn tensors(&self) -> Vec<(String, Tensor)> {
        let slots = self.read();
        let it = slots.entries.iter();
        it.map(|s| (s.name.clone(), s.tensor.clone())).collect()
    }

    /// How many replacements happened so far.
    pub fn generation(&self) -> u64 {
        self.read().generation
    }

    /// Bytes held by materialised weights (placeholders count as zero).
    pub fn resident_bytes(&self) -> usize {
        let tensors = self.tensors();
        let resident = tensors.iter().filter(|(_, t)| !is_placeholder(t));
        resident
            .map(|(_, t)| t.elem_count() * t.dtype().size_in_bytes())
            .sum()
    }

    /// Whether any weight is a placeholder now.
    pub fn has_placeholders(&self) -> bool {
        self.tensors().iter().any(|(_, t)| is_placeholder(t))
    }

    /// Makes `tensor` the weight `name`; its shape must match (the dtype and
    /// device may change: that is what casting and placement hooks do).
    ///
    /// # Errors
    /// [`Error::UnknownWeight`], [`Error::WeightShapeMismatch`].
    pub fn set(&self, name: &str, tensor: Tensor) -> Result<()> {
        let mut slots = self.inner.write().expect("ModuleWeights lock poisoned");
        let module = slots.prefix.clone();
        let Some(slot) = slots.entries.iter_mut().find(|s| s.name == name) else {
            return Err(Error::UnknownWeight {
                module,
                tensor: name.to_string(),
            });
        };
        if slot.tensor.dims() != tensor.dims() {
            return Err(Error::WeightShapeMismatch {
                module,
                tensor: name.to_string(),
                expected: slot.tensor.dims().to_vec(),
                got: tensor.dims().to_vec(),
            });
        }
        slot.tensor = tensor;
        slots.generation += 1;
        Ok(())
    }

    /// Replaces `name` by a placeholder of its shape and current dtype on
    /// `device`, freeing its storage once nothing else holds it.
    ///
    /// # Errors
    /// As [`ModuleWeights::set`], [`Error::Candle`].
    pub fn release(&self, name: &str, device: &Device) -> Result<()> {
        let t = self.tensor(name).ok_or_else(|| Error::UnknownWeight {
            module: self.prefix(),
            tensor: name.to_string(),
        })?;
        self.set(name, placeholder(t.shape().clone(), t.dtype(), device)?)
    }
}

/// A candle `SimpleBackend` over a weights handle: the layer built on it gets
/// exactly the tensors the hooks placed, without conversion.
struct SlotBackend(ModuleWeights);

impl SimpleBackend for SlotBackend {
    fn get(
        &self,
        shape: Shape,
        name: &str,
        _init: candle_nn::Init,
        _dtype: DType,
        _device: &Device,
    ) -> candle_core::Result<Tensor> {
        let t = self.get_unchecked(name, _dtype, _device)?;
        if t.dims() != shape.dims() {
            candle_core::bail!("`{name}` is {:?}, the layer asks for {shape:?}", t.dims());
        }
        Ok(t)
    }

    fn get_unchecked(&self, name: &str, _: DType, _: &Device) -> candle_core::Result<Tensor> {
        match self.0.tensor(name) {
            Some(t) => Ok(t),
            None => candle_core::bail!("module {:?} has no weight `{name}`", self.0.prefix()),
        }
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.0.tensor(name).is_some()
    }
}

/// A layer constructor: candle code that builds the module from a `VarBuilder`.
pub type BuildFn =
    dyn Fn(VarBuilder) -> candle_core::Result<Box<dyn Module + Send + Sync>> + Send + Sync;

/// A candle module whose weights live in a [`ModuleWeights`] handle, with an
/// optional [`ModelHook`] called around each forward.
///
/// The module is kept as its *constructor* (any candle code taking a
/// `VarBuilder`, e.g. `candle_nn::linear` or a whole transformer block) and
/// built from the handle's current tensors. The built layer is reused while
/// the weights stay put and rebuilt after a hook replaced them; building a
/// candle layer only clones tensor handles, so this costs microseconds.
pub struct HookedModule {
    weights: ModuleWeights,
    class_name: Option<String>,
    build: Arc<BuildFn>,
    built: Mutex<Option<(u64, Arc<dyn Module + Send + Sync>)>>,
    hook: Mutex<Option<Box<dyn ModelHook>>>,
}

impl std::fmt::Debug for HookedModule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HookedModule")
            .field("prefix", &self.weights.prefix())
            .field("class_name", &self.class_name)
            .field("hooked", &self.has_hook())
            .finish()
    }
}

fn vb_at(weights: &ModuleWeights) -> VarBuilder<'static> {
    let vb = VarBuilder::from_backend(
        Box::new(SlotBackend(weights.clone())),
        DType::F32,
        Device::Cpu,
    );
    push_prefix(vb, &weights.prefix())
}

fn push_prefix<'a>(vb: VarBuilder<'a>, prefix: &str) -> VarBuilder<'a> {
    if prefix.is_empty() {
        vb
    } else {
        vb.pp(prefix)
    }
}

impl HookedModule {
    /// A module over an existing handle; `build` is run once now to check
    /// that it finds every weight it asks for.
    ///
    /// # Errors
    /// [`Error::Candle`] when `build` fails on the handle.
    pub fn new<F>(weights: ModuleWeights, build: F) -> Result<Self>
    where
        F: Fn(VarBuilder) -> candle_core::Result<Box<dyn Module + Send + Sync>>
            + Send
            + Sync
            + 'static,
    {
        let module = HookedModule {
            weights,
            class_name: None,
            build: Arc::new(build),
            built: Mutex::new(None),
            hook: Mutex::new(None),
        };
        module.layer()?;
        Ok(module)
    }

    /// An empty module at `prefix`: `build` runs on [`init_empty_weights`],
    /// and every weight it asks for becomes a placeholder of `dtype` on `device`.
    ///
    /// # Errors
    /// [`Error::Candle`] when `build` fails.
    pub fn empty<F>(prefix: &str, dtype: DType, device: &Device, build: F) -> Result<Self>
    where
        F: Fn(VarBuilder) -> candle_core::Result<Box<dyn Module + Send + Sync>>
            + Send
            + Sync
            + 'static,
    {
        let (recorder, vb) = init_empty_weights(dtype, device);
        build(push_prefix(vb, prefix))?;
        let vars = recorder
            .tensors()
            .into_iter()
            .map(|t| Ok((t.name, placeholder(t.shape, t.dtype, device)?)))
            .collect::<Result<Vec<_>>>()?;
        HookedModule::new(ModuleWeights::new(prefix, vars)?, build)
    }

    /// A module built on a candle `VarMap` (initialising the `Var`s it asks
    /// for, as `VarBuilder::from_varmap` does); the handle shares those `Var`s
    /// until a hook replaces them.
    ///
    /// # Errors
    /// [`Error::Candle`] when `build` fails.
    pub fn from_varmap<F>(
        prefix: &str,
        varmap: &VarMap,
        dtype: DType,
        device: &Device,
        build: F,
    ) -> Result<Self>
    where
        F: Fn(VarBuilder) -> candle_core::Result<Box<dyn Module + Send + Sync>>
            + Send
            + Sync
            + 'static,
    {
        // Record the names through an empty pass, then let the VarMap create them.
        let (recorder, vb) = init_empty_weights(dtype, device);
        build(push_prefix(vb, prefix))?;
        build(push_prefix(
            VarBuilder::from_varmap(varmap, dtype, device),
            prefix,
        ))?;
        let data = varmap.data().lock().expect("VarMap lock poisoned");
        let vars = recorder
            .tensors()
            .into_iter()
            .map(|t| {
                let var = data
                    .get(&t.name)
                    .cloned()
                    .ok_or_else(|| Error::UnknownWeight {
                        module: prefix.to_string(),
                        tensor: t.name.clone(),
                    })?;
                Ok((t.name, var.as_tensor().clone()))
            })
            .collect::<Result<Vec<_>>>()?;
        drop(data);
        HookedModule::new(ModuleWeights::new(prefix, vars)?, build)
    }

    /// Sets the class name the planner's `no_split_module_classes` matches.
    pub fn with_class_name(mut self, class_name: impl Into<String>) -> Self {
        self.class_name = Some(class_name.into());
        self
    }

    /// The class name given by [`HookedModule::with_class_name`].
    pub fn class_name(&self) -> Option<&str> {
        self.class_name.as_deref()
    }

    /// The module's dotted name.
    pub fn prefix(&self) -> String {
        self.weights.prefix()
    }

    /// The weights handle.
    pub fn weights(&self) -> &ModuleWeights {
        &self.weights
    }

    /// Whether a hook is attached.
    pub fn has_hook(&self) -> bool {
        self.hook.lock().expect("hook lock poisoned").is_some()
    }

    /// Runs `f` on the attached hook, if any (for inspecting its state).
    pub fn with_hook<R>(&self, f: impl FnOnce(Option<&dyn ModelHook>) -> R) -> R {
        let hook = self.hook.lock().expect("hook lock poisoned");
        f(hook.as_deref())
    }

    pub(crate) fn take_hook(&mut self) -> Option<Box<dyn ModelHook>> {
        self.hook.get_mut().expect("hook lock poisoned").take()
    }

    pub(crate) fn put_hook(&mut self, hook: Box<dyn ModelHook>) {
        *self.hook.get_mut().expect("hook lock poisoned") = Some(hook);
    }

    /// The layer built from the current weights, rebuilt when they changed.
    fn layer(&self) -> Result<Arc<dyn Module + Send + Sync>> {
        let generation = self.weights.generation();
        let mut built = self.built.lock().expect("built lock poisoned");
        if let Some((g, layer)) = built.as_ref() {
            if *g == generation {
                return Ok(layer.clone());
            }
        }
        let layer: Arc<dyn Module + Send + Sync> = Arc::from((self.build)(vb_at(&self.weights))?);
        *built = Some((generation, layer.clone()));
        Ok(layer)
    }

    /// Forward with the hook: `pre_forward`, the layer, `post_forward`.
    ///
    /// # Errors
    /// Whatever the hook or the layer return.
    pub fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        let mut hook = self.hook.lock().expect("hook lock poisoned");
        let args = match hook.as_mut() {
            Some(h) => h.pre_forward(&self.weights, xs.clone())?,
            None => xs.clone(),
        };
        let out = self.layer()?.forward(&args)?;
        let out = match hook.as_mut() {
            Some(h) => h.post_forward(&self.weights, out)?,
            None => out,
        };
        // The cached layer holds the tensors it was built from; when the hook
        // released them, drop it too, or offloaded weights would stay resident.
        let generation = self.weights.generation();
        let mut built = self.built.lock().expect("built lock poisoned");
        if built.as_ref().is_some_and(|(g, _)| *g != generation) {
            *built = None;
        }
        Ok(out)
    }
}

impl Module for HookedModule {
    fn forward(&self, xs: &Tensor) -> candle_core::Result<Tensor> {
        HookedModule::forward(self, xs).map_err(|e| candle_core::Error::Msg(e.to_string()))
    }
}

/// A model as an ordered list of hooked parts run one after the other (an
/// embedding, the blocks, a head): the granularity at which device maps place.
#[derive(Debug, Default)]
pub struct HookedModel {
    /// The parts, in execution order.
    pub parts: Vec<HookedModule>,
}

impl HookedModel {
    /// A model from its parts.
    pub fn new(parts: Vec<HookedModule>) -> Self {
        HookedModel { parts }
    }

    /// Runs every part in order.
    ///
    /// # Errors
    /// The first part's error.
    pub fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        let mut x = xs.clone();
        for part in &self.parts {
            x = part.forward(&x)?;
        }
        Ok(x)
    }

    /// Every weight of every part with its current tensor, in order.
    pub fn named_tensors(&self) -> Vec<(String, Tensor)> {
        let parts = self.parts.iter();
        parts.flat_map(|p| p.weights().tensors()).collect()
    }

    /// The model as a [`ModuleTree`] for planning: every weight as a
    /// parameter, part class names set, weights typed as `dtype` when given.
    ///
    /// # Errors
    /// [`Error::NoTorchDtype`], [`Error::DuplicateName`].
    pub fn tree(&self, dtype: Option<DType>) -> Result<ModuleTree> {
        let tensors = self
            .named_tensors()
            .into_iter()
            .map(|(n, v)| {
                let d = crate::DTypeName::try_from(dtype.unwrap_or(v.dtype()))?;
                Ok((n, v.dims().to_vec(), d))
            })
            .collect::<Result<Vec<_>>>()?;
        let mut tree = ModuleTree::from_tensors(tensors)?;
        for part in &self.parts {
            if let Some(class) = part.class_name() {
                tree.set_class_name(&part.prefix(), class)?;
            }
        }
        Ok(tree)
    }
}
