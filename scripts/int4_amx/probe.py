#!/usr/bin/env python
"""Our 4-bit kernels (h2o_chat/models/native: chunks' int4_mm, steps' int4_mv; AMX's or AVX2's build)
against PyTorch's CPU kernel, by rows.

    python scripts/int4_amx/probe.py [--threads 2] [--rows 1,2,4,8,16,48,512]

Builds the kernel as h2o-chat does (into a temporary folder), checks it as h2o-chat does before first use (the
CPU, the packed layout, one product), then for each of the embedded model's linear shapes and each row count prints
the three kernels' best time of five (microseconds, weights in cache), their largest difference from the float32
product of the dequantized weights, and whether a row's result is the same alone as in the batch (both of ours).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

from h2o_chat.models import native
from h2o_chat.models.cpu_quant import GROUP, Int4Linear, _int4_mm

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # the embedded model's joined q/k/v, o, gate/up, down


def load_kernels(folder: Path):
    """The kernels built into `folder` (chunks', steps'), loaded and checked; exits with the reason where they
    cannot run here."""
    why = native.unsupported()
    if why is not None:
        raise SystemExit(f"the kernels cannot run here: {why}")
    ops = native.load(native.build(folder / native.library_name()))
    why = native.check(ops[0]) or native.check(ops[1])
    if why is not None:
        raise SystemExit(f"the kernels must not be used here: {why}")
    return ops


def best(fn, calls: int) -> float:
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls)
    return min(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", default="1,2,4,8,16,48,512")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        ours, steps = load_kernels(Path(tmp))
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next((line.split(":", 1)[1].strip() for line in flags.splitlines() if line.startswith("model name")), "?")
    print(f"{model}, {args.threads} threads, torch {torch.__version__}\n", file=sys.stderr)
    print("| N x K | rows | PyTorch us | int4_mm us | int4_mv us | max error PyTorch / mm / mv | alone = in batch |")
    print("|---|---:|---:|---:|---:|---|---|")
    generator = torch.Generator().manual_seed(0)
    for N, K in SHAPES:
        lin = Int4Linear.from_float(torch.randn(N, K, generator=generator) * 0.05)
        exact = lin.dequantize()
        for M in (int(r) for r in args.rows.split(",")):
            x = torch.randn(M, K, generator=generator).to(torch.bfloat16)
            theirs, mine = _int4_mm(x, lin.packed, lin.scales_zeros), ours(x, lin.packed, GROUP, lin.scales_zeros)
            ref = x.float() @ exact.t()
            alone = ours(x[-1:].contiguous(), lin.packed, GROUP, lin.scales_zeros)
            calls = 200 if M < 100 else 20
            t_theirs = best(lambda x=x, w=lin: _int4_mm(x, w.packed, w.scales_zeros), calls)
            t_ours = best(lambda x=x, w=lin: ours(x, w.packed, GROUP, w.scales_zeros), calls)
            results, same, t_step = [theirs, mine], torch.equal(alone, mine[-1:]), "-"
            step = steps(x, lin.packed, GROUP, lin.scales_zeros)
            step_alone = steps(x[-1:].contiguous(), lin.packed, GROUP, lin.scales_zeros)
            t_step = f"{best(lambda x=x, w=lin: steps(x, w.packed, GROUP, w.scales_zeros), calls):.0f}"
            results.append(step)
            same = same and torch.equal(step_alone, step[-1:])
            err = " / ".join(f"{(y.float() - ref).abs().max():.3g}" for y in results)
            print(f"| {N} x {K} | {M} | {t_theirs:.0f} | {t_ours:.0f} | {t_step} | {err} | {same} |")


if __name__ == "__main__":
    main()
