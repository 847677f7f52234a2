"""The CPU's compiled decode step (`--decode compile`): the same tokens and the same kept positions, per layer
and head, as eager steps; eager with the reason said when it cannot compile."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_model
from h2o_chat.engine import compiled
from h2o_chat.engine.cache import H2OCache
from h2o_chat.engine.decode import Engine, left_pad, resolve_decode
from h2o_chat.engine.policies import make_policy
from h2o_chat.engine.sampling import Sampler

pytestmark = pytest.mark.skipif(compiled.unavailable() is not None, reason="no C++ compiler for inductor")
STEPS = 240


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", seed=41, max_positions=128)


def _run(model, mode: str, policy: str, positions: str, prompts: list[list[int]], sampled: bool = False):
    cache = H2OCache.for_model(model, make_policy(policy, 24), positions)
    engine = Engine(model, cache, mode)
    ids, mask = left_pad(prompts, 0)
    if sampled:
        engine.set_sampler(Sampler(temperature=0.8, top_p=0.9, seed=3), len(prompts))
    tokens, pos = [], []
    for step, row_tokens in enumerate(engine.tokens(engine.prefill(ids, mask, chunk_size=16), STEPS)):
        tokens.append(row_tokens)
        if step % 50 == 0:
            pos.append(cache.slots.pos.clone())
    return tokens, torch.stack(pos), engine, cache


@pytest.mark.parametrize(
    "policy, positions, rows, sampled",
    [
        ("h2o", "auto", 1, False),  # past the trained context of 128: renumbered on the way
        ("sink", "absolute", 1, False),  # the same program as the first (compiled once per shape and sampler)
        ("snap", "rolling", 2, True),  # a padded batch, sampled
    ],
)
def test_the_compiled_step_keeps_what_the_eager_step_keeps(model, policy, positions, rows, sampled):
    prompts = [[(7 * i + 3 * r) % 250 + 1 for i in range(40 - 9 * r)] for r in range(rows)]
    want, want_pos, _, _ = _run(model, "eager", policy, positions, prompts, sampled)
    got, got_pos, engine, cache = _run(model, "compile", policy, positions, prompts, sampled)
    assert engine.mode == "compile" and engine.captures >= 1, cache.pop_notices()
    assert engine._program.replaying  # the steps ran without dynamo's checks (`compiled.Program`)
    assert got == want
    assert torch.equal(got_pos, want_pos)  # the same tokens kept per layer, row and head, every 50 steps
    assert cache.stats().seen == 40 + STEPS - 1


def test_a_step_that_cannot_compile_runs_eagerly_and_says_why(model, monkeypatch):
    def broken(body):
        def run(*args):
            raise RuntimeError("inductor could not build this step\nmore detail")

        return run

    monkeypatch.setattr(compiled, "compile_step", broken)
    prompts = [[(5 * i) % 250 + 1 for i in range(30)]]
    want, want_pos, _, _ = _run(model, "eager", "h2o", "auto", prompts)
    got, got_pos, engine, cache = _run(model, "compile", "h2o", "auto", prompts)
    assert engine.mode == "eager" and got == want and torch.equal(got_pos, want_pos)
    notes = cache.pop_notices()
    assert any("compiling one failed (inductor could not build this step)" in n for n in notes), notes


def test_recall_decodes_eagerly_and_says_why(model):
    prompts = [[(3 * i) % 250 + 1 for i in range(30)]]
    cache = H2OCache.for_model(model, make_policy("recall", 24), "auto")
    engine = Engine(model, cache, "compile")
    ids, mask = left_pad(prompts, 0)
    list(engine.tokens(engine.prefill(ids, mask), 5))
    assert engine.mode == "eager" and any("recall" in n for n in cache.pop_notices())


def test_auto_is_eager_on_cpu_unless_told_to_compile(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.delenv("H2O_CHAT_DECODE", raising=False)
    assert resolve_decode("auto", cpu) == "eager"
    monkeypatch.setenv("H2O_CHAT_DECODE", "compile")
    assert resolve_decode("auto", cpu) == "compile"
    monkeypatch.setenv("H2O_CHAT_DECODE", "eager")
    assert resolve_decode("auto", cpu) == "eager"
    monkeypatch.setattr(compiled, "unavailable", lambda: "no C++ compiler (g++) for inductor's CPU code")
    monkeypatch.setenv("H2O_CHAT_DECODE", "compile")
    assert resolve_decode("auto", cpu) == "eager"


class _Holder:
    def __init__(self):
        self.weight = torch.arange(6.0).view(2, 3)
        self.seen: list[torch.Tensor] = []

    def pure(self, x):
        return (self.weight @ x).relu(), self.weight.sum(0) * x

    def remembers(self, x):  # Python state of its own: dynamo restores it after each call
        y = self.weight @ x
        self.seen.append(y)
        return (y,)


def test_a_program_over_fixed_tensors_is_replayed_and_reads_them_as_they_are_now():
    h, x = _Holder(), torch.ones(3)
    program = compiled.Program(h.pure)
    for step in range(5):
        x.add_(1)
        h.weight[0, step % 3] -= 2  # changed in place, as the cache's storage is
        got, want = program(x), h.pure(x)
        assert all(torch.allclose(a, b) for a, b in zip(got, want, strict=True)), step
    assert program.replaying


def test_a_program_with_state_of_its_own_or_new_inputs_keeps_dynamos_checks():
    h = _Holder()
    program = compiled.Program(h.remembers)
    for step in range(4):
        x = torch.full((3,), float(step))  # a new tensor each call
        (got,) = program(x)
        assert torch.equal(got, h.weight @ x) and torch.equal(h.seen[-1], got)
    assert not program.replaying and len(h.seen) == 4

    h2 = _Holder()
    program = compiled.Program(h2.pure)
    for step in range(4):
        h2.weight = torch.full((2, 3), float(step))  # the body reads a new tensor each call
        got = program(torch.ones(3))
        assert torch.equal(got[0], torch.full((2,), 3.0 * step))
    assert not program.replaying


def test_auto_compiles_a_cpu_step_for_a_long_generation_only(monkeypatch):
    from h2o_chat.engine.decode import LONG_GENERATION, decode_for

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.delenv("H2O_CHAT_DECODE", raising=False)
    assert decode_for("auto", cpu, LONG_GENERATION) == "compile"
    assert decode_for("auto", cpu, LONG_GENERATION - 1) == "auto"  # resolved to eager on CPU
    assert decode_for("eager", cpu, 10 * LONG_GENERATION) == "eager"  # asked for: kept
    assert decode_for("auto", cuda, 10 * LONG_GENERATION) == "auto"  # a CUDA graph there
    monkeypatch.setenv("H2O_CHAT_DECODE", "eager")  # the environment decides (the test suite's own setting)
    assert decode_for("auto", cpu, 10 * LONG_GENERATION) == "auto"
    monkeypatch.delenv("H2O_CHAT_DECODE")
    monkeypatch.setattr(compiled, "unavailable", lambda: "no C++ compiler (g++) for inductor's CPU code")
    assert decode_for("auto", cpu, 10 * LONG_GENERATION) == "auto"
