"""Make device-map reference cases with the real Accelerate (1.15.0, torch 2.15 CPU is enough).

    python gen_cases.py                       # hand-written + 60 random cases -> accelerate_cases.json
    python gen_cases.py --random 2000 --seed 7 --out /tmp/fuzz.json --no-hand
    ACCEL_BIGMODEL_EXTRA_CASES=/tmp/fuzz.json cargo test -p accel-bigmodel --test device_map_cases

Same format as device_map_cases.md (beside this file), plus, per case:
  exact_number_types: true   numbers keep Python's int/float type (3.0 stays 3.0)
  order_unchecked: [keys]    outputs whose key order depends on PYTHONHASHSEED
                             (clean_device_map iterates a set); their values are still checked
  expected.stdout            what infer_auto_device_map(verbose=True) printed for device_map

Key order is kept (no sort_keys), so the Rust test checks it. Each case is computed under several
PYTHONHASHSEED values in child processes to find the hash-dependent orders.
"""

import argparse
import contextlib
import io
import json
import logging
import os
import random
import subprocess
import sys
import warnings

SEEDS = ["0", "1", "2", "3", "4", "5"]


def build_model(tree):
    import torch
    import torch.nn as nn

    classes = {}

    def cls(name):
        if name not in classes:
            classes[name] = type(name, (nn.Module,), {})
        return classes[name]

    mods = {}
    for m in tree["modules"]:
        inst = cls(m["class"])()
        mods[m["name"]] = inst
        if m["name"]:
            parent, _, leaf = m["name"].rpartition(".")
            mods[parent].add_module(leaf, inst)
    owner = {}
    for group in tree["tied"]:
        for n in group:
            owner[n] = group
    made = {}
    for p in tree["parameters"]:
        parent, _, leaf = p["name"].rpartition(".")
        group = owner.get(p["name"])
        shared = next((made[g] for g in group if g in made), None) if group else None
        if shared is None:
            t = torch.empty(p["shape"], dtype=getattr(torch, p["dtype"]), device="meta")
            shared = nn.Parameter(t, requires_grad=False)
        made[p["name"]] = shared
        mods[parent].register_parameter(leaf, shared)
    for b in tree["buffers"]:
        parent, _, leaf = b["name"].rpartition(".")
        t = torch.empty(b["shape"], dtype=getattr(torch, b["dtype"]), device="meta")
        mods[parent].register_buffer(leaf, t, persistent=b["persistent"])
    return mods[""]


def run_case(case):
    """Computes every expected output of one case in this process."""
    from accelerate.utils.modeling import (
        compute_module_sizes,
        find_tied_parameters,
        get_balanced_memory,
        get_max_layer_size,
        get_max_memory,
        infer_auto_device_map,
    )

    tree, args = case["model_tree"], case["args"]
    model = build_model(tree)
    tree["tied"] = find_tied_parameters(model)
    mm = lambda m: {int(k) if k.isdigit() else k: v for k, v in m.items()}  # noqa: E731
    ex = {}

    def attempt(key, fn):
        try:
            ex[key] = fn()
        except Exception as e:  # the reference records the raising call
            ex[key] = None
            ex[key + "_error"] = f"{type(e).__name__}: {e}"

    common = dict(
        no_split_module_classes=args["no_split_module_classes"],
        dtype=args["dtype"],
        special_dtypes=args["special_dtypes"],
    )
    attempt("module_sizes", lambda: dict(compute_module_sizes(model, args["dtype"], args["special_dtypes"])))

    def max_layer():
        sizes = compute_module_sizes(model, args["dtype"], args["special_dtypes"])
        items = (
            list(model.named_parameters(recurse=False))
            + list(model.named_children())
            + list(model.named_buffers(recurse=False))
        )
        size, names = get_max_layer_size(items, sizes, args["no_split_module_classes"])
        return {"size": size, "names": names}

    attempt("max_layer", max_layer)
    attempt("max_memory_resolved", lambda: get_max_memory(mm(args["max_memory"])))

    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            msg = record.getMessage()
            if not (msg.startswith("Device ") and "is not available" in msg):
                records.append(msg)

    log = logging.getLogger("accelerate.utils.modeling")
    log.setLevel(logging.INFO)
    log.addHandler(Keep())

    def plan(max_memory, verbose):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            dm = infer_auto_device_map(
                model,
                max_memory=max_memory,
                verbose=verbose,
                clean_result=args["clean_result"],
                offload_buffers=args["offload_buffers"],
                fallback_allocation=args["fallback_allocation"],
                **common,
            )
        return dm, out.getvalue()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        records.clear()
        try:
            dm, stdout = plan(mm(args["max_memory"]), True)
            ex["device_map"] = {k: v for k, v in dm.items()}
            ex["stdout"] = stdout
        except Exception as e:
            ex["device_map"] = None
            ex["device_map_error"] = f"{type(e).__name__}: {e}"
    ex["warnings"] = [str(w.message) for w in caught if w.filename.endswith("modeling.py")]
    ex["logs"] = list(records)

    ex["balanced_memory"] = None
    ex["device_map_balanced"] = None
    if any(k.isdigit() for k in args["max_memory"]):
        attempt(
            "balanced_memory",
            lambda: get_balanced_memory(model, max_memory=mm(args["max_memory"]), low_zero=args["low_zero"], **common),
        )
        if ex["balanced_memory"] is not None:
            attempt("device_map_balanced", lambda: dict(plan(dict(ex["balanced_memory"]), False)[0]))
    return ex


