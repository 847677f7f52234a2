"""The H2O cache on tiny random models: parity, the paper's eviction, fixed capacity, batches, chunked prefill."""

from __future__ import annotations

import pytest
import torch
from transformers import AttentionInterface, DynamicCache

from conftest import FAMILIES, tiny_model
from h2o_chat import layer as layer_module
from h2o_chat.cache import H2OCache
from h2o_chat.errors import CacheUsageError
from h2o_chat.generate import Sampler, generate_steps, prefill
from h2o_chat.policies import make_policy


def run(model, cache, tokens: torch.Tensor, schedule: list[int]) -> torch.Tensor:
    """Feed (1, L) tokens in forwards of the given sizes; return all logits (1, L, V)."""
    out, s = [], 0
    with torch.inference_mode():
        for size in schedule:
            out.append(model(input_ids=tokens[:, s : s + size], past_key_values=cache, use_cache=True).logits)
            s += size
    return torch.cat(out, 1)


# -- (a) parity with transformers' DynamicCache when nothing is evicted --------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_dynamic_cache_when_budget_covers_sequence(family):
    model = tiny_model(family)
    tokens = torch.randint(0, 256, (1, 48))
    schedule = [20, 9] + [1] * 19  # a prompt, a second chunk (a chat turn), then decode steps
    model.set_attn_implementation("sdpa")
    expected = run(model, DynamicCache(config=model.config), tokens, schedule)
    model.set_attn_implementation("h2o")
    got = run(model, H2OCache.for_model(model, make_policy("h2o", 64)), tokens, schedule)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_padded_batch_matches_dynamic_cache():
    model = tiny_model("llama")
    ids = torch.randint(0, 256, (2, 16))
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[0, :5] = 0  # row 0 is left-padded
    model.set_attn_implementation("sdpa")
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    model.set_attn_implementation("h2o")
    got = model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=12,
        do_sample=False,
        past_key_values=H2OCache.for_model(model, make_policy("h2o", 64)),
    )
    assert torch.equal(got, expected)


# -- (b) eviction equals a straightforward mask-based reference of the paper --------------------------------
class PaperReference:
    """H2O as the paper states it, on a full cache: nothing leaves storage; an evicted token is masked out of
    attention for its (layer, KV head). Scores: softmax mass summed over queries and the query heads of a group.
    After each forward, while a head holds more than `budget` tokens, drop its lowest-scoring token outside
    the `recent` newest positions."""

    def __init__(self, budget: int, recent: int):
        self.budget, self.recent = budget, recent
        self.keep: dict[int, torch.Tensor] = {}
        self.acc: dict[int, torch.Tensor] = {}

    def __call__(self, module, q, k, v, attention_mask, scaling=None, **kwargs):
        layer = module.layer_idx
        _, Hq, T, D = q.shape
        H, S = k.shape[1], k.shape[2]
        G = Hq // H
        keep = torch.cat((self.keep.get(layer, torch.zeros(H, 0, dtype=torch.bool)), torch.ones(H, T, dtype=bool)), 1)
        acc = torch.cat((self.acc.get(layer, torch.zeros(H, 0)), torch.zeros(H, T)), 1)
        logits = ((q * scaling) @ k.repeat_interleave(G, 1).transpose(-1, -2)).float()  # (1, Hq, T, S)
        allowed = torch.ones(T, S, dtype=torch.bool).tril(S - T) & keep.repeat_interleave(G, 0)[None, :, None, :]
        probs = logits.masked_fill(~allowed, -torch.inf).softmax(-1)
        acc += probs.view(H, G, T, S).sum(dim=(1, 2))
        old = torch.arange(S) <= S - 1 - self.recent
        while int(keep.sum(-1).max()) > self.budget:
            victim = acc.masked_fill(~keep | ~old, torch.inf).argmin(-1)  # (H,)
            keep[torch.arange(H), victim] = False
        self.keep[layer], self.acc[layer] = keep, acc
        out = probs.to(v.dtype) @ v.repeat_interleave(G, 1)
        return out.transpose(1, 2), None

    def kept_positions(self, layer: int) -> list[set[int]]:
        return [set(torch.nonzero(row).flatten().tolist()) for row in self.keep[layer]]


def kept_positions(cache: H2OCache, layer: int) -> list[set[int]]:
    pos = cache.layers[layer].pos[0]
    return [set(p[p >= 0].tolist()) for p in pos]


