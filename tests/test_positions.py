"""Rolling positions (--positions rolling / auto): keys re-numbered by cache slot, generation past the context."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_model
from h2o_chat.engine.cache import H2OCache
from h2o_chat.engine.decode import Engine
from h2o_chat.engine.grouped import GroupedCache
from h2o_chat.engine.layer import _ranks
from h2o_chat.engine.policies import make_policy
from h2o_chat.engine.rope import Rope
from h2o_chat.engine.sampling import Sampler
from h2o_chat.errors import ConfigError, ContextLimitError


def feed(model, cache, ids: torch.Tensor, schedule: list[int]) -> torch.Tensor:
    """Feed (B, L) tokens in plain forwards numbered by the cache (as the engine does); all logits."""
    out, s = [], 0
    with torch.inference_mode():
        for size in schedule:
            mask = torch.ones(ids.shape[0], size, dtype=torch.long)
            out.append(
                model(
                    input_ids=ids[:, s : s + size],
                    position_ids=cache.chunk_positions(mask),
                    past_key_values=cache,
                    use_cache=True,
                ).logits
            )
            s += size
    cache.settle()
    return torch.cat(out, 1)


def generate(model, cache, ids: torch.Tensor, steps: int, sampler: Sampler | None = None):
    """The engine's token stream for a prompt (eager decode)."""
    engine = Engine(model, cache, "eager")
    engine.set_sampler(sampler, ids.shape[0])
    return engine.tokens(engine.prefill(ids), steps)


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "gpt_neox"])
def test_rolling_equals_absolute_while_nothing_is_evicted(family):
    model = tiny_model(family, seed=11)
    ids = torch.randint(0, 256, (1, 40))
    schedule = [17, 6] + [1] * 17
    absolute = feed(model, H2OCache.for_model(model, make_policy("h2o", 64), "absolute"), ids, schedule)
    rolling_cache = H2OCache.for_model(model, make_policy("h2o", 64), "rolling")
    rolling = feed(model, rolling_cache, ids, schedule)
    torch.testing.assert_close(rolling, absolute, atol=1e-4, rtol=1e-4)
    assert rolling_cache.rolling and rolling_cache.chunk_positions(torch.ones(1, 3)).eq(0).all()


def test_rolling_rotates_by_rank_among_held_tokens():
    model = tiny_model("llama", seed=12)
    cache = H2OCache.for_model(model, make_policy("h2o", 8), "rolling")
    feed(model, cache, torch.randint(0, 256, (1, 30)), [30])
    layer = cache.layers[0]
    q, k_new = torch.randn(1, 4, 2, 16), torch.randn(1, 2, 2, 16)
    q_r, keys_r, k_new_r = layer._rotate_by_rank(q, layer.keys, k_new, None)
    rope = Rope.from_model(model)
    for h in range(2):
        pos = layer.pos[0, h]
        held = pos >= 0
        rank = pos[held].argsort().argsort()  # rank of each held slot among the 8 held tokens
        assert sorted(pos[held].tolist()) != list(range(8))  # evictions left gaps: ranks differ from positions
        torch.testing.assert_close(keys_r[0, h][held], rope.rotate(layer.keys[0, h][held], rank))
        torch.testing.assert_close(k_new_r[0, h], rope.rotate(k_new[0, h], torch.tensor([8, 9])))
    torch.testing.assert_close(q_r[0, 0], rope.rotate(q[0, 0], torch.tensor([8, 9])))
    assert torch.equal(_ranks(torch.tensor([5, -1, 2, 9])), torch.tensor([1, 3, 0, 2]))  # empty slots rank last


