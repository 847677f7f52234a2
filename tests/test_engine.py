"""The decode engine: a static step that never reads the device, traces as one graph and decides exactly as the
eager one does; captured steps stay valid across prefills and renumbering. CUDA runs graph capture itself."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import cached, tiny_model
from h2o_chat.engine.cache import H2OCache
from h2o_chat.engine.policies import make_policy
from h2o_chat.engine.step import compiled
from h2o_chat.engine.step.decode import Engine, left_pad, resolve_decode
from h2o_chat.engine.step.sampling import Sampler
from h2o_chat.errors import ConfigError
from h2o_chat.measure.bench import attention
from h2o_chat.measure.prefill import OperatorCount

BUDGET = 16
POLICIES = {
    "h2o": lambda: make_policy("h2o", BUDGET),
    "sink": lambda: make_policy("sink", BUDGET),
    "recent": lambda: make_policy("recent", BUDGET),
    "snap": lambda: make_policy("snap", BUDGET, window=4),
}
HOT = Sampler(temperature=0.8, top_p=0.9, seed=7, repetition_penalty=1.2)


class HostReads(TorchDispatchMode):
    """Records every operator that makes the host wait for a tensor's value, and every Python-level read of one
    (`.tolist()`, `.cpu()`, `bool()`, ...: on a CPU tensor these copy nothing, so no operator shows them)."""

    SYNCING = ("_local_scalar_dense", "item", "nonzero", "is_nonzero", "equal", "allclose")
    READS = ("tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []
        self._saved = {}

    def __enter__(self):
        for name in self.READS:
            real = getattr(torch.Tensor, name)
            self._saved[name] = real

            def spy(t, *args, _real=real, _name=name, **kwargs):
                self.seen.append(_name)
                return _real(t, *args, **kwargs)

            setattr(torch.Tensor, name, spy)
        return super().__enter__()

    def __exit__(self, *exc):
        for name, real in self._saved.items():
            setattr(torch.Tensor, name, real)
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if name in self.SYNCING:
            self.seen.append(name)
        return func(*args, **(kwargs or {}))


def prompts(batch: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    g = torch.Generator().manual_seed(batch)
    if batch == 1:
        return torch.randint(1, 256, (1, 20), generator=g), None
    rows = [torch.randint(1, 256, (n,), generator=g).tolist() for n in (27, 20, 9)]  # left-padded
    return left_pad(rows, 0)


def traced(engine: Engine) -> Engine:
    """The engine with its step traced by torch.compile(fullgraph=True) on a backend that runs the traced graph
    as is: any host read or Python branch on a tensor value would break the graph (and fail here)."""
    engine._body = torch.compile(engine._body, fullgraph=True, backend="eager")
    return engine


def decode_run(model, policy, batch: int, steps: int, decode: str, positions="absolute"):
    """Prefill, then `steps` sampled decode steps; logits of every step and the held positions at three points.
    decode "traced": eager steps through one traced graph."""
    ids, mask = prompts(batch)
    ids, mask = ids.to(model.device), None if mask is None else mask.to(model.device)
    cache = H2OCache.for_model(model, policy, positions)
    engine = Engine(model, cache, "eager" if decode == "traced" else decode)
    if decode == "traced":
        traced(engine)
    engine.set_sampler(HOT, ids.shape[0])
    tokens = engine.first_tokens(engine.prefill(ids, mask, chunk_size=8))
    logits, held = [], []
    for i in range(steps):
        out, tokens = engine.decode(tokens if i == 0 else None)
        logits.append(out.float().clone())
        if i in (0, steps // 2, steps - 1):
            held.append(cache.slots.pos.clone())
    return torch.stack(logits), held, engine


def same_held(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same set of positions in every (layer, row, head), wherever the slots are."""
    return torch.equal(a.sort(-1).values, b.sort(-1).values)


