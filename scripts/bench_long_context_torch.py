#!/usr/bin/env python3
"""PyTorch side of `bench_long_context`, and the checkpoint both sides train.

    python3 scripts/bench_long_context_torch.py write DIR
        A 4-layer Llama (d 512, 8 heads, 4 kv heads, MLP 1408, vocab 32000,
        fp32, transformers' random init with seed 0) saved to DIR.
    python3 scripts/bench_long_context_torch.py step DIR T [--checkpointing] [--threads N] [--steps S]
        Loads DIR with SDPA attention, trains S steps of AdamW (lr 1e-4,
        weight decay 0) on one row of T token ids (i * 7919 % vocab), prints
        one JSON object: the first loss, seconds of the fastest step after the
        first, peak RSS. `--checkpointing` calls gradient_checkpointing_enable().
"""
import argparse
import json
import resource
import time

import torch


def write(path):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=32000,
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=32768,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)


def ids(t, vocab):
    return torch.tensor([[(i * 7919) % vocab for i in range(t)]])


def step(path, t, checkpointing, threads, steps):
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    if checkpointing:
        model.gradient_checkpointing_enable()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
    x = ids(t, model.config.vocab_size)
    times, first = [], None
    for _ in range(steps):
        start = time.perf_counter()
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - start)
        first = loss.item() if first is None else first
    print(json.dumps({
        "t": t,
        "first_loss": first,
        "seconds_per_step": min(times[1:]) if len(times) > 1 else times[0],
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "gradient_checkpointing": checkpointing,
        "torch_version": torch.__version__,
    }))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("cmd", choices=["write", "step"])
    p.add_argument("dir")
    p.add_argument("t", type=int, nargs="?")
    p.add_argument("--checkpointing", action="store_true")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=2)
    a = p.parse_args()
    if a.cmd == "write":
        write(a.dir)
    else:
        step(a.dir, a.t, a.checkpointing, a.threads, a.steps)


if __name__ == "__main__":
    main()
