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
    peak_bytes: int = 0  # peak GPU memory while this configuration ran (CUDA only)


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
    status: Callable[[str], None] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> list[BenchRecord]:
    """Decode ms/token per configuration at each length. On CPU every configuration is brought to each length
    and timed in interleaved rounds (A, B, C, A, B, C, ...) so that drift on a noisy machine hits all alike,
    with an h2o twin parked at the first length for the flatness ratio. On CUDA (steady clocks) configurations
    run one after another, each with its own peak memory. `tokenizer=None` feeds random ids (random models)."""
    device = next(model.parameters()).device
    longest = max(lengths)
    n = longest + 2 * steps + 64
    if tokenizer is None:
        vocab = model.config.get_text_config().vocab_size
        ids = torch.randint(3, vocab, (1, n), generator=torch.Generator().manual_seed(0))
    else:
        ids = corpus_ids(tokenizer, n)
    ids = ids.to(device).expand(batch, -1).contiguous()
    measure = _Measure(model, ids, lengths, steps, rounds, chunk, status, progress)
    twin = ("h2o@first",) if device.type != "cuda" and "h2o" in configs else ()
    measure.total = sum(measure.tokens(c) for c in (*configs, *twin))
    if device.type != "cuda":
        runs = [_Run(c, model, budget, longest) for c in configs]
        if "h2o" in configs:
            runs.append(_Run("h2o", model, budget, longest))
            runs[-1].config = "h2o@first"
        return measure(runs)
    records = []
    for config in configs:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        records += measure([_Run(config, model, budget, longest)])
    return records


class _Measure:
    """Brings runs to each length and times greedy decode steps in rounds over them."""

    def __init__(self, model, ids, lengths, steps, rounds, chunk, status, progress=None):
        self.model, self.ids, self.lengths = model, ids, sorted(lengths)
        self.rounds, self.per_round, self.chunk, self.status = rounds, max(1, steps // rounds), chunk, status
        self.progress, self.done, self.total = progress, 0, 0  # tokens fed, over every run
        self.device = ids.device
        self.dtype = str(next(model.parameters()).dtype).removeprefix("torch.")

    def tokens(self, config: str) -> int:
        """Tokens one run will feed: the loops of __call__, counted ahead (for a progress total)."""
        fed = 0
        for length in self.lengths:
            while fed < length and not (config == "h2o@first" and fed):
                fed = min(length, fed + self.chunk)
            fed += (self.rounds + 1) * self.per_round
        return fed

    def forward(self, run: _Run, x: torch.Tensor) -> torch.Tensor:
        out = self.model(input_ids=x, past_key_values=run.cache, use_cache=True, logits_to_keep=1).logits[:, -1]
        run.fed += x.shape[1]
        self.done += x.shape[1]
        if self.progress is not None:
            self.progress(self.done, self.total)
        return out.argmax(-1, keepdim=True)

    def __call__(self, runs: list[_Run]) -> list[BenchRecord]:
        records = []
        for length in self.lengths:
            for run in runs:
                with attention(self.model, run.impl):
                    while run.fed < length and not (run.config == "h2o@first" and run.fed):
                        run.token = self.forward(run, self.ids[:, run.fed : min(length, run.fed + self.chunk)])
                run.times = []
            for r in range(self.rounds + 1):  # round 0 warms up
                for run in runs:
                    with attention(self.model, run.impl):
                        for _ in range(self.per_round):
                            _sync(self.device)
                            t = time.perf_counter()
                            run.token = self.forward(run, run.token)
                            _sync(self.device)
                            if r:
                                run.times.append(time.perf_counter() - t)
            for run in runs:
                records.append(self.record(run, length))
        return records

    def record(self, run: _Run, length: int) -> BenchRecord:
        ms = 1000 * statistics.median(run.times)
        seen = self.lengths[0] if run.config == "h2o@first" else length
        peak = torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else 0
        if self.status:
            self.status(f"{run.config:>12} at {seen:>6} seen: {ms:7.1f} ms/token (rounds of {length})")
        return BenchRecord(
            run.config,
            run.policy,
            run.budget,
            seen,
            round(ms, 2),
            kv_bytes(run.cache),
            self.ids.shape[0],
            self.device.type,
            self.dtype,
            measured_at=length,
            peak_bytes=peak,
        )


def ratios(records: list[BenchRecord], budget: int) -> list[tuple[str, float, str]]:
    """The targets, as (description, value, target), each from figures timed in the same rounds."""
    at = {(r.config, r.measured_at): r.ms_per_token for r in records}
    lengths = sorted({r.measured_at for r in records})
    lo, hi = lengths[0], lengths[-1]
    out = []
    first = ("h2o@first", hi) if ("h2o@first", hi) in at else ("h2o", lo)  # the twin when interleaved
    if ("h2o", hi) in at and first in at and hi != lo:
        out.append((f"h2o {budget}: ms/token at {hi} seen / at {lo} seen", at["h2o", hi] / at[first], "<= 1.10"))
    kv = {(r.config, r.measured_at): r.kv_bytes for r in records}
    for base in ("dynamic", "full"):
        if (base, hi) in at and ("h2o", hi) in at:
            out.append((f"{base} / h2o {budget}: ms/token at {hi} seen", at[base, hi] / at["h2o", hi], ">= 5"))
            out.append((f"{base} / h2o {budget}: KV bytes at {hi} seen", kv[base, hi] / kv["h2o", hi], ">= 8"))
    if all(("h2o-nobound", n) in at and ("dynamic", n) in at for n in lengths):
        worst = max(at["h2o-nobound", n] / at["dynamic", n] for n in lengths)
        out.append(("h2o with budget >= length / dynamic: worst over lengths", worst, "<= 1.10"))
    return out


def as_json_lines(records: list[BenchRecord]) -> str:
    import json

    return "\n".join(json.dumps(asdict(r)) for r in records)