@pytest.mark.parametrize("policy", list(POLICIES))
def test_a_decode_step_never_reads_the_device(policy):
    """No .item(), no bool(tensor), no nonzero: the step can be queued (and captured) without the host waiting,
    with sampling, a repetition penalty, padding and renumbered positions (a 48-token trained context)."""
    model = tiny_model("llama", seed=1, max_positions=48)
    for positions in ("absolute", "rolling", "auto"):
        ids, mask = prompts(3)
        cache = H2OCache.for_model(model, POLICIES[policy](), positions)
        engine = Engine(model, cache, "eager")
        engine.set_sampler(HOT, 3)
        tokens = engine.first_tokens(engine.prefill(ids, mask, chunk_size=8))
        engine.decode(tokens)
        with HostReads() as reads:
            for _ in range(2 * BUDGET):  # through filling and evicting
                engine.decode()
        assert reads.seen == [], f"{policy}, {positions}: {sorted(set(reads.seen))}"
        assert cache.seq.renumbered == (positions != "absolute")
    assert cache.stats().kept == BUDGET


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("family", ["llama", "opt"])
def test_the_step_traces_as_one_graph_and_decides_as_the_eager_one(family, batch, single_thread):
    """torch.compile(fullgraph=True) of the whole step (what a CUDA graph needs: nothing the host must read):
    over 300 steps past the budget, the same held positions in every layer and head, the same logits, for h2o,
    sink, recent and snap."""
    torch._dynamo.reset()
    model = tiny_model(family, seed=3)
    for name, make in POLICIES.items():
        eager_logits, eager_held, _ = decode_run(model, make(), batch, 310, "eager")
        logits, held, _ = decode_run(model, make(), batch, 310, "traced")
        for a, b in zip(held, eager_held, strict=True):
            assert same_held(a, b), name
        torch.testing.assert_close(logits, eager_logits, atol=1e-5, rtol=1e-5, msg=name)


