//! Memory budgets: size strings, resolved `max_memory`, and balanced budgets across GPUs.

use crate::bytes::Bytes;
use crate::device_map::Placement;
use crate::dtype::DTypeName;
use crate::error::{Error, Result};
use crate::ordered_map::OrderedMap;
use crate::sizes::{compute_module_sizes, SpecialDtypes};
use crate::tree::ModuleTree;
use std::collections::HashSet;

/// A memory budget as a user writes it: a byte count or a size string (`"10GiB"`).
#[derive(Clone, Debug, PartialEq)]
pub enum MemorySize {
    /// Bytes (a Python int, or a float from an earlier computation).
    Bytes(Bytes),
    /// A string for [`convert_file_size_to_int`].
    Text(String),
}

impl From<u64> for MemorySize {
    fn from(b: u64) -> Self {
        MemorySize::Bytes(Bytes::from(b))
    }
}

impl From<i64> for MemorySize {
    fn from(b: i64) -> Self {
        MemorySize::Bytes(Bytes::new(b))
    }
}

// Lets a bare literal (`(Placement::Cpu, 1000.into())`) type-check: integer literals default to i32.
impl From<i32> for MemorySize {
    fn from(b: i32) -> Self {
        MemorySize::Bytes(Bytes::new(b.into()))
    }
}

impl From<Bytes> for MemorySize {
    fn from(b: Bytes) -> Self {
        MemorySize::Bytes(b)
    }
}

impl From<&str> for MemorySize {
    fn from(s: &str) -> Self {
        MemorySize::Text(s.to_string())
    }
}

impl From<String> for MemorySize {
    fn from(s: String) -> Self {
        MemorySize::Text(s)
    }
}

/// Parses the number before a unit as Python's `float()` does (surrounding
/// whitespace, a sign, `_` between digits, `inf`/`nan`).
fn python_float(text: &str) -> Option<f64> {
    let t = text.trim();
    let bytes = t.as_bytes();
    for (i, &b) in bytes.iter().enumerate() {
        if b == b'_' {
            let digit = |j: Option<&u8>| j.is_some_and(u8::is_ascii_digit);
            if !digit(i.checked_sub(1).and_then(|j| bytes.get(j))) || !digit(bytes.get(i + 1)) {
                return None;
            }
        }
    }
    let cleaned = t.replace('_', "");
    let lower = cleaned.to_ascii_lowercase();
    let unsigned = lower.trim_start_matches(['+', '-']);
    let special = ["inf", "infinity", "nan"].contains(&unsigned);
    if cleaned.is_empty()
        || (!special && cleaned.contains(|c: char| !(c.is_ascii_digit() || "+-.eE".contains(c))))
    {
        return None;
    }
    cleaned.parse().ok()
}

/// Converts a size string to bytes, as Accelerate's `convert_file_size_to_int`.
///
/// `KiB`/`MiB`/`GiB` are powers of 1024 and `KB`/`MB`/`GB` powers of 1000
/// (units case-insensitive); a lowercase final `b` (`"5Mb"`) means bits, so the
/// result is divided by 8. Fractions are allowed (`"1.5GB"`), truncated to whole bytes.
///
/// # Errors
/// [`Error::InvalidSize`], with Accelerate's message, for anything else
/// (including a plain number without unit, and `TB`).
pub fn convert_file_size_to_int(size: &str) -> Result<Bytes> {
    let invalid = || Error::InvalidSize {
        size: size.to_string(),
    };
    let upper = size.to_uppercase();
    let (unit_len, scale, bits_allowed): (usize, f64, bool) = if upper.ends_with("GIB") {
        (3, 2f64.powi(30), false)
    } else if upper.ends_with("MIB") {
        (3, 2f64.powi(20), false)
    } else if upper.ends_with("KIB") {
        (3, 2f64.powi(10), false)
    } else if upper.ends_with("GB") {
        (2, 1e9, true)
    } else if upper.ends_with("MB") {
        (2, 1e6, true)
    } else if upper.ends_with("KB") {
        (2, 1e3, true)
    } else {
        return Err(invalid());
    };
    // Python slices the original string by characters, whatever `upper()` did.
    let chars: Vec<char> = size.chars().collect();
    let number: String = chars[..chars.len() - unit_len].iter().collect();
    let number = python_float(&number).ok_or_else(invalid)?;
    let bytes = number * scale;
    if bytes.is_nan() {
        return Err(invalid());
    }
    if bytes.is_infinite() {
        // `int(inf)` raises OverflowError, which Accelerate does not catch.
        return Err(Error::SizeOverflow {
            size: size.to_string(),
        });
    }
    // Python's `int()` truncates towards zero; a negative result is rejected below.
    let mut whole = bytes.trunc() as i128;
    if bits_allowed && size.ends_with('b') {
        whole = whole.div_euclid(8);
    }
    if whole < 0 {
        return Err(invalid());
    }
    Ok(Bytes::from_bits(whole * 8, false))
}