@pytest.mark.parametrize("family", ["llama", "opt", "gpt_neox"])
@pytest.mark.parametrize("schedule", [[10] + [1] * 70, [24, 8] + [1] * 50], ids=["short-prompt", "chunked"])
def test_eviction_matches_paper_reference(family, schedule):
    budget, heavy_ratio = 16, 0.5
    model = tiny_model(family, seed=3)
    tokens = torch.randint(0, 256, (1, sum(schedule)))

    reference = PaperReference(budget, recent=budget - round(budget * heavy_ratio))
    AttentionInterface.register("h2o_paper_reference", reference)
    model.set_attn_implementation("h2o_paper_reference")
    expected = run(model, DynamicCache(config=model.config), tokens, schedule)

    model.set_attn_implementation("h2o")
    cache = H2OCache.for_model(model, make_policy("h2o", budget, heavy_ratio=heavy_ratio))
    got = run(model, cache, tokens, schedule)

    for layer in range(len(cache.layers)):
        assert kept_positions(cache, layer) == reference.kept_positions(layer)
        torch.testing.assert_close(
            cache.layers[layer].score[0].sort(-1).values,
            reference.acc[layer].masked_fill(~reference.keep[layer], -1).sort(-1).values[:, -budget:],
            atol=1e-4,
            rtol=1e-4,
        )
    # attention over the kept slots is the reference's masked attention: same logits at every step
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    assert cache.stats().evicted == sum(schedule) - budget


def test_heads_keep_different_positions():
    model = tiny_model("llama", seed=5)
    cache = H2OCache.for_model(model, make_policy("h2o", 16))
    run(model, cache, torch.randint(0, 256, (1, 80)), [8] + [1] * 72)
    sets = [frozenset(s) for layer in range(2) for s in kept_positions(cache, layer)]
    assert len(set(sets)) > 1


# -- (c) capacity: fixed storage, never re-allocated ---------------------------------------------------------
def test_storage_is_allocated_once_and_never_exceeds_budget(single_thread):
    budget = 32
    model = tiny_model("llama", seed=1)
    cache = H2OCache.for_model(model, make_policy("h2o", budget))
    steps = generate_steps(
        model, cache, torch.randint(0, 256, (1, 5)), sampler=Sampler(temperature=1.0, seed=0), max_new_tokens=2000
    )
    next(steps)
    layers = cache.layers
    pointers = [
        (lay.keys.data_ptr(), lay.values.data_ptr(), lay.pos.data_ptr(), lay.score.data_ptr()) for lay in layers
    ]
    count = 1
    for _ in steps:
        count += 1
        for lay, ptrs in zip(layers, pointers, strict=True):
            assert lay.n <= budget and lay.keys.shape[2] == budget
            assert (lay.keys.data_ptr(), lay.values.data_ptr(), lay.pos.data_ptr(), lay.score.data_ptr()) == ptrs
    assert count == 2000
    stats = cache.stats()
    assert stats.seen == 5 + 1999 and stats.kept == budget and stats.kept_max == budget
    assert stats.kv_bytes == 2 * 2 * 1 * 2 * budget * 16 * 4  # layers * (K,V) * B * heads * slots * dim * fp32


# -- (d) batch rows evict independently: a row gives what the prompt gives alone ------------------------------
def left_pad(prompts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :], mask[i, width - len(p) :] = p, 1
    return ids, mask


def greedy(model, policy, ids, mask, steps, chunk):
    cache = H2OCache.for_model(model, policy)
    out = [s.tokens for s in generate_steps(model, cache, ids, mask, max_new_tokens=steps, chunk_size=chunk)]
    return torch.stack(out, 1), cache


@pytest.mark.parametrize("family", ["llama", "opt", "gpt_neox"])
def test_batch_row_equals_the_same_prompt_alone(family):
    model = tiny_model(family, seed=2)
    prompts = [torch.randint(1, 256, (n,)) for n in (21, 13, 6)]
    policy = make_policy("h2o", 12)
    ids, mask = left_pad(prompts)
    batched, cache = greedy(model, policy, ids, mask, 40, chunk=8)
    for i, p in enumerate(prompts):
        alone, solo_cache = greedy(model, policy, p[None], None, 40, chunk=8)
        assert torch.equal(batched[i], alone[0]), f"row {i}"
        for layer in range(2):
            pos_b, pos_s = cache.layers[layer].pos[i], solo_cache.layers[layer].pos[0]
            assert [set(r[r >= 0].tolist()) for r in pos_b] == [set(r[r >= 0].tolist()) for r in pos_s]
    # padding never survives in place of a real token once the rows are full
    assert (cache.layers[0].pos >= 0).all()