def test_auto_switches_to_rolling_past_the_trained_context():
    model = tiny_model("llama", seed=13, max_positions=64)
    cache = H2OCache.for_model(model, make_policy("h2o", 32), "auto")
    engine = Engine(model, cache, "eager")
    engine.prefill(torch.randint(0, 256, (1, 60)))
    layer = cache.layers[0]
    assert not cache.rolling
    engine.decode(torch.tensor([5]))  # 61 tokens: still inside
    assert not cache.rolling and not cache.notices
    cache.settle()
    before, pos = layer.keys.clone(), layer.pos.clone()
    for t in range(10):
        engine.decode(torch.tensor([t]))
    assert cache.rolling
    assert len(cache.pop_notices()) == 1 and not cache.notices
    # the switch un-rotated every stored key: rotating back by its true position gives the key as it was
    rope = Rope.from_model(model)
    kept = (layer.pos[:, :, :, None] == pos[:, :, None, :]) & (pos[:, :, None, :] >= 0)  # pre-switch tokens
    checked = 0
    for h in range(2):
        for slot in range(layer.pos.shape[-1]):
            match = kept[0, h, slot].nonzero()
            if len(match):
                old = before[0, h, match[0, 0]]
                again = rope.rotate(layer.keys[0, h, slot][None], layer.pos[0, h, slot][None])[0]
                torch.testing.assert_close(again, old, atol=1e-5, rtol=1e-5)
                checked += 1
    assert checked > 20


def test_absolute_past_the_context_warns_once():
    model = tiny_model("llama", seed=14, max_positions=32)
    cache = H2OCache.for_model(model, make_policy("h2o", 16), "absolute")
    list(generate(model, cache, torch.randint(0, 256, (1, 30)), 10))
    notices = cache.pop_notices()
    assert len(notices) == 1 and "degrades" in notices[0] and not cache.rolling


def test_opt_cannot_go_past_its_learned_positions():
    model = tiny_model("opt", seed=15, max_positions=32)
    with pytest.raises(ConfigError, match="learned absolute positions"):
        H2OCache.for_model(model, make_policy("h2o", 16), "rolling")
    cache = H2OCache.for_model(model, make_policy("h2o", 16), "auto")
    with pytest.raises(ContextLimitError, match="32 tokens"):
        list(generate(model, cache, torch.randint(0, 256, (1, 28)), 10))
    assert cache.stats().seen <= 32  # stopped before reading past the table


def test_grouped_cache_mixes_position_modes():
    model = tiny_model("llama", seed=16, max_positions=32)
    policies = [make_policy("h2o", 16)] * 2
    grouped = GroupedCache.for_model(model, policies, positions=["absolute", "rolling"])
    ids = torch.randint(0, 256, (2, 10))
    Engine(model, grouped).prefill(ids)
    assert grouped.decode_positions().tolist() == [[10], [0]]


def test_long_runs_past_a_short_context_stay_in_budget(single_thread):
    """The soak's mechanics at a smaller scale (the soak itself reads 20,000 tokens): 5,000 decode steps,
    budget 64, a model trained on 32 positions, so generation runs 150 trained contexts past the end."""
    model = tiny_model("llama", seed=17, layers=1, max_positions=32)
    cache = H2OCache.for_model(model, make_policy("h2o", 64, sinks=4), "auto")
    steps = generate(model, cache, torch.randint(0, 256, (1, 8)), 5_000, Sampler(temperature=1.0, seed=1))
    slots = None
    for i, _ in enumerate(steps):
        if i == 100:
            slots = cache.slots
            pointer = slots.keys.data_ptr()
        if slots is not None and i % 250 == 0:
            assert cache.slots is slots and slots.keys.data_ptr() == pointer and slots.capacity == 64
            assert int((slots.pos >= 0).sum(-1).min()) == 64
    stats = cache.stats()
    assert stats.seen == 8 + 4_999 and stats.kept == 64 and cache.rolling
    assert set(range(4)) <= set(cache.layers[0].pos[0, 0].tolist())  # the sinks survived


def test_soak_command_reports_memory_and_perplexity_per_window(monkeypatch, tmp_path, single_thread):
    import json

    from typer.testing import CliRunner

    from h2o_chat.app import cli

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


