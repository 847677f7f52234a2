"""The memory a prompt's reading and a decode step need: the estimates that size throughput batches and refuse
prompts that would not fit bound what the profiler measures (every allocation, in time order)."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from conftest import tiny_model
from h2o_chat.engine.cache import H2OCache
from h2o_chat.engine.policies import make_policy
from h2o_chat.engine.step.decode import Engine, left_pad
from h2o_chat.errors import DeviceError
from h2o_chat.measure.prefill import cpu_peak_bytes
from h2o_chat.models import memory
from h2o_chat.models.memory import ModelShape, cache_storage_bytes, decode_bytes, fitting_chunk, prefill_bytes


def _measured_and_estimated(
    policy: str, rows: int, length: int, chunk: int, count_recall: bool = True, kv_quant: str = "none", store=None
):
    model = tiny_model("llama", seed=30, layers=3)
    shape = ModelShape.of(model.config)
    shape = dataclasses.replace(shape, kv_quant=kv_quant)
    budget = 48
    g = torch.Generator().manual_seed(rows)
    prompts = [torch.randint(1, 256, (length - 37 * r,), generator=g).tolist() for r in range(rows)]
    ids, mask = left_pad(prompts, 0)
    knobs = {"store": store} if store else {}
    pol = make_policy(policy, budget, **knobs) if policy != "full" else make_policy("full")
    cache = H2OCache.for_model(model, pol, kv_quant=kv_quant)
    cache.reserve(length)
    measured = cpu_peak_bytes(lambda: Engine(model, cache, "eager").prefill(ids, mask, chunk_size=chunk))
    mass = policy in ("h2o", "snap", "recall")  # the policies that rank by attention compute its mass too
    snap = policy in ("snap", "recall")
    recall = dict(recall=2 * pol.recalled, stored=pol.store) if policy == "recall" and count_recall else {}
    capacity = cache.slots.capacity  # recall holds budget - recalled slots
    estimate = prefill_bytes(shape, 4, rows, capacity, chunk, snap=snap, window=12, mass=mass, **recall)
    return measured, estimate


@pytest.mark.parametrize("policy", ["h2o", "snap", "full", "sink", "recall"])
@pytest.mark.parametrize("rows, length, chunk", [(1, 600, 64), (3, 300, 128)], ids=["long", "padded-batch"])
def test_the_prefill_estimate_bounds_the_measured_peak(policy, rows, length, chunk):
    measured, estimate = _measured_and_estimated(policy, rows, length, chunk)
    assert measured <= estimate < 4 * measured, (measured, estimate)


@pytest.mark.parametrize("policy", ["h2o", "snap", "recall"])
def test_an_8bit_cache_is_estimated_as_it_is_stored(policy):
    """int8 slots (and a float16 scale per token) count a quarter of fp32's bytes; the peak stays bounded."""
    measured, estimate = _measured_and_estimated(policy, 1, 600, 64, kv_quant="8bit")
    assert measured <= estimate < 4 * measured, (measured, estimate)
    shape = ModelShape.of(tiny_model("llama", layers=3).config)
    narrow = dataclasses.replace(shape, kv_quant="8bit")
    assert cache_storage_bytes(narrow, 4, 1, 48) < 0.5 * cache_storage_bytes(shape, 4, 1, 48)


def _hinted(error: pytest.ExceptionInfo) -> int:
    return int(re.search(r"--budget (\d+) fits", str(error.value)).group(1))


def test_a_budget_that_fits_only_in_8_bits_is_refused_unquantized_and_taken_in_8_bits(monkeypatch):
    config = tiny_model("llama", layers=3).config
    fp = memory.Footprint(0, 0, 3, 2, 16, shape=ModelShape.of(config))  # as check_budget counts: storage and run
    narrow = dataclasses.replace(fp, kv_quant="8bit")
    free = (fp.total_bytes(torch.float32, "none", 1000) + narrow.total_bytes(torch.float32, "none", 1000)) // 2
    monkeypatch.setattr(memory, "available_memory", lambda: free)
    with pytest.raises(DeviceError, match="--budget 1000: a 1000-token KV cache needs .*fits") as e:
        memory.check_budget(config, torch.float32, torch.device("cpu"), 1000)
    hint = _hinted(e)  # the hint fits, one more token does not
    assert fp.total_bytes(torch.float32, "none", hint) <= free < fp.total_bytes(torch.float32, "none", hint + 1)
    memory.check_budget(config, torch.float32, torch.device("cpu"), 1000, kv_quant="8bit")  # ~0.3x the bytes
    with pytest.raises(DeviceError, match="a 2500-token KV cache in 8 bits needs .*fits") as e:
        memory.check_budget(config, torch.float32, torch.device("cpu"), 2500, kv_quant="8bit")
    hint = _hinted(e)
    assert narrow.total_bytes(torch.float32, "none", hint) <= free < narrow.total_bytes(torch.float32, "none", hint + 1)


