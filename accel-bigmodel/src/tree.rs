//! A shape-only description of a model: modules, parameters, buffers and tied storage.

use crate::dtype::DTypeName;
use crate::error::{Error, Result};
use std::collections::{HashMap, HashSet};

/// Index of a module in its [`ModuleTree`]; the root (`""`) is always module 0.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ModuleId(pub(crate) usize);

/// Index of a parameter or buffer in its [`ModuleTree`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TensorId(pub(crate) usize);

/// Whether a tensor is a trainable parameter or a buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TensorKind {
    /// `nn.Parameter`.
    Parameter,
    /// A registered buffer.
    Buffer,
}

/// One parameter or buffer: what sizing and placement need to know about it.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorInfo {
    /// Full dotted name, e.g. `h.0.attn.weight`.
    pub name: String,
    /// Dimensions; empty for a scalar.
    pub shape: Vec<usize>,
    /// Element type.
    pub dtype: DTypeName,
    /// Parameter or buffer.
    pub kind: TensorKind,
    /// Whether a buffer goes into the state dict (always true for parameters).
    pub persistent: bool,
    /// Tensors with equal storage ids are one tensor under several names (tied weights).
    pub(crate) storage: usize,
    pub(crate) module: ModuleId,
}

impl TensorInfo {
    /// Number of elements (1 for a scalar).
    pub fn numel(&self) -> u128 {
        self.shape.iter().map(|&d| d as u128).product()
    }
}

/// One module of the tree.
#[derive(Clone, Debug, PartialEq)]
pub struct ModuleInfo {
    /// Full dotted name; `""` for the root.
    pub name: String,
    /// Python class name (`Linear`, `GPTBlock`), or `None` when unknown, e.g.
    /// for trees built from checkpoint headers. `no_split_module_classes` matches on it.
    pub class_name: Option<String>,
    pub(crate) parent: Option<ModuleId>,
    pub(crate) children: Vec<ModuleId>,
    pub(crate) tensors: Vec<TensorId>,
}

impl ModuleInfo {
    /// The enclosing module; `None` for the root.
    pub fn parent(&self) -> Option<ModuleId> {
        self.parent
    }

    /// Direct children, in registration order.
    pub fn children(&self) -> &[ModuleId] {
        &self.children
    }

    /// Direct parameters and buffers, in registration order (tied aliases included).
    pub fn tensors(&self) -> &[TensorId] {
        &self.tensors
    }
}

/// An entry of the planner's work list: a whole module or a single tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TreeItem {
    /// A module with everything below it.
    Module(ModuleId),
    /// One parameter or buffer.
    Tensor(TensorId),
}

/// A model as Accelerate's planners see it: modules in registration order with
/// class names, each module's direct parameters and buffers, and which
/// parameters share storage.
///
/// Built from the reference spec format ([`ModuleTree::from_spec_json`]), from
/// `(name, shape, dtype)` lists such as safetensors headers or a candle `VarMap`
/// ([`ModuleTree::from_tensors`]), or step by step. Traversals follow PyTorch's
/// `named_modules` / `named_parameters` order (pre-order, children and tensors in
/// registration order), which is what Accelerate's results depend on.
#[derive(Clone, Debug, PartialEq)]
pub struct ModuleTree {
    modules: Vec<ModuleInfo>,
    tensors: Vec<TensorInfo>,
    by_module: HashMap<String, ModuleId>,
    by_tensor: HashMap<String, TensorId>,
    tied: Vec<Vec<String>>,
}

impl Default for ModuleTree {
    fn default() -> Self {
        Self::new(None)
    }
}

fn parent_of(name: &str) -> (&str, &str) {
    name.rsplit_once('.').unwrap_or(("", name))
}

impl ModuleTree {
    /// A tree holding only the root module, of class `root_class`.
    pub fn new(root_class: Option<&str>) -> Self {
        let root = ModuleInfo {
            name: String::new(),
            class_name: root_class.map(str::to_string),
            parent: None,
            children: Vec::new(),
            tensors: Vec::new(),
        };
        ModuleTree {
            modules: vec![root],
            tensors: Vec::new(),
            by_module: HashMap::from([(String::new(), ModuleId(0))]),
            by_tensor: HashMap::new(),
            tied: Vec::new(),
        }
    }

