//! Which parameters form a unit: Accelerate's `auto_wrap_policy`.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

/// How parameters are grouped into separately gathered units.
///
/// The transformer-based policy matches block class names as Python configs
/// give them (`LlamaDecoderLayer`, `GPT2Block`: each block of a model declares
/// its class) and module-name patterns: `h.*` wraps `h.0`, `h.1`, ... (a `*`
/// stands for one dotted segment).
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AutoWrapPolicy {
    /// `TRANSFORMER_BASED_WRAP`: every module whose name matches one of the
    /// patterns becomes a unit (the outermost match wins).
    Transformer {
        /// Block class names or module-name patterns, e.g. `["LlamaDecoderLayer"]`,
        /// `["h.*"]` or `["encoder.layer.*"]`.
        patterns: Vec<String>,
    },
    /// `SIZE_BASED_WRAP`: bottom-up, a module becomes a unit once the
    /// parameters not already in a unit below it reach `min_num_params`
    /// (PyTorch's `size_based_auto_wrap_policy`).
    Size {
        /// Smallest unit, in scalar parameters.
        min_num_params: usize,
    },
    /// `NO_WRAP`: the whole model is one unit.
    #[default]
    NoWrap,
}

/// Groups parameters (`names[i]`, `numels[i]`) into units: the root unit
/// (prefix `""`, the parameters no policy wrapped, possibly none) first, then
/// the wrapped modules sorted by name. Each unit lists parameter indices in
/// the order of `names`.
pub fn group_units(
    names: &[String],
    numels: &[usize],
    policy: &AutoWrapPolicy,
) -> Vec<(String, Vec<usize>)> {
    let unit_of: Vec<Option<String>> = match policy {
        AutoWrapPolicy::NoWrap => vec![None; names.len()],
        AutoWrapPolicy::Transformer { patterns } => names
            .iter()
            .map(|n| {
                let modules = module_prefixes(n);
                modules
                    .into_iter()
                    .find(|m| patterns.iter().any(|p| matches_pattern(m, p)))
            })
            .collect(),
        AutoWrapPolicy::Size { min_num_params } => size_based(names, numels, *min_num_params),
    };
    let mut units: BTreeMap<String, Vec<usize>> = BTreeMap::new();
    let mut root = vec![];
    for (i, u) in unit_of.into_iter().enumerate() {
        match u {
            Some(prefix) => units.entry(prefix).or_default().push(i),
            None => root.push(i),
        }
    }
    std::iter::once((String::new(), root))
        .chain(units)
        .collect()
}

/// The modules a parameter lives in, outermost first: `a.b.w` -> `a`, `a.b`.
fn module_prefixes(name: &str) -> Vec<String> {
    let parts: Vec<&str> = name.split('.').collect();
    (1..parts.len()).map(|k| parts[..k].join(".")).collect()
}

/// Whether module name `module` matches `pattern` (dotted, `*` matches one name part).
pub fn matches_pattern(module: &str, pattern: &str) -> bool {
    let m: Vec<&str> = module.split('.').collect();
    let p: Vec<&str> = pattern.split('.').collect();
    m.len() == p.len() && m.iter().zip(&p).all(|(a, b)| *b == "*" || a == b)
}

fn size_based(names: &[String], numels: &[usize], min: usize) -> Vec<Option<String>> {
    // Deepest modules first, so a module only counts parameters its
    // children left unwrapped (post-order, as PyTorch's `_recursive_wrap`).
    let mut modules: BTreeSet<(usize, String)> = BTreeSet::new();
    for n in names {
        for m in module_prefixes(n) {
            modules.insert((usize::MAX - m.split('.').count(), m));
        }
    }
    let mut unit_of: Vec<Option<String>> = vec![None; names.len()];
    for (_, m) in modules {
        let prefix = format!("{m}.");
        let inside: Vec<usize> = (0..names.len())
            .filter(|&i| unit_of[i].is_none() && names[i].starts_with(&prefix))
            .collect();
        let count: usize = inside.iter().map(|&i| numels[i]).sum();
        if count >= min && count > 0 {
            for i in inside {
                unit_of[i] = Some(m.clone());
            }
        }
    }
    unit_of
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpt_names() -> (Vec<String>, Vec<usize>) {
        let mut v = vec![
            ("wte.weight", 1000),
            ("wpe.weight", 100),
            ("ln_f.weight", 10),
            ("ln_f.bias", 10),
        ];
        for b in ["h.0", "h.1", "h.10"] {
            for (p, n) in [
                ("attn.c_attn.weight", 300),
                ("attn.c_attn.bias", 30),
                ("mlp.c_fc.weight", 400),
            ] {
                v.push((Box::leak(format!("{b}.{p}").into_boxed_str()), n));
            }
        }
        v.into_iter().map(|(a, b)| (a.to_string(), b)).unzip()
    }

    #[test]
    fn transformer_policy_wraps_each_matching_block_and_leaves_the_rest_in_root() {
        let (names, numels) = gpt_names();
        let units = group_units(
            &names,
            &numels,
            &AutoWrapPolicy::Transformer {
                patterns: vec!["h.*".into()],
            },
        );
        let prefixes: Vec<&str> = units.iter().map(|(p, _)| p.as_str()).collect();
        assert_eq!(prefixes, ["", "h.0", "h.1", "h.10"]);
        assert_eq!(units[0].1, [0, 1, 2, 3]);
        assert_eq!(units[3].1, [10, 11, 12]);
    }

    #[test]
    fn size_policy_wraps_bottom_up_once_the_unwrapped_count_reaches_the_minimum() {
        let (names, numels) = gpt_names();
        // 400 >= 400: each c_fc linear is a unit; an attention (330) is not,
        // nor is a block with its 330 unwrapped attention parameters, but `h`
        // with the three blocks' 990 is; `wte` alone has 1000.
        let units = group_units(
            &names,
            &numels,
            &AutoWrapPolicy::Size {
                min_num_params: 400,
            },
        );
        let prefixes: Vec<&str> = units.iter().map(|(p, _)| p.as_str()).collect();
        assert_eq!(
            prefixes,
            [
                "",
                "h",
                "h.0.mlp.c_fc",
                "h.1.mlp.c_fc",
                "h.10.mlp.c_fc",
                "wte"
            ]
        );
        assert_eq!(units[1].1, [4, 5, 7, 8, 10, 11]);
        assert_eq!(units[0].1, [1, 2, 3]);
    }

    #[test]
    fn no_wrap_is_one_root_unit() {
        let (names, numels) = gpt_names();
        let units = group_units(&names, &numels, &AutoWrapPolicy::NoWrap);
        assert_eq!(units.len(), 1);
        assert_eq!(units[0].1.len(), names.len());
    }
}
