#!/usr/bin/env python3
"""PyTorch side of `bench_attention`: causal attention forward + backward
with `F.scaled_dot_product_attention` (torch's CPU flash kernel), b 1,
h 8 query heads over 4 kv heads (`enable_gqa`), head dim 64, fp32, on as
many threads as accel-rs uses. One sequence length per process, so the peak
RSS is this length's alone; prints one JSON object.

    python3 scripts/bench_attention_torch.py T [--threads N] [--reps R]

With `--device cuda` it times `bench_attention --device cuda`'s shape instead:
b 8, 12 heads, head dim 64, bf16 (SDPA picks its flash kernel), and reports
`tflops` (flash-attention's count: 3.5 times the causal forward's) and
`peak_mib` (`torch.cuda.max_memory_allocated()` over the timed calls).
"""
import argparse
import json
import resource
import time

import torch
import torch.nn.functional as F


def rss_kib():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1])
    return 0


def main():
    p = argparse.ArgumentParser()
    p.add_argument("t", type=int)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    a = p.parse_args()
    if a.device == "cuda":
        return cuda(a)
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    b, h, kvh, d, t = 1, 8, 4, 64, a.t
    q = torch.randn(b, h, t, d, requires_grad=True)
    k = torch.randn(b, kvh, t, d, requires_grad=True)
    v = torch.randn(b, kvh, t, d, requires_grad=True)
    g = torch.randn(b, h, t, d)

    def step():
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        y.backward(g)
        q.grad = k.grad = v.grad = None

    before = rss_kib()
    step()  # warm-up
    times = []
    for _ in range(a.reps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({
        "t": t,
        "seconds": min(times),
        "peak_rss_mib": peak / 1024,
        "op_peak_mib": max(peak - before, 0) / 1024,
        "torch_version": torch.__version__,
    }))


def cuda(a):
    torch.manual_seed(0)
    b, h, d, t = 8, 12, 64, a.t
    dev, dt = "cuda", torch.bfloat16
    q, k, v = (torch.randn(b, h, t, d, device=dev, dtype=dt, requires_grad=True) for _ in range(3))
    g = torch.ones(b, h, t, d, device=dev, dtype=dt)

    def step():
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y.backward(g)
        q.grad = k.grad = v.grad = None

    step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(a.reps):
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    best = min(times)
    flops = 3.5 * 4 * b * h * t * t * d / 2
    print(json.dumps({
        "t": t,
        "seconds": best,
        "tflops": flops / best / 1e12,
        "peak_mib": torch.cuda.max_memory_allocated() / 2**20,
        "torch_version": torch.__version__,
    }))


if __name__ == "__main__":
    main()
