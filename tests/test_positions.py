"""Positions past the trained context (--positions auto / rolling): held tokens renumbered by their order, keys
rotated by the change, decode steps at the cost of absolute positions."""

from __future__ import annotations

import pytest
import torch

from conftest import cached, tiny_model
from h2o_chat.engine.cache import H2OCache
from h2o_chat.engine.policies import make_policy
from h2o_chat.engine.rope import Rope
from h2o_chat.engine.step.decode import Engine, left_pad
from h2o_chat.engine.step.sampling import Sampler
from h2o_chat.engine.storage.quant import dequantize
from h2o_chat.errors import ConfigError, ContextLimitError


def feed(model, cache, ids: torch.Tensor, schedule: list[int]) -> torch.Tensor:
    """Feed (B, L) tokens in plain model forwards of the given sizes (the hooks number them); all logits."""
    out, s = [], 0
    with torch.inference_mode():
        for size in schedule:
            out.append(model(input_ids=ids[:, s : s + size], **cached(model, cache), use_cache=True).logits)
            s += size
    return torch.cat(out, 1)


def generate(model, cache, ids: torch.Tensor, steps: int, sampler: Sampler | None = None):
    """The engine's token stream for a prompt (eager decode)."""
    engine = Engine(model, cache, "eager")
    engine.set_sampler(sampler, ids.shape[0])
    return engine.tokens(engine.prefill(ids), steps)