    /// Builds a tree from tensors alone, creating every module their dotted names
    /// imply (classes unknown) and registering modules and tensors in first-seen order.
    ///
    /// All tensors are parameters; use [`ModuleTree::add_buffer`] and
    /// [`ModuleTree::tie`] afterwards for buffers and tied weights.
    ///
    /// # Errors
    /// [`Error::DuplicateName`] when a name repeats or is both a module and a tensor.
    pub fn from_tensors<I, N>(tensors: I) -> Result<Self>
    where
        I: IntoIterator<Item = (N, Vec<usize>, DTypeName)>,
        N: AsRef<str>,
    {
        let mut tree = ModuleTree::new(None);
        for (name, shape, dtype) in tensors {
            let name = name.as_ref();
            tree.ensure_module(parent_of(name).0)?;
            tree.add_parameter(name, shape, dtype)?;
        }
        Ok(tree)
    }

    /// Creates `name` and any missing ancestors, with unknown classes.
    fn ensure_module(&mut self, name: &str) -> Result<ModuleId> {
        if let Some(&id) = self.by_module.get(name) {
            return Ok(id);
        }
        self.ensure_module(parent_of(name).0)?;
        self.add_module(name, None)
    }

    /// Registers module `name` (its parent must exist) as the last child of its parent.
    ///
    /// # Errors
    /// [`Error::UnknownModule`] without the parent, [`Error::DuplicateName`] when taken.
    pub fn add_module(&mut self, name: &str, class_name: Option<&str>) -> Result<ModuleId> {
        if name.is_empty() || self.by_module.contains_key(name) || self.by_tensor.contains_key(name)
        {
            return Err(Error::DuplicateName {
                name: name.to_string(),
            });
        }
        let parent = self
            .module_id(parent_of(name).0)
            .ok_or_else(|| Error::UnknownModule {
                name: name.to_string(),
                module: parent_of(name).0.to_string(),
            })?;
        let id = ModuleId(self.modules.len());
        self.modules.push(ModuleInfo {
            name: name.to_string(),
            class_name: class_name.map(str::to_string),
            parent: Some(parent),
            children: Vec::new(),
            tensors: Vec::new(),
        });
        self.modules[parent.0].children.push(id);
        self.by_module.insert(name.to_string(), id);
        Ok(id)
    }

    /// Sets the class name of an existing module.
    ///
    /// # Errors
    /// [`Error::UnknownModule`] when there is no such module.
    pub fn set_class_name(&mut self, module: &str, class_name: &str) -> Result<()> {
        let id = self.module_id(module).ok_or_else(|| Error::UnknownModule {
            name: "set_class_name".to_string(),
            module: module.to_string(),
        })?;
        self.modules[id.0].class_name = Some(class_name.to_string());
        Ok(())
    }

    fn add_tensor(
        &mut self,
        name: &str,
        shape: Vec<usize>,
        dtype: DTypeName,
        kind: TensorKind,
        persistent: bool,
    ) -> Result<TensorId> {
        if self.by_tensor.contains_key(name) || self.by_module.contains_key(name) {
            return Err(Error::DuplicateName {
                name: name.to_string(),
            });
        }
        let owner = parent_of(name).0;
        let module = self.module_id(owner).ok_or_else(|| Error::UnknownModule {
            name: name.to_string(),
            module: owner.to_string(),
        })?;
        let id = TensorId(self.tensors.len());
        self.tensors.push(TensorInfo {
            name: name.to_string(),
            shape,
            dtype,
            kind,
            persistent,
            storage: id.0,
            module,
        });
        self.modules[module.0].tensors.push(id);
        self.by_tensor.insert(name.to_string(), id);
        Ok(id)
    }

    /// Registers a parameter on the module its dotted prefix names (which must exist).
    ///
    /// # Errors
    /// [`Error::UnknownModule`] or [`Error::DuplicateName`].
    pub fn add_parameter(
        &mut self,
        name: &str,
        shape: Vec<usize>,
        dtype: DTypeName,
    ) -> Result<TensorId> {
        self.add_tensor(name, shape, dtype, TensorKind::Parameter, true)
    }

