//! Every reference case computed by Accelerate 1.15.0 must come out identical:
//! module sizes, largest layer, resolved and balanced budgets, both device maps
//! (values and, where the file records it, key order), warnings, logs and errors.
//!
//! Case files: `tests/data/device_map_cases.json` (the project's reference cases, from
//! Accelerate's `infer_auto_device_map`; format in `tests/data/device_map_cases.md`),
//! `tests/data/accelerate_cases.json` (more cases made by `tests/data/gen_cases.py`
//! with the real Accelerate), and any paths in `ACCEL_BIGMODEL_EXTRA_CASES`
//! (colon-separated), e.g. a large generated fuzz set.

mod support;

use accel_bigmodel::{
    compute_module_sizes, get_balanced_memory, get_max_layer_size, get_max_memory,
    infer_auto_device_map, parse_max_memory_json, Bytes, DTypeName, DeviceMap, Error, MaxMemory,
    ModuleTree, Placement, PlanOptions, SpecialDtypes,
};
use std::path::{Path, PathBuf};
use support::ordered_json::Json;

/// Everything a case can get wrong, one line per mismatch.
type Failures = Vec<String>;

struct Checker<'a> {
    case: &'a Json,
    /// Whether key order in the file means something (false for `sort_keys` dumps).
    order_known: bool,
    failures: Failures,
}

fn as_bits(n: &serde_json::Number) -> Option<i128> {
    if let Some(i) = n.as_i64() {
        return Some(i as i128 * 8);
    }
    let f = n.as_f64()? * 8.0;
    (f.fract() == 0.0).then_some(f as i128)
}

impl Checker<'_> {
    fn expected(&self, key: &str) -> Option<&Json> {
        self.case.get("expected")?.get(key)
    }

    fn order_checked(&self, key: &str) -> bool {
        let unchecked = match self.case.get("order_unchecked") {
            Some(Json::Arr(a)) => a.iter().any(|k| *k == Json::Str(key.to_string())),
            _ => false,
        };
        self.order_known && !unchecked
    }

    fn exact_types(&self) -> bool {
        self.case.get("exact_number_types") == Some(&Json::Bool(true))
    }

    fn fail(&mut self, key: &str, msg: String) {
        self.failures.push(format!("{key}: {msg}"));
    }

    fn check_number(&mut self, key: &str, what: &str, expected: &Json, got: Bytes) {
        let Json::Num(n) = expected else {
            return self.fail(
                key,
                format!("{what}: expected {expected:?} is not a number"),
            );
        };
        if as_bits(n) != Some(got.bits()) {
            return self.fail(key, format!("{what}: expected {n}, got {got}"));
        }
        // A float written as `3.0` must be a float here; an int only when the file keeps types.
        let expected_float = n.is_f64();
        if (expected_float || self.exact_types()) && expected_float != got.is_float() {
            self.fail(
                key,
                format!(
                    "{what}: expected {n} (float: {expected_float}), got {got} (float: {})",
                    got.is_float()
                ),
            );
        }
    }

    /// Compares an expected object with ordered (key, value) pairs from us.
    fn check_map<V: Copy>(
        &mut self,
        key: &str,
        got: &[(String, V)],
        mut same: impl FnMut(&mut Self, &str, &Json, V),
    ) {
        let Some(Json::Obj(expected)) = self.expected(key).cloned() else {
            return self.fail(
                key,
                format!("expected an object, file has {:?}", self.expected(key)),
            );
        };
        let mut want: Vec<&str> = expected.iter().map(|(k, _)| k.as_str()).collect();
        let mut have: Vec<&str> = got.iter().map(|(k, _)| k.as_str()).collect();
        if self.order_checked(key) && want != have {
            self.fail(
                key,
                format!("key order differs:\n    expected {want:?}\n    got      {have:?}"),
            );
        }
        want.sort_unstable();
        have.sort_unstable();
        if want != have {
            return self.fail(
                key,
                format!("keys differ:\n    expected {want:?}\n    got      {have:?}"),
            );
        }
        for (k, v) in &expected {
            let mine = got.iter().find(|(g, _)| g == k).map(|(_, v)| *v);
            if let Some(mine) = mine {
                same(self, k, v, mine);
            }
        }
    }

    fn check_sizes_map(&mut self, key: &str, got: Vec<(String, Bytes)>) {
        self.check_map(key, &got, |c, name, want, have| {
            c.check_number(key, name, want, have)
        });
    }

    fn check_max_memory(&mut self, key: &str, got: &MaxMemory) {
        let got: Vec<(String, Bytes)> = got.iter().map(|(d, b)| (d.to_string(), b)).collect();
        self.check_sizes_map(key, got);
    }

    fn check_device_map(&mut self, key: &str, got: &DeviceMap) {
        let got: Vec<(String, Placement)> = got.iter().map(|(k, p)| (k.to_string(), p)).collect();
        self.check_map(key, &got, |c, name, want, have| {
            match Placement::try_from(&want.to_value()) {
                Ok(p) if p == have => {}
                _ => c.fail(key, format!("{name}: expected {want:?}, got {have}")),
            }
        });
    }

    fn check_strings(&mut self, key: &str, got: &[String]) {
        let want: Option<Vec<String>> = match self.expected(key) {
            Some(Json::Arr(a)) => a
                .iter()
                .map(|s| match s {
                    Json::Str(s) => Some(s.clone()),
                    _ => None,
                })
                .collect(),
            _ => None,
        };
        match want {
            Some(want) if want == got => {}
            want => self.fail(key, format!("expected {want:?}, got {got:?}")),
        }
    }

    /// Runs the check for `key` if the case expects it, or checks the error Accelerate raised.
    fn check<T>(&mut self, key: &str, got: &Result<T, Error>, ok: impl FnOnce(&mut Self, &T)) {
        let error_key = format!("{key}_error");
        let expected_error = match self.expected(&error_key) {
            Some(Json::Str(e)) => Some(e.clone()),
            _ => None,
        };
        match (expected_error, got) {
            (Some(want), Err(e)) if same_failure(&want, e) => {}
            (Some(want), Err(e)) => {
                self.fail(key, format!("expected error {want:?}, got error {e}"))
            }
            (Some(want), Ok(_)) => self.fail(key, format!("expected error {want:?}, got a result")),
            (None, Err(e)) => self.fail(key, format!("unexpected error: {e}")),
            (None, Ok(v)) => {
                if self.expected(key).is_some() {
                    ok(self, v)
                }
            }
        }
    }
}

