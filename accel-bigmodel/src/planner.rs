//! Device-map planning: Accelerate's `infer_auto_device_map`, step for step.

use crate::bytes::Bytes;
use crate::device_map::{clean_device_map, DeviceMap, Placement};
use crate::dtype::DTypeName;
use crate::error::Result;
use crate::memory::{get_max_memory, MemorySize};
use crate::ordered_map::OrderedMap;
use crate::planner_fallback::{fallback_allocate, module_size_with_ties, tied_params_outside};
use crate::sizes::{
    compute_module_sizes, compute_module_total_buffer_size, get_max_layer_size, is_no_split,
    MaxLayer, SpecialDtypes,
};
use crate::tree::{ModuleTree, TreeItem};

/// The arguments of [`infer_auto_device_map`], named as in Accelerate.
#[derive(Clone, Debug, PartialEq)]
pub struct PlanOptions {
    /// Budget per device; devices are filled GPUs first, then cpu, then disk
    /// (disk is always available and unbounded).
    pub max_memory: Vec<(Placement, MemorySize)>,
    /// Classes of modules that must stay on one device (residual blocks).
    pub no_split_module_classes: Vec<String>,
    /// The dtype weights will be converted to when loaded, if any.
    pub dtype: Option<DTypeName>,
    /// Per-tensor dtypes that override `dtype`.
    pub special_dtypes: Option<SpecialDtypes>,
    /// Record Accelerate's `verbose=True` debugging lines in [`Plan::trace`].
    pub verbose: bool,
    /// Group submodules sharing a device under their parent (default true).
    pub clean_result: bool,
    /// Offload buffers with their layers instead of counting them against GPU memory.
    pub offload_buffers: bool,
    /// When a device would otherwise stay empty, search for a smaller module that fits it.
    pub fallback_allocation: bool,
}

impl Default for PlanOptions {
    fn default() -> Self {
        PlanOptions {
            max_memory: Vec::new(),
            no_split_module_classes: Vec::new(),
            dtype: None,
            special_dtypes: None,
            verbose: false,
            clean_result: true,
            offload_buffers: false,
            fallback_allocation: false,
        }
    }
}

impl PlanOptions {
    /// Options with these budgets and Accelerate's defaults for the rest.
    pub fn new(max_memory: Vec<(Placement, MemorySize)>) -> Self {
        PlanOptions {
            max_memory,
            ..Self::default()
        }
    }

    /// Sets `no_split_module_classes`.
    pub fn with_no_split_module_classes<S: Into<String>>(
        mut self,
        classes: impl IntoIterator<Item = S>,
    ) -> Self {
        self.no_split_module_classes = classes.into_iter().map(Into::into).collect();
        self
    }

    /// Sets `dtype`.
    pub fn with_dtype(mut self, dtype: Option<DTypeName>) -> Self {
        self.dtype = dtype;
        self
    }

    /// Sets `special_dtypes`.
    pub fn with_special_dtypes(mut self, special_dtypes: Option<SpecialDtypes>) -> Self {
        self.special_dtypes = special_dtypes;
        self
    }

    /// Sets `verbose`.
    pub fn with_verbose(mut self, verbose: bool) -> Self {
        self.verbose = verbose;
        self
    }

    /// Sets `clean_result`.
    pub fn with_clean_result(mut self, clean_result: bool) -> Self {
        self.clean_result = clean_result;
        self
    }

    /// Sets `offload_buffers`.
    pub fn with_offload_buffers(mut self, offload_buffers: bool) -> Self {
        self.offload_buffers = offload_buffers;
        self
    }

    /// Sets `fallback_allocation`.
    pub fn with_fallback_allocation(mut self, fallback_allocation: bool) -> Self {
        self.fallback_allocation = fallback_allocation;
        self
    }
}

/// What [`infer_auto_device_map`] decided, and what Accelerate would have said meanwhile.
#[derive(Clone, Debug, PartialEq)]
pub struct Plan {
    /// Module name → device, in placement order.
    pub device_map: DeviceMap,
    /// Texts Accelerate passes to `warnings.warn`.
    pub warnings: Vec<String>,
    /// Texts Accelerate logs at INFO or above.
    pub logs: Vec<String>,
    /// With `verbose`, the lines Accelerate prints while planning.
    pub trace: Vec<String>,
}

/// Python's `repr` of a list of names: `['a', 'b']`.
fn py_list<S: AsRef<str>>(items: &[S]) -> String {
    let inner: Vec<String> = items.iter().map(|s| format!("'{}'", s.as_ref())).collect();
    format!("[{}]", inner.join(", "))
}

