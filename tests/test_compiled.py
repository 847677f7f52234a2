"""The CPU's decode step compiled ahead of time (`--decode compile`, what `auto` runs on a CPU): the same tokens and
the same kept positions, per layer and head, as eager steps, recall's store included; one program per kind of
step, shared by every engine of a model and any budget, batch or store size; a package that is missing, damaged
or being built leaves the steps eager, and the user is told why."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from conftest import tiny_model
from h2o_chat.engine.cache import H2OCache
from h2o_chat.engine.policies import make_policy
from h2o_chat.engine.step import compiled
from h2o_chat.engine.step.decode import EAGER_WHILE_BUILDING, Engine, left_pad, resolve_decode
from h2o_chat.engine.step.sampling import Sampler

pytestmark = pytest.mark.skipif(compiled.unavailable() is not None, reason="no C++ compiler for the compiled step")
STEPS = 240


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", seed=41, max_positions=128)


def _run(model, mode, policy, positions, prompts, sampled=False, steps=STEPS, budget=24, **knobs):
    cache = H2OCache.for_model(model, make_policy(policy, budget, **knobs), positions)
    engine = Engine(model, cache, mode)
    ids, mask = left_pad(prompts, 0)
    if sampled:
        engine.set_sampler(Sampler(temperature=0.8, top_p=0.9, seed=3, repetition_penalty=1.1), len(prompts))
    tokens, pos = [], []
    for step, row_tokens in enumerate(engine.tokens(engine.prefill(ids, mask, chunk_size=16), steps)):
        tokens.append(row_tokens)
        if step % 40 == 0:
            pos.append(cache.slots.pos.clone())
            if cache.store is not None:
                pos.append(cache.store.pos.long().clone())
    return tokens, pos, engine, cache


def _prompts(rows: int) -> list[list[int]]:
    return [[(7 * i + 3 * r) % 250 + 1 for i in range(40 - 9 * r)] for r in range(rows)]


@pytest.mark.parametrize(
    "policy, positions, rows, sampled, knobs",
    [
        ("h2o", "auto", 1, False, {}),  # past the trained context of 128: renumbered on the way
        ("snap", "rolling", 2, True, {}),  # a padded batch, sampled
        ("recall", "auto", 2, True, {"recalled": 4, "store": 32}),  # the store fills, then drops
        ("recall", "auto", 2, True, {"recalled": 4, "store": 200}),  # steps rank 64, 128, 192 entries, then all
        ("h2o", "absolute", 2, True, {"budget": 100}),  # steps read the first 64, 96 slots, then every one
    ],
)
def test_the_compiled_step_keeps_what_the_eager_step_keeps(model, policy, positions, rows, sampled, knobs):
    want, want_pos, _, _ = _run(model, "eager", policy, positions, _prompts(rows), sampled, **knobs)
    got, got_pos, engine, cache = _run(model, "compile", policy, positions, _prompts(rows), sampled, **knobs)
    assert engine.mode == "compile" and engine._compiled.program is not None, cache.pop_notices()
    assert got == want
    assert all(torch.equal(a, b) for a, b in zip(got_pos, want_pos, strict=True))  # every 40 steps
    assert cache.stats().seen == 40 + STEPS - 1
    if policy == "recall":
        assert cache.stats().store_dropped > 0 and cache.stats().store_tokens == knobs["store"]


def test_a_step_compiled_in_process_keeps_what_the_eager_step_keeps_as_rows_leave(model, monkeypatch):
    """What a GPU runs under `--decode compile` (`compiled.Fused`: the step exported as for a package, compiled in
    process, captured there with the eviction), checked on a CPU through dynamo and AOT autograd (inductor's
    Triton kernels are the GPU check's): the same tokens and kept positions as eager steps, a row leaving midway
    (a new batch size, compiled again), one program per kind of step, its setup counted once."""
    monkeypatch.setattr(compiled, "in_process", lambda device: True)
    monkeypatch.setattr(compiled, "FUSED_BACKEND", "aot_eager")
    compiled._fused.pop(model, None)

    def run(mode, policy, **knobs):
        cache = H2OCache.for_model(model, make_policy(policy, 24, **knobs), "auto")
        engine = Engine(model, cache, mode)
        ids, mask = left_pad(_prompts(3), 0)
        engine.set_sampler(Sampler(temperature=0.8, top_p=0.9, seed=3), 3)
        tokens = engine.first_tokens(engine.prefill(ids, mask, chunk_size=16))
        out = []
        for i in range(120):
            if i == 60:  # the middle row is done: it leaves the batch
                engine.select_rows(torch.tensor([0, 2]))
                tokens = tokens[[0, 2]]
            tokens = engine.decode(tokens if i in (0, 60) else None)[1]
            out.append(tokens.tolist())
        return out, cache.slots.pos.clone(), engine

    for policy, knobs in (("h2o", {}), ("recall", {"recalled": 4, "store": 32})):
        want, want_pos, _ = run("eager", policy, **knobs)
        got, got_pos, engine = run("compile", policy, **knobs)
        assert isinstance(engine._compiled.program, compiled.Fused), engine.cache.pop_notices()
        assert got == want and torch.equal(got_pos, want_pos), policy
        assert engine.captures == 2 and engine.setup_seconds > 0  # compiled at batch 3, then at batch 2
    assert len(compiled._fused[model]) == 2  # one per kind of step
    compiled._fused.pop(model)


def test_one_program_serves_every_budget_batch_and_engine_and_old_storage_is_freed(model):
    """A chat that changes its budget ten times, and ten new caches and engines (what /reset makes), stay
    compiled through one loaded program, and what an old step read is freed: a program belongs to no engine."""
    before = set(compiled._loaded.get(model, {}))
    cache = H2OCache.for_model(model, make_policy("h2o", 24), "auto")
    engine = Engine(model, cache, "compile")
    tokens = engine.first_tokens(engine.prefill(torch.tensor([_prompts(1)[0]])))
    gone = []
    for budget in range(26, 46, 2):
        for _ in range(5):
            tokens = engine.decode(tokens)[1]
        gone.append(weakref.ref(cache.slots.keys))
        cache.set_policy(make_policy("h2o", budget))
    for _ in range(5):
        tokens = engine.decode(tokens)[1]
    caches = []
    for _ in range(10):  # new caches and engines over the same model
        other = Engine(model, H2OCache.for_model(model, make_policy("h2o", 30), "auto"), "compile")
        list(other.tokens(other.prefill(torch.tensor([_prompts(2)[1]])), 3))
        caches.append(weakref.ref(other.cache.slots.keys))
        assert other.mode == "compile"
    del other
    gc.collect()
    assert engine.mode == "compile" and cache.slots.capacity == 44
    assert not any(ref() is not None for ref in gone + caches)  # every old storage freed
    kind = compiled.package_key(model, compiled.StepKind())
    assert set(compiled._loaded[model]) - before <= {kind}  # one kind of step: one program, loaded once


def test_a_damaged_package_is_built_again_and_a_failed_build_leaves_eager_steps_with_the_reason(model, monkeypatch):
    prompts = [_prompts(1)[0][:30]]
    want, want_pos, _, _ = _run(model, "eager", "h2o", "auto", prompts, steps=20)
    cache = H2OCache.for_model(model, make_policy("h2o", 24), "auto")
    path = compiled.cache_dir() / f"step-{compiled.package_key(model, compiled.StepKind())}.pt2"
    compiled._loaded.pop(model, None)
    path.parent.mkdir(parents=True, exist_ok=True)
    built = path.read_bytes() if path.exists() else None
    path.write_bytes(b"not a package")
    got, got_pos, engine, cache = _run(model, "compile", "h2o", "auto", prompts, steps=20)
    assert got == want and engine.mode == "compile" and path.stat().st_size > 1000  # built again
    if built is None:
        assert path.read_bytes() != b"not a package"

    def broken(*args, **kwargs):
        raise RuntimeError("the C++ compiler failed\nmore detail")

    compiled._loaded.pop(model, None)
    monkeypatch.setattr(compiled, "build", broken)
    path.unlink()
    got, got_pos, engine, cache = _run(model, "compile", "h2o", "auto", prompts, steps=20)
    assert engine.mode == "eager" and got == want and all(map(torch.equal, got_pos, want_pos))
    notes = cache.pop_notices()
    assert any("compiling one failed (the C++ compiler failed)" in n for n in notes), notes


def test_auto_compiles_on_cpu_and_decodes_eagerly_while_a_package_is_built(model, monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.delenv("H2O_CHAT_DECODE", raising=False)
    assert resolve_decode("auto", cpu) == "compile"
    monkeypatch.setenv("H2O_CHAT_DECODE", "eager")
    assert resolve_decode("auto", cpu) == "eager"
    monkeypatch.setattr(compiled, "unavailable", lambda: "no C++ compiler (g++) for the compiled step")
    monkeypatch.delenv("H2O_CHAT_DECODE")
    assert resolve_decode("auto", cpu) == "eager"
    monkeypatch.undo()
    monkeypatch.delenv("H2O_CHAT_DECODE", raising=False)
    # a kind not built yet: auto asks the builder once and steps eagerly meanwhile
    monkeypatch.setattr(compiled, "ready", lambda *a: False)
    cache = H2OCache.for_model(model, make_policy("sink", 24), "auto")
    engine = Engine(model, cache, "auto")
    asked = []
    engine.builder = asked.append
    list(engine.tokens(engine.prefill(torch.tensor([_prompts(1)[0]])), 10))
    assert engine._compiled.program is None and asked == [compiled.StepKind()]
    assert engine.describe() == "eager (the compiled step is being built)" and engine.stepping == "eager"
    # and said once: the eager step rounds otherwise than the compiled one, so a later run's text can part
    notices = cache.pop_notices()
    assert notices.count(EAGER_WHILE_BUILDING) == 1, notices
    list(engine.tokens(engine.prefill(torch.tensor([[5, 6, 7]])), 3))
    assert EAGER_WHILE_BUILDING not in cache.pop_notices()
    engine.builder = None  # nothing builds it (a library's engine): not said to be built
    assert engine.describe() == "eager (the compiled step is not built)" and engine.stepping == "eager"
    monkeypatch.setattr(compiled, "ready", lambda *a: True)  # built: the next step runs it
    list(engine.tokens(engine.prefill(torch.tensor([[5, 6, 7]])), 3))
    assert engine._compiled.program is not None and engine.describe().startswith("compiled")
    assert engine.stepping == "compile"


def test_rows_joining_and_leaving_a_server_lane_reuse_one_compiled_program(model, monkeypatch):
    """Issue 49.4: a server lane's rows come and go (a prompt read beside the rows and moved into a free one, the
    lane grown to 2 and 4 rows, rows stopped, the lane shrunk): every step runs the one loaded program, built at
    most once (before the first step) and never again."""
    from types import SimpleNamespace

    from h2o_chat.app.serve.rows import EngineSettings, Lane, LaneKey

    builds: list[int] = []
    real_build = compiled.build
    monkeypatch.setattr(compiled, "build", lambda *a, **k: (builds.append(1), real_build(*a, **k))[1])
    loaded = SimpleNamespace(model=model, tokenizer=SimpleNamespace(pad_token_id=0), context=128, device=model.device)
    lane = Lane(loaded, LaneKey("h2o", 24, True, True), make_policy("h2o", 24), EngineSettings(decode="compile"))
    request = SimpleNamespace(temperature=0.7, repetition_penalty=1.1, top_k=0, min_p=0.0, top_p=0.9, seed=1)
    programs = set()

    def join(r: int, n: int) -> None:
        reading = lane.read(None, [(5 + 3 * i) % 250 + 1 for i in range(n)])
        while not reading.advance():
            pass
        lane.jobs[r] = SimpleNamespace(reading=None)
        lane.enter(r, reading, request)

    def steps() -> None:
        for _ in range(6):
            lane.step()
            programs.add(id(lane.engine._compiled.program))

    join(0, 30)
    steps()
    built = len(builds)
    for rows, new in ((2, [1]), (4, [2, 3])):
        lane.resize(rows)
        for r in new:
            join(r, 20 + r)
        steps()
    for r in (1, 3):
        lane.stop(r, keep=False)
    lane.resize(2)
    steps()
    assert lane.engine.mode == "compile" and len(programs) == 1 and None not in programs
    assert built <= 1 and len(builds) == built, builds


def test_a_step_asked_for_by_many_engines_is_built_by_one_process(model, tmp_path, monkeypatch):
    """Three lanes of a server (or two servers) asking for one kind of step started three builds of one package
    side by side; now the first claims it (a marker beside the packages, removed when the build ends) and the
    others leave it to that one, unless its marker is stale (a build that died). A build that ended without a
    package (failed) is not started again by the builder that started it: an evaluation's engines share one."""
    import os
    import subprocess
    from types import SimpleNamespace

    from h2o_chat.files import BUILDING_STALE
    from h2o_chat.models import prebuild
    from h2o_chat.models.registry import ModelSpec

    started: list = []
    monkeypatch.setattr(compiled, "cache_dir", lambda: tmp_path)
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: started.append(a))
    loaded = SimpleNamespace(
        model=model, device=torch.device("cpu"), spec=ModelSpec(name="tiny", source="x"), dtype=torch.float32,
        quantize="none",
    )  # fmt: skip
    build = prebuild.builder_for(loaded)
    kind = compiled.StepKind()
    for _ in range(3):
        build(kind)
    assert len(started) == 1
    marker = tmp_path / f".building-{compiled.package_key(model, kind)}"
    assert marker.exists()
    old = marker.stat().st_mtime - BUILDING_STALE - 1
    os.utime(marker, (old, old))  # its build died long ago
    build(kind)
    assert len(started) == 2
    build(compiled.StepKind(quantized=True))  # another package: built beside it
    assert len(started) == 3
    marker.unlink()  # that build ended without a package (it failed): this builder does not start it again
    build(kind)
    assert len(started) == 3
    prebuild.builder_for(loaded)(kind)  # another builder (a new conversation, or lane) tries it once more
    assert len(started) == 4


