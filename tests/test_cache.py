"""The H2O cache on tiny random models: parity, the paper's eviction, fixed capacity, batches, chunked prefill."""

from __future__ import annotations

import pytest
import torch
from transformers import AttentionInterface, DynamicCache

from conftest import FAMILIES, cached, tiny_model
from h2o_chat.engine import layer as layer_module
from h2o_chat.engine.cache import H2OCache
from h2o_chat.engine.policies import POLICIES, make_policy
from h2o_chat.engine.step.decode import Engine, left_pad
from h2o_chat.engine.step.sampling import Sampler
from h2o_chat.errors import CacheUsageError


def run(model, cache, tokens: torch.Tensor, schedule: list[int]) -> torch.Tensor:
    """Feed (1, L) tokens in plain model forwards of the given sizes (as model.generate does); all logits."""
    out, s = [], 0
    with torch.inference_mode():
        for size in schedule:
            out.append(model(input_ids=tokens[:, s : s + size], **cached(model, cache), use_cache=True).logits)
            s += size
    return torch.cat(out, 1)


def held(cache, layer: int, row: int = 0) -> list[set[int]]:
    """The positions each KV head of a layer holds."""
    pos = cache.layers[layer].pos[row]
    return [set(p[p >= 0].tolist()) for p in pos]


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
        **cached(model, H2OCache.for_model(model, make_policy("h2o", 64))),
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
        assert held(cache, layer) == reference.kept_positions(layer)
        lay = cache.layers[layer]
        for h in range(lay.pos.shape[1]):
            ours = {int(p): float(a) for p, a in zip(lay.pos[0, h], lay.score[0, h], strict=True) if p >= 0}
            theirs = {p: float(reference.acc[layer][h, p]) for p in reference.kept_positions(layer)[h]}
            assert ours.keys() == theirs.keys()
            torch.testing.assert_close(torch.tensor(list(ours.values())), torch.tensor([theirs[p] for p in ours]))
    # attention over the kept slots is the reference's masked attention: same logits at every step
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    assert cache.stats().evicted == sum(schedule) - budget


def test_heads_keep_different_positions():
    model = tiny_model("llama", seed=5)
    cache = H2OCache.for_model(model, make_policy("h2o", 16))
    run(model, cache, torch.randint(0, 256, (1, 80)), [8] + [1] * 72)
    sets = [frozenset(s) for layer in range(2) for s in held(cache, layer)]
    assert len(set(sets)) > 1


# -- (c) capacity: fixed storage, never re-allocated ---------------------------------------------------------
def test_storage_is_allocated_once_and_never_exceeds_budget(single_thread):
    budget = 32
    model = tiny_model("llama", seed=1)
    cache = H2OCache.for_model(model, make_policy("h2o", budget))
    engine = Engine(model, cache, "eager")
    engine.set_sampler(Sampler(temperature=1.0, seed=0), 1)
    steps = engine.tokens(engine.prefill(torch.randint(0, 256, (1, 5))), 2000)
    next(steps)
    slots = cache.slots
    pointers = [t.data_ptr() for t in (slots.keys, slots.values, slots.pos, slots.score, slots.seen)]
    count = 1
    for _ in steps:
        count += 1
        assert cache.slots is slots and slots.capacity == budget
        assert [t.data_ptr() for t in (slots.keys, slots.values, slots.pos, slots.score, slots.seen)] == pointers
        if count % 100 == 0:
            assert int((slots.pos >= 0).sum(-1).max()) <= budget
    assert count == 2000
    stats = cache.stats()
    assert stats.seen == 5 + 1999 and stats.kept == budget and stats.kept_max == budget
    # layers * rows * heads * (budget + the spare slot) * (K,V of head dim in fp32 + position, rotation (int64)
    # and score (fp32)), and the rows' counters (seen, next rotation: int64)
    assert stats.kv_bytes == 2 * 1 * 2 * (budget + 1) * (2 * 16 * 4 + 8 + 8 + 4) + 1 * 2 * 8
    assert stats.kv_used_bytes == 2 * 1 * 2 * budget * (2 * 16 * 4 + 8 + 8 + 4)


