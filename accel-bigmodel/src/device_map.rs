//! Where each module goes: placements and ordered device maps.

use crate::error::{Error, Result};
use crate::ordered_map::OrderedMap;
use crate::tree::{ModuleTree, TensorKind};
use std::fmt;

/// A device a module (or a memory budget) belongs to.
///
/// The order (`Gpu(0) < Gpu(1) < … < Cpu < Disk`) is the order in which
/// Accelerate fills devices. In JSON a GPU is its ordinal and the others are
/// `"cpu"` / `"disk"`, as in Accelerate's `device_map` dicts.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Placement {
    /// An accelerator, by ordinal.
    Gpu(usize),
    /// Host memory.
    Cpu,
    /// Offloaded to disk.
    Disk,
}

impl Placement {
    /// Parses a device key as the reference JSON writes them: digits are a GPU
    /// ordinal, otherwise `cpu` or `disk`.
    ///
    /// # Errors
    /// [`Error::UnrecognizedDevice`] for anything else (including `mps`, which
    /// Accelerate knows but this crate does not place on).
    pub fn parse_key(key: &str) -> Result<Self> {
        if !key.is_empty() && key.bytes().all(|b| b.is_ascii_digit()) {
            if let Ok(i) = key.parse() {
                return Ok(Placement::Gpu(i));
            }
        }
        match key {
            "cpu" => Ok(Placement::Cpu),
            "disk" => Ok(Placement::Disk),
            _ => Err(Error::UnrecognizedDevice {
                device: key.to_string(),
            }),
        }
    }

    /// Whether this is an accelerator (an integer key in Accelerate).
    pub fn is_gpu(self) -> bool {
        matches!(self, Placement::Gpu(_))
    }
}

impl std::str::FromStr for Placement {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        Placement::parse_key(s)
    }
}

/// Prints as Python formats the device in an f-string: `0`, `cpu`, `disk`.
impl fmt::Display for Placement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Placement::Gpu(i) => write!(f, "{i}"),
            Placement::Cpu => f.write_str("cpu"),
            Placement::Disk => f.write_str("disk"),
        }
    }
}

impl fmt::Debug for Placement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Placement::Gpu(i) => write!(f, "{i}"),
            other => write!(f, "'{other}'"),
        }
    }
}

impl serde::Serialize for Placement {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        match self {
            Placement::Gpu(i) => s.serialize_u64(*i as u64),
            Placement::Cpu => s.serialize_str("cpu"),
            Placement::Disk => s.serialize_str("disk"),
        }
    }
}

impl<'de> serde::Deserialize<'de> for Placement {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let value = serde_json::Value::deserialize(d)?;
        Placement::try_from(&value).map_err(serde::de::Error::custom)
    }
}

impl TryFrom<&serde_json::Value> for Placement {
    type Error = Error;
    fn try_from(value: &serde_json::Value) -> Result<Self> {
        let invalid = || Error::InvalidPlacement {
            value: value.to_string(),
        };
        match value {
            serde_json::Value::Number(n) => {
                let i = n.as_u64().ok_or_else(invalid)?;
                Ok(Placement::Gpu(usize::try_from(i).map_err(|_| invalid())?))
            }
            serde_json::Value::String(s) if s == "cpu" => Ok(Placement::Cpu),
            serde_json::Value::String(s) if s == "disk" => Ok(Placement::Disk),
            _ => Err(invalid()),
        }
    }
}

/// Module name → placement, in insertion order (Accelerate's `OrderedDict`).
///
/// The empty name `""` stands for the whole model. Order matters to Accelerate
/// users (it is the order modules were placed in), so it is kept and serialised.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct DeviceMap {
    map: OrderedMap<String, Placement>,
}

impl DeviceMap {
    /// An empty map.
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets the placement of `module`; an existing key keeps its position.
    pub fn insert(&mut self, module: impl Into<String>, placement: Placement) {
        self.map.insert(module.into(), placement);
    }

    /// Removes `module`, returning its placement.
    pub fn remove(&mut self, module: &str) -> Option<Placement> {
        self.map.remove(module)
    }

    /// The placement of exactly `module` (no prefix lookup).
    pub fn get(&self, module: &str) -> Option<Placement> {
        self.map.get(module).copied()
    }

    /// The placement that covers `name`: its own entry or its closest listed
    /// ancestor (Accelerate's `_get_param_device`).
    pub fn placement_of(&self, name: &str) -> Option<Placement> {
        let mut current = name;
        loop {
            if let Some(p) = self.get(current) {
                return Some(p);
            }
            if current.is_empty() {
                return None;
            }
            current = current.rsplit_once('.').map_or("", |(parent, _)| parent);
        }
    }

