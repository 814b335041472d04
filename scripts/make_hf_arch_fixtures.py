#!/usr/bin/env python3
"""Writes the tiny random checkpoints of the newer architectures under
tests/fixtures/hf/ (Qwen3, Gemma 2, Gemma 3 text, Phi-3 with partial rotary
and longrope, Mixtral, Qwen3-MoE), with transformers' outputs for them, as
scripts/make_hf_fixtures.py does for the older ones (same reference.json
keys: logits, loss, greedy tokens, Accelerate's device maps).

    pip install torch transformers accelerate
    python3 scripts/make_hf_arch_fixtures.py

Every weight is random, norm weights included (a missing `1 + w` or a
skipped norm shows). The MoE fixtures also store, for `labels=input_ids`
with `output_router_logits=True`: the total loss, the auxiliary
load-balancing loss, and the autograd gradients of the first sparse layer's router and of
every expert's weights, with the token count each expert was routed.
"""

import json
import os
import shutil
import sys

import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma3Config,
    Gemma3ForConditionalGeneration,
    SiglipVisionConfig,
    Gemma2Config,
    Gemma3TextConfig,
    MixtralConfig,
    Phi3Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_hf_fixtures import BIG, DECODER_IDS, decoder_reference, save, write_reference  # noqa: E402


def randomize_norms(model, std=0.3):
    """Norm weights (initialised to 1 or 0) drawn around their init."""
    for n, p in model.named_parameters():
        if "norm" in n:
            p.add_(torch.randn_like(p) * std)


def moe_reference(folder, layer, disk_prefix, names):
    """Loss, aux loss and the first sparse layer's gradients with the
    router's loss on. transformers 5 holds the experts fused in memory
    (`mlp.experts.gate_up_proj [E, 2F, d]`, `down_proj [E, d, F]`); the
    gradients are stored under the checkpoint's per-expert names
    (`{disk_prefix}.experts.{e}.{gate|up|down}.weight`)."""
    torch.set_grad_enabled(True)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).train()
    # No dropout anywhere in these configs; train() only turns on the aux loss path.
    ids = torch.tensor(DECODER_IDS)
    out = model(ids, labels=ids, output_router_logits=True)
    out.loss.backward()
    params = dict(model.named_parameters())
    mem = f"model.layers.{layer}.mlp"
    grads = {f"{disk_prefix}.gate.weight": params[f"{mem}.gate.weight"].grad.tolist()}
    logits = out.router_logits[0]
    k = model.config.num_experts_per_tok
    chosen = torch.topk(torch.softmax(logits.float(), -1), k, dim=-1).indices
    n_exp = logits.shape[-1]
    counts = [int((chosen == e).sum()) for e in range(n_exp)]
    gate_up = params[f"{mem}.experts.gate_up_proj"].grad
    down = params[f"{mem}.experts.down_proj"].grad
    f = gate_up.shape[1] // 2
    gate_name, up_name, down_name = names
    for e in range(n_exp):
        base = f"{disk_prefix}.experts.{e}"
        grads[f"{base}.{gate_name}.weight"] = gate_up[e, :f].tolist()
        grads[f"{base}.{up_name}.weight"] = gate_up[e, f:].tolist()
        grads[f"{base}.{down_name}.weight"] = down[e].tolist()
    torch.set_grad_enabled(False)
    return {
        "loss_with_aux": float(out.loss),
        "aux_loss": float(out.aux_loss),
        "router_aux_loss_coef": model.config.router_aux_loss_coef,
        "tokens_per_expert": counts,
        "grads": grads,
    }


def gemma2():
    """Gemma 2: Gemma 3's layer without q/k norms, one rope for every layer,
    and the attention scores soft-capped (`attn_logit_softcapping`, small
    here so that the tanh bends them) before the mask and softmax."""
    torch.set_grad_enabled(False)
    torch.manual_seed(27)
    cfg = Gemma2Config(
        vocab_size=152, hidden_size=32, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64, num_hidden_layers=3,
        initializer_range=0.3, query_pre_attn_scalar=24, sliding_window=4,
        attn_logit_softcapping=2.0, final_logit_softcapping=3.0, pad_token_id=0,
        bos_token_id=1, eos_token_id=2,
    )
    model = AutoModelForCausalLM.from_config(cfg)
    randomize_norms(model)
    folder = save("gemma2", model, BIG)
    write_reference(folder, decoder_reference(folder, DECODER_IDS))