/// Whether our error is the failure Accelerate reported as `"Type: message"`.
fn same_failure(python: &str, e: &Error) -> bool {
    let (ty, msg) = python.split_once(": ").unwrap_or((python, ""));
    match e {
        Error::InvalidSize { .. } | Error::UnrecognizedDevice { .. } => {
            ty == "ValueError" && msg == e.to_string()
        }
        Error::SizeOverflow { .. } => ty == "OverflowError",
        Error::UnknownDtype { dtype } => {
            ty == "AttributeError" && msg.contains(&format!("'{dtype}'"))
        }
        Error::NotATorchDevice { device, .. } => {
            ty == "RuntimeError" && msg.ends_with(&format!(": {device}"))
        }
        Error::MissingGpu { gpu, .. } => ty == "KeyError" && msg == gpu.to_string(),
        Error::TiedParameterNotQueued { .. } => {
            ty == "IndexError" && msg == "list index out of range"
        }
        Error::FractionalSizeLimit { .. } => {
            ty == "AttributeError" && msg == "'float' object has no attribute 'upper'"
        }
        _ => false,
    }
}

fn strings(v: Option<&Json>) -> Vec<String> {
    match v {
        Some(Json::Arr(a)) => a
            .iter()
            .filter_map(|s| {
                if let Json::Str(s) = s {
                    Some(s.clone())
                } else {
                    None
                }
            })
            .collect(),
        _ => Vec::new(),
    }
}