def test_one_trace_serves_every_step_renumbering_included(single_thread):
    """Nothing the step reads changes between steps, not even when positions are renumbered: one graph."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = tiny_model("llama", seed=4, max_positions=48)
    _, _, engine = decode_run(model, make_policy("snap", BUDGET, window=4), 3, 60, "traced", positions="auto")
    assert engine.cache.seq.renumbered and counters["stats"]["unique_graphs"] == 1


def test_what_a_captured_step_reads_keeps_its_address_across_prefills_and_renumbering():
    """A captured step reads storage by address: a new chat turn (a prefill into the same cache), a long message
    with renumbered positions and a one-column chunk must write in place, never re-allocate (issue: a rotary
    table that grew under a captured step)."""
    model = tiny_model("llama", seed=8, max_positions=64)
    cache = H2OCache.for_model(model, make_policy("h2o", BUDGET), "auto")
    engine = Engine(model, cache, "eager")
    engine.set_sampler(HOT, 1)
    engine.decode(engine.first_tokens(engine.prefill(torch.randint(1, 256, (1, 20)), chunk_size=8)))
    version = cache.version
    buffers = [t.data_ptr() for t in (*cache.slots.buffers(), cache.slots.seen, cache.slots.next_rot)]
    sampler = [t.data_ptr() for t in (engine.sampler.recent, engine.sampler.draws, engine._tokens)]
    for length, chunk in ((9, 8), (120, 16), (17, 16)):  # a turn, a long message past the context, 1 + 16
        engine.decode(engine.first_tokens(engine.prefill(torch.randint(1, 256, (1, length)), chunk_size=chunk)))
    assert cache.seq.renumbered and cache.version == version
    assert [t.data_ptr() for t in (*cache.slots.buffers(), cache.slots.seen, cache.slots.next_rot)] == buffers
    assert [t.data_ptr() for t in (engine.sampler.recent, engine.sampler.draws, engine._tokens)] == sampler


def test_a_one_column_chunk_of_a_padded_batch_is_a_chunk():
    """A prompt one token over a multiple of the chunk size starts with a one-column chunk: where a row's column
    is padding it is neither stored nor counted (it was once taken for a decode step)."""
    model = tiny_model("llama", seed=9)
    ids, mask = left_pad([[5, 6, 7], [8]], 0)  # chunk 2: the first chunk is column 0 alone, padding in row 1
    cache = H2OCache.for_model(model, make_policy("h2o", BUDGET))
    together = Engine(model, cache, "eager").prefill(ids, mask, chunk_size=2)
    assert cache.slots.seen.tolist() == [3, 1]
    assert [sorted(p[p >= 0].tolist()) for p in cache.slots.pos[0, :, 0]] == [[0, 1, 2], [0]]
    for row, prompt in enumerate(([5, 6, 7], [8])):
        alone = Engine(model, H2OCache.for_model(model, make_policy("h2o", BUDGET)), "eager")
        torch.testing.assert_close(together[row], alone.prefill(torch.tensor([prompt]), chunk_size=2)[0])


def test_a_step_that_cannot_be_captured_runs_eagerly_and_says_why(monkeypatch):
    """The graph path's fallback, on CPU: CUDA's stream and graph calls are stood in for, and the capture fails
    as it does when a model reads the device inside its forward."""
    import contextlib
    from types import SimpleNamespace

    model = tiny_model("llama", seed=7)
    expected, _, _ = decode_run(model, make_policy("h2o", BUDGET), 1, 30, "eager")

    class Stream:
        def __init__(self, *args):
            pass

        def wait_stream(self, other):
            pass

    @contextlib.contextmanager
    def failing_graph(graph, pool=None):
        raise RuntimeError("operation not permitted when stream is capturing")
        yield

    fake = SimpleNamespace(
        Stream=Stream,
        stream=lambda s: contextlib.nullcontext(),
        current_stream=lambda device=None: Stream(),
        graph=failing_graph,
        CUDAGraph=lambda: object(),
        graph_pool_handle=lambda: None,
        synchronize=lambda device=None: None,
        device=lambda device: contextlib.nullcontext(),
    )
    monkeypatch.setattr(torch, "cuda", fake)
    ids, _ = prompts(1)
    cache = H2OCache.for_model(model, make_policy("h2o", BUDGET))
    engine = Engine(model, cache, "eager")
    engine.mode = "graph"
    engine.set_sampler(HOT, 1)
    tokens = engine.first_tokens(engine.prefill(ids, None, chunk_size=8))
    logits = []
    for i in range(30):
        out, tokens = engine.decode(tokens if i == 0 else None)
        logits.append(out.float().clone())
    assert engine.mode == "eager" and engine.describe() == "eager"
    notices = cache.pop_notices()
    assert len(notices) == 1 and notices[0].startswith("decode steps run eagerly: capturing one failed")
    torch.testing.assert_close(torch.stack(logits), expected)  # the step that failed to capture was taken, once


def test_decode_modes_are_checked():
    cpu = torch.device("cpu")
    assert resolve_decode("auto", cpu) == "eager" and resolve_decode("eager", cpu) == "eager"
    assert resolve_decode("auto", torch.device("cuda")) == "graph"
    with pytest.raises(ConfigError, match="needs a CUDA GPU"):
        resolve_decode("graph", cpu)
    with pytest.raises(ConfigError, match="^decode must be one of auto, eager, graph, compile"):
        resolve_decode("fast", cpu)
    assert resolve_decode("compile", torch.device("cuda")) == "compile"  # inductor's kernels in the CUDA graph
    with pytest.raises(ConfigError, match="compiles for a CPU or a CUDA GPU, not mps"):
        resolve_decode("compile", torch.device("mps"))


def test_a_new_sampler_gets_a_new_step_key_where_a_freed_one_lived():
    """Issue 41.4: a captured step is keyed on its sampler's serial number, not its id(): a sampler made after the
    last one was freed often lives at the same address, and must not replay a step that reads the freed one's
    tensors. Forty samplers of one shape, each made after the last was freed: forty keys."""
    import gc

    model = tiny_model("llama", seed=2)
    engine = Engine(model, H2OCache.for_model(model, make_policy("h2o", BUDGET)), "eager")
    tokens = engine.prefill(torch.randint(1, 256, (1, 12))).argmax(-1)
    keys, addresses = set(), set()
    gc.freeze()  # each collection below then scans only what the loop made (0.5 s a collection otherwise)
    try:
        for _ in range(40):
            engine.set_sampler(None, 1)  # the last sampler is freed
            gc.collect()
            engine.set_sampler(HOT, 1)
            addresses.add(id(engine.sampler))
            engine.decode(tokens)
            keys.add(engine._key)
    finally:
        gc.unfreeze()
    assert len(keys) == 40, f"{len(keys)} keys for 40 samplers at {len(addresses)} addresses"


# -- CUDA only ------------------------------------------------------------------------------------------------
@pytest.mark.cuda
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("family", ["llama", "opt"])
def test_cuda_captured_step_decides_as_the_eager_one(family, batch):
    model = tiny_model(family, seed=3).to("cuda")
    for name, make in POLICIES.items():
        eager_logits, eager_held, _ = decode_run(model, make(), batch, 310, "eager")
        logits, held, engine = decode_run(model, make(), batch, 310, "graph")
        for a, b in zip(held, eager_held, strict=True):
            assert same_held(a, b), name
        torch.testing.assert_close(logits, eager_logits, atol=1e-4, rtol=1e-4, msg=name)
        assert engine.captures == 1, name  # one capture served all 310 steps


@pytest.mark.cuda
@pytest.mark.parametrize("batch", [1, 3])
def test_cuda_compiled_step_decides_as_the_eager_one_in_one_capture(batch):
    """`--decode compile` on a GPU: inductor's kernels for the forward, the eviction after them, one CUDA graph
    for the whole step; it keeps what the eager step keeps (h2o, snap, and recall's store, which fills and drops),
    and one compiled program serves every policy of a kind."""
    model = tiny_model("llama", seed=3).to("cuda")
    policies = {**POLICIES, "recall": lambda: make_policy("recall", BUDGET, recalled=4, store=64)}
    for name in ("h2o", "snap", "recall"):
        eager_logits, eager_held, _ = decode_run(model, policies[name](), batch, 310, "eager")
        logits, held, engine = decode_run(model, policies[name](), batch, 310, "compile")
        notices = [n for n in engine.cache.pop_notices() if n.startswith("decode steps")]
        assert engine.mode == "compile" and notices == [], (name, notices)
        assert engine.describe().startswith("compiled CUDA graph") and engine.captures == 1, (name, engine.describe())
        for a, b in zip(held, eager_held, strict=True):
            assert same_held(a, b), name
        torch.testing.assert_close(logits, eager_logits, atol=1e-4, rtol=1e-4, msg=name)
    assert len(compiled._fused[model]) == 2  # h2o and snap share one kind; recall has its own


@pytest.mark.cuda
@pytest.mark.parametrize("positions", ["absolute", "rolling", "auto"])
def test_cuda_replays_after_new_prefills_equal_the_eager_step(positions):
    """A chat: a captured step, then a second turn's prefill, a long message (renumbering past the context in
    rolling and auto), a one-column chunk; every later replay equals the eager step."""
    model = tiny_model("llama", seed=10, max_positions=96).to("cuda")

    def chat(decode: str):
        cache = H2OCache.for_model(model, make_policy("h2o", BUDGET), positions)
        engine = Engine(model, cache, decode)
        engine.set_sampler(HOT, 1)
        g = torch.Generator().manual_seed(0)
        out = []
        for length, chunk in ((20, 8), (9, 8), (150, 16), (17, 16)):
            ids = torch.randint(1, 256, (1, length), generator=g).cuda()
            out += [t[0] for t in engine.tokens(engine.prefill(ids, chunk_size=chunk), 24)]
        return out, engine

    eager, _ = chat("eager")
    graph, engine = chat("graph")
    assert graph == eager and engine.captures == 1


class FakeCuda:
    """CUDA calls faked for a step that runs on the CPU: graphs that replay nothing, the current device (and the
    one each capture began on), and the allocator's count of live graphs per memory pool, with its assertion (a
    capture into a pool whose graphs are all gone fails)."""

    def __init__(self, monkeypatch):
        import contextlib

        self.live: dict[int, int] = {}  # pool -> graphs alive that were captured into it
        self.current, self.captured_on = ["cuda:0"], []
        live, current, captured_on = self.live, self.current, self.captured_on

        class Device:  # torch.cuda.device(d): the current device within the block
            def __init__(self, device):
                self.device = str(torch.device(device))

            def __enter__(self):
                self.before, current[0] = current[0], self.device

            def __exit__(self, *exc):
                current[0] = self.before

        class Graph:
            def __init__(self):
                self.pool = None

            def replay(self):
                pass

            def __del__(self):
                if self.pool is not None:
                    live[self.pool] -= 1  # the entry stays: a buffer first made in a capture still holds memory

        class Stream:
            def wait_stream(self, other):
                pass

        @contextlib.contextmanager
        def graph(cuda_graph, pool=None):
            captured_on.append(current[0])
            if pool in live and live[pool] == 0:
                raise RuntimeError("it->second->use_count > 0 INTERNAL ASSERT FAILED")
            live[pool] = live.get(pool, 0) + 1
            cuda_graph.pool = pool
            yield

        fakes = {"device": Device, "Stream": lambda device=None: Stream(),
                 "current_stream": lambda device=None: Stream(), "stream": lambda s: contextlib.nullcontext(),
                 "graph": graph, "graph_pool_handle": lambda: 7, "CUDAGraph": Graph,
                 "synchronize": lambda device=None: None}  # fmt: skip
        for name, fake in fakes.items():
            monkeypatch.setattr(torch.cuda, name, fake)


def test_a_graph_for_the_second_gpu_is_captured_on_that_gpu(monkeypatch):
    """Issue 49.5: PyTorch captures on the current device's stream unless told; a model on cuda:1 must capture and
    replay on cuda:1. No GPU here: the step runs on the CPU, and the CUDA calls around it record which device was
    current when the capture began (as the fake two-GPU map test in test_config_loading.py fakes its devices)."""
    model = tiny_model("llama", seed=4)
    engine = Engine(model, H2OCache.for_model(model, make_policy("h2o", BUDGET)), "eager")
    engine.decode(engine.first_tokens(engine.prefill(torch.randint(1, 256, (1, 12)))))  # the step's input, on CPU
    cuda = FakeCuda(monkeypatch)
    engine.mode, engine.device = "graph", torch.device("cuda", 1)
    for _ in range(3):  # two warm-up steps, then the capture
        engine.decode()
    assert cuda.captured_on == ["cuda:1"] and engine.captures == 1 and cuda.current == ["cuda:0"]


def _engine_on_fake_cuda(monkeypatch, mode: str, rows: int = 3) -> tuple[Engine, FakeCuda]:
    """An engine whose steps run on the CPU as if on a GPU (`mode` graph or compile), a prompt read."""
    model = tiny_model("llama", seed=4)
    engine = Engine(model, H2OCache.for_model(model, make_policy("h2o", BUDGET)), "eager")
    ids, mask = prompts(rows)
    engine.decode(engine.first_tokens(engine.prefill(ids, mask)))
    cuda = FakeCuda(monkeypatch)
    engine.mode, engine.device = mode, torch.device("cuda", 0)
    return engine, cuda


def test_a_step_captured_again_shares_a_pool_that_a_live_graph_still_holds(monkeypatch):
    """The GPU check's server fell back to eager steps: "capturing one failed (it->second->use_count > 0 INTERNAL
    ASSERT FAILED)". A graph's pool outlives its graphs while memory it gave out is still held, and the allocator
    refuses a capture into a pool whose graphs are all gone. A lane whose rows change captures again into its
    engine's one pool: the graph it forgot must still be alive then."""
    engine, cuda = _engine_on_fake_cuda(monkeypatch, "graph")
    for rows in (None, [0, 2], [1]):  # a row leaves, then another: each a new shape, captured again
        if rows is not None:  # (the rows are on the CPU, where the step runs)
            engine.device = torch.device("cpu")
            engine.select_rows(torch.tensor(rows))
            engine.device = torch.device("cuda", 0)
        for _ in range(4):  # two warm-up steps, a capture, a replay
            engine.decode()
    assert engine.mode == "graph" and engine.captures == 3, engine.cache.pop_notices()
    assert cuda.live == {7: 1}  # the graphs forgotten were let go once the next was captured