def child(path):
    from accelerate import PartialState

    PartialState()  # accelerate's logger refuses to log without it
    cases = json.load(open(path))
    out = {name: {"tied": c["model_tree"]["tied"], "expected": run_case(c)} for name, c in cases.items()}
    for name in out:
        out[name]["tied"] = cases[name]["model_tree"]["tied"]
    json.dump(out, sys.stdout)


# ---------------------------------------------------------------- case builders


def tree_of(modules, params, buffers=(), tied=()):
    return {
        "modules": [{"name": n, "class": c} for n, c in modules],
        "parameters": [{"name": n, "shape": list(s), "dtype": d} for n, s, d in params],
        "buffers": [{"name": n, "shape": list(s), "dtype": d, "persistent": p} for n, s, d, p in buffers],
        "tied": [list(g) for g in tied],
    }


def args_of(max_memory, **kw):
    a = dict(
        max_memory={str(k): v for k, v in max_memory.items()},
        no_split_module_classes=[],
        dtype=None,
        special_dtypes=None,
        offload_buffers=False,
        fallback_allocation=False,
        clean_result=True,
        low_zero=False,
    )
    a.update(kw)
    return a


def gpt(n_layers=4, d=32, vocab=500, tie=True, mask=False):
    mods = [("", "GPT"), ("wte", "Embedding"), ("h", "ModuleList")]
    params = [("wte.weight", (vocab, d), "float32")]
    buffers = []
    for i in range(n_layers):
        p = f"h.{i}"
        mods += [(p, "GPTBlock"), (p + ".ln", "LayerNorm"), (p + ".attn", "Linear"), (p + ".mlp", "MLP"),
                 (p + ".mlp.fc1", "Linear"), (p + ".mlp.fc2", "Linear")]
        params += [(p + ".ln.weight", (d,), "float32"), (p + ".ln.bias", (d,), "float32"),
                   (p + ".attn.weight", (3 * d, d), "float32"), (p + ".attn.bias", (3 * d,), "float32"),
                   (p + ".mlp.fc1.weight", (4 * d, d), "float32"), (p + ".mlp.fc2.weight", (d, 4 * d), "float32")]
        if mask:
            buffers.append((p + ".attn.mask", (64, 64), "bool", False))
    mods += [("ln_f", "LayerNorm"), ("lm_head", "Linear")]
    params += [("ln_f.weight", (d,), "float32"), ("lm_head.weight", (vocab, d), "float32")]
    return tree_of(mods, params, buffers, [("lm_head.weight", "wte.weight")] if tie else [])