/// `get_max_layer_size` over the modules (not tensors) still queued, as
/// Accelerate recomputes it after each split.
fn max_layer_of_queue(
    tree: &ModuleTree,
    queue: &[TreeItem],
    sizes: &crate::sizes::ModuleSizes,
    no_split: &[String],
) -> MaxLayer {
    let modules: Vec<TreeItem> = queue
        .iter()
        .copied()
        .filter(|i| matches!(i, TreeItem::Module(_)))
        .collect();
    get_max_layer_size(tree, &modules, sizes, no_split)
}

/// Plans which device each module goes to (Accelerate's `infer_auto_device_map`).
///
/// Modules are taken in registration order and packed onto GPU 0, 1, …, then
/// cpu, then disk. A module that does not fit is split into its parameters and
/// children unless it is a leaf or of a no-split class; then the next device is
/// tried. GPU 0 and cpu keep room for the largest remaining layer (so an
/// offloaded layer can be brought back), tied parameters are placed together
/// with the module that holds their storage, and buffers of offloaded modules
/// are counted towards a warning unless `offload_buffers` is set.
///
/// # Errors
/// As [`get_max_memory`], plus the failures Accelerate itself runs into:
/// [`crate::Error::TiedParameterNotQueued`] and [`crate::Error::FractionalSizeLimit`].
pub fn infer_auto_device_map(tree: &ModuleTree, options: &PlanOptions) -> Result<Plan> {
    let max_memory = get_max_memory(&options.max_memory)?;
    let no_split = &options.no_split_module_classes;
    let (dtype, special) = (options.dtype, options.special_dtypes.as_ref());
    let mut plan = Plan {
        device_map: DeviceMap::new(),
        warnings: Vec::new(),
        logs: Vec::new(),
        trace: Vec::new(),
    };
    let mut trace = |line: String| {
        if options.verbose {
            plan.trace.push(line);
        }
    };

    let mut devices = max_memory.devices();
    if !devices.contains(&Placement::Disk) {
        devices.push(Placement::Disk);
    }
    let gpus: Vec<Placement> = devices.iter().copied().filter(|d| d.is_gpu()).collect();
    // Devices that keep room for the largest layer, to load an offloaded one back.
    let main_devices = match gpus.first() {
        Some(&gpu0) => vec![gpu0, Placement::Cpu],
        None => vec![Placement::Cpu],
    };
    let module_sizes = compute_module_sizes(tree, dtype, special);
    let tied = tree.tied_parameters();
    let mut queue = tree.root_items();

    let mut device_map = DeviceMap::new();
    let mut current_device = 0usize;
    let mut used: OrderedMap<Placement, Bytes> =
        devices.iter().map(|&d| (d, Bytes::ZERO)).collect();
    let mut buffer_sizes: OrderedMap<Placement, Bytes> = OrderedMap::new();
    let mut minimum_assignment: OrderedMap<Placement, Bytes> = OrderedMap::new();

    let MaxLayer {
        size: mut max_layer_size,
        names: mut max_layer_names,
    } = get_max_layer_size(tree, &queue, &module_sizes, no_split);

    while !queue.is_empty() {
        let item = queue.remove(0);
        let name = tree.item_name(item).to_string();
        let dotted = format!("{name}.");
        trace(format!("\nTreating module {name}."));
        // The largest layer may have been this one; if none of that size is left, look again.
        max_layer_names.retain(|n| *n != name && !n.starts_with(&dotted));
        if max_layer_names.is_empty() {
            MaxLayer {
                size: max_layer_size,
                names: max_layer_names,
            } = max_layer_of_queue(tree, &queue, &module_sizes, no_split);
        }
        let module_size = module_sizes.get(&name);

        let (groups, tied_params) = tied_params_outside(tied, &name);
        if !groups.is_empty() {
            let groups: Vec<String> = groups.iter().map(|g| py_list(g)).collect();
            trace(format!(
                "  Found the relevant tied param groups [{}]",
                groups.join(", ")
            ));
        }
        if !tied_params.is_empty() {
            trace(format!(
                "  So those parameters need to be taken into account {}",
                py_list(&tied_params)
            ));
        }

        let device = devices[current_device];
        let budget = max_memory.get(device).unwrap_or_default();
        let mut current_max_size = (device != Placement::Disk).then_some(budget);
        let mut reserved = Bytes::ZERO;
        if main_devices.contains(&device) {
            current_max_size = current_max_size.map(|m| m - max_layer_size);
            reserved = max_layer_size;
        }
        let (size_with_ties, tied_modules) = module_size_with_ties(
            tree,
            "infer_auto_device_map",
            &tied_params,
            module_size,
            &module_sizes,
            &queue,
        )?;
        let tied_names: Vec<String> = tied_modules
            .iter()
            .map(|&m| tree.item_name(m).to_string())
            .collect();
        let used_here = used.get(&device).copied().unwrap_or_default();

        // The module and the modules of its tied parameters fit: place them all.
        let Some(max_size) = current_max_size.filter(|&m| used_here + size_with_ties > m) else {
            if options.verbose {
                let mut line = format!("Putting {name}");
                if tied_names.is_empty() {
                    line += &format!(" (size={module_size})");
                } else {
                    line += &format!(" and {}", py_list(&tied_names));
                }
                if let Some(m) = current_max_size {
                    line += &format!(" (available={})", m - used_here);
                }
                trace(format!("{line} on {device}."));
            }
            *used.entry_or(device, Bytes::ZERO) += size_with_ties;
            device_map.insert(name.clone(), device);
            for tied_name in &tied_names {
                if let Some(pos) = queue.iter().position(|&i| tree.item_name(i) == tied_name) {
                    queue.remove(pos);
                }
                device_map.insert(tied_name.clone(), device);
            }
            if let (false, TreeItem::Module(m)) = (options.offload_buffers, item) {
                let buffers = compute_module_total_buffer_size(tree, m, dtype, special);
                *buffer_sizes.entry_or(device, Bytes::ZERO) += buffers;
            }
            continue;
        };

        // The module alone fits: try to split one of the tied modules instead.
        if !tied_params.is_empty() && used_here + module_size <= max_size {
            trace(format!(
                "Not enough space on {device} to put {name} and {} (space available {}, needed size {size_with_ties}).",
                py_list(&tied_names),
                max_size - used_here
            ));
            let mut split_happened = false;
            for (tied_name, &tied_item) in tied_names.iter().zip(&tied_modules) {
                let TreeItem::Module(m) = tied_item else {
                    continue;
                };
                if tree.children(m).is_empty() || is_no_split(tree, m, no_split) {
                    continue;
                }
                trace(format!("Splitting {tied_name}."));
                let Some(idx) = queue.iter().position(|&i| i == tied_item) else {
                    continue;
                };
                let mut next = vec![item];
                next.extend_from_slice(&queue[..idx]);
                next.extend(tree.split_items(m));
                next.extend_from_slice(&queue[idx + 1..]);
                queue = next;
                MaxLayer {
                    size: max_layer_size,
                    names: max_layer_names,
                } = max_layer_of_queue(tree, &queue, &module_sizes, no_split);
                split_happened = true;
                break;
            }
            if split_happened {
                continue;
            }
            trace("None of the tied module can be split, going to the next device.".to_string());
        }

        // The module itself does not fit (note `>=`): split it if it can be split.
        if used_here + module_size >= max_size {
            trace(format!(
                "Not enough space on {device} to put {name} (space available {}, module size {module_size}).",
                max_size - used_here
            ));
            match item {
                TreeItem::Module(m)
                    if !tree.children(m).is_empty() && !is_no_split(tree, m, no_split) =>
                {
                    trace(format!("Splitting {name}."));
                    let mut next = tree.split_items(m);
                    next.append(&mut queue);
                    queue = next;
                    MaxLayer {
                        size: max_layer_size,
                        names: max_layer_names,
                    } = max_layer_of_queue(tree, &queue, &module_sizes, no_split);
                    continue;
                }
                _ => trace("This module cannot be split, going to the next device.".to_string()),
            }
        }

        // Rather than leave this device empty, look for something smaller that fits on it.
        if used_here == Bytes::ZERO && options.fallback_allocation && device != Placement::Disk {
            let limit = budget - max_layer_size.py_max(size_with_ties);
            if let Some((found, rest)) = fallback_allocate(
                tree,
                &queue,
                &module_sizes,
                limit - used_here,
                no_split,
                tied,
            )? {
                queue = [found, item].into_iter().chain(rest).collect();
                continue;
            }
        }

        if used_here == Bytes::ZERO {
            minimum_assignment.insert(device, size_with_ties + reserved);
        }
        *used.entry_or(device, Bytes::ZERO) += reserved;
        current_device += 1;
        queue.insert(0, item);
    }

    used.retain(|_, m| *m > Bytes::ZERO);
    if options.clean_result {
        clean_device_map(&mut device_map);
    }
    plan.device_map = device_map;

    let zero = Bytes::ZERO;
    let non_gpu_buffer = *buffer_sizes.get(&Placement::Cpu).unwrap_or(&zero)
        + *buffer_sizes.get(&Placement::Disk).unwrap_or(&zero);
    if non_gpu_buffer > zero && !options.offload_buffers {
        let fits_a_gpu = max_memory
            .iter()
            .filter(|(d, _)| d.is_gpu())
            .any(|(d, budget)| budget >= non_gpu_buffer + *used.get(&d).unwrap_or(&zero));
        if !gpus.is_empty() && !fits_a_gpu {
            plan.warnings.push(format!(
                "Current model requires {non_gpu_buffer} bytes of buffer for offloaded layers, which seems does \
                 not fit any GPU's remaining memory. If you are experiencing a OOM later, please consider using \
                 offload_buffers=True."
            ));
        }
    }

    if !minimum_assignment.is_empty() {
        let devices_info: Vec<String> = minimum_assignment
            .iter()
            .map(|(d, mem)| format!("  - {d}: {mem} bytes required"))
            .collect();
        plan.logs.push(format!(
            "Based on the current allocation process, no modules could be assigned to the following devices due to \
             insufficient memory:\n{}\nThese minimum requirements are specific to this allocation attempt and may \
             vary. Consider increasing the available memory for these devices to at least the specified minimum, or \
             adjusting the model config.",
            devices_info.join("\n")
        ));
    }
    Ok(plan)
}