def _failing_backend(graph, example_inputs):
    _failing_backend.calls += 1
    raise RuntimeError("inductor could not lower an operator")


_failing_backend.calls = 0


@pytest.mark.parametrize("backend", ["no_such_backend", _failing_backend])
def test_a_gpu_step_that_fails_to_compile_is_captured_without_inductor_and_says_why(monkeypatch, backend):
    """`--decode compile` on a GPU compiles at the capture's first warm-up step; a compilation that fails, when
    the program is made (a backend that does not exist) or at its first call (a backend that fails to compile),
    leaves the plain captured step, not eager steps, and a notice."""
    monkeypatch.setattr(compiled, "in_process", lambda device: True)
    monkeypatch.setattr(compiled, "FUSED_BACKEND", backend)
    engine, _ = _engine_on_fake_cuda(monkeypatch, "compile")
    columns = engine.cache.seq.columns
    for _ in range(5):  # the failed warm-up (its step taken eagerly), two warm-ups, a capture, a replay
        logits, _ = engine.decode()
    notices = engine.cache.pop_notices()
    assert engine.mode == "graph" and engine.captures == 1 and engine._compiled.program is None
    assert len(notices) == 1, notices
    assert notices[0].startswith("decode steps run as a CUDA graph without inductor's kernels: compiling one failed")
    assert engine.cache.seq.columns == columns + 5  # the failed attempt's bookkeeping undone, its step taken once
    # a new engine of the model (a /reset, a server's lane) falls back at once, without compiling again
    calls = _failing_backend.calls
    again = Engine(engine.model, H2OCache.for_model(engine.model, make_policy("h2o", BUDGET)), "eager")
    again.decode(again.first_tokens(again.prefill(prompts(3)[0], prompts(3)[1])))
    again.mode, again.device = "compile", torch.device("cuda", 0)
    again.decode()
    assert again.mode == "graph" and _failing_backend.calls == calls
    assert again.cache.pop_notices()[0].startswith("decode steps run as a CUDA graph without inductor's kernels")
    compiled._fused.pop(engine.model, None)


