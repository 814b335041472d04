"""Writes tests/fixtures/fsdp_args/reference.json: the Accelerate FSDP plugin arguments transformers'
TrainingArguments._process_fsdp_args makes of `fsdp` and `fsdp_config` values (or the error it raises),
for the cases the Rust test replays through accel_core::trainer::fsdp_plugin.

    pip install transformers accelerate
    python scripts/make_fsdp_args_fixtures.py
"""

import copy
import json
import os
import types

from transformers import TrainingArguments

OUT = os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "fsdp_args", "reference.json")

CASES = [
    {"fsdp": True, "fsdp_config": {}},
    {"fsdp": True, "fsdp_config": {"fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer",
                                    "fsdp_reshard_after_forward": False, "fsdp_cpu_offload": True}},
    {"fsdp": True, "fsdp_config": {"transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
                                    "activation_checkpointing": "true", "state_dict_type": "SHARDED_STATE_DICT",
                                    "cpu_ram_efficient_loading": True}},
    {"fsdp": True, "fsdp_config": {"auto_wrap_policy": "SIZE_BASED_WRAP", "min_num_params": 1000}},
    {"fsdp": True, "fsdp_config": {"auto_wrap_policy": "NO_WRAP"}},
    {"fsdp": "full_shard auto_wrap", "fsdp_config": {"fsdp_transformer_layer_cls_to_wrap": ["GPT2Block"]}},
    {"fsdp": "shard_grad_op offload", "fsdp_config": {}},
    {"fsdp": ["full_shard", "offload"], "fsdp_config": {"version": 1, "backward_prefetch": "backward_pre",
                                                          "forward_prefetch": True, "sync_module_states": "false"}},
    {"fsdp": "hybrid_shard", "fsdp_config": {}},
    {"fsdp": True, "fsdp_config": {"version": 1, "reshard_after_forward": "shard_grad_op"}},
]


def run(case):
    ns = types.SimpleNamespace(fsdp=copy.deepcopy(case["fsdp"]), fsdp_config=copy.deepcopy(case["fsdp_config"]),
                               activation_checkpointing=False,
                               _apply_legacy_fsdp_to_config=TrainingArguments._apply_legacy_fsdp_to_config)
    try:
        out = TrainingArguments._process_fsdp_args(ns)
        return {"plugin_args": out}
    except ValueError as e:
        return {"error": str(e)}


def main():
    cases = [dict(case, **run(case)) for case in CASES]
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT, "w") as f:
        json.dump(cases, f, indent=1, sort_keys=True)
        f.write("\n")


if __name__ == "__main__":
    main()
