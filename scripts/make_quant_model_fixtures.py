#!/usr/bin/env python3
"""Writes the model fixtures of tests/fixtures/quant/: a tiny transformers Llama, what
transformers + bitsandbytes compute with it loaded in 4 and 8 bits, folders transformers saved
quantized, and a PEFT adapter on the 4-bit base with PEFT's logits.

    pip install torch transformers bitsandbytes peft safetensors
    python3 scripts/make_quant_model_fixtures.py

- llama/: the full-precision model (fp32; every linear dim a multiple of 64, which bitsandbytes'
  CPU kernels need) and reference.json: the input ids, fp32 logits, and the logits of every 4-bit
  setting (nf4/fp4, with and without double quantization; compute dtype float32, and bfloat16 for
  nf4 + double quantization) and of LLM.int8 (threshold 6.0).
- llama-nf4-dq/, llama-8bit/: `save_pretrained` of the model loaded in 4 bits (nf4, double
  quantization) and in 8 bits, with reference.json: the logits after reloading the folder.
- qlora-adapter/: a PEFT LoRA adapter (r 8, alpha 16, q_proj and v_proj, random A and B) on the
  nf4 + double quantization base, and reference.json: PEFT's logits and its parameter counts.

bitsandbytes' CPU layers are kept off their bf16 fast path (`support_avx512bf16_for_cpu`),
which multiplies in bf16 on CPUs with AVX512-BF16 whatever the compute dtype; with it off they
dequantize to the compute dtype and multiply there, on every CPU.
"""
import json
import os
import shutil

import bitsandbytes as bnb
import peft
import torch
import transformers
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, BitsAndBytesConfig, LlamaConfig

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "quant"))
IDS = [[1, 40, 212]]


def exact_cpu_layers(model):
    for m in model.modules():
        if isinstance(m, bnb.nn.Linear4bit):
            m.support_avx512bf16_for_cpu = False
    return model


def logits(model):
    with torch.no_grad():
        return model(torch.tensor(IDS)).logits[0].float().tolist()


def load(folder, q=None):
    kw = dict(dtype=torch.float32, device_map="cpu")
    if q is not None:
        kw["quantization_config"] = q
    return exact_cpu_layers(AutoModelForCausalLM.from_pretrained(folder, **kw).eval())


def four_bit(qt, dq, compute=torch.float32):
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=qt,
        bnb_4bit_use_double_quant=dq,
        bnb_4bit_compute_dtype=compute,
    )


def write_json(folder, obj):
    with open(os.path.join(folder, "reference.json"), "w") as f:
        json.dump(obj, f)


def main():
    base = os.path.join(ROOT, "llama")
    for d in ("llama", "llama-nf4-dq", "llama-8bit", "qlora-adapter"):
        shutil.rmtree(os.path.join(ROOT, d), ignore_errors=True)
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=64,
        initializer_range=0.1,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    AutoModelForCausalLM.from_config(cfg).to(torch.float32).save_pretrained(base)
    ref = {
        "transformers": transformers.__version__,
        "bitsandbytes": bnb.__version__,
        "torch": torch.__version__,
        "input_ids": IDS,
        "fp32": logits(load(base)),
    }
    for qt in ("nf4", "fp4"):
        for dq in (False, True):
            ref[f"4bit_{qt}_{'dq' if dq else 'plain'}"] = logits(load(base, four_bit(qt, dq)))
    ref["4bit_nf4_dq_bf16"] = logits(load(base, four_bit("nf4", True, torch.bfloat16)))
    ref["8bit"] = logits(load(base, BitsAndBytesConfig(load_in_8bit=True)))
    write_json(base, ref)

    for name, q in (("llama-nf4-dq", four_bit("nf4", True)), ("llama-8bit", BitsAndBytesConfig(load_in_8bit=True))):
        out = os.path.join(ROOT, name)
        load(base, q).save_pretrained(out)
        write_json(out, {"input_ids": IDS, "logits": logits(load(out))})

    model = load(base, four_bit("nf4", True))
    lcfg = dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    counted = get_peft_model(load(base, four_bit("nf4", True)), LoraConfig(**lcfg))
    trainable, total = counted.get_nb_trainable_parameters()
    torch.manual_seed(1)
    adapted = get_peft_model(model, LoraConfig(init_lora_weights=False, **lcfg)).eval()
    out = os.path.join(ROOT, "qlora-adapter")
    adapted.save_pretrained(out)
    os.remove(os.path.join(out, "README.md"))  # PEFT's model card template
    path = os.path.join(out, "adapter_config.json")
    with open(path) as f:
        acfg = json.load(f)
    acfg["base_model_name_or_path"] = "../llama"  # not this machine's absolute path
    with open(path, "w") as f:
        json.dump(acfg, f, indent=2, sort_keys=True)
    reloaded = PeftModel.from_pretrained(load(base, four_bit("nf4", True)), out).eval()
    got = logits(reloaded)
    assert got == logits(adapted)
    write_json(out, {
        "peft": peft.__version__,
        "input_ids": IDS,
        "logits": got,
        "trainable_parameters_r8": trainable,
        "all_parameters_r8": total,
    })
    print("trainable", trainable, "all", total)


if __name__ == "__main__":
    main()
