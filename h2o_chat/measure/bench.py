"""Speed and memory measurements: decode ms/token and KV bytes as the context grows, side by side.

Each configuration prefills one text once, pausing at every measurement point (512, 2k, 4k, 8k tokens seen)
to time greedy decode steps (median over rounds, after a warm-up round that also absorbs any compilation or
graph capture). Configurations:

- dynamic: transformers' DynamicCache with SDPA (what users have without h2o-chat)
- static: transformers' StaticCache with SDPA, eager
- static-compiled: StaticCache + torch.compile(mode="reduce-overhead", fullgraph=True): the strongest anchor a
  user could pick with plain transformers
- full: h2o-chat's cache without eviction (capacity reserved up front), through the decode engine
- h2o: the paper's policy at the given budget, through the decode engine
- h2o-compiled, snap-compiled, recall-compiled, h2o-8bit-compiled: those configurations with the compiled
  decode step (`--decode compile`: on a CPU the package built ahead of time, on a GPU inductor's kernels
  captured in the step's CUDA graph), whatever `--decode` says
- h2o-rolling: the same with --positions rolling: held tokens renumbered by order whenever positions would
  pass twice the budget (what every step past the trained context runs)
- h2o-nobound: h2o with a budget above the longest length (nothing evicted: the cost of scoring itself)
- snap, recall: those policies at the given budget (recall: every step also ranks the evicted tokens in the
  store and attends to the best of them; its cost grows with what the store holds)
- h2o-8bit, snap-8bit, recall-8bit: the same with the held keys and values in int8 (`--kv-quant 8bit`)
- llama.cpp: the same GGUF file in llama.cpp (`measure/llamacpp.py`), the same ids and threads, a full cache
  (the anchor a CPU user would pick)

h2o-chat's configurations decode through `Engine` with the chosen `--decode` mode (auto: CUDA graphs on a GPU,
eager on CPU). Ratios are computed from figures taken in the same run, never compared across runs.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from importlib import resources

import torch
from transformers import DynamicCache, StaticCache

from h2o_chat.engine.cache import H2OCache
from h2o_chat.engine.policies import make_policy
from h2o_chat.engine.step.attention import cache_keyword
from h2o_chat.engine.step.decode import Engine, resolve_decode, sync
from h2o_chat.measure import llamacpp

QUANTIZED = ("h2o-8bit", "snap-8bit", "recall-8bit")
COMPILED = ("h2o-compiled", "snap-compiled", "recall-compiled", "h2o-8bit-compiled")
CONFIGS = (
    "dynamic", "static", "static-compiled", "full", "h2o", *COMPILED, "h2o-rolling", "h2o-nobound", "snap",
    "recall", *QUANTIZED, llamacpp.CONFIG,
)  # fmt: skip
OURS = ("full", "h2o", *COMPILED, "h2o-rolling", "h2o-nobound", "snap", "recall", *QUANTIZED)


def storage_of(config: str) -> tuple[str, str]:
    """A configuration's name without its storage or decode suffix, and the storage (`--kv-quant`):
    "recall-8bit" -> ("recall", "8bit"), "recall-compiled" -> ("recall", "none"). The decode and the prefill
    bench name their 8-bit rows alike."""
    config = config.removesuffix("-compiled")
    if config.endswith("-8bit"):
        return config.removesuffix("-8bit"), "8bit"
    return config, "none"


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
    measured_at: int = 0  # the length whose rounds this figure comes from
    peak_bytes: int = 0  # peak GPU memory while this configuration ran (CUDA only)
    decode: str = "eager"  # how decode steps ran: eager | graph | compile (transformers anchors: eager | compile)
    setup_seconds: float = 0.0  # one-time compile or capture time of this configuration


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


class _Run:
    """One configuration: its cache, how it prefills and decodes, and how far it has read."""

    def __init__(self, config: str, model, budget: int, total: int, batch: int, decode: str, gguf=None):
        # `total`: every token the run will see; static caches (full, h2o-nobound, StaticCache) hold that many
        self.config, self.model = config, model
        self.fed, self.times = 0, []
        self.setup_seconds = 0.0
        self.token: torch.Tensor | None = None
        self.fresh = False
        self.engine: Engine | None = None
        self.llama: llamacpp.LlamaCpp | None = None
        self._compiled = None
        self._cache_kw = cache_keyword(model)  # read once: not inside the timed steps
        if config == llamacpp.CONFIG:
            if batch != 1:
                raise llamacpp.Unavailable("the llama.cpp row decodes one row (--batch 1)")
            self.impl, self.policy, self.budget, self.decode = model.config._attn_implementation, None, None, "eager"
            self.llama = llamacpp.LlamaCpp(gguf, total, torch.get_num_threads())
            self.cache = None
            return
        if config in OURS:
            self.impl = "h2o"
            name, quant = storage_of(config)
            if config == "full":
                self.policy, self.budget = make_policy("full"), None
            else:
                self.budget = total if config == "h2o-nobound" else budget
                self.policy = make_policy(name if name in ("snap", "recall") else "h2o", self.budget)
            positions = "rolling" if config == "h2o-rolling" else "absolute"
            self.cache = H2OCache.for_model(model, self.policy, positions, kv_quant=quant)
            self.cache.reserve(total)
            # *-compiled: the compiled step beside the run's own mode (`--decode`), in the same rounds. A compiled
            # step is timed as it runs once built: one not built yet is built now, its time one-time setup (`auto`
            # would run it eagerly until a build elsewhere is done, and those steps were labelled compiled)
            mode = "compile" if config in COMPILED else decode
            device = next(model.parameters()).device
            self.engine = Engine(model, self.cache, "compile" if resolve_decode(mode, device) == "compile" else mode)
            return
        self.impl, self.policy, self.budget = "sdpa", make_policy("full"), None
        if config == "dynamic":
            self.cache, self.decode = DynamicCache(config=model.config), "eager"
        elif config in ("static", "static-compiled"):
            self.cache = StaticCache(config=model.config, max_cache_len=total)
            self.decode = "compile" if config == "static-compiled" else "eager"
        else:
            raise ValueError(f"unknown bench config {config!r}; choose from {', '.join(CONFIGS)}")

    def prefill(self, ids: torch.Tensor) -> None:
        if self.llama is not None:
            self.token = torch.tensor([self.llama.eval(ids[0].tolist())])
        elif self.engine is not None:
            self.token = self.engine.first_tokens(self.engine.prefill(ids))
            self.fresh = True  # the next step feeds this token; later ones feed the engine's own output
        else:
            out = self.model(input_ids=ids, use_cache=True, logits_to_keep=1, **{self._cache_kw: self.cache})
            self.token = out.logits[:, -1].argmax(-1)
        self.fed += ids.shape[1]

    def step(self) -> None:
        if self.llama is not None:
            self.token = torch.tensor([self.llama.eval([int(self.token[0])])])
        elif self.engine is not None:
            self.token = self.engine.decode(self.token if self.fresh else None)[1]
            self.fresh = False
        else:
            forward = self._compiled_forward() if self.decode == "compile" else self.model.forward
            out = forward(
                input_ids=self.token[:, None], use_cache=True, logits_to_keep=1, **{self._cache_kw: self.cache}
            )
            self.token = out.logits[:, -1].argmax(-1)
        self.fed += 1

    def _compiled_forward(self):
        if self._compiled is None:
            self._compiled = torch.compile(self.model.forward, mode="reduce-overhead", fullgraph=True)
        return self._compiled

    def kv_bytes(self) -> int:
        if self.llama is not None:
            return self.llama.kv_bytes()
        if self.engine is not None:
            return self.cache.stats().kv_bytes
        return sum(
            t.numel() * t.element_size()
            for layer in self.cache.layers
            if layer.is_initialized
            for t in (layer.keys, layer.values)
        )

    def setup(self) -> float:
        return self.engine.setup_seconds if self.engine is not None else self.setup_seconds

    @property
    def mode(self) -> str:
        """How its steps ran (an engine's step that could not be built fell back to eager)."""
        return self.engine.stepping if self.engine is not None else self.decode


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
    decode: str = "auto",
    gguf=None,
    on_record: Callable[[BenchRecord], None] | None = None,
) -> list[BenchRecord]:
    """Decode ms/token per configuration at each length. On CPU every configuration is brought to each length
    and timed in interleaved rounds (A, B, C, A, B, C, ...) so that drift on a noisy machine hits all alike,
    with an h2o twin parked at the first length for the flatness ratio. On CUDA (steady clocks) configurations
    run one after another, each with its own peak memory. `tokenizer=None` feeds random ids (random models).
    `gguf`: the model's file, for the llama.cpp row. `on_record(record)` as soon as each record is measured (a
    length's records on CPU, one configuration's at a time on CUDA)."""
    device = next(model.parameters()).device
    longest = max(lengths)
    n = longest + 2 * (steps + steps // rounds) * len(lengths) + 64
    if tokenizer is None:
        vocab = model.config.get_text_config().vocab_size
        ids = torch.randint(3, vocab, (1, n), generator=torch.Generator().manual_seed(0))
    else:
        ids = corpus_ids(tokenizer, n)
    ids = ids.to(device).expand(batch, -1).contiguous()
    measure = _Measure(model, ids, lengths, steps, rounds, chunk, status, progress, on_record)
    twin = ("h2o@first",) if device.type != "cuda" and "h2o" in configs else ()
    measure.total = sum(measure.tokens(c) for c in (*configs, *twin))

    def make(config: str) -> _Run:
        run = _Run(config, model, budget, n, batch, decode, gguf)
        if run.engine is not None and status is not None:  # a step built now takes minutes: said, not silent
            run.engine.on_setup = lambda message: status(f"{config}: {message} ...")
        return run

    if device.type != "cuda":
        runs = [make(c) for c in configs]
        if "h2o" in configs:
            runs.append(make("h2o"))
            runs[-1].config = "h2o@first"
        return measure(runs)
    records = []
    for config in configs:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        records += measure([make(config)])
    return records


class _Measure:
    """Brings runs to each length and times greedy decode steps in rounds over them."""

    def __init__(self, model, ids, lengths, steps, rounds, chunk, status, progress=None, on_record=None):
        self.model, self.ids, self.lengths, self.on_record = model, ids, sorted(lengths), on_record
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

    def advanced(self, tokens: int) -> None:
        self.done += tokens
        if self.progress is not None:
            self.progress(self.done, self.total)

    def __call__(self, runs: list[_Run]) -> list[BenchRecord]:
        records = []
        for length in self.lengths:
            for run in runs:
                with attention(self.model, run.impl):
                    while run.fed < length and not (run.config == "h2o@first" and run.fed):
                        before = run.fed
                        run.prefill(self.ids[:, run.fed : min(length, run.fed + self.chunk)])
                        self.advanced(run.fed - before)
                run.times = []
            for r in range(self.rounds + 1):  # round 0 warms up (and compiles or captures)
                for run in runs:
                    with attention(self.model, run.impl):
                        sync(self.device)
                        t = time.perf_counter()
                        for _ in range(self.per_round):
                            run.step()
                        sync(self.device)
                        seconds = time.perf_counter() - t
                    self.advanced(self.per_round)
                    if r:
                        run.times.append(seconds / self.per_round)
                    elif run.engine is None and run.decode == "compile" and not run.setup_seconds:
                        run.setup_seconds = seconds  # the first compiled steps: compilation dominates
            for run in runs:
                records.append(self.record(run, length))
                if self.on_record is not None:
                    self.on_record(records[-1])
        return records

    def record(self, run: _Run, length: int) -> BenchRecord:
        ms = 1000 * statistics.median(run.times)
        seen = self.lengths[0] if run.config == "h2o@first" else length
        peak = torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else 0
        if self.status:
            self.status(f"{run.config:>15} at {seen:>6} seen: {ms:7.2f} ms/token ({run.mode}, rounds of {length})")
        return BenchRecord(
            run.config,
            run.policy.name if run.policy is not None else "full",
            run.budget,
            seen,
            round(ms, 3),
            run.kv_bytes(),
            self.ids.shape[0],
            self.device.type,
            self.dtype,
            measured_at=length,
            peak_bytes=peak,
            decode=run.mode,
            setup_seconds=round(run.setup(), 2),
        )


def ratios(records: list[BenchRecord], budget: int) -> list[tuple[str, float]]:
    """Measured ratios, each from figures timed in the same run: (description, value)."""
    at = {(r.config, r.measured_at): r.ms_per_token for r in records}
    kv = {(r.config, r.measured_at): r.kv_bytes for r in records}
    lengths = sorted({r.measured_at for r in records})
    lo, hi = lengths[0], lengths[-1]
    out = []
    first = ("h2o@first", hi) if ("h2o@first", hi) in at else ("h2o", lo)  # the twin when interleaved
    if ("h2o", hi) in at and first in at and hi != lo:  # the text says which figure it divides by (both shown)
        under = f"the row '{lo} (twin)', timed beside {hi}" if first[0] == "h2o@first" else f"the row {lo}"
        out.append((f"h2o {budget}: ms/token at {hi} seen / at {lo} seen ({under})", at["h2o", hi] / at[first]))
    if ("h2o-rolling", hi) in at and ("h2o", hi) in at:
        out.append(
            (f"h2o {budget} rolling / absolute positions: ms/token at {hi} seen", at["h2o-rolling", hi] / at["h2o", hi])
        )
    for base in ("static-compiled", "full", "dynamic", "static"):
        if (base, hi) in at and ("h2o", hi) in at:
            out.append((f"h2o {budget} / {base}: ms/token at {hi} seen", at["h2o", hi] / at[base, hi]))
    for ours in COMPILED:  # the GPU's anchor: each compiled row against StaticCache + torch.compile
        for n in lengths if ("static-compiled", hi) in at and (ours, hi) in at else ():
            anchor = at["static-compiled", n]
            out.append((f"{ours} {budget} / static-compiled: ms/token at {n} seen", at[ours, n] / anchor))
    for ours in ("h2o", *COMPILED):
        for n in lengths if (llamacpp.CONFIG, hi) in at and (ours, hi) in at else ():
            out.append((f"{ours} {budget} / llama.cpp: ms/token at {n} seen", at[ours, n] / at[llamacpp.CONFIG, n]))
    for ours in ("snap-compiled", "recall-compiled"):  # recall's promise: within 1.15x of the compiled h2o step
        for n in lengths if ("h2o-compiled", hi) in at and (ours, hi) in at else ():
            out.append((f"{ours} / h2o-compiled {budget}: ms/token at {n} seen", at[ours, n] / at["h2o-compiled", n]))
    for base in ("dynamic", "full"):
        if (base, hi) in kv and ("h2o", hi) in kv:
            out.append((f"{base} / h2o {budget}: KV bytes at {hi} seen", kv[base, hi] / kv["h2o", hi]))
    if all(("h2o-nobound", n) in at and ("dynamic", n) in at for n in lengths):
        worst = max(at["h2o-nobound", n] / at["dynamic", n] for n in lengths)
        out.append(("h2o with budget >= length / dynamic: worst over lengths", worst))
    return out


def as_json_lines(records: list[BenchRecord]) -> str:
    import json

    return "\n".join(json.dumps(asdict(r)) for r in records)