/// Resolved per-device budgets in Accelerate's fill order: GPUs ascending, then cpu, then disk.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct MaxMemory {
    map: OrderedMap<Placement, Bytes>,
}

impl MaxMemory {
    /// The budget of `device`, if it has one.
    pub fn get(&self, device: Placement) -> Option<Bytes> {
        self.map.get(&device).copied()
    }

    /// Devices and budgets in order.
    pub fn iter(&self) -> impl Iterator<Item = (Placement, Bytes)> + '_ {
        self.map.iter().map(|(k, v)| (*k, *v))
    }

    /// Devices in order.
    pub fn devices(&self) -> Vec<Placement> {
        self.map.keys().copied().collect()
    }

    /// Number of devices.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether no device has a budget.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// The budgets as planner input, e.g. to plan with a balanced budget.
    pub fn to_limits(&self) -> Vec<(Placement, MemorySize)> {
        self.iter()
            .map(|(d, b)| (d, MemorySize::Bytes(b)))
            .collect()
    }

    fn set(&mut self, device: Placement, bytes: Bytes) {
        self.map.insert(device, bytes);
    }
}

/// Serialises as Accelerate's dict: `{"0": 1000, "cpu": 5000}`.
impl serde::Serialize for MaxMemory {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.collect_map(self.iter().map(|(d, b)| (d.to_string(), b)))
    }
}

/// Resolves a `max_memory` argument (Accelerate's `get_max_memory` with an explicit dict):
/// size strings become bytes and devices are reordered GPUs first, then cpu, then disk.
///
/// A device listed twice keeps its first position and last value, as a dict
/// literal does. Accelerate also logs when a GPU ordinal exceeds the visible
/// device count; that needs a runtime and is left to the caller.
///
/// # Errors
/// [`Error::InvalidSize`] for a bad size string.
pub fn get_max_memory(max_memory: &[(Placement, MemorySize)]) -> Result<MaxMemory> {
    let mut given: OrderedMap<Placement, Bytes> = OrderedMap::new();
    for (device, size) in max_memory {
        let bytes = match size {
            MemorySize::Bytes(b) => *b,
            MemorySize::Text(t) => convert_file_size_to_int(t)?,
        };
        given.insert(*device, bytes);
    }
    let mut devices: Vec<Placement> = given.keys().copied().collect();
    devices.sort();
    let mut out = MaxMemory::default();
    for d in devices {
        out.set(d, given.get(&d).copied().unwrap_or_default());
    }
    Ok(out)
}

/// Reads a `max_memory` JSON object of the reference format: keys are GPU
/// ordinals written as digits, `"cpu"` or `"disk"`; values are integers, floats or size strings.
///
/// Checks happen in Accelerate's order: all size strings first, then device names.
///
/// # Errors
/// [`Error::InvalidSize`], [`Error::UnrecognizedDevice`], or [`Error::InvalidSpec`] for a non-object.
pub fn parse_max_memory_json(value: &serde_json::Value) -> Result<Vec<(Placement, MemorySize)>> {
    let Some(obj) = value.as_object() else {
        crate::error::bail_spec!("max_memory", "expected an object, got {value}");
    };
    let mut sizes = Vec::with_capacity(obj.len());
    for (key, v) in obj {
        let size = match v {
            serde_json::Value::String(s) => {
                convert_file_size_to_int(s)?;
                MemorySize::Text(s.clone())
            }
            serde_json::Value::Number(n) => match (n.as_i64(), n.as_f64()) {
                (Some(i), _) => MemorySize::Bytes(Bytes::new(i)),
                (None, Some(f)) => MemorySize::Bytes(Bytes::from_f64(f)),
                _ => crate::error::bail_spec!(format!("max_memory.{key}"), "not a number: {n}"),
            },
            other => crate::error::bail_spec!(
                format!("max_memory.{key}"),
                "expected bytes or a size string, got {other}"
            ),
        };
        sizes.push((key, size));
    }
    sizes
        .into_iter()
        .map(|(k, s)| Ok((Placement::parse_key(k)?, s)))
        .collect()
}