def test_pytest_m_cuda_selects_the_cuda_tests():
    """scripts/gpu_check.sh runs `pytest -m cuda`: every CUDA test carries the mark (conftest skips them without a
    GPU), so the check runs them all (it used to select none: they only had skipif)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).parent.parent
    command = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "cuda", "-p", "no:cacheprovider", "tests/"]
    out = subprocess.run(command, cwd=root, capture_output=True, text=True, timeout=300).stdout
    selected = {line.split("::")[1].split("[")[0] for line in out.splitlines() if "::" in line}
    named = set()
    for path in (root / "tests").glob("test_*.py"):
        named |= {line.split("(")[0][4:] for line in path.read_text().splitlines() if line.startswith("def test_cuda_")}
    named.discard("test_cuda_device_without_gpu")  # a CPU test: the error a CUDA request gets without a GPU
    named.discard("test_cuda_request_without_gpu")
    assert named and named <= selected, named - selected
    assert {"test_a_captured_8bit_step_decodes_as_the_eager_one", "test_cuda_graph_replays_never_sync"} <= selected


@pytest.mark.cuda
def test_cuda_graph_replays_never_sync():
    model = tiny_model("llama", seed=6).to("cuda", torch.float16)
    cache = H2OCache.for_model(model, make_policy("h2o", 32))
    engine = Engine(model, cache, "graph")
    engine.set_sampler(HOT, 2)
    tokens = engine.first_tokens(engine.prefill(torch.randint(0, 256, (2, 48), device="cuda")))
    for i in range(4):  # warm-up steps and the capture
        engine.decode(tokens if i == 0 else None)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(16):
            engine.decode()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert engine.captures == 1 and cache.stats().kept == 32


@pytest.mark.parametrize("policy", ["h2o", "snap", "full"])
def test_a_row_refilled_mid_stream_decodes_as_its_prompt_alone(policy):
    """Continuous batching: row 1 takes a new prompt while rows 0 and 2 keep decoding; the new prompt's greedy
    tokens equal the same prompt alone, the other rows' equal a run without the refill, and the storage (what
    a captured step reads) keeps its addresses."""
    model = tiny_model("llama", seed=11)
    ids, mask = prompts(3)
    fresh = torch.randint(1, 256, (1, 37), generator=torch.Generator().manual_seed(9))

    def make():
        cache = H2OCache.for_model(model, make_policy(policy, BUDGET) if policy != "full" else make_policy("full"))
        cache.reserve(80)
        return cache, Engine(model, cache, "eager")

    def run(refill_at: int | None):
        cache, engine = make()
        tokens = engine.first_tokens(engine.prefill(ids, mask, chunk_size=8))
        rows, pointer = [[] for _ in range(3)], cache.slots.keys.data_ptr()
        for i in range(30):
            if i == refill_at:
                tokens[1] = engine.refill(1, fresh, chunk_size=8)
                rows[1] = []
            for r in range(3):
                rows[r].append(int(tokens[r]))
            tokens = engine.decode(tokens)[1].clone()
        assert cache.slots.keys.data_ptr() == pointer
        return rows

    plain, refilled = run(None), run(12)
    assert refilled[0] == plain[0] and refilled[2] == plain[2]
    _, alone = make()
    tokens = alone.first_tokens(alone.prefill(fresh, chunk_size=8))
    expected = []
    for _ in range(18):
        expected.append(int(tokens[0]))
        tokens = alone.decode(tokens)[1].clone()
    assert refilled[1] == expected


@pytest.mark.parametrize("layers", [2, 8])
def test_a_prefill_chunk_runs_about_as_many_operators_as_transformers(layers):
    """Issue 17: the host's cost of reading a prompt is its operator count. A chunk that attends over a full
    cache and evicts (h2o) runs at most 1.5x the operators of transformers' own SDPA forward of the same chunk
    over a DynamicCache (before the rewrite: ~2.7x, with the mask rebuilt per layer and three sorts per chunk),
    and policies that need no attention mass about as many; snap's probe pass included, it stays within 1.5x
    per chunk read."""
    from transformers import DynamicCache

    model = tiny_model("llama", seed=1, layers=layers)
    T = 32
    ids = torch.randint(4, 256, (1, 3 * T), generator=torch.Generator().manual_seed(0))
    with attention(model, "sdpa"), torch.inference_mode():
        reference = DynamicCache(config=model.config)
        model(input_ids=ids[:, : 2 * T], **cached(model, reference), use_cache=True, logits_to_keep=1)
        with OperatorCount() as ops:
            model(input_ids=ids[:, 2 * T :], **cached(model, reference), use_cache=True, logits_to_keep=1)
    base = ops.total
    for name, bound in (("full", 1.15), ("recent", 1.15), ("h2o", 1.5), ("snap", 1.5)):
        engine = Engine(model, H2OCache.for_model(model, make_policy(name, T)))
        counts, forward = [], engine._forward

        def counted(*args, _forward=forward, _counts=counts, **kwargs):
            with OperatorCount() as ops:
                out = _forward(*args, **kwargs)
            _counts.append(ops.total)
            return out

        engine._forward = counted
        with torch.inference_mode():
            engine.prefill(ids, chunk_size=T)
        assert len(counts) == (6 if name == "snap" else 3), (name, counts)  # snap: the probe reads the prompt too
        assert sum(counts) <= bound * base * len(counts), (name, counts, base)
        assert max(counts) <= 1.75 * base, (name, counts, base)


@pytest.mark.parametrize("kv_quant", ["none", "8bit"])
def test_a_filling_cache_steps_over_what_it_holds_and_decides_as_over_every_slot(kv_quant, monkeypatch, single_thread):
    """A step reads the first slots its rows can hold (`forward.read_width`: 32, 64, 96, then all), not its whole
    budget, and while every row has room its token takes the first empty slot without ranking any (`evict.append`):
    the first turns of a chat at a large budget were read at the budget's cost. Over a left-padded batch of three
    filling, then evicting: the same logits and every token in the same slot as reading and ranking every slot, for
    h2o, snap, sink and recall (its store ranked beside the slots: every token in the same entry too). Reading
    fewer slots sums in another order (last-bit differences, ~3e-6 here); recall's store rounds what it keeps to
    int8, and on some CPUs (an AVX2 EPYC) such a difference put two stored values one step of int8 apart, which
    moved its later logits by up to ~3e-3: recall's logits are compared to within what one such step can move."""
    from h2o_chat.engine import forward

    model = tiny_model("llama", seed=12)
    real, widths = forward.read_width, []

    def narrow(*args):
        widths.append(real(*args))
        return widths[-1]

    makes = {
        "h2o": lambda: make_policy("h2o", 100),
        "snap": lambda: make_policy("snap", 100, window=4),
        "sink": lambda: make_policy("sink", 100),
        "recall": lambda: make_policy("recall", 100),
        # rows of budgets 100, 40 and 100: the second is full (and evicts) while the others still fill
        "mixed": lambda: [make_policy("h2o", 100), make_policy("h2o", 40), make_policy("snap", 100, window=4)],
    }
    for name, make in makes.items():
        runs = []
        for width in (narrow, lambda *args: None):
            monkeypatch.setattr(forward, "read_width", width)
            ids, mask = prompts(3)
            rows = [1, 1, 1] if name == "mixed" else None
            cache = H2OCache.for_model(model, make(), "absolute", rows=rows, kv_quant=kv_quant)
            engine = Engine(model, cache, "eager")
            engine.set_sampler(HOT, 3)
            tokens = engine.first_tokens(engine.prefill(ids, mask, chunk_size=8))
            logits = []
            for i in range(110):  # 27 + 110 columns: through widths 32 .. 128 and past the budget of 100
                out, tokens = engine.decode(tokens if i == 0 else None)
                logits.append(out.clone())
            stored = None if cache.store is None else cache.store.pos.clone()
            runs.append((torch.stack(logits), cache.slots.pos.clone(), stored))
        (read, held, stored), (read_all, held_all, stored_all) = runs
        assert torch.equal(held, held_all), name  # every token in the same slot
        assert (stored is None) == (name != "recall")
        assert stored is None or torch.equal(stored, stored_all), name  # and in the same entry of the store
        tolerance = 1e-2 if name == "recall" else 1e-5
        torch.testing.assert_close(read, read_all, atol=tolerance, rtol=tolerance, msg=name)
    assert {32, 64, 96, None} <= set(widths), sorted(set(widths), key=str)


