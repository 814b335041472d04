"""Writes tests/fixtures/lora/{llama,gpt2}/: PEFT LoRA adapters of the tiny HF fixtures, and what PEFT computes.

Each folder holds the adapter as `PeftModel.save_pretrained` writes it (adapter_config.json,
adapter_model.safetensors) with both matrices drawn at random (`init_lora_weights=False`), so the update
is not zero, and reference.json: PEFT's logits of the adapted model on fixed ids, the logits of
`merge_and_unload()`, and `print_trainable_parameters`' counts for the same LoraConfig (r=8, alpha=16),
which the command-line run in tests/tests/lora.rs must report. GPT-2's `Conv1D` layers get
`fan_in_fan_out=True`, as PEFT sets it for them.

Usage: python3 scripts/make_lora_fixture.py [NAME ...]   (needs torch, transformers, peft; all cases
without names)
"""
import json
import os
import shutil

import peft
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

ROOT = os.path.join(os.path.dirname(__file__), "..")
CASES = {
    "llama": dict(target_modules=["q_proj", "v_proj"], ids=[[1, 40, 21, 7, 99], [3, 5, 8, 13, 21]]),
    "gpt2": dict(target_modules=["c_attn"], fan_in_fan_out=True, ids=[[1, 40, 21, 7, 99], [3, 5, 8, 13, 21]]),
    # The newer architectures (scripts/make_hf_arch_fixtures.py), each with
    # PEFT's default target modules for it (Phi-3: the fused qkv_proj).
    "qwen3": dict(target_modules=["q_proj", "v_proj"], ids=[[1, 40, 21, 7, 99], [3, 5, 8, 13, 21]]),
    "gemma2": dict(target_modules=["q_proj", "v_proj"], ids=[[1, 40, 21, 7, 99], [3, 5, 8, 13, 21]]),
    "gemma3": dict(target_modules=["q_proj", "v_proj"], ids=[[1, 40, 21, 7, 99], [3, 5, 8, 13, 21]]),
    "phi3": dict(target_modules=["qkv_proj"], ids=[[1, 40, 21, 7, 99], [3, 5, 8, 13, 21]]),
    "mixtral": dict(target_modules=["q_proj", "v_proj"], ids=[[1, 40, 21, 7, 99], [3, 5, 8, 13, 21]]),
    "qwen3_moe": dict(target_modules=["q_proj", "v_proj"], ids=[[1, 40, 21, 7, 99], [3, 5, 8, 13, 21]]),
}


def counts(model):
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return trainable, sum(p.numel() for p in model.parameters())


def main():
    import sys

    wanted = sys.argv[1:] or list(CASES)
    for name, case in CASES.items():
        if name not in wanted:
            continue
        base_dir = os.path.join(ROOT, "tests/fixtures/hf", name)
        out = os.path.join(ROOT, "tests/fixtures/lora", name)
        shutil.rmtree(out, ignore_errors=True)
        torch.manual_seed(0)
        kw = dict(r=8, lora_alpha=16, target_modules=case["target_modules"], task_type="CAUSAL_LM")
        if case.get("fan_in_fan_out"):
            kw["fan_in_fan_out"] = True
        base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
        trainable, total = counts(get_peft_model(base, LoraConfig(**kw)))
        base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
        model = get_peft_model(base, LoraConfig(init_lora_weights=False, **kw)).eval()
        model.save_pretrained(out)
        os.remove(os.path.join(out, "README.md"))  # PEFT's model card template
        ids = torch.tensor(case["ids"])
        with torch.no_grad():
            logits = model(ids).logits
            loaded = PeftModel.from_pretrained(
                AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32), out
            ).eval()
            assert torch.equal(loaded(ids).logits, logits)
            merged = loaded.merge_and_unload()(ids).logits
        with open(os.path.join(out, "reference.json"), "w") as f:
            json.dump(
                {
                    "peft_version": peft.__version__,
                    "input_ids": case["ids"],
                    "logits": logits.tolist(),
                    "merged_logits": merged.tolist(),
                    "trainable_parameters_r8": trainable,
                    "all_parameters_r8": total,
                },
                f,
            )
        print(name, "trainable", trainable, "all", total)


if __name__ == "__main__":
    main()