def hand_cases():
    c = {}

    def add(name, desc, tree, args):
        c[name] = {"description": desc, "model_tree": tree, "args": args}

    add("gpt_bool_masks_offloaded_buffers_warn", "bool mask buffers (float sizes) offloaded to cpu: buffer warning",
        gpt(mask=True), args_of({0: 157000, "cpu": 10**7}, no_split_module_classes=["GPTBlock"]))
    add("gpt_bool_masks_fallback_float_limit", "fallback with fractional sizes: accelerate crashes (AttributeError)",
        gpt(vocab=100, mask=True), args_of({0: 50000, 1: 10**6, "cpu": 10**7}, no_split_module_classes=["GPTBlock"],
                                fallback_allocation=True))
    add("gpt_no_room_logs_minimum", "GPU 0 too small for anything: logs the minimum per device",
        gpt(), args_of({0: 1000, 1: 300000, "cpu": 10**7}, no_split_module_classes=["GPTBlock"]))
    add("gpt_low_zero_three_gpus", "balanced with low_zero over 3 GPUs",
        gpt(n_layers=8), args_of({0: "1MB", 1: "1MB", 2: "1MB", "cpu": "1GB"}, no_split_module_classes=["GPTBlock"],
                                 low_zero=True))
    add("gpt_low_zero_gap_keyerror", "low_zero with GPUs 0 and 2: accelerate indexes GPU 1 (KeyError)",
        gpt(), args_of({0: "1MB", 2: "1MB", "cpu": "1GB"}, low_zero=True))
    add("gpt_disk_key_balanced_error", "a disk key makes get_balanced_memory call torch.device('disk')",
        gpt(), args_of({0: 200000, "cpu": 200000, "disk": "1GB"}, no_split_module_classes=["GPTBlock"]))
    add("bad_size_string", "an invalid size string fails every call that resolves max_memory",
        gpt(n_layers=1), args_of({0: "5XB", "cpu": "1GB"}))
    add("unknown_device", "an unknown device key", gpt(n_layers=1), args_of({0: 1000, "tpu": "1GB"}))
    add("bits_and_fraction_sizes", "'5Mb' is bits, '0.5MiB' fractional",
        gpt(), args_of({0: "1Mb", 1: "0.5MiB", "cpu": "2.5GB"}, no_split_module_classes=["GPTBlock"]))
    add("fp16_target_keeps_int_and_bool", "dtype=float16: floats halve, int64/bool buffers keep their size",
        gpt(mask=True), args_of({0: 100000, 1: 100000, "cpu": 10**7}, dtype="float16"))
    add("gpt_unclean", "clean_result=False keeps every leaf key", gpt(n_layers=2),
        args_of({0: 100000, "cpu": 150000, "disk": 10**9}, clean_result=False))
    add("zero_budget_gpu", "a GPU with 0 bytes is skipped by balancing",
        gpt(), args_of({0: 0, 1: 400000, 2: 400000, "cpu": 10**7}, no_split_module_classes=["GPTBlock"]))
    # Tied weights between a small module and a splittable big one: the planner splits the tied module.
    mods = [("", "Net"), ("emb", "Embedding"), ("big", "Stack"), ("big.a", "Linear"), ("big.b", "Linear"),
            ("big.c", "Linear"), ("out", "Linear")]
    params = [("emb.weight", (100, 50), "float32"), ("big.a.weight", (200, 200), "float32"),
              ("big.b.weight", (100, 50), "float32"), ("big.c.weight", (200, 200), "float32"),
              ("out.weight", (10, 50), "float32")]
    tied = tree_of(mods, params, tied=[("big.b.weight", "emb.weight")])
    add("tied_split_of_tied_module", "emb fits alone but not with its tied 'big': big is split",
        tied, args_of({0: 200000, 1: 400000, "cpu": 10**7}))
    add("tied_split_verbose_offload", "same with a tight cpu and disk",
        tied, args_of({0: 50000, "cpu": 200000, "disk": 10**9}, offload_buffers=True))
    # A root-level parameter tied to a child's: the root one holds the storage and is placed first.
    root = tree_of([("", "Net"), ("lin", "Linear")],
                   [("shared", (10, 10), "float32"), ("lin.weight", (10, 10), "float32")],
                   tied=[("lin.weight", "shared")])
    add("tied_root_parameter", "a root parameter tied to a child's", root, args_of({0: 1000, "cpu": 10**6}))
    # Substring semantics of the tie test: 'h.0' is "inside" 'wh.0.x'.
    sub = tree_of([("", "Net"), ("h", "ModuleList"), ("h.0", "Linear"), ("wh", "ModuleList"), ("wh.0", "Linear")],
                  [("h.0.x", (30, 30), "float32"), ("wh.0.x", (30, 30), "float32")],
                  tied=[("h.0.x", "wh.0.x")])
    add("tie_substring_names", "tie between h.0.x and wh.0.x", sub, args_of({0: 5000, 1: 5000, "cpu": 10**6}))
    # special_dtypes on a buffer: the buffer total inside the planner looks names up relative to the module.
    sp = gpt(n_layers=2, mask=True)
    add("special_dtype_on_buffer", "special dtype keyed by a buffer's full name",
        sp, args_of({0: 30000, 1: 60000, "cpu": 10**6}, special_dtypes={"h.0.attn.mask": "float32"},
                    dtype="bfloat16"))
    add("empty_budget", "no budgets at all: everything on disk", gpt(n_layers=1), args_of({}))
    return c