def test_a_prompt_ranks_the_store_it_has_filled_and_recalls_as_over_every_entry(monkeypatch, single_thread):
    """A prompt chunk ranked every entry of recall's store, though the store holds no more than its rows have
    evicted by the chunk's end: reading a long prompt paid for the whole store from its first chunk. A chunk now
    ranks the first `read_width` entries: a left-padded batch of three 300-token prompts read in chunks of 16,
    the store filling past 192 entries, gives the same logits, slots, store and recall counts as ranking every
    entry, and the decode steps after it too."""
    from h2o_chat.engine.policies import recall_rank

    model = tiny_model("llama", seed=14)
    real, widths = recall_rank.read_width, []

    def narrow(store):
        widths.append(real(store))
        return widths[-1]

    g = torch.Generator().manual_seed(5)
    rows = [torch.randint(1, 256, (n,), generator=g).tolist() for n in (300, 260, 290)]
    runs = []
    for width in (narrow, lambda store: None):
        monkeypatch.setattr(recall_rank, "read_width", width)
        ids, mask = left_pad(rows, 0)
        cache = H2OCache.for_model(model, make_policy("recall", 24, recalled=4, store=400), "absolute")
        engine = Engine(model, cache, "eager")
        first = engine.prefill(ids, mask, chunk_size=16)
        logits = [first.clone()]
        tokens = first.argmax(-1)
        for i in range(20):
            out, tokens = engine.decode(tokens if i == 0 else None)
            logits.append(out.clone())
        store = cache.store
        held = store.pos >= 0
        runs.append((torch.stack(logits), cache.slots.pos.clone(), store.pos.clone(), store.marks[held].clone()))
    for a, b, what in zip(*runs, ("logits", "slots", "store", "recall counts"), strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=what)
    assert {64, 128, 192, 256} <= set(widths), sorted(set(widths), key=str)