# -- (d) batch rows evict independently: a row gives what the prompt gives alone ------------------------------
def greedy(model, policy, ids, mask, steps, chunk, decode="eager"):
    cache = H2OCache.for_model(model, policy)
    engine = Engine(model, cache, decode)
    out = [torch.tensor(t) for t in engine.tokens(engine.prefill(ids, mask, chunk), steps)]
    return torch.stack(out, 1), cache


BATCH_POLICIES = {  # snap first: it is the default of batch mode
    "snap": lambda: make_policy("snap", 24, window=6),
    "h2o": lambda: make_policy("h2o", 24),
    "sink": lambda: make_policy("sink", 24),
    "recent": lambda: make_policy("recent", 24),
    "full": lambda: make_policy("full"),
}


@pytest.mark.parametrize("policy", list(BATCH_POLICIES))
@pytest.mark.parametrize("family", ["llama", "opt"])
def test_batch_row_equals_the_same_prompt_alone(family, policy, single_thread):
    """Rows of 70, 33 and 10 tokens: the short rows must not be compressed or numbered because their
    neighbour is long (a snap row is compressed only when its own tokens overflow the budget)."""
    model = tiny_model(family, seed=2)
    prompts = [torch.randint(1, 256, (n,)) for n in (70, 33, 10)]
    ids, mask = left_pad([p.tolist() for p in prompts], 0)
    batched, cache = greedy(model, BATCH_POLICIES[policy](), ids, mask, 40, chunk=16)
    for i, p in enumerate(prompts):
        alone, solo = greedy(model, BATCH_POLICIES[policy](), p[None], None, 40, chunk=16)
        assert torch.equal(batched[i], alone[0]), f"row {i}"
        for layer in range(2):
            assert held(cache, layer, i) == held(solo, layer), f"row {i}, layer {layer}"
    if policy != "full":  # padding never survives in place of a real token once the rows are full
        assert ((cache.slots.pos[..., :-1] >= 0).sum(-1) == 24).all()


# -- (e) long prompts in bounded memory -----------------------------------------------------------------------
def test_chunked_long_prompt_holds_at_most_budget_plus_chunk(monkeypatch):
    budget, chunk, length = 256, 128, 4096
    seen_shapes = []
    real = layer_module.attention_with_mass

    def spy(query, keys, values, *args):
        seen_shapes.append((keys.shape[2] - query.shape[2], query.shape[2]))
        return real(query, keys, values, *args)

    monkeypatch.setattr(layer_module, "attention_with_mass", spy)
    model = tiny_model("llama", seed=4)
    cache = H2OCache.for_model(model, make_policy("h2o", budget))
    Engine(model, cache).prefill(torch.randint(0, 256, (1, length)), chunk_size=chunk)
    assert len(seen_shapes) == 2 * length // chunk  # every chunk, every layer
    assert max(slots + new for slots, new in seen_shapes) <= budget + chunk  # the budget and a chunk
    assert cache.slots.capacity == budget
    stats = cache.stats()
    assert stats.seen == length and stats.kept == budget and stats.evicted == length - budget
    # a full cache would hold keys and values of every token; ours holds each kept slot (position, rotation and
    # score included: 20 bytes beside 2 x 16 fp32)
    assert stats.full_kv_bytes * 148 // 128 == stats.kv_used_bytes * length // budget


def test_model_without_h2o_attention_is_refused():
    model = tiny_model("llama")
    model.set_attn_implementation("sdpa")
    cache = H2OCache.for_model(model, make_policy("h2o", 16))
    with pytest.raises(CacheUsageError, match="prepare_model"):
        model(input_ids=torch.randint(0, 256, (1, 4)), **cached(model, cache))
    assert cache.slots is None  # refused before the first layer wrote anything


