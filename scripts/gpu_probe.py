"""The GPU's decode and prompt rows without the CLI: a random model of a real shape built in GPU memory (no 13 GB
folder written and read back), then `run_decode_bench` or `run_prefill_bench` over it. What a short device session
runs where `scripts/gpu_check.sh` would take too long.

    python scripts/gpu_probe.py decode static-compiled,h2o,h2o-compiled 4096,16384
    CHUNKS=512,1024 python scripts/gpu_probe.py prefill transformers,full,h2o,snap

SHAPE (llama-2-7b), LAYERS (32), DEV (cuda), PROMPT (4,096 tokens) and CHUNKS change what it builds and reads;
`DEV=cpu SHAPE=llama-tiny LAYERS=2` tries it on a CPU.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from kernel_count import model_of  # noqa: E402

from h2o_chat.measure.bench import run_decode_bench  # noqa: E402
from h2o_chat.measure.prefill import run_prefill_bench  # noqa: E402


def main() -> None:
    what, configs = sys.argv[1], tuple(sys.argv[2].split(","))
    device = torch.device(os.environ.get("DEV", "cuda"))
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    t = time.time()
    model = model_of(os.environ.get("SHAPE", "llama-2-7b"), int(os.environ.get("LAYERS", 32)), device, dtype)
    print(f"model built in {time.time() - t:.1f} s", flush=True)
    if what == "decode":
        lengths = [int(x) for x in sys.argv[3].split(",")]
        records = run_decode_bench(
            model, None, lengths, budget=512, configs=configs, steps=24, status=lambda s: print(s, flush=True)
        )
        for r in records:
            print(json.dumps(asdict(r)), flush=True)
        return
    vocab = model.config.vocab_size
    ids = torch.randint(3, vocab, (1, int(os.environ.get("PROMPT", 4096))), generator=torch.Generator().manual_seed(0))
    for chunk in [int(c) for c in os.environ.get("CHUNKS", "512,1024,2048,4096").split(",")]:
        for r in run_prefill_bench(model, ids, 512, chunk, configs, rounds=2, count_ops=False):
            print(
                f"chunk {chunk}: {r.config} {r.seconds:.3f} s, {r.tokens_per_second:,.0f} tok/s, "
                f"+{r.extra_peak_bytes / 1e9:.2f} GB",
                flush=True,
            )


if __name__ == "__main__":
    main()
