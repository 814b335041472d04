#!/usr/bin/env python3
"""Writes the tiny random Hugging Face checkpoints under tests/fixtures/hf/ that
accel-models is checked against, with transformers' own outputs for them.

    pip install torch transformers tokenizers
    python3 scripts/make_hf_fixtures.py            # rewrites tests/fixtures/hf/

Each fixture folder holds what `save_pretrained` writes (config.json, weights:
model.safetensors, or shards with model.safetensors.index.json) and
reference.json: the input ids, transformers' fp32 logits for them (BERT: the
last hidden state, the pooler output and the mean-pooled sentence embedding
over the attention mask), the mean next-token loss with labels = input ids,
and greedy `generate(do_sample=False, max_new_tokens=8)` tokens for the
decoders. References are computed on the model *reloaded from the folder*, so
they describe exactly the files the Rust side reads.

Weights are random (fixed seeds) with a large init std so that logits are
well separated: greedy decoding then does not hinge on float rounding
(`min_top2_gap` in reference.json records the smallest margin seen).
"""

import json
import os
import shutil
import sys

import torch
import transformers
from transformers import (
    AutoModel,
    AutoModelForCausalLM,
    BertConfig,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
)

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "hf")
NEW_TOKENS = 8


def llama_hub_format(folder):
    """Rewrites transformers 5's `rope_parameters` into the `rope_theta` and
    `rope_scaling` keys that Llama 3 checkpoints on the Hub carry, so both
    config spellings are covered by the fixtures."""
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    rope = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rope.pop("rope_theta")
    cfg["rope_scaling"] = rope
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)


def top2_gap(logits):
    top = torch.topk(logits.float(), 2, dim=-1).values
    return float((top[..., 0] - top[..., 1]).min())


def decoder_reference(folder, input_ids, cls=AutoModelForCausalLM):
    model = cls.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.tensor(input_ids)
    with torch.no_grad():
        out = model(ids, labels=ids)
        gen = model.generate(
            ids[:1],
            attention_mask=torch.ones_like(ids[:1]),
            do_sample=False,
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            eos_token_id=None,
            pad_token_id=0,
        )
        # the margins of every greedy step, re-run on the full sequence
        gen_logits = model(gen).logits[0, len(input_ids[0]) - 1 : -1]
    base = getattr(model.base_model, "language_model", model.base_model)
    no_split = type(base.layers[0] if hasattr(base, "layers") else base.h[0]).__name__
    return {
        "input_ids": input_ids,
        "device_maps": device_maps(model, no_split),
        "logits": out.logits.tolist(),
        "loss": float(out.loss),
        "generate": {
            "prompt_ids": input_ids[0],
            "max_new_tokens": NEW_TOKENS,
            "tokens": gen[0].tolist(),
        },
        "min_top2_gap": min(top2_gap(out.logits), top2_gap(gen_logits)),
    }


def device_maps(model, no_split):
    """Accelerate's `infer_auto_device_map` for the transformers model under a
    few CPU budgets (the rest on disk), with the decoder layer class as
    no-split: what the Rust planner must reproduce, key order included."""
    from accelerate import infer_auto_device_map

    total = sum(p.numel() * p.element_size() for p in model.parameters())
    out = []
    for frac in (0.5, 0.75, 0.9):
        budget = {"cpu": int(total * frac), "disk": "1GB"}
        plan = infer_auto_device_map(model, max_memory=budget, no_split_module_classes=[no_split])
        out.append({"max_memory": budget, "no_split_module_classes": [no_split],
                    "device_map": [[k, v] for k, v in plan.items()]})
    return out


BERT_TOKEN_TYPES = [[0, 0, 0, 0, 1, 1, 1], [0, 0, 1, 1, 0, 0, 0]]


def bert_token_types_reference(folder, input_ids, attention_mask):
    """The last hidden state with segment ids (`token_type_ids`) given."""
    model = AutoModel.from_pretrained(folder, dtype=torch.float32).eval()
    ids, mask = torch.tensor(input_ids), torch.tensor(attention_mask)
    types = torch.tensor(BERT_TOKEN_TYPES)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, token_type_ids=types)
    return {
        "token_type_ids": BERT_TOKEN_TYPES,
        "last_hidden_state_with_token_types": out.last_hidden_state.tolist(),
    }


def bert_reference(folder, input_ids, attention_mask):
    model = AutoModel.from_pretrained(folder, dtype=torch.float32).eval()
    ids, mask = torch.tensor(input_ids), torch.tensor(attention_mask)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask)
    h = out.last_hidden_state
    m = mask.unsqueeze(-1).float()
    # sentence-transformers' mean pooling: padded positions excluded
    mean = (h * m).sum(1) / m.sum(1).clamp(min=1e-9)
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "last_hidden_state": h.tolist(),
        "pooler_output": out.pooler_output.tolist(),
        "mean_pooled": mean.tolist(),
        "device_maps": device_maps(model, "BertLayer"),
        **bert_token_types_reference(folder, input_ids, attention_mask),
    }