def test_an_unprepared_model_fails_at_its_first_update():
    """Without prepare_model there is no hook: the first update must fail, not fall back to other attention."""
    from transformers import AutoModelForCausalLM

    from conftest import tiny_config

    model = AutoModelForCausalLM.from_config(tiny_config("llama"), attn_implementation="sdpa").eval()
    cache = H2OCache.for_model(model, make_policy("h2o", 16))
    calls = []
    layer0 = model.model.layers[0].self_attn
    layer0.register_forward_hook(lambda *a: calls.append("layer 0 finished"))
    with pytest.raises(CacheUsageError, match="prepare_model"):
        model(input_ids=torch.randint(0, 256, (1, 4)), **cached(model, cache))
    assert calls == []  # stopped inside the first attention, not a layer (or a forward) later


def test_changing_budget_mid_stream_keeps_the_best_and_frees_the_rest():
    model = tiny_model("llama", seed=6)
    cache = H2OCache.for_model(model, make_policy("h2o", 32))
    run(model, cache, torch.randint(0, 256, (1, 60)), [20] + [1] * 40)
    s = cache.slots
    before = {p: a for p, a in zip(s.pos[0, 0, 0].tolist(), s.score[0, 0, 0].tolist(), strict=True) if p >= 0}
    smaller = make_policy("h2o", 16)
    # the new policy's choice, by hand: the 8 newest, then the 8 highest scores of the rest
    held_now = sorted(before, reverse=True)
    recent, older = held_now[:8], held_now[8:]
    expected = set(recent) | set(sorted(older, key=lambda p: -before[p])[:8])
    cache.set_policy(smaller)
    layer = cache.layers[0]
    assert cache.slots.capacity == 16 and held(cache, 0)[0] == expected
    after = {p: a for p, a in zip(layer.pos[0, 0].tolist(), layer.score[0, 0].tolist(), strict=True) if p >= 0}
    assert after == {p: before[p] for p in expected}  # scores travel with their tokens
    assert cache.stats().evicted == 60 - 16
    run(model, cache, torch.randint(0, 256, (1, 5)), [1] * 5)  # keeps working at the new budget
    assert cache.stats().kept == 16
    cache.set_policy(make_policy("h2o", 64))  # larger: nothing comes back, room to grow
    assert cache.slots.capacity == 64 and cache.stats().kept == 16
    run(model, cache, torch.randint(0, 256, (1, 10)), [1] * 10)
    assert cache.stats().kept == 26


def test_stats_tell_allocated_from_in_use_bytes():
    # 2 layers, 2 KV heads of 16 dims, fp32: a slot is K+V (128 bytes) + position, rotation, score (20): 592 bytes
    # a token over layers and heads, 512 of them its keys and values (what a full cache holds of it)
    model = tiny_model("llama", seed=2)
    cache = H2OCache.for_model(model, make_policy("h2o", 32))
    run(model, cache, torch.randint(0, 256, (1, 10)), [10])
    stats = cache.stats()
    rows = 2 * 8  # the row's counters: seen and the next rotation (int64)
    assert stats.kv_bytes == (32 + 1) * 592 + rows  # the whole budget (and its spare slot) from the first token
    assert stats.kv_used_bytes == 10 * 592 and stats.full_kv_bytes == 10 * 512  # ten tokens held
    run(model, cache, torch.randint(0, 256, (1, 40)), [1] * 40)
    stats = cache.stats()
    assert stats.kv_used_bytes == 32 * 592 and stats.kv_bytes == 33 * 592 + rows and stats.full_kv_bytes == 50 * 512
    record = stats.as_dict()
    assert record["kept"] == 32 and type(record["kept"]) is int and type(record["evicted"]) is int
    assert record["kv_used_bytes"] == 32 * 592


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_a_reset_cache_reads_the_next_sequence_as_a_fresh_one(name):
    """Issue 41.3: reset() forgets everything of the sequence before (recall's store of evicted tokens, the
    positions, the numbering): a second sequence after it gives a fresh cache's logits, prompt and steps, past a
    48-token trained context (auto positions renumber) so that every piece of the numbering is used."""
    model = tiny_model("llama", seed=22, max_positions=48)
    g = torch.Generator().manual_seed(22)
    first, second = (torch.randint(1, 256, (1, n), generator=g) for n in (70, 40))

    def read(cache, ids: torch.Tensor) -> torch.Tensor:
        engine = Engine(model, cache, "eager")
        logits = [engine.prefill(ids, chunk_size=8)]
        tokens = logits[0].argmax(-1)
        for _ in range(30):
            out, tokens = engine.decode(tokens)
            logits.append(out.clone())
        return torch.stack(logits)

    def make():
        return H2OCache.for_model(model, make_policy(name, 16 if name != "recall" else 24), "auto")

    reused = make()
    read(reused, first)
    reused.reset()
    torch.testing.assert_close(read(reused, second), read(make(), second), atol=1e-5, rtol=1e-5)


