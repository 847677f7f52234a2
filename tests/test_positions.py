"""Rolling positions (--positions rolling / auto): keys re-numbered by cache slot, generation past the context."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_model
from h2o_chat.cache import H2OCache
from h2o_chat.errors import ConfigError, ContextLimitError
from h2o_chat.generate import Sampler, decode_one, generate_steps, prefill
from h2o_chat.grouped import GroupedCache
from h2o_chat.policies import make_policy
from h2o_chat.rope import Rope


def feed(model, cache, ids: torch.Tensor, schedule: list[int]) -> torch.Tensor:
    """Feed (B, L) tokens in chunks through the generation loop's prefill (which numbers them); all logits."""
    out, s = [], 0
    with torch.inference_mode():
        for size in schedule:
            mask = torch.ones(ids.shape[0], size, dtype=torch.long)
            out.append(
                model(
                    input_ids=ids[:, s : s + size],
                    position_ids=cache.position_ids(mask),
                    past_key_values=cache,
                    use_cache=True,
                ).logits
            )
            s += size
    return torch.cat(out, 1)


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "gpt_neox"])
def test_rolling_equals_absolute_while_nothing_is_evicted(family):
    model = tiny_model(family, seed=11)
    ids = torch.randint(0, 256, (1, 40))
    schedule = [17, 6] + [1] * 17
    absolute = feed(model, H2OCache.for_model(model, make_policy("h2o", 64), "absolute"), ids, schedule)
    rolling_cache = H2OCache.for_model(model, make_policy("h2o", 64), "rolling")
    rolling = feed(model, rolling_cache, ids, schedule)
    torch.testing.assert_close(rolling, absolute, atol=1e-4, rtol=1e-4)
    assert rolling_cache.rolling and rolling_cache.position_ids(torch.ones(1, 3)).eq(0).all()


def test_rolling_rotates_by_rank_among_held_tokens():
    model = tiny_model("llama", seed=12)
    cache = H2OCache.for_model(model, make_policy("h2o", 8), "rolling")
    feed(model, cache, torch.randint(0, 256, (1, 30)), [30])
    layer = cache.layers[0]
    layer._pending = None
    q, k_new = torch.randn(1, 4, 2, 16), torch.randn(1, 2, 2, 16)
    q_r, keys_r, k_new_r = layer._rotate_by_rank(q, layer.keys, k_new, None)
    rope = Rope.from_model(model)
    for h in range(2):
        pos = layer.pos[0, h]
        rank = pos.argsort().argsort()  # rank of each slot among the 8 held tokens
        assert sorted(pos.tolist()) != list(range(8))  # evictions left gaps: ranks differ from positions
        torch.testing.assert_close(keys_r[0, h], rope.rotate(layer.keys[0, h], rank))
        torch.testing.assert_close(k_new_r[0, h], rope.rotate(k_new[0, h], torch.tensor([8, 9])))
    torch.testing.assert_close(q_r[0, 0], rope.rotate(q[0, 0], torch.tensor([8, 9])))


def test_auto_switches_to_rolling_past_the_trained_context():
    model = tiny_model("llama", seed=13, max_positions=64)
    cache = H2OCache.for_model(model, make_policy("h2o", 32), "auto")
    prefill(model, cache, torch.randint(0, 256, (1, 60)))
    layer = cache.layers[0]
    assert not cache.rolling
    before = layer.keys[:, :, : layer.n].clone()
    decode_one(model, cache, torch.tensor([5]))  # 61 tokens: still inside
    assert not cache.rolling and not cache.notices
    before = layer.keys[:, :, : layer.n].clone()
    pos = layer.pos[:, :, : layer.n].clone()
    for t in range(10):
        decode_one(model, cache, torch.tensor([t]))
    assert cache.rolling
    assert len(cache.pop_notices()) == 1 and not cache.notices
    # the switch un-rotated every stored key: rotating back by its true position gives the key as it was
    rope = Rope.from_model(model)
    kept = layer.pos[:, :, : layer.n, None] == pos[:, :, None, :]  # slots still holding a pre-switch token
    for h in range(2):
        for slot in range(layer.n):
            match = kept[0, h, slot].nonzero()
            if len(match):
                old = before[0, h, match[0, 0]]
                again = rope.rotate(layer.keys[0, h, slot][None], layer.pos[0, h, slot][None])[0]
                torch.testing.assert_close(again, old, atol=1e-5, rtol=1e-5)


