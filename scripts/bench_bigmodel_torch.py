#!/usr/bin/env python3
"""Python side of `bench_bigmodel`: write the ~2 GB Llama checkpoint, and time
transformers + Accelerate on it.

    python3 scripts/bench_bigmodel_torch.py write DIR
        A Llama-architecture model (hidden 1536, 16 layers, GQA 12/4 heads,
        intermediate 4096, vocab 32000: 0.55 B parameters, 2.2 GB in fp32),
        random weights (seed 0), saved by `save_pretrained` in 5 shards with
        `model.safetensors.index.json`.

    python3 scripts/bench_bigmodel_torch.py time DIR MAP.json OFFLOAD_DIR
        `from_pretrained(DIR, device_map=MAP, offload_folder=OFFLOAD_DIR)` then
        two forwards of 1 x 32 tokens; prints one JSON object with load_s,
        forward_s (the first), forward_warm_s (the second) and peak_rss_mib
        (this process's ru_maxrss).
"""
import json
import resource
import sys
import time

import torch


def write(path):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=32000,
        hidden_size=1536,
        intermediate_size=4096,
        num_hidden_layers=16,
        num_attention_heads=12,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(path, max_shard_size="480MB", safe_serialization=True)


def timed(path, map_path, offload):
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(2)
    device_map = json.load(open(map_path))
    t = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(
        path, device_map=device_map, offload_folder=offload, torch_dtype=torch.float32
    )
    load = time.perf_counter() - t
    ids = torch.arange(1, 33).unsqueeze(0)
    with torch.no_grad():
        t = time.perf_counter()
        logits = model(ids).logits
        forward = time.perf_counter() - t
        t = time.perf_counter()
        model(ids)
        forward_warm = time.perf_counter() - t
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({
        "load_s": round(load, 3),
        "forward_s": round(forward, 3),
        "forward_warm_s": round(forward_warm, 3),
        "peak_rss_mib": round(rss, 1),
        "logits_sum": float(logits.double().sum()),
        "torch": torch.__version__,
    }))


if __name__ == "__main__":
    if sys.argv[1] == "write":
        write(sys.argv[2])
    else:
        timed(sys.argv[2], sys.argv[3], sys.argv[4])