def test_a_field_added_to_the_storage_declaration_is_carried_everywhere(monkeypatch):
    """The storage's buffers are declared once (`slots.FIELDS`): a new one is allocated, moved by eviction and
    budget changes, selected with its rows, viewed, snapshotted, restored, cleared and counted without another
    edit. Here it holds a copy of each slot's position: wherever tokens go, it must go with them."""
    from h2o_chat.engine.step.decode import Engine
    from h2o_chat.engine.storage import slots as slots_module
    from h2o_chat.models.memory import footprint

    mark = slots_module.Field("mark", -7, torch.int32)
    monkeypatch.setattr(slots_module, "FIELDS", (*slots_module.FIELDS, mark))
    model = tiny_model("llama", seed=9)
    cache = H2OCache.for_model(model, make_policy("h2o", 24), "auto")
    engine = Engine(model, cache, "eager")
    logits = engine.prefill(torch.randint(1, 256, (2, 20)))
    s = cache.slots
    assert s.mark.shape == s.pos.shape and s.mark.dtype == torch.int32

    @torch.inference_mode()
    def stamp() -> None:  # every held token's mark is its position
        cache.slots.mark.copy_(cache.slots.pos.to(torch.int32).masked_fill(cache.slots.pos < 0, -7))

    def carried(c=None) -> None:
        c = c or cache
        held = c.slots.pos >= 0
        marks = c.slots.mark[held]
        # a token kept since the stamp has its position; one placed since then has the field's empty value
        assert bool(((marks == c.slots.pos[held].to(torch.int32)) | (marks == -7)).all())
        assert bool((c.slots.mark[~held] == -7).all())
        assert bool((marks != -7).any())  # some stamped tokens are still held

    stamp()
    list(engine.tokens(logits, 12))  # decode steps: the spare replaces victims
    carried()
    engine.prefill(torch.randint(1, 256, (2, 30)), chunk_size=8)  # chunks that do not fit: selection
    carried()
    stamp()
    state = cache.snapshot()
    assert state["slots"].mark.device.type == "cpu"
    engine.prefill(torch.randint(1, 256, (2, 10)))
    cache.restore(state)
    carried()
    view = cache.row(1)  # a row's view shares the storage
    assert view.slots.mark.data_ptr() == cache.slots.mark[:, 1:2].data_ptr()
    twin = cache.fork()
    carried(twin)
    cache.set_policy(make_policy("h2o", 16))  # a smaller budget moves the best slots into new storage
    assert cache.slots.capacity == 16
    carried()
    cache.select_rows(torch.tensor([1]))
    carried()
    cache.clear_row(0)
    assert bool((cache.slots.mark == -7).all())
    fp = footprint(model.config)
    assert cache.storage_bytes() == fp.kv_bytes(16, torch.float32, 1)  # counted in the one formula too
    assert cache.storage_bytes() == cache.slots.nbytes() > 0
