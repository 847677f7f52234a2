"""Kernels (CUDA) or operators (CPU) one decode step and one prompt chunk launch, per layer and in all.

    python scripts/kernel_count.py [--shape llama-2-7b] [--device cuda] [--seen 1024] [--budget 512] [--chunk 512]

Builds the shape's model twice with random weights, with 2 and 4 layers, so that what one layer adds
(`per layer`) is told apart from what the step does once (embedding, head, sampling, the host's bookkeeping
on the device). For each configuration it reads `--seen` tokens (more than the budget: eviction runs) and
counts, under the profiler, the device kernels (CUDA: what a captured step's graph holds as nodes, memory
copies and sets included) or the ATen operators (CPU, dispatched leaves) of one eager decode step and of one
prompt chunk. A `-compiled` configuration (CUDA) counts the kernels of the step compiled by inductor, run once
outside its graph after the graph is captured. One JSON line per configuration, then a table.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from h2o_chat.engine.cache import H2OCache
from h2o_chat.engine.policies import make_policy
from h2o_chat.engine.step.attention import prepare_model
from h2o_chat.engine.step.decode import Engine, sync
from h2o_chat.measure.bench import storage_of
from h2o_chat.measure.prefill import OperatorCount
from h2o_chat.models import native  # noqa: F401 (a CPU step's attention through our library, as a loaded model's)
from h2o_chat.models.shapes import SHAPES


def count(fn, device: torch.device) -> int:
    sync(device)
    if device.type != "cuda":
        with OperatorCount() as ops:
            fn()
        return ops.total
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        sync(device)
    kinds = ("kernel", "gpu_memcpy", "gpu_memset")
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return (
        sum(1 for e in events if getattr(e, "kind", None) in kinds)
        if any(hasattr(e, "kind") for e in events)
        else len(events)
    )


def model_of(shape: str, layers: int, device: torch.device, dtype: torch.dtype):
    from transformers import AutoConfig, AutoModelForCausalLM

    params = dict(SHAPES[shape])
    params["num_hidden_layers"] = layers
    config = AutoConfig.for_model(params.pop("model_type"), **params)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa").eval()
    return prepare_model(model)


@torch.inference_mode()
def measure(model, config: str, seen: int, budget: int, chunk: int, device: torch.device) -> tuple[int, int]:
    name, quant = storage_of(config)
    policy = make_policy("full") if name == "full" else make_policy(name, budget)
    cache = H2OCache.for_model(model, policy, "absolute", kv_quant=quant)
    cache.reserve(seen + chunk + 16)
    compiled = config.endswith("-compiled")  # the GPU's compiled step (inductor's kernels), as its graph holds it
    engine = Engine(model, cache, "compile" if compiled else "eager")
    vocab = model.config.get_text_config().vocab_size
    ids = torch.randint(3, vocab, (1, seen + chunk), generator=torch.Generator().manual_seed(0)).to(device)
    model.set_attn_implementation("h2o")
    token = engine.first_tokens(engine.prefill(ids[:, :seen], chunk_size=chunk))
    for _ in range(3):  # warm: the first steps allocate what later ones reuse
        token = engine.decode(token)[1]
    if compiled:  # once the program is made and captured: its kernels launched outside the graph, one step

        def one():
            engine.cache.before_forward(1)
            engine._body()

        step = count(one, device)
    else:
        step = count(lambda: engine.decode(), device)
    prompt = count(lambda: engine.prefill(ids[:, seen:], chunk_size=chunk), device)
    return step, prompt


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="llama-2-7b")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seen", type=int, default=1024)
    p.add_argument("--budget", type=int, default=512)
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--configs", default="full,h2o,snap,recall,h2o-8bit")
    a = p.parse_args()
    device = torch.device(a.device)
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    configs = a.configs.split(",")
    counts: dict[int, dict[str, tuple[int, int]]] = {}
    for layers in (2, 4):
        model = model_of(a.shape, layers, device, dtype)
        counts[layers] = {c: measure(model, c, a.seen, a.budget, a.chunk, device) for c in configs}
        del model
    what = "kernels" if device.type == "cuda" else "operators"
    layers = SHAPES[a.shape]["num_hidden_layers"]
    rows = []
    for c in configs:
        (s2, p2), (s4, p4) = counts[2][c], counts[4][c]
        row = {
            "config": c, "device": device.type, "shape": a.shape, "seen": a.seen, "budget": a.budget,
            "chunk": a.chunk, "what": what,
            "step_per_layer": (s4 - s2) / 2, "step_once": s2 - (s4 - s2),
            "step_all_layers": s2 + (s4 - s2) / 2 * (layers - 2),
            "chunk_per_layer": (p4 - p2) / 2, "chunk_once": p2 - (p4 - p2),
        }  # fmt: skip
        rows.append(row)
        print(json.dumps(row))
    print(
        f"\n{what} per decode step and per prompt chunk of {a.chunk} ({a.shape}, {a.seen} seen, budget {a.budget})",
        file=sys.stderr,
    )
    print(
        f"{'config':<10} {'step/layer':>10} {'step once':>9} {'step all':>9} {'chunk/layer':>11} {'chunk once':>10}",
        file=sys.stderr,
    )
    for r in rows:
        print(
            f"{r['config']:<10} {r['step_per_layer']:>10.0f} {r['step_once']:>9.0f} {r['step_all_layers']:>9.0f} "
            f"{r['chunk_per_layer']:>11.0f} {r['chunk_once']:>10.0f}",
            file=sys.stderr,
        )


if __name__ == "__main__":
    main()
