"""What recall's per-step ranking costs the host for a model of a real shape: the store alone (no model), filled
with keys that have the low-rank structure real keys have, and one decode step's ranking over every layer.

    python scripts/store_rank_cost.py [--shape llama-2-7b] [--stored 2048,4096,7680] [--budget 512]
                                      [--dtype float32|float16|bfloat16] [--threads 2] [--rounds 6]

float32 is the CPU's store; float16 and bfloat16 are what a CUDA model's store holds. All are ranked by
csrc/recall_step.c where it builds (H2O_CHAT_NATIVE=0: by PyTorch operators). Prints one JSON line per stored
count: min and median ms per step (every layer), the store's host MB, and the step's time beside `--step-ms` (a
GPU decode step to compare with; default 8.9, h2o 512 on an H100 at Llama-2-7B's shape).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from h2o_chat.engine.store import Store, entry_bytes, host_available
from h2o_chat.models.shapes import SHAPES


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama-2-7b", choices=sorted(SHAPES))
    parser.add_argument("--stored", default="2048,4096,7680", help="evicted tokens in the store, comma-separated")
    parser.add_argument("--budget", type=int, default=512, help="recall brings back a quarter of it per step")
    parser.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--step-ms", type=float, default=8.9)
    args = parser.parse_args()
    try:
        counts = [int(x) for x in args.stored.split(",") if x.strip()]
    except ValueError:
        sys.exit(f"store_rank_cost: --stored takes whole numbers, got {args.stored!r}")
    torch.set_num_threads(args.threads)
    shape = SHAPES[args.shape]
    L, H = shape["num_hidden_layers"], shape.get("num_key_value_heads", shape["num_attention_heads"])
    Hq, D = shape["num_attention_heads"], shape["hidden_size"] // shape["num_attention_heads"]
    dtype, recalled = getattr(torch, args.dtype), args.budget // 4
    need = max(counts) * entry_bytes(L, 1, H, D, D, dtype.itemsize, 1, None, 16)
    if need + (1 << 30) > host_available():
        sys.exit(f"store_rank_cost: a store of {max(counts)} tokens needs {need / 1e9:.1f} GB of host memory")
    gen = torch.Generator().manual_seed(0)
    rank = min(24, D)  # real keys vary along few directions: a basis per head, plus noise
    basis = torch.randn(H, rank, D, generator=gen)
    for n in counts:
        template = torch.zeros(1, H, 1, D, dtype=dtype)
        store = Store(L, template, template, [recalled], 1)
        store._grow(n)
        for c in range(0, n, 512):
            m = min(512, n - c)
            noise = 0.3 * torch.randn(L, 1, H, m, D, generator=gen)
            keys = torch.randn(L, 1, H, m, rank, generator=gen) @ basis + noise
            values = torch.randn(L, 1, H, m, D, generator=gen)
            store.append(keys.to(dtype), values.to(dtype), torch.arange(c, c + m).expand(L, 1, H, m).contiguous())
        group = Hq // H
        queries = [
            (torch.randn(H, group, rank, generator=gen) @ basis).reshape(1, Hq, 1, D).to(dtype) for _ in range(L)
        ]
        times = []
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            for i in range(L):
                store.recall(i, queries[i])
            times.append(1e3 * (time.perf_counter() - t0))
        record = {
            "shape": args.shape, "dtype": args.dtype, "threads": args.threads, "stored": n, "recalled": recalled,
            "ranking": "C" if store.ranking.use_c else "operators", "two_pass": store.ranking.two is True,
            "ms_min": round(min(times), 1), "ms_median": round(statistics.median(times), 1),
            "store_mb": round(store.nbytes() / 1e6), "x_step": round(min(times) / args.step_ms, 2),
        }  # fmt: skip
        print(json.dumps(record), flush=True)
        del store


if __name__ == "__main__":
    main()