/// Budgets that spread a model evenly over the GPUs (Accelerate's `get_balanced_memory`,
/// what `device_map="balanced"` plans with).
///
/// Every GPU but the last gets `total / n_gpus` plus a margin of 1.25 × the larger of
/// the first no-split block's size and the mean size of the innermost modules, capped
/// by its own budget; the last keeps its budget. With `low_zero`, GPU 0 gets only
/// what the others cannot hold. Budgets of 0 do not count as GPUs.
///
/// # Errors
/// As [`get_max_memory`]; [`Error::NotATorchDevice`] when `max_memory` has a `disk`
/// key (Accelerate passes every non-integer key to `torch.device`, which rejects
/// it); [`Error::MissingGpu`] when `low_zero` needs GPUs `0..n` and one is absent.
pub fn get_balanced_memory(
    tree: &ModuleTree,
    max_memory: &[(Placement, MemorySize)],
    no_split_module_classes: &[String],
    dtype: Option<DTypeName>,
    special_dtypes: Option<&SpecialDtypes>,
    low_zero: bool,
) -> Result<MaxMemory> {
    const OP: &str = "get_balanced_memory";
    let mut max_memory = get_max_memory(max_memory)?;
    let mut num_devices = 0u64;
    for (device, bytes) in max_memory.iter() {
        match device {
            Placement::Gpu(_) if bytes > Bytes::ZERO => num_devices += 1,
            Placement::Gpu(_) | Placement::Cpu => {}
            Placement::Disk => {
                return Err(Error::NotATorchDevice {
                    op: OP,
                    device: device.to_string(),
                })
            }
        }
    }
    if num_devices == 0 {
        return Ok(max_memory);
    }
    // One GPU cannot be left empty for generation, so low_zero is dropped.
    let low_zero = low_zero && num_devices > 1;

    let module_sizes = compute_module_sizes(tree, dtype, special_dtypes);
    let mut per_gpu = module_sizes.total().floor_div(if low_zero {
        num_devices - 1
    } else {
        num_devices
    });

    // Size of the first module met of each no-split class; the margin uses the largest.
    let mut buffer = Bytes::ZERO;
    if !no_split_module_classes.is_empty() {
        let wanted: HashSet<&str> = no_split_module_classes.iter().map(String::as_str).collect();
        let mut found: OrderedMap<&str, Bytes> = OrderedMap::new();
        for (name, size) in module_sizes.iter().filter(|(n, _)| !n.is_empty()) {
            if let Some(class) = tree.class_name_at(name).filter(|c| wanted.contains(c)) {
                if !found.contains_key(class) {
                    found.insert(class, size);
                }
            }
            if found.len() == wanted.len() {
                break;
            }
        }
        let mut sizes = found.iter().map(|(_, s)| *s);
        if let Some(first) = sizes.next() {
            buffer = sizes.fold(first, Bytes::py_max);
        }
    }

    // Mean size of the innermost modules: drop the tensors (the leaves of the
    // size table), then average the leaves of what remains.
    let tensor_leaves = module_leaves(&module_sizes);
    let module_sizes = module_sizes.without(&tensor_leaves.into_iter().collect());
    let leaves = module_leaves(&module_sizes);
    let leaf_total: Bytes = leaves.iter().map(|n| module_sizes.get(n)).sum();
    // int(sum / len): true division then truncation towards zero.
    let count = leaves.len().max(1) as i128;
    let mean_leaves = Bytes::from_bits((leaf_total.bits() / (8 * count)) * 8, false);
    // int(1.25 * max(buffer, mean)), computed exactly in bits.
    let base = buffer.py_max(mean_leaves);
    let buffer = Bytes::from_bits(((base.bits() * 5) / 32) * 8, false);
    per_gpu += buffer;

    let gpus: Vec<usize> = max_memory
        .iter()
        .filter_map(|(d, b)| match d {
            Placement::Gpu(i) if b > Bytes::ZERO => Some(i),
            _ => None,
        })
        .collect();
    let gpu0 = |m: &MaxMemory, reason| {
        m.get(Placement::Gpu(0)).ok_or(Error::MissingGpu {
            op: OP,
            gpu: 0,
            reason,
        })
    };
    // The last GPU keeps its whole budget in case the margin was not enough.
    for &idx in &gpus[..gpus.len() - 1] {
        let cap = if low_zero && idx == 0 {
            gpu0(&max_memory, "low_zero caps GPU 0 by itself")?
        } else {
            per_gpu
        };
        let own = max_memory.get(Placement::Gpu(idx)).unwrap_or_default();
        max_memory.set(Placement::Gpu(idx), cap.py_min(own));
    }

    if low_zero {
        let mut others = Bytes::ZERO;
        for i in 1..num_devices as usize {
            others += max_memory.get(Placement::Gpu(i)).ok_or(Error::MissingGpu {
                op: OP,
                gpu: i,
                reason: "low_zero sums the budgets of GPUs 1..n",
            })?;
        }
        let min_zero = Bytes::ZERO.py_max(module_sizes.total() - others);
        let zero = gpu0(&max_memory, "low_zero shrinks GPU 0")?;
        max_memory.set(Placement::Gpu(0), min_zero.py_min(zero));
    }
    Ok(max_memory)
}

