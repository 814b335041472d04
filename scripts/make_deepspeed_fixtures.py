"""Writes tests/fixtures/deepspeed/reference.json: what transformers' HfTrainerDeepSpeedConfig makes of
the Trainer guide's ZeRO-2 and ZeRO-3-offload configs ("auto" values filled from TrainingArguments, the
mismatch error for contradicting values), and the learning rates DeepSpeed's own WarmupLR, WarmupDecayLR
and WarmupCosineLR give at each optimizer step.

    pip install torch transformers accelerate deepspeed   # DS_BUILD_OPS=0 is enough: no op is built
    python scripts/make_deepspeed_fixtures.py
"""

import copy
import json
import os
import types

import torch
from deepspeed.runtime.lr_schedules import WarmupCosineLR, WarmupDecayLR, WarmupLR
from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

HERE = os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "deepspeed")


def training_args(**kw):
    """The TrainingArguments fields HfTrainerDeepSpeedConfig reads."""
    a = dict(
        world_size=2,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_grad_norm=0.5,
        learning_rate=3e-3,
        adam_beta1=0.9,
        adam_beta2=0.95,
        adam_epsilon=1e-7,
        weight_decay=0.01,
        fp16=False,
        fp16_full_eval=False,
        bf16=False,
        bf16_full_eval=False,
        save_on_each_node=False,
        warmup_steps=3,
    )
    a.update(kw)
    ns = types.SimpleNamespace(**a)
    ns.get_warmup_steps = lambda total: ns.warmup_steps
    return ns, a


def filled(config, args_kw, total_steps, hidden):
    ds = HfTrainerDeepSpeedConfig(copy.deepcopy(config))
    args, plain = training_args(**args_kw)
    ds.trainer_config_process(args)
    model = types.SimpleNamespace(config=types.SimpleNamespace(hidden_size=hidden))
    try:
        ds.trainer_config_finalize(args, model, total_steps)
        return {"args": plain, "num_training_steps": total_steps, "hidden_size": hidden, "config": ds.config}
    except ValueError as e:
        return {"args": plain, "num_training_steps": total_steps, "hidden_size": hidden, "error": str(e)}


def lrs(make, base_lr, steps):
    """The rate each optimizer step uses: DeepSpeed steps its schedule after the optimizer."""
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=base_lr)
    sched = make(opt)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def main():
    configs = {}
    for name in ["ds_zero2", "ds_zero3_offload"]:
        with open(os.path.join(HERE, name + ".json")) as f:
            configs[name] = json.load(f)
    fills = {
        "zero2": filled(configs["ds_zero2"], {}, 20, 64),
        "zero3_offload": filled(configs["ds_zero3_offload"], {"bf16": True}, 20, 64),
    }
    bad = copy.deepcopy(configs["ds_zero2"])
    bad["optimizer"]["params"]["lr"] = 1e-4
    bad["gradient_accumulation_steps"] = 4
    bad["train_micro_batch_size_per_gpu"] = 2
    fills["mismatch"] = filled(bad, {}, 20, 64)
    schedules = {
        "warmup_log": {"params": {"warmup_min_lr": 1e-4, "warmup_max_lr": 3e-3, "warmup_num_steps": 5},
                       "base_lr": 3e-3,
                       "lrs": lrs(lambda o: WarmupLR(o, 1e-4, 3e-3, 5), 3e-3, 12)},
        "warmup_linear": {"params": {"warmup_min_lr": 0.0, "warmup_max_lr": 3e-3, "warmup_num_steps": 4,
                                     "warmup_type": "linear"},
                          "base_lr": 3e-3,
                          "lrs": lrs(lambda o: WarmupLR(o, 0.0, 3e-3, 4, "linear"), 3e-3, 10)},
        "warmup_decay": {"params": {"warmup_min_lr": 0.0, "warmup_max_lr": 2e-3, "warmup_num_steps": 3,
                                    "total_num_steps": 10},
                         "base_lr": 2e-3,
                         "lrs": lrs(lambda o: WarmupDecayLR(o, 10, 0.0, 2e-3, 3), 2e-3, 12)},
        "warmup_cosine": {"params": {"total_num_steps": 12, "warmup_min_ratio": 0.1, "warmup_num_steps": 4,
                                     "cos_min_ratio": 0.01, "warmup_type": "linear"},
                          "base_lr": 1e-3,
                          "lrs": lrs(lambda o: WarmupCosineLR(o, 12, 0.1, 4, 0.01, "linear"), 1e-3, 14)},
    }
    out = {"fills": fills, "schedules": schedules}
    with open(os.path.join(HERE, "reference.json"), "w") as f:
        json.dump(out, f, indent=1, sort_keys=True)
        f.write("\n")


if __name__ == "__main__":
    main()
