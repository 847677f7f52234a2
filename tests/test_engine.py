"""The decode engine: a static step that never reads the device, and captured/compiled steps that decide exactly
as the eager one does. CPU runs torch.compile with a cheap backend; CUDA runs graph capture and inductor."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import tiny_model
from h2o_chat.engine.cache import H2OCache
from h2o_chat.engine.decode import Engine, left_pad, resolve_decode
from h2o_chat.engine.policies import make_policy
from h2o_chat.engine.sampling import Sampler
from h2o_chat.errors import ConfigError

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible to torch)")

BUDGET = 16
POLICIES = {
    "h2o": lambda: make_policy("h2o", BUDGET),
    "sink": lambda: make_policy("sink", BUDGET),
    "recent": lambda: make_policy("recent", BUDGET),
    "snap": lambda: make_policy("snap", BUDGET, window=4),
}
HOT = Sampler(temperature=0.8, top_p=0.9, seed=7, repetition_penalty=1.2)


class HostReads(TorchDispatchMode):
    """Records every operator that makes the host wait for a tensor's value."""

    SYNCING = ("_local_scalar_dense", "item", "nonzero", "is_nonzero", "equal", "allclose")

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

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


def decode_run(model, policy, batch: int, steps: int, decode: str, positions="absolute", backend=None):
    """Prefill, then `steps` sampled decode steps; logits of every step and the held positions at three points."""
    ids, mask = prompts(batch)
    ids, mask = ids.to(model.device), None if mask is None else mask.to(model.device)
    cache = H2OCache.for_model(model, policy, positions)
    engine = Engine(model, cache, decode, compile_backend=backend)
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
    with sampling, a repetition penalty, padding and rolling positions."""
    model = tiny_model("llama", seed=1)
    for positions in ("absolute", "rolling"):
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
    assert cache.stats().kept == BUDGET


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("family", ["llama", "opt"])
def test_compiled_step_decides_as_the_eager_one(family, batch, single_thread):
    """torch.compile(fullgraph=True) of the whole step (a cheap backend on CPU): over 300 steps past the budget,
    the same held positions in every layer and head, the same logits, for h2o, sink, recent and snap."""
    torch._dynamo.reset()
    model = tiny_model(family, seed=3)
    for name, make in POLICIES.items():
        eager_logits, eager_held, _ = decode_run(model, make(), batch, 310, "eager")
        logits, held, engine = decode_run(model, make(), batch, 310, "compile", backend="aot_eager")
        for a, b in zip(held, eager_held, strict=True):
            assert same_held(a, b), name
        torch.testing.assert_close(logits, eager_logits, atol=1e-5, rtol=1e-5, msg=name)
        assert engine.setup_seconds > 0 and engine.describe().startswith("compiled")


def test_compiled_step_compiles_once(single_thread):
    """Nothing the step reads changes between steps: one compilation serves every step, rolling included."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = tiny_model("llama", seed=4)
    decode_run(model, make_policy("snap", BUDGET, window=4), 3, 60, "compile", positions="rolling", backend="eager")
    assert counters["stats"]["unique_graphs"] == 1


def test_a_step_that_cannot_be_compiled_runs_eagerly_and_says_why(monkeypatch):
    model = tiny_model("llama", seed=7)
    expected, _, _ = decode_run(model, make_policy("h2o", BUDGET), 1, 30, "eager")
    real = H2OCache.decode_positions

    def breaks(self):
        torch._dynamo.graph_break()  # what a model doing host work in its forward would do
        return real(self)

    monkeypatch.setattr(H2OCache, "decode_positions", breaks)
    torch._dynamo.reset()
    logits, _, engine = decode_run(model, make_policy("h2o", BUDGET), 1, 30, "compile", backend="eager")
    assert engine.mode == "eager" and engine.describe() == "eager"
    notices = engine.cache.pop_notices()
    assert len(notices) == 1 and notices[0].startswith("decode steps run eagerly: capturing one failed")
    torch.testing.assert_close(logits, expected)  # the step that failed to compile was still taken, once


def test_decode_modes_are_checked():
    cpu = torch.device("cpu")
    assert resolve_decode("auto", cpu) == "eager" and resolve_decode("compile", cpu) == "compile"
    assert resolve_decode("auto", torch.device("cuda")) == "graph"
    with pytest.raises(ConfigError, match="needs a CUDA GPU"):
        resolve_decode("graph", cpu)
    with pytest.raises(ConfigError, match="--decode must be one of"):
        resolve_decode("fast", cpu)


def test_rows_can_leave_a_batch_mid_stream():
    """keep_rows() between steps: the remaining rows go on exactly as if the others had never left."""
    model = tiny_model("llama", seed=5)
    ids, mask = prompts(3)

    def stream(keep_at: int | None):
        cache = H2OCache.for_model(model, make_policy("h2o", BUDGET))
        engine = Engine(model, cache, "eager")
        out = []
        for i, row_tokens in enumerate(engine.tokens(engine.prefill(ids, mask, 8), 40)):
            out.append(row_tokens)
            if i == keep_at:
                engine.keep_rows(torch.tensor([0, 2]))
        return out, cache

    full, _ = stream(None)
    dropped, cache = stream(10)
    assert [t[0] for t in dropped] == [t[0] for t in full]
    assert [t[-1] for t in dropped] == [t[2] for t in full]
    assert cache.slots.batch == 2


# -- CUDA only ------------------------------------------------------------------------------------------------
@needs_cuda
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("family", ["llama", "opt"])
@pytest.mark.parametrize("mode", ["graph", "compile"])
def test_cuda_captured_step_decides_as_the_eager_one(family, batch, mode):
    torch._dynamo.reset()
    model = tiny_model(family, seed=3).to("cuda")
    for name, make in POLICIES.items():
        eager_logits, eager_held, _ = decode_run(model, make(), batch, 310, "eager")
        logits, held, engine = decode_run(model, make(), batch, 310, mode)
        for a, b in zip(held, eager_held, strict=True):
            assert same_held(a, b), name
        torch.testing.assert_close(logits, eager_logits, atol=1e-4, rtol=1e-4, msg=name)
        if mode == "graph":
            assert engine.captures == 1, name  # one capture served all 310 steps


@needs_cuda
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