fn check_case(case: &Json, order_known: bool) -> Failures {
    let mut c = Checker {
        case,
        order_known,
        failures: Vec::new(),
    };
    let tree = match case
        .get("model_tree")
        .map(|t| ModuleTree::from_spec_json(&t.to_value()))
    {
        Some(Ok(tree)) => tree,
        other => return vec![format!("model_tree: cannot build: {other:?}")],
    };
    let args = case.get("args").cloned().unwrap_or(Json::Null);
    let flag = |k: &str| args.get(k) == Some(&Json::Bool(true));
    let no_split = strings(args.get("no_split_module_classes"));
    // Recomputed at each use: errors are not `Clone`.
    let dtypes = || -> Result<(Option<DTypeName>, Option<SpecialDtypes>), Error> {
        let dtype = match args.get("dtype") {
            Some(Json::Str(s)) => Some(DTypeName::parse(s)?),
            _ => None,
        };
        let special = match args.get("special_dtypes") {
            Some(Json::Obj(o)) => Some(
                o.iter()
                    .map(|(k, v)| {
                        Ok((
                            k.clone(),
                            DTypeName::parse(if let Json::Str(s) = v { s } else { "" })?,
                        ))
                    })
                    .collect::<Result<SpecialDtypes, Error>>()?,
            ),
            _ => None,
        };
        Ok((dtype, special))
    };
    let max_memory_json = args
        .get("max_memory")
        .map(Json::to_value)
        .unwrap_or_default();
    let limits = || parse_max_memory_json(&max_memory_json);

    let sizes = dtypes().map(|(d, s)| compute_module_sizes(&tree, d, s.as_ref()));
    c.check("module_sizes", &sizes, |c, s| {
        c.check_sizes_map(
            "module_sizes",
            s.iter().map(|(k, v)| (k.to_string(), v)).collect(),
        )
    });
    let max_layer = dtypes()
        .map(|(d, s)| compute_module_sizes(&tree, d, s.as_ref()))
        .map(|s| get_max_layer_size(&tree, &tree.root_items(), &s, &no_split));
    c.check("max_layer", &max_layer, |c, layer| {
        if let Some(size) = c.expected("max_layer").and_then(|m| m.get("size")).cloned() {
            c.check_number("max_layer", "size", &size, layer.size);
        }
        let want = strings(c.expected("max_layer").and_then(|m| m.get("names")));
        if want != layer.names {
            c.fail(
                "max_layer",
                format!("names: expected {want:?}, got {:?}", layer.names),
            );
        }
    });
    let resolved = limits().and_then(|l| get_max_memory(&l));
    c.check("max_memory_resolved", &resolved, |c, m| {
        c.check_max_memory("max_memory_resolved", m)
    });

    let options = |limits: Vec<_>| -> Result<PlanOptions, Error> {
        let (dtype, special) = dtypes()?;
        Ok(PlanOptions::new(limits)
            .with_no_split_module_classes(no_split.clone())
            .with_dtype(dtype)
            .with_special_dtypes(special)
            .with_offload_buffers(flag("offload_buffers"))
            .with_fallback_allocation(flag("fallback_allocation"))
            .with_clean_result(args.get("clean_result") != Some(&Json::Bool(false)))
            .with_verbose(case.get("expected").and_then(|e| e.get("stdout")).is_some()))
    };
    let plan = limits()
        .and_then(options)
        .and_then(|o| infer_auto_device_map(&tree, &o));
    c.check("device_map", &plan, |c, p| {
        c.check_device_map("device_map", &p.device_map)
    });
    if let Ok(p) = &plan {
        c.check_strings("warnings", &p.warnings);
        c.check_strings("logs", &p.logs);
        if let Some(Json::Str(stdout)) = c.expected("stdout").cloned() {
            let mine: String = p.trace.iter().map(|l| format!("{l}\n")).collect();
            if mine != stdout {
                c.fail("stdout", format!("expected {stdout:?}\n    got {mine:?}"));
            }
        }
    }

    // The reference skips the balanced run when no budget key is a GPU.
    let has_gpu = matches!(&max_memory_json, serde_json::Value::Object(o) if o.keys().any(|k| k.bytes().all(|b| b.is_ascii_digit())));
    if has_gpu {
        let balanced = limits().and_then(|l| {
            let (dtype, special) = dtypes()?;
            get_balanced_memory(
                &tree,
                &l,
                &no_split,
                dtype,
                special.as_ref(),
                flag("low_zero"),
            )
        });
        c.check("balanced_memory", &balanced, |c, m| {
            c.check_max_memory("balanced_memory", m)
        });
        if let Ok(b) = &balanced {
            let plan = options(b.to_limits()).and_then(|o| infer_auto_device_map(&tree, &o));
            c.check("device_map_balanced", &plan, |c, p| {
                c.check_device_map("device_map_balanced", &p.device_map)
            });
        }
    } else {
        for key in ["balanced_memory", "device_map_balanced"] {
            if !matches!(c.expected(key), None | Some(Json::Null)) {
                c.fail(key, "expected null: no GPU in max_memory".to_string());
            }
        }
    }
    c.failures
}

/// Checks every case of one file and returns (passed, failed case reports).
fn check_file(path: &Path) -> (usize, Vec<String>) {
    let text = std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    let doc: Json = serde_json::from_str(&text)
        .unwrap_or_else(|e| panic!("{} is not JSON: {e}", path.display()));
    let order_known = !doc.all_objects_sorted();
    if !order_known {
        println!(
            "{}: written with sorted keys, so key order is not checked",
            path.display()
        );
    }
    let Json::Obj(cases) = doc else {
        panic!("{}: expected an object of cases", path.display())
    };
    let (mut passed, mut failed) = (0, Vec::new());
    for (name, case) in &cases {
        let failures = check_case(case, order_known);
        if failures.is_empty() {
            println!("PASS {name}");
            passed += 1;
        } else {
            println!("FAIL {name}");
            failed.push(format!("{name}:\n  {}", failures.join("\n  ")));
        }
    }
    println!(
        "{}: {passed} passed, {} failed",
        path.display(),
        failed.len()
    );
    (passed, failed)
}

fn run(paths: &[PathBuf]) {
    let mut all_failed = Vec::new();
    for path in paths {
        let (passed, failed) = check_file(path);
        assert!(passed + failed.len() > 0, "{}: no cases", path.display());
        all_failed.extend(failed);
    }
    assert!(
        all_failed.is_empty(),
        "{} case(s) differ from Accelerate:\n{}",
        all_failed.len(),
        all_failed.join("\n")
    );
}

#[test]
fn spec_cases_match_accelerate() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/device_map_cases.json");
    assert!(
        path.exists(),
        "the reference cases are missing: expected {}",
        path.display()
    );
    run(&[path]);
}

#[test]
fn generated_cases_match_accelerate() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/accelerate_cases.json");
    let mut paths = vec![path];
    if let Ok(extra) = std::env::var("ACCEL_BIGMODEL_EXTRA_CASES") {
        paths.extend(
            extra
                .split(':')
                .filter(|p| !p.is_empty())
                .map(PathBuf::from),
        );
    }
    run(&paths);
}