#[cfg(test)]
mod tests {
    //! Expected values come from accelerate 1.15.0 on the same trees, e.g.
    //! `infer_auto_device_map(model, max_memory={0: 200000, 1: 400000, "cpu": 10**7})`
    //! with the model rebuilt by `tests/data/gen_cases.py::build_model`.
    use super::*;
    use crate::memory::get_balanced_memory;
    use Placement::{Cpu, Gpu};

    fn budget(entries: &[(Placement, u64)]) -> Vec<(Placement, MemorySize)> {
        entries.iter().map(|&(d, b)| (d, b.into())).collect()
    }

    fn placed(plan: &Plan) -> Vec<(&str, Placement)> {
        plan.device_map.iter().collect()
    }

    /// emb (20 kB) tied to big.b inside `big` (a 160 kB, b 20 kB, c 160 kB), then out (2 kB).
    fn tied_tree(big_class: &str) -> Result<ModuleTree> {
        let mut tree = ModuleTree::new(Some("Net"));
        tree.add_module("emb", Some("Embedding"))?;
        tree.add_module("big", Some(big_class))?;
        for m in ["big.a", "big.b", "big.c", "out"] {
            tree.add_module(m, Some("Linear"))?;
        }
        let f32 = DTypeName::FLOAT32;
        tree.add_parameter("emb.weight", vec![100, 50], f32)?;
        tree.add_parameter("big.a.weight", vec![200, 200], f32)?;
        tree.add_parameter("big.b.weight", vec![100, 50], f32)?;
        tree.add_parameter("big.c.weight", vec![200, 200], f32)?;
        tree.add_parameter("out.weight", vec![10, 50], f32)?;
        tree.tie(&["big.b.weight", "emb.weight"])?;
        Ok(tree)
    }

