//! [`ModuleWeights`]: the swappable weights handle of one module, which hooks,
//! offload and sharding replace tensors in rather than writing into them.

use std::sync::{Arc, RwLock};

use candle_core::{DType, Device, Shape, Tensor};
use candle_nn::var_builder::{SimpleBackend, VarBuilder};

use crate::empty::placeholder;
use crate::error::{Error, Result};

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
    // Bumped by every replacement, so a block knows when the layer
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
/// exactly the tensors the hooks placed, without conversion (names are full
/// dotted names, so a `VarBuilder` over it starts at the root).
pub struct SlotBackend(pub ModuleWeights);

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

impl ModuleWeights {
    /// Whether `other` is this very handle (a clone of it), not just equal contents.
    pub fn same_handle(&self, other: &ModuleWeights) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    /// A `VarBuilder` over this handle's current tensors, at the root (names
    /// are full dotted names).
    pub fn root_var_builder(&self) -> VarBuilder<'static> {
        VarBuilder::from_backend(Box::new(SlotBackend(self.clone())), DType::F32, Device::Cpu)
    }

    /// A `VarBuilder` over this handle's current tensors, at the module's prefix.
    pub fn var_builder(&self) -> VarBuilder<'static> {
        let vb = self.root_var_builder();
        let prefix = self.prefix();
        if prefix.is_empty() {
            vb
        } else {
            vb.pp(prefix)
        }
    }
}