/// Names in a size table with no entry below them (`get_module_leaves`); the root is never a leaf.
fn module_leaves(module_sizes: &crate::sizes::ModuleSizes) -> Vec<&str> {
    let mut has_children: HashSet<&str> = HashSet::new();
    for (name, _) in module_sizes.iter() {
        if let Some((parent, _)) = name.rsplit_once('.') {
            has_children.insert(parent);
        }
    }
    module_sizes
        .iter()
        .map(|(n, _)| n)
        .filter(|n| !n.is_empty() && !has_children.contains(n))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn size_strings_parse_like_accelerate() {
        let cases = [
            ("1GiB", 1 << 30),
            ("1GB", 1_000_000_000),
            ("5Mb", 625_000),
            ("5mb", 625_000),
            ("5MB", 5_000_000),
            ("1.5KiB", 1536),
            ("0.3KB", 300),
            ("1_000KB", 1_000_000),
            (" 2 GB", 2_000_000_000),
            ("7kb", 875),
        ];
        for (text, bytes) in cases {
            assert_eq!(
                convert_file_size_to_int(text).unwrap(),
                Bytes::new(bytes),
                "{text}"
            );
        }
        for bad in ["10", "1TB", "GB", "x1GB", "-1GB", "nanGB", "1__0GB"] {
            let err = convert_file_size_to_int(bad).unwrap_err().to_string();
            assert!(
                err.starts_with(&format!("`size` {bad} is not in a valid format.")),
                "{err}"
            );
        }
        assert!(matches!(
            convert_file_size_to_int("infGB"),
            Err(Error::SizeOverflow { .. })
        ));
        assert!(matches!(
            convert_file_size_to_int("1e400KB"),
            Err(Error::SizeOverflow { .. })
        ));
        assert_eq!(
            convert_file_size_to_int("-0.0001KB").unwrap(),
            Bytes::new(0)
        );
    }

    #[test]
    fn max_memory_orders_gpus_then_cpu_then_disk() -> Result<()> {
        use Placement::*;
        let resolved = get_max_memory(&[
            (Disk, "1GB".into()),
            (Cpu, 10u64.into()),
            (Gpu(2), 5u64.into()),
            (Gpu(0), "1KiB".into()),
        ])?;
        assert_eq!(resolved.devices(), [Gpu(0), Gpu(2), Cpu, Disk]);
        assert_eq!(resolved.get(Gpu(0)), Some(Bytes::new(1024)));
        Ok(())
    }

    #[test]
    fn json_keys_check_sizes_before_devices() {
        let err = parse_max_memory_json(&serde_json::json!({"mps": 1, "tpu": "3XB"})).unwrap_err();
        assert!(matches!(err, Error::InvalidSize { .. }), "{err}");
        let err = parse_max_memory_json(&serde_json::json!({"mps": 1})).unwrap_err();
        assert!(
            err.to_string().starts_with("Device mps is not recognized"),
            "{err}"
        );
    }
}
