#!/usr/bin/env python3
"""PyTorch's gloo collectives on loopback, measured as bench_allreduce measures
accel-dist's: the same sizes, ops and iteration counts; each timed iteration
starts after a barrier and counts the slowest rank's time. Prints one JSON
object (rank 0). bench_allreduce runs this in the same run when torch imports.

    python3 scripts/bench_gloo.py --world-size 2 --sizes 4096,1048576,67108864
"""

import argparse
import json
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

DEFAULT_SIZES = [4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20, 256 << 20]


def iterations(nbytes):
    """bench_allreduce's iteration counts per size."""
    if nbytes <= 65_536:
        return 200
    if nbytes <= 1_048_576:
        return 50
    if nbytes <= 16_777_216:
        return 20
    if nbytes <= 67_108_864:
        return 10
    return 5


def run_rank(rank, args, port, queue):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    # One intra-op thread per rank, as each accel-dist rank computes on one thread.
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=args.world_size)
    n = args.world_size
    results = []
    for op in args.ops:
        for nbytes in args.sizes:
            elems = nbytes // 4
            iters = args.iters or iterations(elems * 4)
            buf = torch.ones(elems, dtype=torch.float32)
            inp = torch.ones(elems // n, dtype=torch.float32)
            out = [torch.empty(elems // n, dtype=torch.float32) for _ in range(n)]

            def call():
                if op == "all_reduce":
                    dist.all_reduce(buf)
                elif op == "all_gather":
                    dist.all_gather(out, inp)
                else:
                    dist.broadcast(buf, 0)

            for _ in range(2):
                call()
            times = []
            for _ in range(iters):
                dist.barrier()
                start = time.perf_counter()
                call()
                times.append(time.perf_counter() - start)
            slowest = torch.tensor(times, dtype=torch.float64)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            t = slowest.tolist()
            results.append(
                {
                    "op": op,
                    "bytes": elems * 4,
                    "iters": iters,
                    "median_ms": round(sorted(t)[len(t) // 2] * 1e3, 3),
                    "min_ms": round(min(t) * 1e3, 3),
                    "mean_ms": round(statistics.fmean(t) * 1e3, 3),
                }
            )
    if rank == 0:
        queue.put(results)
    dist.barrier()
    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], default=DEFAULT_SIZES)
    p.add_argument(
        "--ops",
        type=lambda s: s.split(","),
        default=["all_reduce", "all_gather", "broadcast"],
    )
    p.add_argument("--iters", type=int, default=None)
    args = p.parse_args()
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=run_rank, args=(r, args, port, queue)) for r in range(args.world_size)]
    for proc in procs:
        proc.start()
    results = queue.get()
    for r, proc in enumerate(procs):
        proc.join()
        if proc.exitcode != 0:
            raise SystemExit(f"bench_gloo: rank {r} failed with exit code {proc.exitcode}")
    print(
        json.dumps(
            {
                "bench": "bench_gloo",
                "backend": "gloo",
                "torch": torch.__version__,
                "world_size": args.world_size,
                "dtype": "f32",
                "results": results,
            }
        )
    )


if __name__ == "__main__":
    main()
