"""Reading a prompt: seconds, tokens/s, extra peak memory and operators per layer, h2o-chat against transformers.

Rows, timed in interleaved rounds of one run (round 0 warms up; the median of the others is reported):

- transformers: the same model with SDPA and a DynamicCache, the prompt in one forward (what plain
  transformers does; memory grows with the prompt)
- transformers-chunked: the same, in chunks of --chunk-size (what a memory-aware transformers user does)
- full, h2o, snap, recall: h2o-chat's engine prefill at the budget, in chunks (`full` reserves the prompt's
  slots; recall: each chunk also ranks the evicted tokens, kept in host memory, and attends to the best)
- llama.cpp: the same GGUF in llama.cpp, the prompt in batches of --chunk-size (its "extra peak" is the KV
  cache it allocates for the prompt; the profiler cannot see its other allocations)

Extra peak memory is measured in a separate, untimed read: on CUDA `max_memory_allocated` above what was
allocated before the read; on CPU the largest sum of live allocations the profiler records during the read.
Operators per layer and chunk count every ATen operator dispatched for one middle chunk, divided by layers.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass

import torch
from transformers import DynamicCache

from h2o_chat.engine.cache import H2OCache
from h2o_chat.engine.policies import make_policy
from h2o_chat.engine.step.attention import cache_keyword
from h2o_chat.engine.step.decode import Engine, sync
from h2o_chat.measure import llamacpp
from h2o_chat.measure.bench import attention, storage_of

DEFAULT_CONFIGS = ("transformers", "transformers-chunked", "full", "h2o", "snap", "recall")
# -8bit: held keys and values in int8
PREFILL_CONFIGS = (*DEFAULT_CONFIGS, "h2o-8bit", "snap-8bit", "recall-8bit", llamacpp.CONFIG)
_OURS = PREFILL_CONFIGS[2:-1]


@dataclass(frozen=True)
class PrefillRecord:
    config: str
    budget: int | None
    prompt_tokens: int
    batch: int
    chunk: int | None  # None: one forward
    seconds: float
    tokens_per_second: float
    extra_peak_bytes: int
    ops_per_layer: float  # ATen operators per layer for one chunk (0 when not counted)
    device: str
    dtype: str


class OperatorCount(torch.utils._python_dispatch.TorchDispatchMode):
    """Within the block, the ATen operators run, by name (`ops`), and in all (`total`)."""

    def __init__(self):
        super().__init__()
        self.ops = Counter()

    @property
    def total(self) -> int:
        return sum(self.ops.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _no_fd2() -> Iterator[None]:
    """The process's standard error (the descriptor, which C++ writes to) sent to the null device inside."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError, AttributeError):  # no descriptor 2 (a closed or captured stream): nothing to hide
        yield
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def cpu_peak_bytes(fn: Callable[[], object]) -> int:
    """The largest sum of live CPU allocations while fn runs (allocations by operators, frees as the
    profiler's memory events record them, in time order). Garbage left by earlier work is collected first: an
    H2O cache refers to itself through its layers, so a finished reader's storage is freed by the collector, and
    freed inside the window it would count against this one (the profiler knows its size from the measurement
    that allocated it; recall-8bit read after recall showed 239 MB instead of 419)."""
    import gc

    from torch.profiler import ProfilerActivity, profile

    gc.collect()

    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with _no_fd2():  # its C++ side prints "profiler_start" / "profiler_stop" to the terminal at each
        prof.start()
    try:
        fn()
    finally:
        with _no_fd2():
            prof.stop()
    live = peak = 0
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        live += event.cpu_memory_usage if event.name == "[memory]" else event.self_cpu_memory_usage
        peak = max(peak, live)
    return peak


def extra_peak_bytes(fn: Callable[[], object], device: torch.device) -> int:
    if device.type == "cuda":
        sync(device)
        torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        sync(device)
        return torch.cuda.max_memory_allocated(device) - before
    return cpu_peak_bytes(fn)