def test_absolute_past_the_context_warns_once():
    model = tiny_model("llama", seed=14, max_positions=32)
    cache = H2OCache.for_model(model, make_policy("h2o", 16), "absolute")
    steps = generate_steps(model, cache, torch.randint(0, 256, (1, 30)), max_new_tokens=10)
    list(steps)
    notices = cache.pop_notices()
    assert len(notices) == 1 and "degrades" in notices[0] and not cache.rolling


def test_opt_cannot_go_past_its_learned_positions():
    model = tiny_model("opt", seed=15, max_positions=32)
    with pytest.raises(ConfigError, match="learned absolute positions"):
        H2OCache.for_model(model, make_policy("h2o", 16), "rolling")
    cache = H2OCache.for_model(model, make_policy("h2o", 16), "auto")
    with pytest.raises(ContextLimitError, match="32 tokens"):
        list(generate_steps(model, cache, torch.randint(0, 256, (1, 28)), max_new_tokens=10))
    assert cache.stats().seen <= 32  # stopped before reading past the table


def test_grouped_cache_mixes_position_modes():
    model = tiny_model("llama", seed=16, max_positions=32)
    policies = [make_policy("h2o", 16)] * 2
    grouped = GroupedCache.for_model(model, policies, positions=["absolute", "rolling"])
    ids = torch.randint(0, 256, (2, 10))
    prefill(model, grouped, ids)
    pos = grouped.position_ids(torch.ones(2, 1))
    assert pos.tolist() == [[10], [0]]


def test_long_runs_past_a_short_context_stay_in_budget(single_thread):
    """The soak's mechanics at a smaller scale (the soak itself reads 20,000 tokens): 5,000 decode steps,
    budget 64, a model trained on 32 positions, so generation runs 150 trained contexts past the end."""
    model = tiny_model("llama", seed=17, layers=1, max_positions=32)
    cache = H2OCache.for_model(model, make_policy("h2o", 64, sinks=4), "auto")
    steps = generate_steps(
        model, cache, torch.randint(0, 256, (1, 8)), sampler=Sampler(temperature=1.0, seed=1), max_new_tokens=5_000
    )
    layer = None
    for i, _ in enumerate(steps):
        if i == 100:
            layer = cache.layers[0]
            pointer = layer.keys.data_ptr()
        if layer is not None and i % 250 == 0:
            assert layer.n == 64 and layer.keys.shape[2] == 64 and layer.keys.data_ptr() == pointer
    stats = cache.stats()
    assert stats.seen == 8 + 4_999 and stats.kept == 64 and cache.rolling
    assert set(range(4)) <= set(cache.layers[0].pos[0, 0].tolist())  # the sinks survived


def test_soak_command_reports_memory_and_perplexity_per_window(monkeypatch, tmp_path, single_thread):
    import json

    from typer.testing import CliRunner

    from h2o_chat import cli

    monkeypatch.setenv("H2O_CHAT_CACHE", str(tmp_path))
    result = CliRunner().invoke(
        cli.app,
        [
            "soak",
            "--shape",
            "llama-tiny",
            "--tokens",
            "600",
            "--window",
            "200",
            "--budget",
            "32",
            "--context",
            "64",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.stderr
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["window"] for r in records] == [[1, 200], [200, 400], [400, 600]]
    labels = ["absolute", "rolling", "absolute + 4 sinks", "rolling + 4 sinks", "auto + 4 sinks"]
    assert all(list(r["ppl"]) == labels and r["rss"] > 0 for r in records)
    assert records[-1]["positions"][4].startswith("auto: rolling")  # auto switched past the 64-token context
    assert records[0]["kv_bytes"] == records[-1]["kv_bytes"]  # five fixed budgets: nothing grows
    bad = CliRunner().invoke(cli.app, ["soak", "--budget", "8", "--sinks", "8"])
    assert bad.exit_code == 2 and "sink" in bad.stderr