    #[test]
    fn a_tied_module_is_split_so_the_tie_stays_on_one_device() -> Result<()> {
        let options = PlanOptions::new(budget(&[
            (Gpu(0), 200_000),
            (Gpu(1), 400_000),
            (Cpu, 10_000_000),
        ]))
        .with_verbose(true);
        let plan = infer_auto_device_map(&tied_tree("Stack")?, &options)?;
        assert_eq!(
            placed(&plan),
            [
                ("emb", Gpu(0)),
                ("big.b", Gpu(0)),
                ("big.a", Gpu(1)),
                ("big.c", Gpu(1)),
                ("out", Gpu(1))
            ]
        );
        let trace = plan.trace.join("\n");
        assert!(trace.contains(
            "Not enough space on 0 to put emb and ['big'] (space available 40000, needed size 340000).\nSplitting big."
        ));
        assert!(trace.contains("Putting emb and ['big.b'] (available=40000) on 0."));
        Ok(())
    }

    #[test]
    fn an_unsplittable_tied_module_moves_both_to_the_next_device() -> Result<()> {
        let options = PlanOptions::new(budget(&[
            (Gpu(0), 200_000),
            (Gpu(1), 400_000),
            (Cpu, 10_000_000),
        ]))
        .with_no_split_module_classes(["Stack"]);
        let plan = infer_auto_device_map(&tied_tree("Stack")?, &options)?;
        assert_eq!(placed(&plan), [("", Gpu(1))]);
        Ok(())
    }