@pytest.mark.parametrize("positions", ["absolute", "rolling", "auto"])
def test_model_generate_with_the_cache_equals_the_engine(positions):
    """Library use: transformers' generate() with an H2OCache gives h2o-chat's own tokens in every positions
    mode, past a 64-token trained context (generate numbers tokens itself; the cache re-numbers them)."""
    model = tiny_model("llama", seed=18, max_positions=64)
    ids = torch.randint(0, 256, (1, 40))
    ours_cache = H2OCache.for_model(model, make_policy("h2o", 24), positions)
    ours = [t[0] for t in generate(model, ours_cache, ids, 60)]
    cache = H2OCache.for_model(model, make_policy("h2o", 24), positions)
    with torch.inference_mode():
        theirs = model.generate(ids, max_new_tokens=60, do_sample=False, past_key_values=cache)[0, 40:]
    assert theirs.tolist() == ours
    assert cache.rolling == (positions != "absolute") == ours_cache.rolling  # auto switched past 64 tokens
    assert cache.stats().kept == 24 and cache.stats().seen == 40 + 59


# -- models whose positions or attention the cache cannot reproduce are refused, not mishandled -----------------
def test_sliding_window_models_are_refused():
    from transformers import AutoModelForCausalLM, MistralConfig, Qwen2Config

    from h2o_chat.engine.attention import prepare_model

    small = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    mistral = prepare_model(AutoModelForCausalLM.from_config(MistralConfig(**small, sliding_window=8)))
    with pytest.raises(ConfigError, match=r"sliding-window attention \(8 tokens\)"):
        H2OCache.for_model(mistral, make_policy("h2o", 16))
    qwen = Qwen2Config(**small, use_sliding_window=True, max_window_layers=1, sliding_window=8)
    qwen = prepare_model(AutoModelForCausalLM.from_config(qwen))
    with pytest.raises(ConfigError, match="full-attention and sliding-attention"):
        GroupedCache.for_model(qwen, [make_policy("h2o", 16)])


def test_rotary_embeddings_the_cache_cannot_reproduce_refuse_rolling():
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from conftest import tiny_config

    model = tiny_model("llama", seed=19, max_positions=32)
    other = tiny_config("llama")
    other.rope_parameters = {"rope_type": "default", "rope_theta": 1000.0}
    model.model.rotary_emb_local = LlamaRotaryEmbedding(other)  # as Gemma-3 has: local and global rotations
    with pytest.raises(ConfigError, match="2 different rotary embeddings"):
        H2OCache.for_model(model, make_policy("h2o", 16), "rolling")
    cache = H2OCache.for_model(model, make_policy("h2o", 16), "auto")  # auto keeps absolute positions, and says so
    list(generate(model, cache, torch.randint(0, 256, (1, 30)), 8))
    assert not cache.rolling and "rolling positions are not possible" in cache.pop_notices()[0]

    del model.model.rotary_emb_local
    model.model.rotary_emb.rope_type = "longrope"
    with pytest.raises(ConfigError, match="'longrope' rotary scaling depends on the sequence length"):
        H2OCache.for_model(model, make_policy("h2o", 16), "rolling")


def test_scaled_rotary_embeddings_roll_exactly():
    """yarn scales cos and sin by an attention factor: rolling must reproduce it (rolling = absolute while nothing
    is evicted)."""
    from transformers import AutoModelForCausalLM

    from conftest import tiny_config
    from h2o_chat.engine.attention import prepare_model

    config = tiny_config("llama")
    config.rope_parameters = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048}
    config.rope_parameters["rope_theta"] = 10000.0
    torch.manual_seed(20)
    model = prepare_model(AutoModelForCausalLM.from_config(config).eval())
    assert Rope.from_model(model).scale != 1.0
    ids = torch.randint(0, 256, (1, 30))
    schedule = [12, 5] + [1] * 13
    absolute = feed(model, H2OCache.for_model(model, make_policy("h2o", 64), "absolute"), ids, schedule)
    rolling = feed(model, H2OCache.for_model(model, make_policy("h2o", 64), "rolling"), ids, schedule)
    torch.testing.assert_close(rolling, absolute, atol=1e-4, rtol=1e-4)