    /// Registers a buffer; `persistent: false` keeps it out of the state dict.
    ///
    /// # Errors
    /// [`Error::UnknownModule`] or [`Error::DuplicateName`].
    pub fn add_buffer(
        &mut self,
        name: &str,
        shape: Vec<usize>,
        dtype: DTypeName,
        persistent: bool,
    ) -> Result<TensorId> {
        self.add_tensor(name, shape, dtype, TensorKind::Buffer, persistent)
    }

    /// Declares that the named parameters are one tensor (tied weights), merging
    /// with any group that already holds one of them.
    ///
    /// The storage is counted once, under whichever name comes first in
    /// [`ModuleTree::parameters`] order. Groups are kept sorted, as
    /// Accelerate's `find_tied_parameters` returns them, in the order they were first declared.
    ///
    /// # Errors
    /// [`Error::UnknownParameter`] for a name that is not a parameter,
    /// [`Error::TiedMismatch`] when shapes or dtypes differ.
    pub fn tie(&mut self, names: &[&str]) -> Result<()> {
        let mut ids = Vec::with_capacity(names.len());
        for name in names {
            match self.by_tensor.get(*name) {
                Some(&id) if self.tensors[id.0].kind == TensorKind::Parameter => ids.push(id),
                _ => {
                    return Err(Error::UnknownParameter {
                        op: "tie",
                        name: name.to_string(),
                    })
                }
            }
        }
        let Some(&first) = ids.first() else {
            return Ok(());
        };
        let (shape, dtype) = (&self.tensors[first.0].shape, self.tensors[first.0].dtype);
        for &id in &ids[1..] {
            let t = &self.tensors[id.0];
            if &t.shape != shape || t.dtype != dtype {
                return Err(Error::TiedMismatch {
                    first: self.tensors[first.0].name.clone(),
                    other: t.name.clone(),
                    reason: format!("{shape:?} {dtype:?} vs {:?} {:?}", t.shape, t.dtype),
                });
            }
        }
        // Merge with every existing group that shares a name, keeping the first group's position.
        let mut merged: Vec<String> = names.iter().map(|n| n.to_string()).collect();
        let mut position = None;
        let mut kept = Vec::with_capacity(self.tied.len());
        for (i, group) in std::mem::take(&mut self.tied).into_iter().enumerate() {
            if group.iter().any(|g| merged.contains(g)) {
                position.get_or_insert(i);
                merged.extend(group);
            } else {
                kept.push(group);
            }
        }
        merged.sort();
        merged.dedup();
        if merged.len() < 2 {
            // One name is not a tie; `find_tied_parameters` never reports singletons.
            self.tied = kept;
            return Ok(());
        }
        let storage = merged
            .iter()
            .map(|n| self.tensors[self.by_tensor[n].0].storage)
            .min()
            .unwrap_or(first.0);
        for n in &merged {
            let id = self.by_tensor[n];
            self.tensors[id.0].storage = storage;
        }
        let at = position.map_or(kept.len(), |p| p.min(kept.len()));
        kept.insert(at, merged);
        self.tied = kept;
        Ok(())
    }

    /// Groups of parameter names that share storage (`find_tied_parameters`).
    pub fn tied_parameters(&self) -> &[Vec<String>] {
        &self.tied
    }

    /// The id of module `name`.
    pub fn module_id(&self, name: &str) -> Option<ModuleId> {
        self.by_module.get(name).copied()
    }

    /// The id of tensor `name`.
    pub fn tensor_id(&self, name: &str) -> Option<TensorId> {
        self.by_tensor.get(name).copied()
    }

    /// The module with this id.
    pub fn module(&self, id: ModuleId) -> &ModuleInfo {
        &self.modules[id.0]
    }

    /// The tensor with this id.
    pub fn tensor(&self, id: TensorId) -> &TensorInfo {
        &self.tensors[id.0]
    }

    /// The root module.
    pub fn root(&self) -> ModuleId {
        ModuleId(0)
    }

