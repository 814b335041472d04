#!/usr/bin/env python3
"""Checks that PEFT runs an adapter accel-rs trained on a 4-bit base (`finetune_hf --load-in-4bit
... --lora-r R --output-dir OUT`) with accel-rs' logits: PEFT's `PeftModel.from_pretrained` on
transformers' own bitsandbytes base, against `hf_logits --adapter OUT` with the same quantization
flags (read as JSON from a file). Prints one JSON line; exits 1 when the logits differ by 1e-3 or more.

    python3 scripts/check_qlora_peft.py --base DIR --adapter OUT --ours ours.json \\
        --quant-type nf4 --double-quant --input-ids 1,40,212

bitsandbytes' CPU layers are kept off their bf16 fast path, as in make_quant_model_fixtures.py.
"""
import argparse
import json
import sys

import bitsandbytes as bnb
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, BitsAndBytesConfig


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--base", required=True)
    p.add_argument("--adapter", required=True)
    p.add_argument("--ours", required=True, help="hf_logits' JSON output")
    p.add_argument("--quant-type", default="nf4")
    p.add_argument("--double-quant", action="store_true")
    p.add_argument("--input-ids", required=True)
    a = p.parse_args()
    q = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=a.quant_type,
        bnb_4bit_use_double_quant=a.double_quant,
        bnb_4bit_compute_dtype=torch.float32,
    )
    base = AutoModelForCausalLM.from_pretrained(a.base, quantization_config=q, dtype=torch.float32, device_map="cpu")
    model = PeftModel.from_pretrained(base, a.adapter).eval()
    for m in model.modules():
        if isinstance(m, bnb.nn.Linear4bit):
            m.support_avx512bf16_for_cpu = False
    ids = torch.tensor([[int(i) for i in a.input_ids.split(",")]])
    with torch.no_grad():
        theirs = model(ids).logits[0].float()
    with open(a.ours) as f:
        ours = torch.tensor(json.load(f)["logits"])
    diff = (theirs - ours).abs().max().item()
    print(json.dumps({"max_abs_diff": diff, "positions": ids.shape[1], "vocab": theirs.shape[-1]}))
    sys.exit(0 if diff < 1e-3 else 1)


if __name__ == "__main__":
    main()
