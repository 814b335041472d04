#!/usr/bin/env python3
"""PyTorch side of `bench_moe`: transformers' `MixtralSparseMoeBlock`
(fused experts, one product per expert hit, index_add back) forward +
backward on the same shape and threads as accel-rs, fp32, weights and input
drawn N(0, 0.02) / N(0, 1). Prints one JSON object.

    python3 scripts/bench_moe_torch.py --experts 8 --top-k 2 --hidden 1024 --ffn 3584 --tokens 1024 [--threads N] [--reps R]
"""
import argparse
import json
import time

import torch
from transformers import MixtralConfig
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock


def peak_kib():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM"):
                return int(line.split()[1])
    return 0


def main():
    p = argparse.ArgumentParser()
    for k, d in [("experts", 8), ("top-k", 2), ("hidden", 1024), ("ffn", 3584), ("tokens", 1024)]:
        p.add_argument(f"--{k}", type=int, default=d)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=3)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    cfg = MixtralConfig(hidden_size=a.hidden, intermediate_size=a.ffn,
                        num_local_experts=a.experts, num_experts_per_tok=a.top_k)
    block = MixtralSparseMoeBlock(cfg).train()
    with torch.no_grad():
        for p_ in block.parameters():
            p_.normal_(0.0, 0.02)
    x = torch.randn(1, a.tokens, a.hidden, requires_grad=True)

    def step():
        block.zero_grad(set_to_none=True)
        x.grad = None
        y = block(x)
        y.sum().backward()

    step()
    best = float("inf")
    for _ in range(a.reps):
        t = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - t)
    print(json.dumps({"seconds": best, "peak_rss_mib": peak_kib() / 1024,
                      "torch": torch.__version__, "threads": a.threads}))


if __name__ == "__main__":
    main()