def test_a_filling_store_is_ranked_over_what_it_holds_and_recalls_as_over_every_entry(monkeypatch, single_thread):
    """Recall ranked every entry of its store at every step, though a store fills in order and holds no more than
    its rows have evicted: a chat paid for 4,096 empty entries per layer from its first token (58-60 ms a step
    eagerly against h2o's 27-29, embedded model). A step now ranks the first entries a row can have stored
    (`recall_rank.read_width`: 64, 128, ...): over a left-padded batch of three whose store fills past 128 entries,
    the same logits, the same slots and the same store, entry by entry, as ranking every entry."""
    from h2o_chat.engine.policies import recall_rank

    model = tiny_model("llama", seed=13)
    real, widths = recall_rank.read_width, []

    def narrow(store):
        widths.append(real(store))
        return widths[-1]

    runs = []
    for width in (narrow, lambda store: None):
        monkeypatch.setattr(recall_rank, "read_width", width)
        ids, mask = prompts(3)
        cache = H2OCache.for_model(model, make_policy("recall", 24, recalled=4, store=400), "absolute")
        engine = Engine(model, cache, "eager")
        engine.set_sampler(HOT, 3)
        tokens = engine.first_tokens(engine.prefill(ids, mask, chunk_size=8))
        logits = []
        for i in range(200):
            out, tokens = engine.decode(tokens if i == 0 else None)
            logits.append(out.clone())
        store = cache.store
        held = store.pos >= 0  # an empty entry a step picked among others counts nothing (it is never attended)
        runs.append((torch.stack(logits), cache.slots.pos.clone(), store.pos.clone(), store.marks[held].clone()))
    for a, b, what in zip(*runs, ("logits", "slots", "store", "recall counts"), strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=what)
    assert {64, 128, 192} <= set(widths), sorted(set(widths), key=str)