def layer0_keys_from_scratch(model, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Layer 0's keys of tokens `ids` (N,) rotated at `positions` (N,), computed by the model's own modules: the
    input of layer 0 is the token embedding, so its keys do not depend on the context. -> (H, N, D)"""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    attn = model.model.layers[0].self_attn
    with torch.inference_mode():
        hidden = model.model.layers[0].input_layernorm(model.model.embed_tokens(ids[None]))
        k = attn.k_proj(hidden).view(1, len(ids), -1, attn.head_dim).transpose(1, 2)
        cos, sin = model.model.rotary_emb(k, positions[None])
        _, k = apply_rotary_pos_emb(k, k, cos, sin)
    return k[0]


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "gpt_neox"])
def test_rolling_equals_absolute_until_positions_are_renumbered(family):
    model = tiny_model(family, seed=11)
    ids = torch.randint(0, 256, (1, 40))
    schedule = [17, 6] + [1] * 17
    absolute = feed(model, H2OCache.for_model(model, make_policy("h2o", 64), "absolute"), ids, schedule)
    rolling_cache = H2OCache.for_model(model, make_policy("h2o", 64), "rolling")
    rolling = feed(model, rolling_cache, ids, schedule)
    torch.testing.assert_close(rolling, absolute, atol=1e-4, rtol=1e-4)
    assert not rolling_cache.seq.renumbered  # 40 tokens stay within twice the budget


def test_renumbered_keys_equal_the_models_keys_at_their_new_positions():
    """After many evictions and several renumberings, every held key of layer 0 is the model's key of its token
    rotated at the position the cache says (checked against the model's own rotary embedding), positions keep
    the tokens' order, and they never pass the trained context."""
    model = tiny_model("llama", seed=12, max_positions=48)
    cache = H2OCache.for_model(model, make_policy("h2o", 16), "auto")
    engine = Engine(model, cache, "eager")
    ids = torch.randint(0, 256, (1, 200))
    engine.prefill(ids[:, :20])
    rot_max = 0
    for t in range(20, 200):
        engine.decode(ids[:, t])
        rot_max = max(rot_max, int(cache.slots.next_rot.max()))
    assert cache.seq.renumbered and rot_max <= 48
    s = cache.slots
    for h in range(s.keys.shape[2]):
        held = s.pos[0, 0, h, :16]
        rot = s.rot[0, 0, h, :16]
        assert (held >= 0).all() and (held.argsort() == rot.argsort()).all()  # renumbering keeps the order
        assert len(set(rot.tolist())) == 16 and int(rot.max()) < 48
        expected = layer0_keys_from_scratch(model, ids[0, held], rot)[h]
        torch.testing.assert_close(s.keys[0, 0, h, :16], expected, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("positions", ["rolling", "auto"])
def test_recalled_tokens_are_renumbered_by_their_rank_among_the_held_ones(positions, monkeypatch):
    """The recall policy past the trained context (issue 20): when the held tokens are renumbered, every stored
    (evicted) token is numbered by its rank among them -- the count of held tokens with a smaller true position,
    per layer, row and head -- and its key rotated to that number (checked against the model's own rotary
    embedding: layer 0's keys depend only on the token and its position); numbers keep the tokens' order across
    held and stored ones, stay inside the trained context, and steps go on recalling. Prompt chunks (a padded
    row) and steps both evict."""
    import itertools
    from bisect import bisect_left

    from h2o_chat.engine.storage.store import Store

    model = tiny_model("llama", seed=16, max_positions=48)
    # 12 held, 4 recalled per step, a store for every evicted token
    cache = H2OCache.for_model(model, make_policy("recall", 16, store=256), positions)
    engine = Engine(model, cache, "eager")
    renumbered = []
    real = Store.renumber

    def checked(store, rows, held, rope):
        real(store, rows, held, rope)
        renumbered.append(rows)
        n = store.capacity
        for i, r, h in itertools.product(*map(range, store.pos.shape[:3])):
            if r not in rows:  # a row renumbers by its own tokens: the padded one passes the context later
                continue
            order = sorted(p for p in held[i, r, h].tolist() if p >= 0)
            for p, rot in zip(store.pos[i, r, h, :n].tolist(), store.rot[i, r, h, :n].tolist(), strict=True):
                assert p < 0 or rot == bisect_left(order, p)

    monkeypatch.setattr(Store, "renumber", checked)
    ids = torch.randint(0, 256, (2, 240), generator=torch.Generator().manual_seed(16))
    mask = torch.ones(2, 60, dtype=torch.long)
    mask[1, :9] = 0
    engine.prefill(ids[:, :60], mask, 8)
    recalled = 0
    for t in range(60, 240):
        engine.decode(ids[:, t])
        recalled += int(cache.store.marks.sum())
        cache.store.take_counts()
        assert int(cache.slots.next_rot.max()) <= 48
    assert len(renumbered) >= 3 and cache.seq.renumbered and recalled > 0
    assert not any("dropped" in n for n in cache.pop_notices())
    store, s = cache.store, cache.slots
    n = store.capacity
    for r in range(2):
        for h in range(s.keys.shape[2]):
            pos, rot = store.pos[0, r, h, :n], store.rot[0, r, h, :n]
            kept = pos >= 0
            assert int(kept.sum()) > 150 and int(rot[kept].max()) < 48
            want = layer0_keys_from_scratch(model, ids[r, pos[kept] + (9 if r else 0)], rot[kept].long())[h]
            got = dequantize(store.keys[0, r, h, :n][kept], store.kscale[0, r, h, :n][kept], torch.float32)
            scale = want.abs().amax(-1, keepdim=True)  # 8-bit keys: within a few roundings of the head's largest
            assert ((got - want).abs() <= 0.03 * scale).all()
            both_pos = torch.cat((pos[kept], s.pos[0, r, h][s.pos[0, r, h] >= 0]))
            both_rot = torch.cat((rot[kept].long(), s.rot[0, r, h][s.pos[0, r, h] >= 0]))
            by_pos = both_rot[both_pos.argsort()]
            assert (by_pos[1:] >= by_pos[:-1]).all()  # the numbers keep the order of the true positions


def test_a_message_taken_back_across_a_renumbering_restores_the_store_as_it_was():
    """Ctrl-C while a long message is read restores the cache from before it: the store is part of the snapshot,
    so entries renumbered (or dropped) while that message was read come back with the numbers and contents
    they had, consistent with the restored held tokens, and nothing is said to be dropped."""
    model = tiny_model("llama", seed=17, max_positions=48)
    cache = H2OCache.for_model(model, make_policy("recall", 16), "auto")
    engine = Engine(model, cache, "eager")
    engine.prefill(torch.randint(0, 256, (1, 20)))
    before = cache.snapshot()
    was = {name: t.clone() for name, t in cache.store.tensors().items()}
    assert float(cache.store.tokens()[0]) > 0
    engine.prefill(torch.randint(0, 256, (1, 60)), None, 8)  # past the trained context: renumbers
    assert cache.seq.renumbered and not torch.equal(cache.store.pos, was["pos"])
    cache.restore(before)
    for name, t in cache.store.tensors().items():
        assert torch.equal(t, was[name]), name
    assert not any("dropped" in n for n in cache.pop_notices())
    engine.prefill(torch.randint(0, 256, (1, 6)))  # and it reads on from there
    assert int(cache.slots.next_rot.max()) <= 48


def test_a_rolling_decode_step_costs_what_an_absolute_one_costs():
    """No per-step ranking, gathering or rotating: the same operators run in every positions mode."""
    from h2o_chat.measure.prefill import OperatorCount

    model = tiny_model("llama", seed=13, max_positions=64)
    counts = {}
    for positions in ("absolute", "rolling", "auto"):
        cache = H2OCache.for_model(model, make_policy("h2o", 16), positions)
        engine = Engine(model, cache, "eager")
        engine.prefill(torch.randint(0, 256, (1, 70)))  # past the context: rolling and auto have renumbered
        engine.decode(torch.tensor([3]))
        with OperatorCount() as c:
            engine.decode()
        counts[positions] = c.ops
        assert cache.seq.renumbered == (positions != "absolute")
    assert counts["rolling"] == counts["absolute"] == counts["auto"]


def test_auto_renumbers_past_the_trained_context_and_says_so_once():
    model = tiny_model("llama", seed=13, max_positions=64)
    cache = H2OCache.for_model(model, make_policy("h2o", 32), "auto")
    engine = Engine(model, cache, "eager")
    engine.prefill(torch.randint(0, 256, (1, 60)))
    engine.decode(torch.tensor([5]))  # 61 tokens: still inside
    assert not cache.rolling and not cache.notices and cache.positions_label().startswith("auto: absolute")
    for t in range(100):
        engine.decode(torch.tensor([t]))
        assert int(cache.slots.next_rot.max()) <= 64
    assert cache.rolling and cache.positions_label().startswith("auto: renumbered")
    assert len(cache.pop_notices()) == 1 and not cache.notices


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


def test_rows_of_one_cache_number_positions_by_their_own_mode():
    model = tiny_model("llama", seed=16, max_positions=32)
    policies = [make_policy("h2o", 8)] * 2
    cache = H2OCache.for_model(model, policies, ["absolute", "rolling"], rows=[1, 1])
    engine = Engine(model, cache, "eager")
    engine.prefill(torch.randint(0, 256, (2, 10)))
    for t in range(8):
        engine.decode(torch.tensor([t, t]))
    assert cache.slots.next_rot.tolist()[0] == 18  # absolute: the true position
    assert cache.slots.next_rot.tolist()[1] <= 16  # rolling: renumbered within twice the budget


def test_long_runs_past_a_short_context_stay_in_budget(single_thread):
    """The soak's mechanics at a smaller scale (the soak itself reads 20,000 tokens): 5,000 decode steps,
    budget 64, a model trained on 160 positions, so generation runs 30 trained contexts past the end."""
    model = tiny_model("llama", seed=17, layers=1, max_positions=160)
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
            assert int(slots.next_rot.max()) <= 160
    stats = cache.stats()
    assert stats.seen == 8 + 4_999 and stats.kept == 64 and cache.rolling
    assert set(range(4)) <= set(cache.layers[0].pos[0, 0].tolist())  # the sinks survived


def test_soak_command_reports_memory_and_perplexity_per_window(monkeypatch, tmp_path, single_thread):
    import json

    from typer.testing import CliRunner

    from h2o_chat.app import cli

    monkeypatch.setenv("H2O_CHAT_CACHE", str(tmp_path))
    args = ["soak", "--shape", "llama-tiny", "--tokens", "600", "--window", "200", "--budget", "32"]
    result = CliRunner().invoke(cli.app, [*args, "--context", "96", "--json"])
    assert result.exit_code == 0, result.stderr
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["window"] for r in records] == [[1, 200], [201, 400], [401, 600]]  # a window names its own tokens
    labels = ["absolute", "rolling", "absolute + 4 sinks", "rolling + 4 sinks", "auto + 4 sinks"]
    assert all(list(r["ppl"]) == labels and r["rss"] > 0 for r in records)
    assert records[-1]["positions"][4].startswith("auto: renumbered")  # auto renumbered past the 96-token context
    # each row says how its own tokens are numbered: the absolute rows never renumber, the rolling rows always do
    assert [p.split(",")[0] for p in records[-1]["positions"][:4]] == [
        "absolute",
        "rolling: renumbered by order among the held tokens",
        "absolute",
        "rolling: renumbered by order among the held tokens",
    ]
    assert records[0]["kv_bytes"] == records[-1]["kv_bytes"]  # five fixed budgets: nothing grows
    bad = CliRunner().invoke(cli.app, ["soak", "--budget", "8", "--sinks", "8"])
    assert bad.exit_code == 2 and "sink" in bad.stderr
    # the recall policy goes past the context too, its store renumbered with the held tokens (not dropped)
    args = ["soak", "--shape", "llama-tiny", "--tokens", "300", "--window", "150", "--budget", "32", "-p", "recall"]
    result = CliRunner().invoke(cli.app, [*args, "--context", "96"])
    assert result.exit_code == 0, result.stderr
    assert "recall 32: perplexity per window" in result.stdout and "dropped" not in result.stderr
    bad = CliRunner().invoke(cli.app, ["soak", "-p", "full"])
    assert bad.exit_code == 2 and "--policy for a soak must be one of h2o, snap, recall" in bad.stderr


@pytest.mark.parametrize("positions", ["absolute", "rolling", "auto"])
def test_model_generate_with_the_cache_equals_the_engine(positions):
    """Library use: transformers' generate() with an H2OCache gives h2o-chat's own tokens in every positions
    mode, past a 64-token trained context (the cache's hooks number the tokens)."""
    model = tiny_model("llama", seed=18, max_positions=64)
    ids = torch.randint(0, 256, (1, 40))
    ours_cache = H2OCache.for_model(model, make_policy("h2o", 24), positions)
    ours = [t[0] for t in generate(model, ours_cache, ids, 60)]
    cache = H2OCache.for_model(model, make_policy("h2o", 24), positions)
    with torch.inference_mode():
        theirs = model.generate(ids, max_new_tokens=60, do_sample=False, **cached(model, cache))[0, 40:]
    assert theirs.tolist() == ours
    assert cache.rolling == (positions != "absolute") == ours_cache.rolling  # renumbered past 64 tokens
    assert cache.stats().kept == 24 and cache.stats().seen == 40 + 59


# -- models whose positions or attention the cache cannot reproduce are refused, not mishandled -----------------
def test_sliding_window_models_are_refused():
    from transformers import AutoModelForCausalLM, MistralConfig, Qwen2Config

    from h2o_chat.engine.step.attention import prepare_model

    small = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    mistral = prepare_model(AutoModelForCausalLM.from_config(MistralConfig(**small, sliding_window=8)))
    with pytest.raises(ConfigError, match=r"sliding-window attention \(8 tokens\)"):
        H2OCache.for_model(mistral, make_policy("h2o", 16))
    qwen = Qwen2Config(**small, use_sliding_window=True, max_window_layers=1, sliding_window=8)
    qwen = prepare_model(AutoModelForCausalLM.from_config(qwen))
    with pytest.raises(ConfigError, match="full-attention and sliding-attention"):
        H2OCache.for_model(qwen, [make_policy("h2o", 16)], rows=[1])


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
    assert not cache.rolling and "renumbered positions are not possible" in cache.pop_notices()[0]

    del model.model.rotary_emb_local
    model.model.rotary_emb.rope_type = "longrope"
    with pytest.raises(ConfigError, match="'longrope' rotary scaling depends on the sequence length"):
        H2OCache.for_model(model, make_policy("h2o", 16), "rolling")


def test_scaled_rotary_embeddings_renumber_exactly():
    """yarn scales cos and sin by an attention factor: a renumbered key must be the model's key at its new
    position, scale included."""
    from transformers import AutoModelForCausalLM

    from conftest import tiny_config
    from h2o_chat.engine.step.attention import prepare_model

    config = tiny_config("llama", max_positions=48)
    config.rope_parameters = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048}
    config.rope_parameters["rope_theta"] = 10000.0
    torch.manual_seed(20)
    model = prepare_model(AutoModelForCausalLM.from_config(config).eval())
    assert Rope.from_model(model).scale != 1.0
    cache = H2OCache.for_model(model, make_policy("h2o", 16), "auto")
    engine = Engine(model, cache, "eager")
    ids = torch.randint(0, 256, (1, 120))
    engine.prefill(ids[:, :20])
    for t in range(20, 120):
        engine.decode(ids[:, t])
    s = cache.slots
    assert cache.seq.renumbered
    held, rot = s.pos[0, 0, 0, :16], s.rot[0, 0, 0, :16]
    expected = layer0_keys_from_scratch(model, ids[0, held], rot)[0]
    torch.testing.assert_close(s.keys[0, 0, 0, :16], expected, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("name, budget", [("h2o", 16), ("snap", 16), ("recall", 32)])
def test_a_padded_row_past_the_context_renumbers_when_it_would_alone(name, budget):
    """Issue 41.1: under --positions auto a row renumbers by its own tokens, never by the batch's columns (its
    left padding included): prompts of 150 and 90 tokens read together past a 64-token trained context give
    each row, at the prompt's last position and for 40 decode steps, the logits of its prompt alone."""
    model = tiny_model("llama", seed=21, max_positions=64)
    if name == "recall":  # its store keeps 8-bit keys: fp32 batch noise can flip a rounding, and a recall with it
        model = model.double()
    g = torch.Generator().manual_seed(21)
    rows = [torch.randint(1, 256, (n,), generator=g).tolist() for n in (150, 90)]

    def run(ids: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        cache = H2OCache.for_model(model, make_policy(name, budget), "auto")
        engine = Engine(model, cache, "eager")
        logits = [engine.prefill(ids, mask, chunk_size=16)]
        tokens = logits[0].argmax(-1)
        for _ in range(40):
            out, tokens = engine.decode(tokens)
            logits.append(out.clone())
        assert cache.seq.renumbered
        return torch.stack(logits, 1)  # (B, 41, V)

    together = run(*left_pad(rows, 0))
    for r, row in enumerate(rows):
        alone = run(torch.tensor([row]), None)[0]
        torch.testing.assert_close(together[r], alone, atol=1e-4, rtol=1e-4, msg=f"{name}: row {r}")


def test_a_full_cache_past_the_context_is_told_what_renumbers_not_an_option_already_on():
    """-p full under --positions auto (the default) passing the context was told that "--positions auto or rolling
    renumbers positions", an option already on: a full cache keeps every token at its true position."""
    model = tiny_model("llama", seed=14, max_positions=32)
    cache = H2OCache.for_model(model, make_policy("full", None), "auto")
    list(generate(model, cache, torch.randint(0, 256, (1, 30)), 10))
    notices = cache.pop_notices()
    assert len(notices) == 1 and "a full cache keeps every token" in notices[0] and "--positions" not in notices[0]
    cache = H2OCache.for_model(model, make_policy("h2o", 16), "absolute")
    list(generate(model, cache, torch.randint(0, 256, (1, 30)), 10))
    assert "--positions auto or rolling renumbers" in cache.pop_notices()[0]
