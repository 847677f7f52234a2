#!/usr/bin/env python
"""The AMX 4-bit product (`int4_amx.cpp`, an experiment) against PyTorch's CPU kernel, by rows.

    python scripts/int4_amx/probe.py [--threads 2] [--rows 1,2,4,8,16,48,512]

Builds the kernel with the system's C++ compiler against the installed torch (into a temporary folder), checks
that this CPU has AMX and that this build of PyTorch packs 4-bit weights in the layout the kernel reads, then for
each of the embedded model's linear shapes and each row count prints both kernels' best time of five (microseconds),
their largest difference from the float32 product of the dequantized weights, and whether a row's result is the
same alone as in the batch. Why it is not used by h2o-chat: docs/experiments.md ("An AMX kernel for 4-bit products").
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from h2o_chat.models.cpu_quant import GROUP, Int4Linear, _int4_mm

SOURCE = Path(__file__).with_name("int4_amx.cpp")
FLAGS = ("avx512f", "avx512bw", "avx512_bf16", "amx_tile", "amx_bf16")
SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # the embedded model's joined q/k/v, o, gate/up, down


def build(folder: Path) -> Path:
    from torch.utils import cpp_extension

    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        raise SystemExit("no C++ compiler (c++ or g++) was found")
    out = folder / "int4_amx.so"
    lib = cpp_extension.library_paths()[0]
    command = [cxx, "-O3", "-std=c++20", "-fPIC", "-shared", "-fopenmp", "-w",
               f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
               "-mavx512f", "-mavx512bw", "-mavx512bf16", "-mamx-tile", "-mamx-bf16",
               *[a for p in cpp_extension.include_paths() for a in ("-isystem", p)],
               str(SOURCE), "-o", str(out), f"-L{lib}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{lib}"]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"the compiler failed: {done.stderr.strip().splitlines()[-1:]}")
    return out


def layout_matches() -> bool:
    """This build of PyTorch packs blocks of 64 output channels, channel j low and j + 32 high in byte j."""
    N, K = 128, 64
    q = ((torch.arange(N)[:, None] * 7 + torch.arange(K)[None, :] * 3) % 16).to(torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.contiguous(), 1).view(N // 64, K, 32)
    blocks = q.view(N // 64, 64, K)
    return torch.equal(packed.int(), (blocks[:, :32] | (blocks[:, 32:] << 4)).transpose(1, 2))


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
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    missing = [f for f in FLAGS if f" {f}" not in flags]
    if missing:
        raise SystemExit(f"this CPU lacks {', '.join(missing)}")
    if not layout_matches():
        raise SystemExit("this build of PyTorch packs 4-bit weights in another layout than the kernel reads")
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        torch.ops.load_library(str(build(Path(tmp))))
    ours = torch.ops.h2o_probe.int4_mm
    model = next((line.split(":", 1)[1].strip() for line in flags.splitlines() if line.startswith("model name")), "?")
    print(f"{model}, {args.threads} threads, torch {torch.__version__}\n", file=sys.stderr)
    print("| N x K | rows | PyTorch us | AMX us | AMX / PyTorch | max error PyTorch / AMX | row alone = in batch |")
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
            err = f"{(theirs.float() - ref).abs().max():.3g} / {(mine.float() - ref).abs().max():.3g}"
            print(f"| {N} x {K} | {M} | {t_theirs:.0f} | {t_ours:.0f} | {t_ours / t_theirs:.2f}x | {err} | "
                  f"{torch.equal(alone, mine[-1:])} |")  # fmt: skip


if __name__ == "__main__":
    main()
