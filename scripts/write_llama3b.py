#!/usr/bin/env python3
"""Writes a Llama-3.2-3B-shaped checkpoint with random weights (bf16, about 6.4 GB) for the QLoRA
memory benchmark (`bench_lora --qlora --model DIR ...`):

    python3 scripts/write_llama3b.py target/bench_llama_3b

The shapes are Llama 3.2 3B's (hidden 3072, 28 layers, 24 heads of 128, 8 KV heads, MLP 8192,
vocabulary 128256, tied embeddings); the weights are drawn once from a fixed seed, never trained.
"""
import os
import sys

import torch
from transformers import AutoModelForCausalLM, LlamaConfig


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "target/bench_llama_3b"
    if os.path.exists(os.path.join(out, "config.json")):
        print(out, "exists")
        return
    cfg = LlamaConfig(
        vocab_size=128256,
        hidden_size=3072,
        intermediate_size=8192,
        num_hidden_layers=28,
        num_attention_heads=24,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        bos_token_id=128000,
        eos_token_id=128001,
    )
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    model = AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(out)
    print("wrote", out)


if __name__ == "__main__":
    main()