def random_case(rng, idx):
    dtypes = ["float32", "float32", "float16", "bfloat16", "int8", "int64", "bool"]
    if rng.random() < 0.2:
        dtypes += ["int4", "float8_e4m3fn", "complex64", "uint8", "float64"]
    classes = ["Linear", "Block", "MLP", "Attn", "Seq"]
    mods, params, buffers = [("", "Root")], [], []
    counter = [0]

    def grow(prefix, depth):
        for i in range(rng.randint(1 if depth == 0 else 0, 4 if depth == 0 else 3)):
            counter[0] += 1
            name = f"{prefix}{rng.choice(['m', 'layer', 'h', 'x'])}{i}" if rng.random() < 0.7 else f"{prefix}{i}"
            if any(m[0] == name for m in mods):
                continue
            mods.append((name, rng.choice(classes)))
            for j in range(rng.randint(0, 3)):
                shape = tuple(rng.choice([1, 3, 8, 16, 64, 100]) for _ in range(rng.randint(0, 2)))
                params.append((f"{name}.p{j}", shape, rng.choice(dtypes)))
            if rng.random() < 0.25:
                shape = (rng.choice([4, 16, 128]), rng.choice([1, 8, 33]))
                buffers.append((f"{name}.buf", shape, rng.choice(dtypes), rng.random() < 0.5))
            if depth < 3 and rng.random() < 0.6:
                grow(name + ".", depth + 1)

    if rng.random() < 0.2:
        params.append(("root_scale", (rng.choice([1, 64]),), "float32"))
    grow("", 0)
    if rng.random() < 0.2:
        buffers.append(("root_buf", (rng.choice([2, 256]),), rng.choice(dtypes), True))
    # Parameters must follow module pre-order, each module's own in registration order.
    order = {m[0]: i for i, m in enumerate(mods)}
    params.sort(key=lambda p: order[p[0].rpartition(".")[0]])
    buffers.sort(key=lambda b: order[b[0].rpartition(".")[0]])
    tied = []
    for _ in range(rng.choice([1, 1, 1, 2])):
        if len(params) <= 2 or rng.random() >= 0.4:
            continue
        src = rng.choice([p for p in params if not p[0].endswith(".tied")])
        others = [m[0] for m in mods if m[0] and not src[0].startswith(m[0] + ".") and m[0] != src[0]]
        others = [o for o in others if not any(p[0] == f"{o}.tied" for p in params)]
        if others and not any(src[0] in g for g in tied):
            host = rng.choice(others)
            alias = (f"{host}.tied", src[1], src[2])
            params.append(alias)
            params.sort(key=lambda p: order[p[0].rpartition(".")[0]])
            tied.append((src[0], alias[0]))
    tree = tree_of(mods, params, buffers, tied)
    total = sum(max(1, eval("*".join(map(str, p[1])) or "1")) * 4 for p in params) + 1
    gpus = rng.randint(0, 3)
    mm = {i: rng.randint(0, total // 2) for i in range(gpus)}
    for k in mm:
        if rng.random() < 0.15:
            mm[k] = f"{mm[k] / 1000:.3f}KB" if rng.random() < 0.5 else f"{mm[k] * 8 // 1000}kb"
    if rng.random() < 0.9:
        mm["cpu"] = rng.randint(total // 8, total * 2)
    if rng.random() < 0.3:
        mm["disk"] = 10**9
    args = args_of(
        mm,
        no_split_module_classes=rng.sample(classes, rng.randint(0, 2)),
        dtype=rng.choice([None, None, "float16", "bfloat16", "float64"]),
        special_dtypes=({params[0][0]: rng.choice(["float32", "int8"])} if params and rng.random() < 0.2 else None),
        offload_buffers=rng.random() < 0.3,
        fallback_allocation=rng.random() < 0.4,
        clean_result=rng.random() < 0.85,
        low_zero=rng.random() < 0.3,
    )
    return f"random_{idx:04d}", {"description": f"random tree #{idx}", "model_tree": tree, "args": args}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--random", type=int, default=60)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--no-hand", action="store_true")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "accelerate_cases.json"))
    ap.add_argument("--child")
    a = ap.parse_args()
    if a.child:
        return child(a.child)
    cases = {} if a.no_hand else hand_cases()
    rng = random.Random(a.seed)
    for i in range(a.random):
        name, case = random_case(rng, i)
        cases[name] = case
    tmp = a.out + ".in.json"
    json.dump(cases, open(tmp, "w"))
    runs = []
    for seed in SEEDS:
        env = dict(os.environ, PYTHONHASHSEED=seed)
        out = subprocess.run([sys.executable, __file__, "--child", tmp], env=env, capture_output=True, text=True)
        if out.returncode:
            sys.exit(out.stderr)
        runs.append(json.loads(out.stdout))
    os.remove(tmp)
    for name, case in cases.items():
        first = runs[0][name]
        case["model_tree"]["tied"] = first["tied"]
        case["expected"] = first["expected"]
        case["exact_number_types"] = True
        unstable = []
        for key in ["device_map", "device_map_balanced", "module_sizes"]:
            orders = {
                tuple((r[name]["expected"].get(key) or {}).keys())
                for r in runs
                if r[name]["tied"] == first["tied"]
            }
            if len(orders) > 1:
                unstable.append(key)
        if unstable:
            case["order_unchecked"] = unstable
    json.dump(cases, open(a.out, "w"), indent=1)
    print(f"wrote {len(cases)} cases to {a.out}")


if __name__ == "__main__":
    main()