def write_tokenizer(folder, vocab_size):
    """A byte-level BPE trained on a fixed text, vocabulary within the model's."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = [
        "the quick brown fox jumps over the lazy dog",
        "a tiny llama reads the tokens it was given and writes a few more",
        "accelerate runs the same loop on one process or many",
    ] * 4
    # The byte alphabet alone is 256 symbols: keep it out so the vocabulary
    # fits a tiny model; characters outside the corpus are not needed.
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<unk>", "<s>", "</s>"],
        show_progress=False,
    )
    tok.train_from_iterator(text, trainer)
    assert tok.get_vocab_size() <= vocab_size, tok.get_vocab_size()
    tok.save(os.path.join(folder, "tokenizer.json"))
    prompt = "the lazy fox reads"
    return {"prompt": prompt, "prompt_ids": tok.encode(prompt).ids}


def save(name, model, shard):
    folder = os.path.join(ROOT, name)
    shutil.rmtree(folder, ignore_errors=True)
    model.save_pretrained(folder, max_shard_size=shard)
    # generation_config.json only repeats config.json's token ids
    gen_cfg = os.path.join(folder, "generation_config.json")
    if os.path.exists(gen_cfg):
        os.remove(gen_cfg)
    return folder


def write_reference(folder, ref):
    ref["transformers_version"] = transformers.__version__
    ref["torch_version"] = torch.__version__
    with open(os.path.join(folder, "reference.json"), "w") as f:
        json.dump(ref, f)


DECODER_IDS = [[1, 17, 42, 5, 99, 63, 7], [1, 3, 88, 120, 64, 12, 30]]
BIG = "10MB"  # one file


def main():
    torch.set_grad_enabled(False)
    small = dict(num_hidden_layers=2, tie_word_embeddings=False, pad_token_id=0)

    # Llama 2-style: GQA (2 kv heads for 4), default RoPE, untied, sharded.
    torch.manual_seed(11)
    cfg = LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.3, **small,
    )
    folder = save("llama", AutoModelForCausalLM.from_config(cfg), "20KB")
    ref = decoder_reference(folder, DECODER_IDS)
    ref.update(tokenizer=write_tokenizer(folder, 128))
    write_reference(folder, ref)

    # Llama 3-style: rope_theta 500000 and llama3 rope_scaling whose three
    # wavelength bands all occur at head_dim 16 (6.3 < 16 < 32 < 64 < 167),
    # config in the Hub's rope_theta/rope_scaling spelling.
    torch.manual_seed(12)
    cfg = LlamaConfig(
        vocab_size=160, hidden_size=64, intermediate_size=96, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.3,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
        },
        **small,
    )
    folder = save("llama3", AutoModelForCausalLM.from_config(cfg), "40KB")
    llama_hub_format(folder)
    write_reference(folder, decoder_reference(folder, DECODER_IDS))

    # Mistral: GQA, untied, no sliding window.
    torch.manual_seed(13)
    cfg = MistralConfig(
        vocab_size=144, hidden_size=32, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=1, max_position_embeddings=64, initializer_range=0.3,
        sliding_window=None, **small,
    )
    folder = save("mistral", AutoModelForCausalLM.from_config(cfg), BIG)
    write_reference(folder, decoder_reference(folder, DECODER_IDS))

    # Qwen2: q/k/v biases, tied embeddings.
    torch.manual_seed(14)
    cfg = Qwen2Config(
        vocab_size=136, hidden_size=32, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.3,
        num_hidden_layers=2, tie_word_embeddings=True, pad_token_id=0,
        use_sliding_window=False,
    )
    model = AutoModelForCausalLM.from_config(cfg)
    # transformers initialises biases to zero: make them count
    for n, p in model.named_parameters():
        if n.endswith("bias"):
            p.normal_(0.0, 0.3)
    folder = save("qwen2", model, BIG)
    write_reference(folder, decoder_reference(folder, DECODER_IDS))

    # GPT-2: Conv1D weights stored [in, out], tied lm_head, sharded.
    torch.manual_seed(15)
    cfg = GPT2Config(
        vocab_size=130, n_embd=32, n_layer=2, n_head=4, n_positions=32,
        initializer_range=0.3, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    model = AutoModelForCausalLM.from_config(cfg)
    for n, p in model.named_parameters():
        if n.endswith("bias"):
            p.normal_(0.0, 0.3)
    folder = save("gpt2", model, "30KB")
    write_reference(folder, decoder_reference(folder, DECODER_IDS))

    # BERT with pooler; the second sequence is padded.
    torch.manual_seed(16)
    cfg = BertConfig(
        vocab_size=120, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=32, initializer_range=0.3,
    )
    model = AutoModel.from_config(cfg, add_pooling_layer=True)
    for n, p in model.named_parameters():
        if n.endswith("bias"):
            p.normal_(0.0, 0.3)
    folder = save("bert", model, BIG)
    ids = [[2, 17, 42, 5, 99, 63, 3], [2, 8, 77, 3, 0, 0, 0]]
    mask = [[1] * 7, [1, 1, 1, 1, 0, 0, 0]]
    write_reference(folder, bert_reference(folder, ids, mask))

    total = sum(
        os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(ROOT) for f in fs
    )
    print(f"wrote {ROOT}: {total / 1e6:.2f} MB", file=sys.stderr)


if __name__ == "__main__":
    main()