    /// Direct children of `id`, in registration order (`named_children`).
    pub fn children(&self, id: ModuleId) -> &[ModuleId] {
        &self.modules[id.0].children
    }

    /// Full name of a work-list item.
    pub fn item_name(&self, item: TreeItem) -> &str {
        match item {
            TreeItem::Module(m) => &self.modules[m.0].name,
            TreeItem::Tensor(t) => &self.tensors[t.0].name,
        }
    }

    /// Class name of whatever `name` designates, as `x.__class__.__name__` after
    /// walking attributes: the module's class, `Parameter` or `Tensor` (buffers).
    pub fn class_name_at(&self, name: &str) -> Option<&str> {
        if let Some(m) = self.module_id(name) {
            return self.modules[m.0].class_name.as_deref();
        }
        self.tensor_id(name).map(|t| match self.tensors[t.0].kind {
            TensorKind::Parameter => "Parameter",
            TensorKind::Buffer => "Tensor",
        })
    }

    /// All modules in pre-order (`named_modules`), root first.
    pub fn modules(&self) -> Vec<ModuleId> {
        let mut out = Vec::with_capacity(self.modules.len());
        let mut stack = vec![ModuleId(0)];
        while let Some(id) = stack.pop() {
            out.push(id);
            stack.extend(self.modules[id.0].children.iter().rev());
        }
        out
    }

    /// Direct tensors of `module` of one kind, skipping repeats of a storage
    /// within the module (`named_parameters(recurse=False)`).
    pub fn direct_tensors(&self, module: ModuleId, kind: TensorKind) -> Vec<TensorId> {
        let mut seen = HashSet::new();
        self.modules[module.0]
            .tensors
            .iter()
            .copied()
            .filter(|t| self.tensors[t.0].kind == kind && seen.insert(self.tensors[t.0].storage))
            .collect()
    }

    /// Tensors of one kind in `module`'s subtree, pre-order, each storage once
    /// (`named_parameters()` / `named_buffers()` with `remove_duplicate=True`).
    pub fn subtree_tensors(&self, module: ModuleId, kind: TensorKind) -> Vec<TensorId> {
        let mut seen = HashSet::new();
        let mut out = Vec::new();
        let mut stack = vec![module];
        while let Some(id) = stack.pop() {
            for &t in &self.modules[id.0].tensors {
                let info = &self.tensors[t.0];
                if info.kind == kind && seen.insert(info.storage) {
                    out.push(t);
                }
            }
            stack.extend(self.modules[id.0].children.iter().rev());
        }
        out
    }

    /// All parameters including tied aliases, pre-order (`named_parameters(remove_duplicate=False)`).
    pub fn parameters(&self) -> Vec<TensorId> {
        self.modules()
            .into_iter()
            .flat_map(|m| self.modules[m.0].tensors.iter().copied())
            .filter(|t| self.tensors[t.0].kind == TensorKind::Parameter)
            .collect()
    }

    /// All buffers, pre-order (`named_buffers(remove_duplicate=False)`).
    pub fn buffers(&self) -> Vec<TensorId> {
        self.modules()
            .into_iter()
            .flat_map(|m| self.modules[m.0].tensors.iter().copied())
            .filter(|t| self.tensors[t.0].kind == TensorKind::Buffer)
            .collect()
    }

    /// What a module splits into: its direct parameters, then its children
    /// (the list Accelerate builds when a module is too big to place whole).
    pub fn split_items(&self, module: ModuleId) -> Vec<TreeItem> {
        let params = self.direct_tensors(module, TensorKind::Parameter);
        params
            .into_iter()
            .map(TreeItem::Tensor)
            .chain(
                self.modules[module.0]
                    .children
                    .iter()
                    .map(|&c| TreeItem::Module(c)),
            )
            .collect()
    }

    /// The planner's starting work list: the root's direct parameters, its
    /// children, then its direct buffers.
    pub fn root_items(&self) -> Vec<TreeItem> {
        let mut items = self.split_items(ModuleId(0));
        items.extend(
            self.direct_tensors(ModuleId(0), TensorKind::Buffer)
                .into_iter()
                .map(TreeItem::Tensor),
        );
        items
    }
}