def test_steps_and_prompt_chunks_leave_a_core_to_a_build_beside_them(model, tmp_path, monkeypatch):
    """While a compiled step is built in a process of its own, an eager step on every core waited at each operator
    for the thread the build had descheduled: 8 rows of the embedded model on 2 cores took 1.8 s a step instead of
    64 ms (98 ms on one thread), for the minutes a first server or chat spends building its step. Forwards now run
    on one thread less while a fresh build marker is beside the packages, and on every thread again after; a stale
    marker (a build that died) takes nothing."""
    import os

    from h2o_chat.engine.step.decode import Engine
    from h2o_chat.files import BUILDING, BUILDING_STALE

    monkeypatch.setattr(compiled, "cache_dir", lambda: tmp_path)
    seen: list[int] = []
    hook = model.register_forward_pre_hook(lambda *a: seen.append(torch.get_num_threads()))
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:

        def run() -> list[int]:
            seen.clear()
            compiled._building[0] = float("-inf")  # look at the folder again
            engine = Engine(model, H2OCache.for_model(model, make_policy("h2o", 24)), "eager")
            engine.decode(engine.first_tokens(engine.prefill(torch.arange(1, 30)[None], chunk_size=8)))
            assert torch.get_num_threads() == 2
            return sorted(set(seen))

        assert run() == [2]
        marker = tmp_path / f"{BUILDING}0123"
        marker.touch()
        assert run() == [1]  # every chunk and the step
        old = marker.stat().st_mtime - BUILDING_STALE - 1
        os.utime(marker, (old, old))
        assert run() == [2]
    finally:
        hook.remove()
        torch.set_num_threads(threads)