class _Reader:
    """One configuration's way of reading the prompt, from nothing, each time it is called."""

    def __init__(self, config: str, model, ids: torch.Tensor, budget: int, chunk: int, gguf=None):
        self.config, self.model, self.ids, self.chunk = config, model, ids, chunk
        self.budget = None if config.startswith("transformers") or config in ("full", llamacpp.CONFIG) else budget
        self.llama = None
        if config == llamacpp.CONFIG:
            if ids.shape[0] != 1:
                raise llamacpp.Unavailable("the llama.cpp row reads one prompt (--batch 1)")
            self.llama = llamacpp.LlamaCpp(gguf, ids.shape[1] + 8, torch.get_num_threads(), chunk)

    def __call__(self, count_chunk: int | None = None) -> Counter | None:
        """Read the prompt; with `count_chunk`, return the operators dispatched during that chunk."""
        if self.llama is not None:  # ATen counts nothing of it
            self.llama.reset()
            self.llama.eval(self.ids[0].tolist())
            return Counter() if count_chunk is not None else None
        if self.config.startswith("transformers"):
            return self._transformers(count_chunk)
        name, quant = storage_of(self.config)
        cache = H2OCache.for_model(self.model, make_policy(name, self.budget), kv_quant=quant)
        cache.reserve(self.ids.shape[1])  # full: the prompt's slots, once (a budget is fixed anyway)
        engine = Engine(self.model, cache, "eager")
        counted = Counter()
        if count_chunk is not None:
            forward, calls = engine._forward, [0]

            def counting(*args, **kwargs):
                calls[0] += 1
                if calls[0] - 1 != count_chunk:
                    return forward(*args, **kwargs)
                with OperatorCount() as c:
                    out = forward(*args, **kwargs)
                counted.update(c.ops)
                return out

            engine._forward = counting
        engine.prefill(self.ids, chunk_size=self.chunk)
        return counted if count_chunk is not None else None

    @torch.inference_mode()
    def _transformers(self, count_chunk: int | None) -> Counter | None:
        cache, keyword = DynamicCache(config=self.model.config), cache_keyword(self.model)
        L = self.ids.shape[1]
        step = self.chunk if self.config == "transformers-chunked" else L
        counted = Counter()
        with attention(self.model, "sdpa"):
            for i, s in enumerate(range(0, L, step)):
                ctx = OperatorCount() if i == count_chunk else contextlib.nullcontext()
                with ctx as c:
                    self.model(
                        input_ids=self.ids[:, s : s + step], use_cache=True, logits_to_keep=1, **{keyword: cache}
                    )
                if c is not None:
                    counted.update(c.ops)
        return counted if count_chunk is not None else None


def run_prefill_bench(
    model,
    ids: torch.Tensor,
    budget: int,
    chunk: int,
    configs: tuple[str, ...] = DEFAULT_CONFIGS,
    rounds: int = 3,
    count_ops: bool = True,
    progress: Callable[[int, int], None] | None = None,
    gguf=None,
) -> list[PrefillRecord]:
    """Time reading `ids` (B, L) for each configuration in interleaved rounds; then measure each one's extra
    peak memory and (optionally) operators per layer for a middle chunk. `gguf`: the file, for llama.cpp."""
    device = next(model.parameters()).device
    ids = ids.to(device)
    B, L = ids.shape
    layers = model.config.get_text_config().num_hidden_layers
    readers = {c: _Reader(c, model, ids, budget, chunk, gguf) for c in configs}
    times: dict[str, list[float]] = {c: [] for c in configs}
    total, done = (rounds + 2) * len(configs), 0
    for r in range(rounds + 1):  # round 0 warms up
        for config, read in readers.items():
            sync(device)
            t = time.perf_counter()
            read()
            sync(device)
            if r:
                times[config].append(time.perf_counter() - t)
            done += 1
            if progress:
                progress(done, total)
    out = []
    middle = max(0, (L // chunk) // 2)
    for config, read in readers.items():
        peak = read.llama.kv_bytes() if read.llama is not None else extra_peak_bytes(read, device)
        ops = 0.0
        if count_ops and (config != "transformers" or chunk >= L):
            counted = read(middle)
            ops = sum(counted.values()) / layers
        seconds = statistics.median(times[config])
        one_pass = config == "transformers"
        out.append(
            PrefillRecord(
                config,
                readers[config].budget,
                L,
                B,
                None if one_pass else chunk,
                round(seconds, 4),
                round(B * L / seconds, 1),
                peak,
                round(ops, 1),
                device.type,
                str(model.dtype).removeprefix("torch."),
            )  # fmt: skip
        )
        done += 1
        if progress:
            progress(done, total)
    return out


def ratios(records: list[PrefillRecord]) -> list[tuple[str, float]]:
    """Tokens/s and peak memory against the transformers rows, all from this run."""
    by = {r.config: r for r in records}
    out = []
    for anchor in ("transformers", "transformers-chunked", llamacpp.CONFIG):
        if anchor not in by:
            continue
        for ours in _OURS:
            if ours in by:
                out.append((f"{ours} / {anchor}: tokens/s", by[ours].tokens_per_second / by[anchor].tokens_per_second))
    if "transformers-chunked" in by:
        base = by["transformers-chunked"]
        for ours in _OURS:
            if ours in by and base.extra_peak_bytes:
                out.append(
                    (f"{ours} / transformers-chunked: extra peak", by[ours].extra_peak_bytes / base.extra_peak_bytes)
                )
            if ours in by and base.ops_per_layer and by[ours].ops_per_layer:
                out.append(
                    (f"{ours} / transformers-chunked: operators per layer", by[ours].ops_per_layer / base.ops_per_layer)
                )
    return out


def as_dicts(records: list[PrefillRecord]) -> list[dict]:
    return [asdict(r) for r in records]
