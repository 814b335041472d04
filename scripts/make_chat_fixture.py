"""Writes tests/fixtures/chat/: a chat tokenizer and template, and what transformers makes of them.

The tokenizer is the Llama fixture's (tests/fixtures/hf/llama/tokenizer.json) with ChatML's two special
tokens added; the template is ChatML with `{% generation %}` around the assistant turns, as templates
that support `return_assistant_tokens_mask` mark them. reference.json holds, per conversation,
transformers' `apply_chat_template` text, token ids and assistant mask (with and without a generation
prompt). accel-core's chat tests (accel-core/src/data/chat_tests.rs) compare against it.

Usage: python3 scripts/make_chat_fixture.py   (needs transformers)
"""
import json
import os
import shutil

from transformers import AutoTokenizer

ROOT = os.path.join(os.path.dirname(__file__), "..")
SRC = os.path.join(ROOT, "tests/fixtures/hf/llama")
OUT = os.path.join(ROOT, "tests/fixtures/chat")

TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- generation %}{{- message['content'] | trim + '<|im_end|>' }}{%- endgeneration %}"
    "{{- '\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] | trim + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

CONVERSATIONS = [
    [
        {"role": "user", "content": "the quick brown fox"},
        {"role": "assistant", "content": "jumps over the lazy dog"},
    ],
    [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "the quick"},
        {"role": "assistant", "content": " brown fox "},
        {"role": "user", "content": "and then?"},
        {"role": "assistant", "content": "the lazy dog"},
    ],
    # A prompt alone, as `generate --chat` renders it.
    [{"role": "user", "content": "the quick brown fox"}],
]


def main():
    os.makedirs(OUT, exist_ok=True)
    shutil.copy(os.path.join(SRC, "tokenizer.json"), os.path.join(OUT, "tokenizer.json"))
    tok = AutoTokenizer.from_pretrained(OUT)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.bos_token = "<|im_start|>"
    tok.eos_token = "<|im_end|>"
    tok.chat_template = TEMPLATE
    tok.save_pretrained(OUT)
    tok = AutoTokenizer.from_pretrained(OUT)
    cases = []
    for messages in CONVERSATIONS:
        for prompt in (False, True):
            text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)
            out = tok.apply_chat_template(
                messages,
                tokenize=True,
                return_dict=True,
                add_generation_prompt=prompt,
                return_assistant_tokens_mask=True,
            )
            cases.append({
                "messages": messages,
                "add_generation_prompt": prompt,
                "text": text,
                "input_ids": out["input_ids"],
                "assistant_masks": out["assistant_masks"],
            })
    with open(os.path.join(OUT, "reference.json"), "w") as f:
        json.dump({"cases": cases}, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
