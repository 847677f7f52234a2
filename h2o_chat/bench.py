"""Speed and memory measurements: decode ms/token and KV bytes as the context grows, side by side.

Each configuration prefills one text once, pausing at every measurement point (512, 2k, 4k, 8k tokens seen)
to time a few greedy decode steps (median of per-token times, after warm-up). Configurations:

- dynamic: transformers' DynamicCache with SDPA (the baseline users have without h2o-chat)
- full: h2o-chat's cache without eviction
- h2o: the paper's policy at the given budget
- h2o-nobound: h2o with a budget above the longest length (nothing evicted: the cost of scoring itself)

Ratios are computed from figures taken in the same run, never compared across runs.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from importlib import resources

import torch
from transformers import DynamicCache

from h2o_chat.cache import H2OCache
from h2o_chat.policies import make_policy

CONFIGS = ("dynamic", "full", "h2o", "h2o-nobound")


@dataclass(frozen=True)
class BenchRecord:
    config: str
    policy: str
    budget: int | None
    seen: int
    ms_per_token: float
    kv_bytes: int
    batch: int = 1
    device: str = "cpu"
    dtype: str = "float32"
    measured_at: int = 0  # the length whose interleaved rounds this figure comes from


def corpus_ids(tokenizer, n: int, name: str = "alice.txt") -> torch.Tensor:
    """n tokens of a shipped public-domain text (repeated if needed), (1, n)."""
    text = resources.files("h2o_chat").joinpath("data", name).read_text(encoding="utf-8")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    while len(ids) < n:
        ids = ids + ids
    return torch.tensor([ids[:n]])


@contextlib.contextmanager
def attention(model, implementation: str) -> Iterator[None]:
    """Temporarily switch the model's attention implementation."""
    before = model.config._attn_implementation
    model.set_attn_implementation(implementation)
    try:
        yield
    finally:
        model.set_attn_implementation(before)


def kv_bytes(cache) -> int:
    if isinstance(cache, H2OCache):
        return cache.stats().kv_bytes
    return sum(
        t.numel() * t.element_size()
        for layer in cache.layers
        if layer.is_initialized
        for t in (layer.keys, layer.values)
    )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_cache(config: str, model, budget: int, longest: int) -> tuple[object, str, str, int | None]:
    """-> (cache, attention implementation, policy name, budget)"""
    if config == "dynamic":
        return DynamicCache(config=model.config), "sdpa", "full", None
    if config == "full":
        return H2OCache.for_model(model, make_policy("full")), "h2o", "full", None
    if config == "h2o":
        return H2OCache.for_model(model, make_policy("h2o", budget)), "h2o", "h2o", budget
    if config == "h2o-nobound":
        bound = longest + 1024
        return H2OCache.for_model(model, make_policy("h2o", bound)), "h2o", "h2o", bound
    raise ValueError(f"unknown bench config {config!r}; choose from {', '.join(CONFIGS)}")


class _Run:
    """One configuration: its cache, attention implementation and how far it has read."""

    def __init__(self, config: str, model, budget: int, longest: int):
        self.config = config
        self.cache, self.impl, self.policy, self.budget = make_cache(config, model, budget, longest)
        self.fed = 0  # tokens seen
        self.token: torch.Tensor | None = None
        self.times: list[float] = []


@torch.inference_mode()
def run_decode_bench(
    model,
    tokenizer,
    lengths: list[int],
    budget: int = 512,
    configs: tuple[str, ...] = CONFIGS,
    steps: int = 24,
    rounds: int = 6,
    batch: int = 1,
    chunk: int = 512,
    progress: Callable[[str], None] | None = None,
) -> list[BenchRecord]:
    """Bring every configuration to each length, then time greedy decode steps in interleaved rounds
    (config A, B, C, A, B, C, ...) so that drift on a noisy machine hits all of them alike."""
    device = next(model.parameters()).device
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    longest = max(lengths)
    ids = corpus_ids(tokenizer, longest + 2 * steps + 64).to(device).expand(batch, -1).contiguous()
    runs = [_Run(c, model, budget, longest) for c in configs]
    if "h2o" in configs:  # a twin parked at the first length, timed beside every later one
        runs.append(_Run("h2o", model, budget, longest))
        runs[-1].config = "h2o@first"
    per_round = max(1, steps // rounds)

    def forward(run: _Run, x: torch.Tensor) -> torch.Tensor:
        out = model(input_ids=x, past_key_values=run.cache, use_cache=True, logits_to_keep=1).logits[:, -1]
        run.fed += x.shape[1]
        return out.argmax(-1, keepdim=True)

    records = []
    for length in sorted(lengths):
        for run in runs:
            with attention(model, run.impl):
                while run.fed < length and not (run.config == "h2o@first" and run.fed):
                    run.token = forward(run, ids[:, run.fed : min(length, run.fed + chunk)])
            run.times = []
        for r in range(rounds + 1):  # round 0 warms up
            for run in runs:
                with attention(model, run.impl):
                    for _ in range(per_round):
                        _sync(device)
                        t = time.perf_counter()
                        run.token = forward(run, run.token)
                        _sync(device)
                        if r:
                            run.times.append(time.perf_counter() - t)
        for run in runs:
            ms = 1000 * statistics.median(run.times)
            seen = min(lengths) if run.config == "h2o@first" else length
            rec = BenchRecord(
                run.config,
                run.policy,
                run.budget,
                seen,
                round(ms, 2),
                kv_bytes(run.cache),
                batch,
                device.type,
                dtype,
                measured_at=length,
            )
            records.append(rec)
            if progress:
                progress(f"{run.config:>12} at {seen:>6} seen: {ms:7.1f} ms/token (rounds of {length})")
    return records


def ratios(records: list[BenchRecord], budget: int) -> list[tuple[str, float, str]]:
    """The targets, as (description, value, target), each from figures timed in the same rounds."""
    at = {(r.config, r.measured_at): r.ms_per_token for r in records}
    lengths = sorted({r.measured_at for r in records})
    lo, hi = lengths[0], lengths[-1]
    out = []
    if ("h2o", hi) in at and ("h2o@first", hi) in at:
        out.append(
            (f"h2o {budget}: ms/token at {hi} seen / at {lo} seen", at["h2o", hi] / at["h2o@first", hi], "<= 1.10")
        )
    for base in ("dynamic", "full"):
        if (base, hi) in at and ("h2o", hi) in at:
            out.append((f"{base} / h2o {budget}: ms/token at {hi} seen", at[base, hi] / at["h2o", hi], ">= 5"))
    if all(("h2o-nobound", n) in at and ("dynamic", n) in at for n in lengths):
        worst = max(at["h2o-nobound", n] / at["dynamic", n] for n in lengths)
        out.append(("h2o with budget >= length / dynamic: worst over lengths", worst, "<= 1.10"))
    return out


def as_json_lines(records: list[BenchRecord]) -> str:
    import json

    return "\n".join(json.dumps(asdict(r)) for r in records)