# -- (e) long prompts in bounded memory -----------------------------------------------------------------------
def test_chunked_long_prompt_holds_at_most_budget_plus_chunk(monkeypatch):
    budget, chunk, length = 256, 128, 4096
    seen_shapes = []
    real = layer_module.attention_with_mass

    def spy(query, k_cache, v_cache, k_new, v_new, *args):
        seen_shapes.append((k_cache.shape[2], k_new.shape[2]))
        return real(query, k_cache, v_cache, k_new, v_new, *args)

    monkeypatch.setattr(layer_module, "attention_with_mass", spy)
    model = tiny_model("llama", seed=4)
    cache = H2OCache.for_model(model, make_policy("h2o", budget))
    prefill(model, cache, torch.randint(0, 256, (1, length)), chunk_size=chunk)
    assert len(seen_shapes) == 2 * length // chunk  # every chunk, every layer
    assert max(stored + new for stored, new in seen_shapes) <= budget + chunk
    assert all(lay.keys.shape[2] == budget for lay in cache.layers)
    stats = cache.stats()
    assert stats.seen == length and stats.kept == budget and stats.evicted == length - budget
    assert stats.full_kv_bytes == stats.kv_bytes * length // budget


def test_model_without_h2o_attention_is_refused():
    model = tiny_model("llama")
    model.set_attn_implementation("sdpa")
    cache = H2OCache.for_model(model, make_policy("h2o", 16))
    with pytest.raises(CacheUsageError, match="prepare_model"):
        model(input_ids=torch.randint(0, 256, (1, 4)), past_key_values=cache)


def test_changing_budget_mid_stream_keeps_the_best_and_frees_the_rest():
    model = tiny_model("llama", seed=6)
    cache = H2OCache.for_model(model, make_policy("h2o", 32))
    run(model, cache, torch.randint(0, 256, (1, 60)), [20] + [1] * 40)
    layer = cache.layers[0]
    before = {p: s for p, s in zip(layer.pos[0, 0].tolist(), layer.score[0, 0].tolist(), strict=True)}
    smaller = make_policy("h2o", 16)
    expected = set(
        layer.pos[0, 0, smaller.priority(layer.score, layer.pos, layer.seen - 1)[0, 0].topk(16).indices].tolist()
    )
    cache.set_policy(smaller)
    assert layer.keys.shape[2] == 16 and set(layer.pos[0, 0].tolist()) == expected
    assert {p: before[p] for p in expected} == dict(
        zip(layer.pos[0, 0].tolist(), layer.score[0, 0].tolist(), strict=True)
    )
    assert cache.stats().evicted == 60 - 16
    run(model, cache, torch.randint(0, 256, (1, 5)), [1] * 5)  # keeps working at the new budget
    assert cache.stats().kept == 16
    cache.set_policy(make_policy("h2o", 64))  # larger: nothing comes back, room to grow
    assert layer.keys.shape[2] == 64 and cache.stats().kept == 16
    run(model, cache, torch.randint(0, 256, (1, 10)), [1] * 10)
    assert cache.stats().kept == 26


def test_stats_tell_allocated_from_in_use_bytes():
    model = tiny_model("llama", seed=2)  # 2 layers, 2 KV heads of 16 dims, fp32: 512 bytes a token (K+V)
    cache = H2OCache.for_model(model, make_policy("h2o", 32))
    run(model, cache, torch.randint(0, 256, (1, 10)), [10])
    stats = cache.stats()
    assert stats.kv_bytes == 32 * 512  # the whole budget is allocated from the first token
    assert stats.kv_used_bytes == 10 * 512 == stats.full_kv_bytes  # ten tokens held, as a full cache would
    run(model, cache, torch.randint(0, 256, (1, 40)), [1] * 40)
    stats = cache.stats()
    assert stats.kv_used_bytes == stats.kv_bytes == 32 * 512 and stats.full_kv_bytes == 50 * 512
    record = stats.as_dict()
    assert record["kept"] == 32 and type(record["kept"]) is int and type(record["evicted"]) is int
    assert record["kv_used_bytes"] == 32 * 512