def main():
    gemma2()
    torch.set_grad_enabled(False)

    # Qwen3: per-head q/k RMS norms, explicit head_dim (16, not 32 / 4).
    torch.manual_seed(21)
    cfg = Qwen3Config(
        vocab_size=136, hidden_size=32, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64, num_hidden_layers=2,
        initializer_range=0.3, tie_word_embeddings=False, pad_token_id=0,
    )
    model = AutoModelForCausalLM.from_config(cfg)
    randomize_norms(model)
    folder = save("qwen3", model, BIG)
    write_reference(folder, decoder_reference(folder, DECODER_IDS))
    # The same weights as torch.save writes them (pytorch_model.bin in two
    # shards with their index, transformers 4's non-safetensors layout; 5
    # writes only safetensors): they must give the safetensors folder's logits.
    bin_dir = os.path.join(os.path.dirname(folder), "qwen3_bin")
    shutil.rmtree(bin_dir, ignore_errors=True)
    os.makedirs(bin_dir)
    shutil.copy(os.path.join(folder, "config.json"), bin_dir)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    names = sorted(state)
    half = len(names) // 2
    weight_map = {}
    for i, part in enumerate([names[:half], names[half:]]):
        shard = f"pytorch_model-0000{i + 1}-of-00002.bin"
        torch.save({k: state[k] for k in part}, os.path.join(bin_dir, shard))
        weight_map.update({k: shard for k in part})
    total = sum(t.numel() * t.element_size() for t in state.values())
    with open(os.path.join(bin_dir, "pytorch_model.bin.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)

    # Gemma 3 text: (1 + w) norms, four per layer, sqrt(hidden) embedding scale,
    # GeGLU, q/k norms, query_pre_attn_scalar != head_dim, sliding layers
    # (window 4, shorter than the 7-token inputs) alternating with full ones,
    # each type with its own rope (full: linear scaling), tied head, final
    # logit softcapping.
    torch.manual_seed(22)
    cfg = Gemma3TextConfig(
        vocab_size=144, hidden_size=32, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64, num_hidden_layers=3,
        initializer_range=0.3, query_pre_attn_scalar=24, sliding_window=4,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
        },
        final_logit_softcapping=30.0, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    model = AutoModelForCausalLM.from_config(cfg)
    randomize_norms(model)
    folder = save("gemma3", model, BIG)
    write_reference(folder, decoder_reference(folder, DECODER_IDS))

    # A multimodal `gemma3` folder: the text model under
    # `language_model.model.*`, its config under `text_config`, beside a
    # (tiny) vision tower the text model ignores; text-only references.
    torch.manual_seed(26)
    text = Gemma3TextConfig(
        vocab_size=160, hidden_size=32, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64, num_hidden_layers=2,
        initializer_range=0.3, query_pre_attn_scalar=16, sliding_window=4,
        layer_types=["sliding_attention", "full_attention"], pad_token_id=0, bos_token_id=1,
        eos_token_id=2,
    )
    vision = SiglipVisionConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        image_size=28, patch_size=14,
    )
    cfg = Gemma3Config(
        text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4,
        image_token_index=159, boi_token_index=157, eoi_token_index=158,
    )
    model = Gemma3ForConditionalGeneration(cfg)
    randomize_norms(model)
    folder = save("gemma3_mm", model, BIG)
    write_reference(folder, decoder_reference(folder, DECODER_IDS, Gemma3ForConditionalGeneration))

    # Phi-3 / Phi-4-mini: fused qkv_proj and gate_up_proj, half the head
    # rotated, longrope whose original length (4) the inputs pass (long factors).
    torch.manual_seed(23)
    cfg = Phi3Config(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, original_max_position_embeddings=4,
        num_hidden_layers=2, initializer_range=0.3, tie_word_embeddings=False, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, partial_rotary_factor=0.5,
        rope_scaling={"rope_type": "longrope", "short_factor": [1.0, 1.25], "long_factor": [1.5, 4.0]},
    )
    model = AutoModelForCausalLM.from_config(cfg)
    randomize_norms(model)
    folder = save("phi3", model, BIG)
    write_reference(folder, decoder_reference(folder, DECODER_IDS))

    # Mixtral: 4 experts, top 2, router aux loss.
    torch.manual_seed(24)
    cfg = MixtralConfig(
        vocab_size=128, hidden_size=32, intermediate_size=48, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, num_hidden_layers=2,
        num_local_experts=4, num_experts_per_tok=2, initializer_range=0.3,
        router_aux_loss_coef=0.02, tie_word_embeddings=False, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, sliding_window=None,
    )
    model = AutoModelForCausalLM.from_config(cfg)
    randomize_norms(model)
    folder = save("mixtral", model, BIG)
    ref = decoder_reference(folder, DECODER_IDS)
    ref.update(moe_reference(folder, 0, "model.layers.0.block_sparse_moe", ["w1", "w3", "w2"]))
    write_reference(folder, ref)

    # Qwen3-MoE: 8 experts, top 2, normalised top-k, a dense layer
    # (mlp_only_layers) before the sparse one; some experts get no token.
    torch.manual_seed(25)
    cfg = Qwen3MoeConfig(
        vocab_size=128, hidden_size=32, intermediate_size=48, moe_intermediate_size=24,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
        num_hidden_layers=2, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[0], initializer_range=0.3,
        router_aux_loss_coef=0.02, tie_word_embeddings=False, pad_token_id=0,
        bos_token_id=1, eos_token_id=2,
    )
    model = AutoModelForCausalLM.from_config(cfg)
    randomize_norms(model)
    folder = save("qwen3_moe", model, BIG)
    ref = decoder_reference(folder, DECODER_IDS)
    ref.update(
        moe_reference(folder, 1, "model.layers.1.mlp", ["gate_proj", "up_proj", "down_proj"])
    )
    write_reference(folder, ref)


if __name__ == "__main__":
    # `gemma2` alone writes only that fixture.
    if sys.argv[1:] == ["gemma2"]:
        gemma2()
    else:
        main()
