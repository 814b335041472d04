"""Writes the reference sentence embeddings that `minilm_dispatch` checks its
plain run against: all-MiniLM-L6-v2 (fetched by `scripts/fetch_minilm.sh`)
through transformers' AutoModel and AutoTokenizer, pooled as
sentence-transformers pools this model (the mean of the token states over the
attention mask, then L2 normalisation), in fp32.

Usage: python3 scripts/minilm_reference.py [DIR] [OUT]
       (DIR defaults to target/minilm, OUT to examples/data/minilm_reference.json)

Needs `pip install torch transformers`. The sentences must equal the
example's `SENTENCES` (it refuses a reference for other sentences).
"""

import json
import sys

import torch
import transformers
from transformers import AutoModel, AutoTokenizer

SENTENCES = [
    "This is an example sentence",
    "Each sentence is converted",
    "Accelerate's big-model inference runs MiniLM in pure Rust, layer by layer!",
]


def main():
    src = sys.argv[1] if len(sys.argv) > 1 else "target/minilm"
    out = sys.argv[2] if len(sys.argv) > 2 else "examples/data/minilm_reference.json"
    tok = AutoTokenizer.from_pretrained(src)
    model = AutoModel.from_pretrained(src, dtype=torch.float32).eval()
    enc = tok(SENTENCES, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**enc).last_hidden_state
    mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
    mean = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
    embeddings = torch.nn.functional.normalize(mean, p=2, dim=1)
    ref = {
        "model": "sentence-transformers/all-MiniLM-L6-v2",
        "pooling": "mean over the attention mask, then L2 normalisation",
        "sentences": SENTENCES,
        "token_ids": [tok(s)["input_ids"] for s in SENTENCES],
        "embeddings": embeddings.tolist(),
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
    }
    with open(out, "w") as f:
        json.dump(ref, f)
        f.write("\n")
    print(out)


if __name__ == "__main__":
    main()