    /// a (40 kB) then three `Blk`s of 10 kB weight + an 80×80 bool mask (800.0 bytes).
    fn buffer_tree() -> Result<ModuleTree> {
        let mut tree = ModuleTree::new(Some("Net"));
        tree.add_module("a", Some("Linear"))?;
        tree.add_parameter("a.weight", vec![100, 100], DTypeName::FLOAT32)?;
        for i in 0..3 {
            tree.add_module(&format!("b{i}"), Some("Blk"))?;
            tree.add_parameter(&format!("b{i}.weight"), vec![50, 50], DTypeName::FLOAT32)?;
            tree.add_buffer(&format!("b{i}.mask"), vec![80, 80], DTypeName::BOOL, false)?;
        }
        Ok(tree)
    }

    #[test]
    fn offloaded_buffers_warn_unless_offload_buffers_is_set() -> Result<()> {
        let tree = buffer_tree()?;
        let options = PlanOptions::new(budget(&[(Gpu(0), 52_000), (Cpu, 1_000_000)]));
        let plan = infer_auto_device_map(&tree, &options)?;
        let expected = [("a", Gpu(0)), ("b0", Cpu), ("b1", Cpu), ("b2", Cpu)];
        assert_eq!(placed(&plan), expected);
        assert_eq!(
            plan.warnings,
            ["Current model requires 2400.0 bytes of buffer for offloaded layers, which seems does not fit any \
              GPU's remaining memory. If you are experiencing a OOM later, please consider using offload_buffers=True."]
        );
        let plan = infer_auto_device_map(&tree, &options.clone().with_offload_buffers(true))?;
        assert_eq!((placed(&plan), plan.warnings.len()), (expected.to_vec(), 0));
        // With room left on the GPU for the 2400 bytes there is nothing to warn about.
        let roomy = PlanOptions::new(budget(&[(Gpu(0), 60_000), (Cpu, 1_000_000)]));
        assert!(infer_auto_device_map(&tree, &roomy)?.warnings.is_empty());
        Ok(())
    }

    /// huge (4000 B), small = 4 × 40 B, tail (2000 B).
    fn fallback_tree() -> Result<ModuleTree> {
        let mut tree = ModuleTree::new(Some("Net"));
        tree.add_module("huge", Some("Linear"))?;
        tree.add_module("small", Some("Seq"))?;
        tree.add_parameter("huge.weight", vec![1000], DTypeName::FLOAT32)?;
        for i in 0..4 {
            tree.add_module(&format!("small.{i}"), Some("Linear"))?;
            tree.add_parameter(&format!("small.{i}.weight"), vec![10], DTypeName::FLOAT32)?;
        }
        tree.add_module("tail", Some("Linear"))?;
        tree.add_parameter("tail.weight", vec![500], DTypeName::FLOAT32)?;
        Ok(tree)
    }

    #[test]
    fn fallback_allocation_fills_a_gpu_the_first_module_skips() -> Result<()> {
        let tree = fallback_tree()?;
        let options = PlanOptions::new(budget(&[
            (Gpu(0), 4500),
            (Gpu(1), 10_000),
            (Cpu, 1_000_000),
        ]));
        let plan = infer_auto_device_map(&tree, &options)?;
        assert_eq!(placed(&plan), [("", Gpu(1))]);
        assert_eq!(plan.logs.len(), 1);
        // 4000 for `huge` plus 2000 kept for the largest layer left (`tail`).
        assert!(
            plan.logs[0].contains("\n  - 0: 6000 bytes required\n"),
            "{}",
            plan.logs[0]
        );
        let plan = infer_auto_device_map(&tree, &options.with_fallback_allocation(true))?;
        assert_eq!(
            placed(&plan),
            [("small", Gpu(0)), ("huge", Gpu(1)), ("tail", Gpu(1))]
        );
        assert!(plan.logs.is_empty());
        Ok(())
    }

    #[test]
    fn balanced_budgets_spread_the_model_and_low_zero_empties_gpu_0() -> Result<()> {
        let tree = fallback_tree()?;
        let limits = budget(&[
            (Gpu(0), 10_000),
            (Gpu(1), 10_000),
            (Gpu(2), 10_000),
            (Cpu, 1_000_000),
        ]);
        let show = |m: crate::memory::MaxMemory| {
            m.iter()
                .map(|(d, b)| format!("{d}={b}"))
                .collect::<Vec<_>>()
        };
        let balanced = get_balanced_memory(&tree, &limits, &[], None, None, false)?;
        assert_eq!(
            show(balanced),
            ["0=3335", "1=3335", "2=10000", "cpu=1000000"]
        );
        let low_zero = get_balanced_memory(&tree, &limits, &[], None, None, true)?;
        assert_eq!(show(low_zero), ["0=0", "1=4362", "2=10000", "cpu=1000000"]);
        Ok(())
    }
}
