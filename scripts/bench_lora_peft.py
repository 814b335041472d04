#!/usr/bin/env python3
"""PEFT side of `bench_lora`: LoRA fine-tuning of a Hugging Face folder with
transformers + PEFT, the way a Python user writes it today.

    python3 scripts/bench_lora_peft.py DIR --steps N --seq-len T --batch B
        [--r 8] [--alpha 16] [--targets q_proj,v_proj] [--lr 1e-4] [--load-in-4bit]

With --load-in-4bit the base is loaded by bitsandbytes in 4-bit NF4 with double
quantization and the compute dtype --dtype (QLoRA).

The model is loaded in bfloat16 (`dtype=torch.bfloat16`), wrapped by
`get_peft_model` (PEFT keeps the adapters in fp32: `autocast_adapter_dtype`),
and trained with `torch.optim.AdamW` over the trainable parameters (weight
decay 0, as the Rust sides) on the token ids `(i * 7 + j * 13) % vocab` of
row i, position j. One untimed warm-up step, then N timed ones; one JSON line:
steps_per_s, the mean seconds of each phase (forward with the loss read out,
backward, optimizer step), first_loss (the warm-up step's), last_loss,
peak_rss_mib (this process's VmHWM, as the Rust sides read theirs; also
split into the load's peak and the training's), trainable_parameters.
"""
import argparse
import json
import os
import time

import torch


def status_mib(field):
    """A field of /proc/self/status in MiB (VmHWM: the peak resident set)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) / 1024
    return float("nan")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--r", type=int, default=8)
    p.add_argument("--alpha", type=float, default=16.0)
    p.add_argument("--targets", default="q_proj,v_proj")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument(
        "--load-in-4bit",
        action="store_true",
        help="QLoRA: the base in 4-bit NF4 with double quantization (bitsandbytes), "
        "compute dtype --dtype",
    )
    a = p.parse_args()

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    threads = len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    t = time.perf_counter()
    kw = {}
    if a.load_in_4bit:
        from transformers import BitsAndBytesConfig

        # prepare_model_for_kbit_training is left out: it turns on gradient
        # checkpointing, which the Rust side does not use here.
        kw["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=getattr(torch, a.dtype),
        )
        kw["device_map"] = "cpu"
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=getattr(torch, a.dtype), **kw)
    config = LoraConfig(
        r=a.r,
        lora_alpha=a.alpha,
        lora_dropout=0.0,
        target_modules=a.targets.split(","),
        task_type="CAUSAL_LM",
    )
    if a.gradient_checkpointing:
        model.gradient_checkpointing_enable()
        model.enable_input_require_grads()
    model = get_peft_model(model, config)
    model.train()
    load_s = time.perf_counter() - t
    # The load's peak, then VmHWM reset (Linux 4.0 and later) so that the
    # next reading is the training's own peak, as the Rust sides do.
    load_peak = status_mib("VmHWM:")
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        train_peak_known = True
    except OSError:
        train_peak_known = False
    trainable = [q for q in model.parameters() if q.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=a.lr, weight_decay=0.0)

    vocab = model.config.vocab_size
    ids = torch.tensor(
        [[(i * 7 + j * 13) % vocab for j in range(a.seq_len)] for i in range(a.batch)]
    )

    def step():
        """The loss and the seconds of forward, backward and optimizer step."""
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        value = loss.item()
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return value, (t1 - t0, t2 - t1, time.perf_counter() - t2)

    first, _ = step()
    last = first
    times, phases = [], [0.0, 0.0, 0.0]
    for _ in range(a.steps):
        t = time.perf_counter()
        last, p = step()
        times.append(time.perf_counter() - t)
        phases = [x + y for x, y in zip(phases, p)]
    n = max(len(times), 1)
    print(json.dumps({
        "steps_per_s": round(len(times) / sum(times), 4) if times else None,
        "step_s": [round(x, 3) for x in times],
        "phase_s": {
            k: round(x / n, 3) for k, x in zip(("forward", "backward", "optimizer"), phases)
        },
        "first_loss": first,
        "last_loss": last,
        "peak_rss_mib": round(max(status_mib("VmHWM:"), load_peak), 1),
        "peak_rss_load_mib": round(load_peak, 1),
        "peak_rss_train_mib": round(status_mib("VmHWM:"), 1) if train_peak_known else None,
        "load_s": round(load_s, 3),
        "trainable_parameters": sum(q.numel() for q in trainable),
        "all_parameters": model.get_nb_trainable_parameters()[1],
        "adapter_dtype": str(trainable[0].dtype).removeprefix("torch."),
        "threads": threads,
        "torch": torch.__version__,
        "peft": __import__("peft").__version__,
        "bitsandbytes": __import__("bitsandbytes").__version__ if a.load_in_4bit else None,
    }))


if __name__ == "__main__":
    main()
