#!/usr/bin/env python3
"""Generates batch_sampler_shard_cases.json with the real Hugging Face Accelerate.

Run with a Python that has accelerate (1.15.0 was used) and torch installed:

    python gen_shard_cases.py > batch_sampler_shard_cases.json

Grid: dataset lengths 0..=23, batch sizes 1..=5, num_processes 1..=4, every
(split_batches, even_batches, drop_last) combination that BatchSamplerShard accepts
(split_batches needs batch_size % num_processes == 0).

Layout (kept compact so the file stays small): "cases" is a list of
    [n, batch_size, num_processes, split_batches, even_batches, drop_last, remainder, shards]
where `remainder` is the DataLoaderShard's `remainder` after a full epoch as
`Accelerator.gather_for_metrics` reads it (-1 means "unknown / don't truncate",
which Accelerate uses when drop_last is set), and `shards[p]` is
    [len(BatchSamplerShard), "batches"]
for process_index p, with batches written as "0 1,2 3" (batches split by ",",
indices by " ") — the exact `list(BatchSamplerShard(...))`.
"""

import itertools
import json
import sys

import accelerate
import torch
from accelerate.data_loader import BatchSamplerShard, prepare_data_loader
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler


def shard(n, bs, drop, np_, p, split, even):
    sampler = BatchSampler(SequentialSampler(range(n)), bs, drop)
    s = BatchSamplerShard(sampler, np_, p, split, even)
    return len(s), [list(b) for b in s]


def prepared(n, bs, drop, np_, p, split, even):
    """Batches and remainder as the prepared DataLoaderShard sees them."""
    dl = DataLoader(list(range(n)), batch_size=bs, drop_last=drop)
    dl = prepare_data_loader(
        dl,
        num_processes=np_,
        process_index=p,
        split_batches=split,
        even_batches=even,
        put_on_device=False,
    )
    batches = []
    remainders = set()
    for batch in dl:
        batches.append([int(x) for x in batch])
        remainders.add(dl.remainder)
    # `begin()` sets remainder before the first batch; it is read again after the
    # loop so the empty dataset (no batch at all) is covered too.
    remainders.add(dl.remainder)
    assert len(remainders) == 1, remainders
    return batches, remainders.pop()


def main():
    cases = []
    for n, bs, np_ in itertools.product(range(24), range(1, 6), range(1, 5)):
        for split, even, drop in itertools.product([False, True], repeat=3):
            if split and bs % np_ != 0:
                continue
            shards = []
            rems = set()
            for p in range(np_):
                length, batches = shard(n, bs, drop, np_, p, split, even)
                got, rem = prepared(n, bs, drop, np_, p, split, even)
                # With one process prepare_data_loader does not wrap the sampler at
                # all (so no padding of a short last batch), unlike a one-process
                # BatchSamplerShard; only the sharded case must agree.
                if np_ != 1:
                    assert got == batches, (n, bs, np_, p, split, even, drop, got, batches)
                rems.add(rem)
                text = ",".join(" ".join(str(i) for i in b) for b in batches)
                shards.append([length, text])
            assert len(rems) == 1
            cases.append([n, bs, np_, int(split), int(even), int(drop), rems.pop(), shards])
    out = {
        "generator": "gen_shard_cases.py",
        "accelerate": accelerate.__version__,
        "torch": torch.__version__.split("+")[0],
        "cases": cases,
    }
    # One case per line: compact, yet a regenerated file diffs readably.
    head = json.dumps({k: v for k, v in out.items() if k != "cases"}, separators=(",", ":"))
    sys.stdout.write(head[:-1] + ',"cases":[\n')
    sys.stdout.write(",\n".join(json.dumps(c, separators=(",", ":")) for c in cases))
    sys.stdout.write("\n]}\n")


if __name__ == "__main__":
    main()