@pytest.mark.parametrize("policy", ["h2o", "snap", "recall", "full", "sink"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_quant", ["none", "8bit"])
def test_the_footprint_is_the_storage_the_cache_allocates(policy, dtype, kv_quant):
    """One formula (`slots.storage_bytes`) for the fit checks, the panel and bench: the estimate before loading
    equals the bytes the cache allocates, for every policy, dtype and storage."""
    model = tiny_model("llama", seed=3, layers=3).to(dtype)
    budget, rows = 40, 2
    pol = make_policy(policy, budget) if policy != "full" else make_policy("full")
    cache = H2OCache.for_model(model, pol, kv_quant=kv_quant)
    cache.reserve(budget)
    Engine(model, cache, "eager").prefill(torch.randint(1, 256, (rows, 30)))
    fp = dataclasses.replace(memory.footprint(model.config), kv_quant=kv_quant)
    capacity = cache.slots.capacity
    allocated = sum(t.numel() * t.element_size() for t in (*cache.slots.slot_tensors(), *cache.slots.row_tensors()))
    assert fp.kv_bytes(capacity, dtype, rows) == allocated == cache.storage_bytes() == cache.stats().kv_bytes
    if policy == "recall":  # its store, allocated beside the slots, counted by the same footprint
        stored = dataclasses.replace(fp, store_tokens=pol.store).kv_bytes(capacity, dtype, rows)
        assert stored - allocated == cache.store.nbytes() == cache.stats().store_bytes > 0
    shape = dataclasses.replace(ModelShape.of(model.config), kv_quant=kv_quant)
    elem = torch.empty(0, dtype=dtype).element_size()
    assert cache_storage_bytes(shape, elem, rows, capacity) == allocated
    per_token = memory.kv_token_bytes(model.config, dtype, kv_quant)
    assert per_token * rows * (capacity + 1) < allocated <= per_token * rows * (capacity + 2)


def test_the_prefill_estimate_counts_what_recall_keeps_and_brings_back():
    # the recall policy's store is allocated beside the slots, in the same memory; a chunk's recalled tokens,
    # per-head masks and ranking transients come on top: leaving them out underestimates
    measured, estimate = _measured_and_estimated("recall", 1, 1000, 64, store=8192)
    assert measured <= estimate < 4 * measured, (measured, estimate)
    measured, without = _measured_and_estimated("recall", 1, 1000, 64, count_recall=False, store=8192)
    assert without < measured / 2, (measured, without)


def test_the_decode_estimate_bounds_the_measured_peak():
    model = tiny_model("llama", seed=31, layers=3)
    shape = ModelShape.of(model.config)
    cache = H2OCache.for_model(model, make_policy("h2o", 64))
    engine = Engine(model, cache, "eager")
    engine.decode(engine.first_tokens(engine.prefill(torch.randint(1, 256, (4, 100)), chunk_size=32)))
    measured = cpu_peak_bytes(lambda: [engine.decode() for _ in range(3)])
    # the storage is allocated already: the step's own transients are what the estimate adds to it
    storage = sum(t.numel() * t.element_size() for t in cache.slots.buffers())
    assert measured <= decode_bytes(shape, 4, 4, 64) - storage + shape.vocab * 4 * 4


def test_a_prompt_that_does_not_fit_is_read_in_smaller_chunks_or_refused():
    model = tiny_model("llama", seed=32, layers=3)
    shape = ModelShape.of(model.config)
    need = prefill_bytes(shape, 4, 1, 64, 512)
    assert fitting_chunk(shape, 4, 1, 64, 512, available=2 * need) == 512
    smaller = fitting_chunk(shape, 4, 1, 64, 512, available=int(0.6 * need))
    assert 16 <= smaller < 512 and prefill_bytes(shape, 4, 1, 64, smaller) * 1.15 <= 0.6 * need
    with pytest.raises(DeviceError, match="lower --budget"):
        fitting_chunk(shape, 4, 1, 64, 512, available=1000)


def test_a_prompt_is_read_in_its_devices_chunks_unless_a_size_is_asked_for(monkeypatch):
    """No --chunk-size: a CPU reads 512 tokens a chunk, a GPU 1,024 (its launches and products pay off over longer
    chunks: docs/results/gpu.md); the fit check sizes the chunk the engine will read; an asked size stays."""
    from h2o_chat.engine.step.prefill import default_chunk

    assert default_chunk(torch.device("cpu")) == 512 and default_chunk(torch.device("cuda")) == 1024
    model = tiny_model("llama", seed=34, layers=2)
    cache = H2OCache.for_model(model, make_policy("h2o", 48))
    assert memory.prefill_chunk(model, cache, 1, 5_000, None) == (512, None)
    assert memory.prefill_chunk(model, cache, 1, 5_000, 96) == (96, None)
    done = []
    engine = Engine(model, cache)
    engine.prefill(torch.randint(1, 256, (1, 1_300)), progress=lambda read, total: done.append(read))
    assert done == [276, 788, 1_300]  # chunks end where the prompt ends: 276, then two of 512
    monkeypatch.setattr(memory, "available_bytes", lambda device: 1 << 40)
    on_gpu = type("Param", (), {"device": torch.device("cuda")})()
    monkeypatch.setattr(model, "parameters", lambda: iter([on_gpu]))
    assert memory.prefill_chunk(model, cache, 1, 5_000, None)[0] == 1024


def test_a_recall_prompt_is_sized_with_its_store(monkeypatch):
    """prefill_chunk counts the recall policy's store (allocated beside the slots, on their device) and chunk
    recall: memory enough for snap's reading of a prompt is not enough for recall's with a large store, and the
    refusal says which settings to lower."""
    from h2o_chat.models import memory

    model = tiny_model("llama", seed=33, layers=3)
    shape = ModelShape.of(model.config)
    snap = H2OCache.for_model(model, make_policy("snap", 48))
    large = H2OCache.for_model(model, make_policy("recall", 48, store=1 << 18))
    small = H2OCache.for_model(model, make_policy("recall", 48, store=64))
    room = int(2 * memory.OVERHEAD * prefill_bytes(shape, 4, 1, 48, 512, snap=True))
    monkeypatch.setattr(memory, "available_bytes", lambda device: room)
    assert memory.prefill_chunk(model, snap, 1, 2_000, 512) == (512, None)
    with pytest.raises(DeviceError, match="--recall-memory"):
        memory.prefill_chunk(model, large, 1, 2_000, 512)  # its store alone would outgrow the room
    assert memory.prefill_chunk(model, small, 1, 2_000, 512)[0] >= 256


def test_the_measured_peak_is_not_lowered_by_earlier_garbage_freed_inside_it():
    """An H2O cache refers to itself through its layers: a finished run's storage waits for the collector. Freed
    inside the next measurement it used to count against it, the profiler knowing its size from the measurement
    that allocated it (recall-8bit read after recall: 239 MB, not 419)."""
    import gc

    class Cycle:
        def __init__(self):
            self.me, self.big = self, torch.ones(25_000_000)  # 100 MB, reachable only through a cycle

    def work():
        gc.collect()  # whatever is still garbage is freed here, inside the window
        return torch.ones(2_500_000) + 1  # 10 MB, twice

    gc.disable()  # the cycle stays garbage until someone collects it
    try:
        cpu_peak_bytes(Cycle)  # made inside a measurement (as a reader's cache is), then dropped
        assert cpu_peak_bytes(work) >= 20_000_000
    finally:
        gc.enable()


# -- issue 49.3: every memory limit holds at the tracked peak ----------------------------------------------------
def _smallest_accepted(check, low: int = 1, high: int = 2**32) -> int:
    """The least free memory `check(free)` accepts (it raises DeviceError below)."""
    while high - low > 1:
        mid = (low + high) // 2
        try:
            check(mid)
            high = mid
        except DeviceError:
            low = mid
    return high


def _run(model, cache, rows: int, length: int) -> None:
    """A prompt read in the chunk the prompt's own check picks, then decode steps."""
    chunk, _ = memory.prefill_chunk(model, cache, rows, length, 512)
    engine = Engine(model, cache, "eager")
    engine.decode(engine.first_tokens(engine.prefill(torch.randint(1, 256, (rows, length)), chunk_size=chunk)))
    for _ in range(3):
        engine.decode()


@pytest.mark.parametrize(("policy", "rows"), [("h2o", 1), ("h2o", 3), ("snap", 1)])
def test_a_budget_the_fit_check_accepts_runs_within_the_memory_it_was_checked_against(monkeypatch, policy, rows):
    """check_budget (a /budget, a batch line's budget, a server's new rows) at the least memory it accepts: the
    prompt is read and steps decode within it, at the tracked peak. It counted the storage alone (x1.15): the
    prompt then could not be read at all, and read in chunks of 16 took 2.9x (snap 5.6x) the memory checked."""
    model = tiny_model("llama", seed=35, layers=3)
    cfg, budget = model.config, 48
    snap = policy == "snap"

    def check(free: int) -> None:
        monkeypatch.setattr(memory, "available_memory", lambda: free)
        memory.check_budget(cfg, torch.float32, torch.device("cpu"), budget, rows=rows, snap=snap)

    free = _smallest_accepted(check)
    monkeypatch.setattr(memory, "available_bytes", lambda device: free)
    cache = H2OCache.for_model(model, make_policy(policy, budget))
    peak = cpu_peak_bytes(lambda: _run(model, cache, rows, 300))
    assert peak <= free, (peak, free)


def test_a_model_the_fit_check_accepts_runs_within_the_memory_it_was_checked_against(monkeypatch):
    """check_fits, before loading: weights plus the tracked peak of reading a prompt and decoding stay within the
    least memory it accepts; its hint ("--budget N fits") holds at that N."""
    model = tiny_model("llama", seed=36, layers=3)
    fp = memory.footprint(model.config)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    assert fp.weight_bytes(torch.float32) == weights

    def check(free: int, budget: int = 512) -> None:
        memory.check_fits("tiny", fp, torch.float32, "none", budget, free, rows=2, gpu=False)

    for budget in (512, None):  # None: the budget the hint names when 512 does not fit
        free = _smallest_accepted(check)
        if budget is None:
            free = free * 3 // 4
            with pytest.raises(DeviceError, match=r"--budget (\d+) fits") as e:
                check(free)
            budget = _hinted(e)
            check(free, budget)
        monkeypatch.setattr(memory, "available_bytes", lambda device, free=free: free - weights)
        peak = cpu_peak_bytes(
            lambda budget=budget: _run(model, H2OCache.for_model(model, make_policy("h2o", budget)), 2, 600)
        )
        assert weights + peak <= free, (budget, weights + peak, free)


def _bench_loaded(seed: int):
    from types import SimpleNamespace

    model = tiny_model("llama", seed=seed, layers=3)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    return SimpleNamespace(model=model, dtype=torch.float32, weight_bytes=weights, quantize="none", device=None)


def test_the_throughput_bench_stays_under_its_limit_at_the_tracked_peak():
    """The batch each configuration runs fits its limit at the profiler's peak (the whole bench, weights held),
    and the peak each record prints is that tracked peak, under the limit (it printed the process's resident
    memory, hundreds of MB above a limit of a few)."""
    from h2o_chat.measure.throughput import run_throughput

    loaded = _bench_loaded(37)
    limit = loaded.weight_bytes + 3 * 2**20
    records: list = []
    kw = dict(prompt_tokens=96, generated_tokens=12, budget=32, chunk=64, decode="eager")
    peak = cpu_peak_bytes(lambda: records.extend(run_throughput(loaded, limit, **kw)))
    assert [r.config for r in records] == ["full", "h2o"] and all(r.batch > 0 for r in records)
    assert loaded.weight_bytes + peak <= limit, (loaded.weight_bytes + peak, limit)
    assert all(loaded.weight_bytes < r.peak_bytes <= limit for r in records), [r.peak_bytes for r in records]


def test_the_throughput_bench_frees_one_configuration_before_the_next(monkeypatch):
    """A cache refers to itself through its layers: without a collection the full cache's storage stayed while
    h2o's batch was allocated beside it (on the H100, h2o's peak 29.3 GB at a 25.8 GB limit)."""
    import gc

    from h2o_chat.measure import throughput

    alive: list[int] = []
    build = H2OCache.for_model

    def counted(*args, **kwargs):
        alive.append(sum(isinstance(o, H2OCache) for o in gc.get_objects()))
        return build(*args, **kwargs)

    monkeypatch.setattr(throughput.H2OCache, "for_model", counted)
    loaded = _bench_loaded(38)
    gc.collect()
    gc.disable()  # no collection by chance: only the bench's own frees the first configuration
    try:
        throughput.run_throughput(loaded, loaded.weight_bytes + 3 * 2**20, 64, 6, 32, chunk=64, decode="eager")
    finally:
        gc.enable()
    assert alive == [0, 0], alive


def test_the_tracked_peak_prints_nothing_on_the_terminal(capfd):
    """The profiler that tracks CPU allocations prints "profiler_start" / "profiler_stop" from C++ at each
    measurement: the throughput bench's and prompt bench's terminal filled with them. Its start and stop now
    write to the null device; standard error works again after."""
    import sys

    assert cpu_peak_bytes(lambda: torch.ones(250_000) + 1) >= 1_000_000
    print("after", file=sys.stderr)
    err = capfd.readouterr().err
    assert "profiler" not in err and "after" in err
