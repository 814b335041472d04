#!/usr/bin/env python3
"""PyTorch side of `bench_train`: the same two workloads, the same optimizer
rule, on 2 CPU threads, printed as one JSON object of steps per second.

- mlp_784_512_512_10_b64: Linear-ReLU-Linear-ReLU-Linear, batch 64, cross entropy.
- gpt_v4096_d256_l4_h4_t128_b8: GPT-2 style pre-LayerNorm decoder (learned
  positions, causal attention, 4x MLP with tanh GELU, final LayerNorm, lm_head
  tied to the token embedding), batch 8 x 128 tokens.

Both train with AdamW (lr 1e-3, betas 0.9/0.999, eps 1e-8, weight decay 0.01)
where biases and LayerNorm weights get no weight decay, which is the rule
accel-rs' Accelerator applies (transformers' `get_parameter_names` grouping).

    python3 scripts/bench_train_torch.py --workload all --rounds 5 --json

With `--serve` it runs rounds on request instead, so that `bench_train` can
alternate them with its own (machine noise then hits both sides alike): it
prints `{"torch_version": ...}`, then for every line `mlp` or `gpt` on stdin
runs one untimed step and one timed round of that workload (the first
request also builds the model and runs two warm-up steps) and prints `{"steps_per_s": x}`.
A line `mlp bf16` or `gpt bf16` does the same for another instance of the
workload whose forward runs under `torch.autocast(dtype=torch.bfloat16)`
(fp32 weights and optimizer, as accel-rs' bf16 mixed precision).

`gpt2_124m` is GPT-2 small (vocab 50257, d 768, 12 layers, 12 heads, context
1024, the same block as above) at `--micro-batch` x `--seq-len` tokens a step
(8 x 1024 by default), trained as a PyTorch user on a GPU would: AdamW with
`fused=True` on CUDA (PyTorch's fastest path there), SDPA (flash attention on
the GPU). Requests: `gpt2_124m [bf16] [compile]`; `compile` wraps the loss in
`torch.compile` (its first request compiles, untimed). On CUDA each reply
also carries `peak_mem_mib`, `torch.cuda.max_memory_allocated()` since the
instance was built (the first instance built is the eager one, so its figure
holds only its own model).
"""
import argparse
import json
import sys

import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10)
        )

    def loss(self, x, y):
        return F.cross_entropy(self.layers(x), y)