    /// Entries in order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, Placement)> {
        self.map.iter().map(|(k, v)| (k.as_str(), *v))
    }

    /// Module names in order.
    pub fn keys(&self) -> impl Iterator<Item = &str> {
        self.map.keys().map(String::as_str)
    }

    /// Number of entries.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether the map has no entries.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }
}

impl FromIterator<(String, Placement)> for DeviceMap {
    fn from_iter<I: IntoIterator<Item = (String, Placement)>>(iter: I) -> Self {
        DeviceMap {
            map: iter.into_iter().collect(),
        }
    }
}

impl fmt::Debug for DeviceMap {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_map().entries(self.iter()).finish()
    }
}

impl serde::Serialize for DeviceMap {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut map = s.serialize_map(Some(self.len()))?;
        for (k, v) in self.iter() {
            map.serialize_entry(k, &v)?;
        }
        map.end()
    }
}

/// Reads a JSON object keeping its key order (serde hands entries over in document order).
impl<'de> serde::Deserialize<'de> for DeviceMap {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct Visitor;
        impl<'de> serde::de::Visitor<'de> for Visitor {
            type Value = DeviceMap;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an object of module name to placement")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut access: A,
            ) -> std::result::Result<DeviceMap, A::Error> {
                let mut map = DeviceMap::new();
                while let Some((k, v)) = access.next_entry::<String, Placement>()? {
                    map.insert(k, v);
                }
                Ok(map)
            }
        }
        d.deserialize_map(Visitor)
    }
}

/// Groups submodules that share a device under their parent, as Accelerate's `clean_device_map`.
///
/// When every key under a module prefix has the same placement and there is more
/// than one, those keys are replaced by the module itself, appended at the end
/// (a `dict` delete-then-insert); then each child prefix is cleaned in turn.
/// Accelerate visits the children of a prefix in `set` order, which depends on
/// Python's string hashing; this visits them in first-appearance order, so the
/// placements are always Accelerate's and the key order is one Accelerate can produce.
pub fn clean_device_map(device_map: &mut DeviceMap) {
    clean_prefix(device_map, "");
}

fn clean_prefix(device_map: &mut DeviceMap, module_name: &str) {
    let prefix = if module_name.is_empty() {
        String::new()
    } else {
        format!("{module_name}.")
    };
    let under: Vec<(String, Placement)> = device_map
        .iter()
        .filter(|(k, _)| k.starts_with(&prefix))
        .map(|(k, v)| (k.to_string(), v))
        .collect();
    if under.len() > 1 && under.iter().all(|(_, v)| *v == under[0].1) {
        for (k, _) in &under {
            device_map.remove(k);
        }
        device_map.insert(module_name, under[0].1);
    }

    // The prefix of each key one level below `module_name`.
    let depth = if module_name.is_empty() {
        1
    } else {
        module_name.split('.').count() + 1
    };
    let mut children: Vec<String> = Vec::new();
    for key in device_map.keys() {
        if key.starts_with(&prefix) && key.len() > module_name.len() {
            let child = key.split('.').take(depth).collect::<Vec<_>>().join(".");
            if !children.contains(&child) {
                children.push(child);
            }
        }
    }
    for child in children {
        clean_prefix(device_map, &child);
    }
}

