"""The paper's metric: generation throughput at a fixed memory limit.

At a fixed memory limit, a full cache must hold prompt + generated tokens for every row, so few rows fit;
H2O holds `budget` tokens per row, so the batch can be much larger and tokens/s over the batch grows. The
batch for each configuration is the largest whose weights + KV cache (+ slack) fit the limit, as the
`memory.Footprint` estimate says; the run then reports the peak memory it really used: on CUDA
`max_memory_allocated`, on CPU the weights plus the largest sum of live allocations the profiler tracks while the
cache is allocated, the prompt read and the warm-up steps run (untimed: the profiler slows what it watches; the
timed steps repeat the warm-up's shapes). Both configurations decode through the same engine, one after the other,
the first's storage freed before the second allocates. (Random-weight models of real shapes:
`h2o_chat.models.shapes`.)
"""

from __future__ import annotations

import functools
import gc
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from h2o_chat.engine.cache import H2OCache
from h2o_chat.engine.policies import make_policy
from h2o_chat.engine.step.decode import Engine, sync
from h2o_chat.measure.prefill import cpu_peak_bytes
from h2o_chat.models.memory import OVERHEAD, ModelShape, decode_bytes, footprint, largest, prefill_bytes


@dataclass(frozen=True)
class ThroughputRecord:
    config: str
    budget: int | None
    batch: int
    prompt_tokens: int
    generated_tokens: int
    tokens_per_second: float
    kv_bytes: int
    peak_bytes: int
    memory_limit: int
    device: str
    decode: str = "eager"  # how decode steps ran (the same engine for both configurations)
    setup_seconds: float = 0.0  # graph capture or compilation, not counted in tokens_per_second
    held_before: int = 0  # (CUDA) bytes allocated when this configuration started: the weights alone, if freed
    prefill_peak: int = 0  # (CUDA) the peak while the cache was allocated and the prompt read, before decoding


def largest_batch(
    shape: ModelShape, elem: int, weight_bytes: int, capacity: int, limit: int, chunk: int
) -> tuple[int, int]:
    """The most rows whose cache, prompt reading (every transient of a prefill chunk) and decode steps fit beside
    the weights under `limit` (with the allocator's slack), and the prefill chunk that allows it: a smaller
    chunk (down to 64) when its transients would cost rows."""

    def rows_for(size: int) -> int:
        def need(rows: int) -> float:
            peak = max(prefill_bytes(shape, elem, rows, capacity, size), decode_bytes(shape, elem, rows, capacity))
            return OVERHEAD * (weight_bytes + peak)

        lo, hi = 0, 1
        while need(hi) <= limit and hi < 1 << 16:
            lo, hi = hi, 2 * hi
        return largest(lambda rows: need(rows) <= limit, hi, lo)  # need() grows with rows

    sizes = [chunk]
    while sizes[-1] > 64:
        sizes.append(sizes[-1] // 2)
    return max(((rows_for(size), size) for size in sizes), key=lambda rs: (rs[0], rs[1]))


def _start(held: list, model, policy, total: int, decode: str, ids, chunk: int, warmup: int, report) -> None:
    """Allocate the cache, read the prompt and run the warm-up steps (every shape the timed steps run); the run's
    cache and engine go into `held`."""
    cache = H2OCache.for_model(model, policy, "absolute", context=total + 1)
    cache.reserve(total)  # the full cache holds every token, allocated once
    engine = Engine(model, cache, decode)
    token = engine.first_tokens(engine.prefill(ids, chunk_size=chunk, progress=report))
    for i in range(warmup):
        engine.decode(token if i == 0 else None)
    sync(next(model.parameters()).device)
    held.extend((cache, engine))


@torch.inference_mode()
def run_throughput(
    loaded,
    memory_limit: int,
    prompt_tokens: int = 512,
    generated_tokens: int = 1536,
    budget: int = 512,
    max_batch: int = 256,
    chunk: int = 512,
    decode: str = "auto",
    progress=None,
    on_record: Callable[[ThroughputRecord], None] | None = None,
) -> list[ThroughputRecord]:
    """Tokens/s over a batch for a full cache and for h2o at `budget`, each at the largest batch that fits,
    both decoded by the same engine (captured on CUDA). Warm-up steps (and the capture) are not timed.
    `progress(done, total)` counts each configuration's prompt columns and decode steps; `on_record(record)` as
    soon as each configuration is measured."""
    model = loaded.model
    device = next(model.parameters()).device
    dtype = loaded.dtype
    fp = footprint(model.config)
    vocab = model.config.get_text_config().vocab_size
    weights = loaded.weight_bytes or fp.weight_bytes(dtype, loaded.quantize, loaded.device.type == "cpu")
    shape, elem = ModelShape.of(model.config), torch.tensor([], dtype=dtype).element_size()
    total = prompt_tokens + generated_tokens
    warmup = min(4, generated_tokens - 1)
    out: list[ThroughputRecord] = []

    def add(record: ThroughputRecord) -> None:
        out.append(record)
        if on_record is not None:
            on_record(record)

    plans = (("full", make_policy("full"), total), ("h2o", make_policy("h2o", budget), budget))
    for k, (config, policy, cap) in enumerate(plans):
        batch, chunk_used = largest_batch(shape, elem, weights, cap, memory_limit, chunk)
        batch = min(max_batch, batch)
        before = k * total  # tokens of the configurations already run
        report = None if progress is None else (lambda done, _of, before=before: progress(before + done, 2 * total))
        if batch == 0:
            add(ThroughputRecord(config, cap, 0, prompt_tokens, 0, 0.0, 0, 0, memory_limit, device.type))
            if report:
                report(total, total)
            continue
        ids = torch.randint(3, vocab, (batch, prompt_tokens), device=device)
        held_before = prefill_peak = 0
        if device.type == "cuda":
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
            held_before = torch.cuda.memory_allocated(device)
        held: list = []
        start = functools.partial(_start, held, model, policy, total, decode, ids, chunk_used, warmup, report)
        tracked = start() if device.type == "cuda" else cpu_peak_bytes(start)  # (CPU) the weights are held throughout
        if device.type == "cuda":
            prefill_peak = torch.cuda.max_memory_allocated(device)
        cache, engine = held
        t = time.perf_counter()
        for i in range(generated_tokens - 1 - warmup):
            engine.decode()
            if report:
                report(prompt_tokens + warmup + i + 1, total)
        sync(device)
        if report:
            report(total, total)
        seconds = time.perf_counter() - t
        timed = generated_tokens - 1 - warmup
        add(
            ThroughputRecord(
                config,
                cap,
                batch,
                prompt_tokens,
                generated_tokens,
                round(batch * timed / seconds, 2) if timed > 0 else 0.0,
                cache.stats().kv_bytes,
                torch.cuda.max_memory_allocated(device) if device.type == "cuda" else weights + tracked,
                memory_limit,
                device.type,
                engine.stepping,  # how the timed steps ran (eagerly, where the compiled step was not built)
                round(engine.setup_seconds, 2),
                held_before,
                prefill_peak,
            )
        )
        del cache, engine, held, start  # the partial holds `held` too
        gc.collect()  # a cache refers to itself through its layers: freed only by the collector, before the next
    return out


def as_dicts(records: list[ThroughputRecord]) -> list[dict]:
    return [asdict(r) for r in records]
