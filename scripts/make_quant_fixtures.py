#!/usr/bin/env python3
"""Writes tests/fixtures/quant/primitives.safetensors and primitives.json: weights and what
bitsandbytes' own quantization makes of them on the CPU, which accel-bigmodel's `quant` module must
reproduce byte for byte.

    pip install torch bitsandbytes safetensors
    python3 scripts/make_quant_fixtures.py

For every weight (dims that are and are not multiples of the blocksize 64, an odd element count,
an all-zero block, f32 and bf16) and every 4-bit setting (nf4/fp4, with and without double
quantization) the file holds `quantize_4bit`'s packed bytes and its QuantState as
`QuantState.as_dict(packed=True)` serialises it (absmax, quant_map, nested_absmax,
nested_quant_map, the `quant_state.bitsandbytes__*` JSON bytes), and the dequantized weight from
bitsandbytes' reference kernel (its torch `default` backend). Its AVX-512 CPU kernel is not used for
that: for a row shorter than the blocksize it reads every row's scale from the first row's blocks
(`absmax_dim_1 = dim_1 / blocksize` is 0 in `dequantizeBlockwise4bitCpu`, csrc/cpu_ops.cpp), so the
bf16 [64, 48] weight below dequantizes wrong there.
For LLM.int8: `int8_vectorwise_quant` at threshold 0 and 6.0 (CB, SCB, outlier columns).
Also the 8-bit dynamic map `create_dynamic_map()` that double quantization uses.
"""
import json
import os

import bitsandbytes as bnb
import bitsandbytes.functional as F
from bitsandbytes.backends.default import ops as default_ops
from bitsandbytes.backends.utils import _get_4bit_code
import torch
from safetensors.torch import save_file

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "quant")


def get_4bit_code(qt):
    return _get_4bit_code(qt, torch.device("cpu"))


def weights():
    g = torch.Generator().manual_seed(0)
    w = {
        "w_96x64": torch.randn(96, 64, generator=g) * 0.05,
        "w_33x70": torch.randn(33, 70, generator=g),  # 2310 values: 36 blocks and a partial one
        "w_7x9": torch.randn(7, 9, generator=g),  # 63 values: odd, one partial block
        "w_200x90": torch.randn(200, 90, generator=g) * 0.02,  # 282 blocks: two nested blocks
        "w_bf16_64x48": (torch.randn(64, 48, generator=g) * 0.1).to(torch.bfloat16),
    }
    z = torch.randn(8, 32, generator=g)
    z[:2] = 0.0  # a whole block of zeros: absmax 0
    z[3, 5] = 0.7399  # values on and near the codes' midpoints after scaling
    w["w_zero_8x32"] = z
    return w


def main():
    os.makedirs(OUT, exist_ok=True)
    tensors, meta = {}, {"bitsandbytes": bnb.__version__, "torch": torch.__version__, "cases": []}
    tensors["dynamic_map"] = F.create_dynamic_map()
    for name, w in weights().items():
        tensors[name] = w.contiguous()
        for qt in ("nf4", "fp4"):
            for dq in (False, True):
                key = f"{name}.{qt}.{'dq' if dq else 'plain'}"
                packed, state = F.quantize_4bit(w, blocksize=64, quant_type=qt, compress_statistics=dq)
                tensors[f"{key}.weight"] = packed.contiguous()
                for k, v in state.as_dict(packed=True).items():
                    tensors[f"{key}.weight.{k}"] = v.contiguous()
                if w.numel() <= 4096 or key.endswith("nf4.dq"):
                    absmax = state.absmax
                    if dq:
                        absmax = F.dequantize_blockwise(state.absmax, state.state2) + state.offset
                    tensors[f"{key}.dequantized"] = default_ops._dequantize_4bit_compute(
                        packed.reshape(-1), absmax, get_4bit_code(qt), 64, w.shape, w.dtype
                    ).contiguous()
                meta["cases"].append(key)
    g = torch.Generator().manual_seed(1)
    a = torch.randn(24, 40, generator=g)
    a[3, 7], a[10, 7], a[5, 31] = 9.5, -7.0, 6.0  # outliers in columns 7 and 31 (6.0 counts: >=)
    tensors["int8_in"] = a
    for threshold in (0.0, 6.0):
        cb, scb, cols = F.int8_vectorwise_quant(a.clone(), threshold=threshold)
        tag = f"int8.t{threshold:g}"
        tensors[f"{tag}.CB"] = cb.view(torch.uint8).contiguous()  # candle has no int8: the bits as u8
        tensors[f"{tag}.SCB"] = scb.contiguous()
        if cols is not None:
            tensors[f"{tag}.outlier_cols"] = cols.contiguous()
        tensors[f"{tag}.dequantized"] = F.int8_vectorwise_dequant(cb, scb).contiguous()
    save_file(tensors, os.path.join(OUT, "primitives.safetensors"))
    with open(os.path.join(OUT, "primitives.json"), "w") as f:
        json.dump(meta, f, indent=1)
    print(len(tensors), "tensors")


if __name__ == "__main__":
    main()