/// Checks that a device map gives a device to every tensor of the model, as
/// Accelerate's `check_device_map`; returns its warnings.
///
/// Keys that are not modules of the tree (tensor names included, as in
/// Accelerate) produce the warning
/// "The following device_map keys do not match any submodules in the model: [...]".
///
/// # Errors
/// [`Error::UncoveredTensors`] listing every state-dict name (parameters,
/// tied aliases included, and persistent buffers) no key covers.
pub fn check_device_map(tree: &ModuleTree, device_map: &DeviceMap) -> Result<Vec<String>> {
    let mut warnings = Vec::new();
    let invalid: Vec<String> = device_map
        .keys()
        .filter(|k| !k.is_empty() && tree.module_id(k).is_none())
        .map(|k| format!("'{k}'"))
        .collect();
    if !invalid.is_empty() {
        warnings.push(format!(
            "The following device_map keys do not match any submodules in the model: [{}]",
            invalid.join(", ")
        ));
    }
    if device_map.get("").is_some() {
        return Ok(warnings);
    }
    // `state_dict()` order: each module's parameters, then its persistent buffers, pre-order.
    let mut uncovered = Vec::new();
    for module in tree.modules() {
        let ids = tree.module(module).tensors();
        let params = ids
            .iter()
            .filter(|&&t| tree.tensor(t).kind == TensorKind::Parameter);
        let buffers = ids.iter().filter(|&&t| {
            let t = tree.tensor(t);
            t.kind == TensorKind::Buffer && t.persistent
        });
        for &t in params.chain(buffers) {
            let name = &tree.tensor(t).name;
            let covered = device_map
                .keys()
                .any(|k| name == k || name.starts_with(&format!("{k}.")));
            if !covered {
                uncovered.push(name.clone());
            }
        }
    }
    if !uncovered.is_empty() {
        return Err(Error::UncoveredTensors { tensors: uncovered });
    }
    Ok(warnings)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(entries: &[(&str, Placement)]) -> DeviceMap {
        entries.iter().map(|(k, v)| (k.to_string(), *v)).collect()
    }

    #[test]
    fn placements_round_trip_through_json() {
        let dm = map(&[
            ("a", Placement::Gpu(1)),
            ("b", Placement::Cpu),
            ("", Placement::Disk),
        ]);
        let text = serde_json::to_string(&dm).unwrap();
        assert_eq!(text, r#"{"a":1,"b":"cpu","":"disk"}"#);
        let back: DeviceMap = serde_json::from_str(&text).unwrap();
        assert_eq!(back.keys().collect::<Vec<_>>(), ["a", "b", ""]);
        assert!(serde_json::from_str::<DeviceMap>(r#"{"a":"mps"}"#).is_err());
    }

    #[test]
    fn cleaning_merges_uniform_subtrees_and_appends_them() {
        use Placement::*;
        let mut dm = map(&[
            ("h.0.a", Gpu(0)),
            ("h.0.b", Gpu(0)),
            ("h.1", Gpu(1)),
            ("x.w", Cpu),
            ("x.y.z", Cpu),
        ]);
        clean_device_map(&mut dm);
        assert_eq!(
            dm.iter().collect::<Vec<_>>(),
            [("h.1", Gpu(1)), ("h.0", Gpu(0)), ("x", Cpu)]
        );
    }

    #[test]
    fn cleaning_a_single_device_map_gives_the_root() {
        let mut dm = map(&[("a", Placement::Gpu(0)), ("b.c", Placement::Gpu(0))]);
        clean_device_map(&mut dm);
        assert_eq!(dm.iter().collect::<Vec<_>>(), [("", Placement::Gpu(0))]);
    }

    #[test]
    fn placement_of_walks_up_to_the_listed_ancestor() {
        let dm = map(&[("h.0", Placement::Gpu(0)), ("", Placement::Cpu)]);
        assert_eq!(dm.placement_of("h.0.attn.weight"), Some(Placement::Gpu(0)));
        assert_eq!(dm.placement_of("wte.weight"), Some(Placement::Cpu));
    }

    #[test]
    fn check_device_map_lists_every_uncovered_tensor_like_accelerate() {
        use crate::dtype::DTypeName;
        let mut tree = ModuleTree::from_tensors([
            ("emb.weight", vec![4, 2], DTypeName::FLOAT32),
            ("h.0.weight", vec![2, 2], DTypeName::FLOAT32),
            ("h.1.weight", vec![2, 2], DTypeName::FLOAT32),
        ])
        .unwrap();
        tree.add_buffer("h.1.mask", vec![2], DTypeName::BOOL, true)
            .unwrap();
        tree.add_buffer("h.1.cache", vec![2], DTypeName::FLOAT32, false)
            .unwrap();
        let partial = map(&[("emb", Placement::Gpu(0)), ("h.0", Placement::Cpu)]);
        let err = check_device_map(&tree, &partial).unwrap_err();
        // Python: ValueError from check_device_map(model, {"emb": 0, "h.0": "cpu"})
        assert_eq!(
            err.to_string(),
            "The device_map provided does not give any device for the following parameters: h.1.weight, h.1.mask"
        );
        let full = map(&[
            ("emb", Placement::Gpu(0)),
            ("h", Placement::Cpu),
            ("nope", Placement::Disk),
            ("h.0.weight", Placement::Cpu),
        ]);
        assert_eq!(
            check_device_map(&tree, &full).unwrap(),
            ["The following device_map keys do not match any submodules in the model: ['nope', 'h.0.weight']"]
        );
        assert!(check_device_map(&tree, &map(&[("", Placement::Cpu)]))
            .unwrap()
            .is_empty());
    }
}