class Block(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d)
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)
        self.ln_2 = nn.LayerNorm(d)
        self.c_fc = nn.Linear(d, 4 * d)
        self.mlp_proj = nn.Linear(4 * d, d)
        self.h = h

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.h, d // self.h).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class Gpt(nn.Module):
    def __init__(self, vocab=4096, d=256, layers=4, heads=4, block=128):
        super().__init__()
        self.block = block
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(block, d)
        self.h = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)

    def loss(self, idx, targets):
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        for blk in self.h:
            x = blk(x)
        logits = self.ln_f(x) @ self.wte.weight.t()
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def adamw(model, fused=False):
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        is_norm = ".ln_" in f".{name}" or name.startswith("ln_")
        (no_decay if name.endswith("bias") or is_norm else decay).append(p)
    groups = [
        {"params": decay, "weight_decay": 0.01},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    # foreach: PyTorch's fast multi-tensor path on CPU; fused: one kernel
    # launch per group on CUDA (what the gpt2_124m workload asks for there).
    fast = {"fused": True} if fused else {"foreach": True}
    return torch.optim.AdamW(groups, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, **fast)


GPT2_124M = dict(vocab=50257, d=768, layers=12, heads=12, block=1024)


def gpt2_124m(device, micro_batch, seq_len):
    """GPT-2 small and a loss of step i over 4 fixed batches of
    `micro_batch` x `seq_len` tokens."""
    g = torch.Generator().manual_seed(0)
    model = Gpt(**GPT2_124M).to(device)
    toks = torch.randint(0, 50257, (4, micro_batch, seq_len + 1), generator=g).to(device)
    return model, lambda i: model.loss(toks[i % 4, :, :seq_len], toks[i % 4, :, 1:])


def workload(kind, device):
    """The model, a loss of step i, and steps per timed round (longer on a GPU)."""
    g = torch.Generator().manual_seed(0)
    scale = 1 if device == "cpu" else 20
    if kind == "mlp":
        model = Mlp().to(device)
        xs = torch.randn(8, 64, 784, generator=g).to(device)
        ys = torch.randint(0, 10, (8, 64), generator=g).to(device)
        return model, lambda i: model.loss(xs[i % 8], ys[i % 8]), 60 * scale
    model = Gpt().to(device)
    toks = torch.randint(0, 4096, (4, 8, 129), generator=g).to(device)
    return model, lambda i: model.loss(toks[i % 4, :, :128], toks[i % 4, :, 1:]), 3 * scale


def autocast(loss, device):
    """`loss` with its forward under bf16 autocast."""

    def run(i):
        with torch.autocast(device_type=device, dtype=torch.bfloat16):
            return loss(i)

    return run


def rate(model, loss, opt, start, n):
    t = time.perf_counter()
    for i in range(start, start + n):
        opt.zero_grad(set_to_none=True)
        loss(i).backward()
        opt.step()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return n / (time.perf_counter() - t)


def build(key, device, args):
    """The live instance for a request line, or None when it is not one."""
    kind, *opts = key.split()
    if kind in ("mlp", "gpt") and opts in ([], ["bf16"]):
        model, loss, steps = workload(kind, device)
        fused = False
    elif kind == "gpt2_124m" and all(o in ("bf16", "compile") for o in opts):
        model, loss = gpt2_124m(device, args.micro_batch, args.seq_len)
        steps, fused = args.gpt2_steps, device == "cuda"
        if "compile" in opts:
            loss = torch.compile(loss)
    else:
        return None
    if "bf16" in opts:
        loss = autocast(loss, device)
    opt = adamw(model, fused)
    rate(model, loss, opt, 0, 2)
    return [model, loss, opt, steps, 2]


def serve(device, args):
    """One timed round per request line; see the module docstring."""
    hello = {"torch_version": torch.__version__}
    if device == "cuda":
        hello["gpu_name"] = torch.cuda.get_device_name()
    print(json.dumps(hello), flush=True)
    live = {}
    for line in sys.stdin:
        key = line.strip()
        if key not in live:
            if device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            instance = build(key, device, args)
            if instance is None:
                print(json.dumps({"error": f"unknown request {key!r}"}), flush=True)
                continue
            live[key] = instance
        model, loss, opt, steps, start = live[key]
        # One untimed step first, as bench_train does for its own rows.
        rate(model, loss, opt, start, 1)
        r = rate(model, loss, opt, start + 1, steps)
        live[key][4] = start + 1 + steps
        reply = {"steps_per_s": r}
        if device == "cuda":
            reply["peak_mem_mib"] = torch.cuda.max_memory_allocated() / 2**20
        print(json.dumps(reply), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", default="all", choices=["mlp", "gpt", "all"])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--serve", action="store_true")
    ap.add_argument("--micro-batch", type=int, default=8, help="gpt2_124m's sequences a step")
    ap.add_argument("--seq-len", type=int, default=1024, help="gpt2_124m's tokens a sequence")
    ap.add_argument("--gpt2-steps", type=int, default=10, help="gpt2_124m's steps a round")
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    if args.serve:
        serve(args.device, args)
        return
    names = {"mlp": "mlp_784_512_512_10_b64", "gpt": "gpt_v4096_d256_l4_h4_t128_b8"}
    kinds = ["mlp", "gpt"] if args.workload == "all" else [args.workload]
    out = {"torch_version": torch.__version__, "threads": args.threads, "device": args.device}
    for kind in kinds:
        model, loss, steps = workload(kind, args.device)
        opt = adamw(model)
        rate(model, loss, opt, 0, 2)
        rates = sorted(rate(model, loss, opt, 2 + r * steps, steps) for r in range(args.rounds))
        out[names[kind]] = round(rates[len(rates) // 2], 2)
    print(json.dumps(out) if args.json else json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
