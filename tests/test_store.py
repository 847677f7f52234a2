"""The recall policy's store: a table of fixed capacity beside the slots, on their device, whose entries (int8
keys and values, their coordinates for the first ranking pass) each decode step and prompt chunk rank and bring
back; full, it drops the entries least likely to be needed, which never come back."""

from __future__ import annotations

import io
import random

import pytest
import torch
from rich.console import Console
from test_recall import talk, tiny_loaded, words

from conftest import tiny_model
from h2o_chat.app import ui
from h2o_chat.app.chat.conversation import ChatSettings, Conversation
from h2o_chat.engine.cache import H2OCache
from h2o_chat.engine.policies import DROP_RULES, make_policy, recall_rank, with_budget
from h2o_chat.engine.step.decode import Engine, left_pad
from h2o_chat.engine.step.generate import Sampler
from h2o_chat.engine.storage.quant import dequantize
from h2o_chat.engine.storage.store import RANK_DIM, Store, store_bytes
from h2o_chat.errors import ConfigError


def _run(model, policy, ids, mask=None, chunk=8, steps=30, seed=0, each=None):
    """Prefill ids (B, T) in chunks, then teacher-force `steps` random tokens; every step's logits (and
    `each(cache)` after every step)."""
    cache = H2OCache.for_model(model, policy)
    engine = Engine(model, cache, "eager")
    out = [engine.prefill(ids, mask, chunk).clone()]
    forced = torch.randint(4, 200, (ids.shape[0], steps), generator=torch.Generator().manual_seed(seed))
    for t in range(steps):
        out.append(engine.decode(forced[:, t])[0].clone())
        if each is not None:
            each(cache)
    return torch.stack(out, 1), cache


def _positions(store: Store, i: int, r: int, h: int) -> list[int]:
    pos = store.pos[i, r, h, : store.capacity]
    return sorted(pos[pos >= 0].tolist())


def test_recalling_every_evicted_token_comes_close_to_the_full_cache(single_thread):
    """A prompt that fits, then steps that evict: when a step may recall as many tokens as were evicted, it
    attends to every token at its true position exactly once; only the store's 8-bit rounding separates its
    logits from the full cache's, far less than what the same held set loses without recall. A store that lost a
    token, kept one twice or rotated one at another position would not come close."""
    model = tiny_model("llama", seed=1)
    ids = torch.randint(4, 200, (2, 12), generator=torch.Generator().manual_seed(1))
    policy = make_policy("recall", 48, recalled=32)  # 16 held, 32 recalled, a store of 8 x 48
    assert policy.capacity == 16 and policy.store == 384
    full, _ = _run(model, make_policy("full"), ids)
    recall, cache = _run(model, policy, ids)
    assert cache.stats().store_tokens == 12 + 30 - 16  # every evicted token is kept
    plain, _ = _run(model, make_policy("snap", 16), ids)  # the same held set without recall
    off = (recall - full).abs().max()
    assert off < 0.05 * (plain - full).abs().max()


def test_prompt_chunks_recall_what_earlier_chunks_evicted(single_thread, monkeypatch):
    """A prompt longer than the held slots, read in chunks with a left-padded row: each chunk's queries recall
    the evicted tokens too (once for the chunk), so when everything evicted can come back the chunks' keys and
    values, and so the logits, come as close to the full cache's as steps do; without recall in the chunks
    (steps only) the keys read after the first eviction differ and so do the logits."""
    model = tiny_model("llama", seed=4)
    ids = torch.randint(4, 200, (2, 40), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    policy = make_policy("recall", 64, recalled=48, window=4)  # 16 held: chunks of 8 evict from the third on
    full, _ = _run(model, make_policy("full"), ids, mask, chunk=8, steps=10)
    recall, cache = _run(model, policy, ids, mask, chunk=8, steps=10)
    assert cache.store.tokens().tolist() == [40 + 10 - 16, 33 + 10 - 16]
    plain, _ = _run(model, make_policy("snap", 16, window=4), ids, mask, chunk=8, steps=10)
    assert (recall - full).abs().max() < 0.05 * (plain - full).abs().max()
    monkeypatch.setattr(recall_rank, "chunk", lambda *a: None)
    stepping, _ = _run(model, policy, ids, mask, chunk=8, steps=10)
    assert (stepping[:, 0] - full[:, 0]).abs().max() > 10 * (recall[:, 0] - full[:, 0]).abs().max()


def test_a_chunk_ranks_the_store_in_blocks_the_device_sizes_and_recalls_the_same_whatever_their_size(
    single_thread, monkeypatch
):
    """A prompt chunk ranks the store `rank_block(device)` logits at a time. On a GPU a CPU-sized block (2 MB)
    meant a Llama-2-7B chunk of 512 queries in 128 passes of 4 (1,475 kernels per layer per chunk, recall's prompt
    read 42x slower than h2o's); the GPU's block is 32x larger. The block only bounds memory: what a chunk recalls
    and so its logits do not depend on it."""
    assert recall_rank.rank_block("cuda") == 32 * recall_rank.rank_block("cpu")
    model = tiny_model("llama", seed=4)
    ids = torch.randint(4, 200, (1, 96), generator=torch.Generator().manual_seed(6))
    policy = make_policy("recall", 32, recalled=8, window=4)
    passes = []
    first_pass = recall_rank.first_pass
    monkeypatch.setattr(recall_rank, "first_pass", lambda *a: passes.append(1) or first_pass(*a))
    runs = {}
    for block in (1 << 10, 1 << 24):
        monkeypatch.setattr(recall_rank, "rank_block", lambda device, block=block: block)
        passes.clear()
        runs[block] = _run(model, policy, ids, chunk=32, steps=4)[0]
        runs[block, "passes"] = len(passes)
    assert torch.equal(runs[1 << 10], runs[1 << 24])
    assert runs[1 << 10, "passes"] > 4 * runs[1 << 24, "passes"], runs


def test_the_store_holds_exactly_the_evicted_tokens_at_their_true_positions(single_thread):
    """Long prompts (compressed by snap, padded rows) and steps, a store large enough for all: per layer, row and
    head the held and the stored positions are disjoint and cover everything seen; layer 0's stored keys (which
    depend only on the token and its position) are the full cache's at the same positions, to 8-bit rounding."""
    model = tiny_model("llama", seed=2)
    ids = torch.randint(4, 200, (2, 90), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, :17] = 0  # a shorter, left-padded row
    _, cache = _run(model, make_policy("recall", 40, recalled=8), ids, mask, chunk=16, steps=25)
    _, full = _run(model, make_policy("full"), ids, mask, chunk=16, steps=25)
    s, store = cache.slots, cache.store
    L, B, H = s.pos.shape[:3]
    for r in range(B):
        real = int(mask[r].sum()) + 25
        for i in range(L):
            for h in range(H):
                held = s.pos[i, r, h][s.pos[i, r, h] >= 0].tolist()
                stored = _positions(store, i, r, h)
                assert not set(held) & set(stored)
                assert sorted(held + stored) == list(range(real))
        fp = full.slots.pos[0, r, 0]
        slot_of = {int(p): k for k, p in enumerate(fp.tolist()) if p >= 0}
        for h in range(H):
            kept = store.pos[0, r, h, : store.capacity]
            for k in torch.nonzero(kept >= 0).flatten().tolist():
                want = full.slots.keys[0, r, h, slot_of[int(kept[k])]]
                got = dequantize(store.keys[0, r, h, k], store.kscale[0, r, h, k], torch.float32)
                torch.testing.assert_close(got, want, atol=want.abs().max() / 100, rtol=0)


@pytest.mark.parametrize("rule", DROP_RULES)
def test_a_full_store_drops_its_lowest_entries_stays_its_size_and_never_brings_one_back(single_thread, rule):
    """A store of 32 entries and a long run, under every drop rule: the store's tensors stay where and what they
    were allocated (no growth, the same memory), it holds at most its capacity, it counts what it dropped, and a
    position once dropped is never held, stored or recalled again. `first` keeps the earliest positions of what was
    evicted (a chat's opening): any position it dropped is later than every one it holds."""
    model = tiny_model("llama", seed=6)
    ids = torch.randint(4, 200, (1, 30), generator=torch.Generator().manual_seed(6))
    policy = make_policy("recall", 16, recalled=4, store=32, drop=rule)
    seen = {"places": None, "stored": {}, "dropped": set()}

    def check(cache):
        store = cache.store
        places = [(t.data_ptr(), tuple(t.shape)) for t in store.tensors().values()]
        assert seen["places"] in (None, places)
        seen["places"] = places
        now = {(i, h): set(_positions(store, i, 0, h)) for i in range(store.pos.shape[0]) for h in range(2)}
        for where, positions in now.items():
            assert len(positions) <= 32
            gone = seen["stored"].get(where, set()) - positions
            if rule == "first" and positions:  # it holds the earliest positions evicted: any dropped one is later
                assert all(p > max(positions) for w, p in seen["dropped"] | {(where, p) for p in gone} if w == where)
            seen["dropped"] |= {(where, p) for p in gone}
            assert not {(where, p) for p in positions} & seen["dropped"]  # never stored again
            held = cache.slots.pos[where[0], 0, where[1]]
            assert not {(where, int(p)) for p in held[held >= 0]} & seen["dropped"]
        seen["stored"] = now
        picked = store.marks > 0  # recalled since the last count: only what is stored now
        assert bool((store.pos[picked] >= 0).all())
        with torch.inference_mode():
            store.marks.zero_()

    _, cache = _run(model, policy, ids, steps=200, each=check)
    stats = cache.stats()
    assert stats.store_tokens == stats.store_capacity == 32
    assert stats.store_dropped == 30 + 200 - 12 - 32 and seen["dropped"]  # every evicted token kept or dropped
    L, H, D = 2, 2, 16
    assert cache.store.nbytes() == stats.store_bytes == store_bytes(L, 1, H, D, D, 32)


def test_the_memory_held_is_the_budget_and_the_store_it_was_given(single_thread):
    model = tiny_model("llama", seed=3)
    ids = torch.randint(4, 200, (1, 64), generator=torch.Generator().manual_seed(3))
    policy = make_policy("recall", 32)
    assert policy.recalled == 8 and policy.capacity == 24 and sum(policy.split().values()) == 32
    assert policy.store == 256 and "from 256 evicted tokens kept" in policy.describe()
    _, cache = _run(model, policy, ids, steps=40)
    assert cache.slots.capacity == 24 and cache.stats().kept == 24  # held slots; 8 more per step, one layer at a time
    assert cache.store.keys.device == cache.slots.keys.device and cache.store.keys.dtype == torch.int8
    assert cache.store.tokens().tolist() == [64 + 40 - 24]
    assert "8 recalled per step" in policy.describe()
    assert with_budget(policy, 64).recalled == 16 and with_budget(policy, 64).store == 512  # defaults follow
    assert with_budget(make_policy("recall", 32, store=100), 64).store == 100  # a given store stays
    stats = cache.stats()
    assert stats.store_bytes == cache.store.nbytes() == store_bytes(2, 1, 2, 16, 16, 256)
    assert f"evicted tokens kept for recall {ui.human_bytes(stats.store_bytes)} (80 of 256 tokens)" in ui.describe_kv(
        stats
    )
    _, plain = _run(model, make_policy("snap", 32), ids, steps=4)
    assert plain.stats().store_bytes == 0 and "recall" not in ui.describe_kv(plain.stats())


@pytest.mark.cuda
def test_cuda_memory_held_stays_flat_while_the_store_fills_and_drops():
    """On CUDA the store lives on the GPU beside the slots, allocated once: memory stays flat once it is full."""
    model = tiny_model("llama", seed=4).cuda()
    cache = H2OCache.for_model(model, make_policy("recall", 64, store=256))
    engine = Engine(model, cache, "auto")
    tokens = engine.first_tokens(engine.prefill(torch.randint(4, 200, (1, 256), device="cuda")))
    for _ in range(50):
        tokens = engine.decode(tokens)[1]
    torch.cuda.synchronize()
    at_50 = torch.cuda.memory_allocated()
    for _ in range(400):
        tokens = engine.decode(tokens)[1]
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() <= at_50 and cache.store.keys.device.type == "cuda"
    assert float(cache.store.tokens()[0]) == 256 and float(cache.store.dropped()[0]) > 0


def test_snapshot_and_restore_bring_the_store_back_as_it_was(single_thread):
    model = tiny_model("llama", seed=5)
    cache = H2OCache.for_model(model, make_policy("recall", 24, recalled=4, store=16))
    engine = Engine(model, cache, "eager")
    tokens = engine.first_tokens(engine.prefill(torch.randint(4, 200, (1, 40))))
    saved = cache.snapshot()
    before = {k: v.clone() for k, v in cache.store.tensors().items()}
    places = {k: v.data_ptr() for k, v in cache.store.tensors().items()}
    for _ in range(10):
        tokens = engine.decode(tokens)[1]
    assert not torch.equal(before["pos"], cache.store.pos)
    cache.restore(saved)
    for name, t in cache.store.tensors().items():
        assert torch.equal(t, before[name]) and t.data_ptr() == places[name]  # in place: a captured step reads it
    cache.clear()
    assert cache.store.tokens().tolist() == [0]


def test_recall_refuses_what_it_cannot_do_in_one_clear_line():
    with pytest.raises(ConfigError, match="at least"):
        make_policy("recall", 20, recalled=20)
    with pytest.raises(ConfigError, match="store must hold at least 32 evicted tokens"):
        make_policy("recall", 64, recalled=8, store=31)


def test_the_chat_says_which_messages_a_reply_recalled(single_thread):
    loaded, rng = tiny_loaded(seed=2), random.Random(2)
    settings = ChatSettings(max_new_tokens=6, sampler=Sampler(temperature=0), chunk_size=8)
    conv = Conversation(loaded, make_policy("recall", 24, recalled=4, window=4), settings)
    said = []  # the note each turn leaves (None: nothing new to say)
    for text in (words(rng, 12), words(rng, 12), words(rng, 6)):
        talk(conv, [text])
        said.append(conv.ledger.recall_note)
    assert conv.ledger.recalled and sum(conv.ledger.recalled.values()) <= 1 + 1e-6
    reports = {r.index: r for r in conv.evictions()}
    assert all(reports[i].recalled == conv.ledger.recalled[i] for i in conv.ledger.recalled)
    top, share = max(conv.ledger.recalled.items(), key=lambda kv: kv[1])
    if share >= 0.05 and said[-1] is not None:  # a note names the top message (said only when it is news)
        assert f"{100 * share:.0f}% from message {top}" in said[-1]
    assert any(note and "from message" in note for note in said)  # and some turn said which
    console = Console(file=io.StringIO(), width=140, no_color=True)
    console.print(ui.eviction_table(list(reports.values())))
    assert "recalled" in console.file.getvalue().splitlines()[0]


def test_recall_scores_decay_before_each_step_adds_its_mass(single_thread):
    """recall's held scores are multiplied by `decay` before a decode step adds its attention mass (the plain sum
    favours old tokens); with nothing evicted the mass is the same either way, so the scores are exactly
    decay x before + the undecayed step's increase. h2o keeps the paper's plain sum."""
    model = tiny_model("llama", seed=9)
    ids = torch.randint(4, 200, (1, 10), generator=torch.Generator().manual_seed(9))
    scores = {}
    for decay in (0.5, 1.0):
        cache = H2OCache.for_model(model, make_policy("recall", 64, decay=decay))
        engine = Engine(model, cache, "eager")
        engine.prefill(ids, None, 8)
        before = cache.slots.score[:, :, :, :10].clone()
        engine.decode(torch.tensor([7]))
        scores[decay] = (before, cache.slots.score[:, :, :, :10].clone())
    before, plain = scores[1.0]
    torch.testing.assert_close(scores[0.5][0], before)
    torch.testing.assert_close(scores[0.5][1], 0.5 * before + (plain - before))
    assert make_policy("recall", 64).decay == 0.99 and "decay x0.99" in make_policy("recall", 64).describe()
    assert not hasattr(make_policy("h2o", 64), "decay")
    with pytest.raises(ConfigError, match="decay must be in"):
        make_policy("recall", 64, decay=1.5)


def test_keys_in_as_many_directions_as_the_basis_keeps_are_ranked_as_exact_ranking_ranks_them(single_thread):
    """The first pass reads each entry's coordinates in its head's principal directions, then ranks the best
    `CANDIDATES` x k exactly. Keys lying in `RANK_DIM` directions are ranked by the first pass up to its 8-bit
    rounding, so a step recalls the exact ranking's tokens for every row and head (a wrong offset or index
    mapping would not), with the logits of their own (rounded) keys."""
    gen = torch.Generator().manual_seed(0)
    L, B, H, D, G, k, N = 2, 2, 2, 32, 2, 8, 256
    template = torch.zeros(B, H, 1, D)
    store = Store.allocate(L, template, template, [N, N], [k, k])
    assert store.low.shape[-1] == RANK_DIM < D
    span = torch.randn(L, B, H, RANK_DIM, D, generator=gen)  # every (layer, row, head) its own subspace
    keys = torch.randn(L, B, H, 200, RANK_DIM, generator=gen) @ span
    values = torch.randn(L, B, H, 200, D, generator=gen)
    pos = torch.arange(200).expand(L, B, H, 200)
    store.append_chunk(keys, values, pos, pos, torch.rand(L, B, H, 200, generator=gen))
    slots = _NoSlots(L, B, H, D)
    store.evicted, store.fitted = [200, 200], [0, 0]
    assert store.due([True, False]) == [0]  # a row with nothing stored before the forward is not fitted yet
    assert store.due([True, True]) == [0, 1]
    store.fit([0, 1], slots)
    for i in range(L):
        q = torch.randn(B, H * G, 1, D, generator=gen)
        got = recall_rank.step(store, i, q)
        stored = dequantize(store.keys[i, :, :, :N], store.kscale[i, :, :, :N], torch.float32)
        logits = (q.view(B, H, G, D) @ stored.mT).masked_fill(store.pos[i, :, :, None, :N] < 0, -torch.inf)
        best = logits.amax(2).topk(k, dim=-1).indices
        assert torch.equal(got.index.sort(-1).values, best.sort(-1).values)
        want = logits.gather(3, got.index[:, :, None, :].expand(B, H, G, k))
        torch.testing.assert_close(got.logits, want, atol=1e-4, rtol=1e-4)


class _NoSlots:
    """Slots holding nothing, for fitting a store on its own entries."""

    def __init__(self, L, B, H, D):
        self.capacity = 1
        self.pos = torch.full((L, B, H, 2), -1)
        self._keys = torch.zeros(L, B, H, 2, D)

    def read(self, which, index):
        return self._keys[index]


def test_a_row_recalls_as_it_would_alone_beside_rows_of_other_budgets(single_thread):
    """Evaluations compare budgets as rows of one batch, which share one store: each row keeps its own capacity
    (the entries past it are never filled), recalls its own number of tokens among its own number of candidates
    and fits its basis on its own schedule, so that its figures do not move with its neighbour's budget. (Rows of
    different budgets read a prompt with products that round differently from the same prompt alone, by ~1e-6
    even in float64: an 8-bit rounding or a near tie then flips sooner or later, so the logits are compared
    over the first steps, and the schedule over the whole run.)"""
    model = _wide_heads_model(seed=3).double()
    ids = torch.randint(4, 200, (1, 40), generator=torch.Generator().manual_seed(3))
    small, large = make_policy("recall", 24, recalled=6), make_policy("recall", 64, recalled=16)
    for first, other in ((small, large), (large, small)):  # each policy the first row (the same forced tokens)
        alone, by_itself = _run(model, first, ids, steps=300)
        both, cache = _run(model, [first, other], ids.expand(2, -1), steps=300)
        store = cache.store
        assert store.capacities == [first.store, other.store] and store.recalled == [first.recalled, other.recalled]
        assert store.host([0]) == by_itself.store.host() and store.fitted[0] != store.fitted[1]
        assert store.tokens()[0] == by_itself.store.tokens()[0] <= first.store
        assert bool((store.pos[:, 0, :, first.store : store.capacity] < 0).all())  # never filled past its own
        torch.testing.assert_close(both[:1, :20], alone[:, :20], atol=1e-4, rtol=1e-4)


def test_a_refilled_batch_row_recalls_only_its_own_prompt(single_thread):
    """Continuous batching with recall: six prompts pass through two rows, each row refilled when its prompt's
    steps are done. Every step's logits of a refilled row equal its prompt's alone: what the prompt evicted went
    to its row of the store, and nothing of the row's earlier prompts is recalled."""
    model = _wide_heads_model(seed=5).double()
    policy = make_policy("recall", 24, recalled=6, store=48)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(4, 200, (1, n), generator=gen) for n in (40, 20, 60, 20, 30, 90)]
    steps = [120, 60, 40, 30, 20, 45]
    forced = [torch.randint(4, 200, (s,), generator=gen) for s in steps]
    alone = [_run_forced(model, policy, p, f) for p, f in zip(prompts, forced, strict=True)]

    cache = H2OCache.for_model(model, policy)
    engine = Engine(model, cache, "eager")
    engine.prefill(*left_pad([p[0].tolist() for p in prompts[:2]], 0), 8)
    item, t, waiting = [0, 1], [0, 0], list(range(2, len(prompts)))
    got: dict[int, list[torch.Tensor]] = {0: [], 1: []}
    while any(i is not None for i in item):
        feed = torch.stack([forced[i][t[r]] if i is not None else torch.tensor(4) for r, i in enumerate(item)])
        logits = engine.decode(feed)[0]
        for r, i in enumerate(item):
            if i is None:
                continue
            got[i].append(logits[r].clone())
            t[r] += 1
            if t[r] == steps[i]:  # done: the next prompt takes the row
                item[r], t[r] = (waiting.pop(0), 0) if waiting else (None, 0)
                if item[r] is not None:
                    got[item[r]] = []
                    engine.refill(r, prompts[item[r]], 8)
    for i in range(len(prompts)):
        torch.testing.assert_close(torch.stack(got[i]), alone[i][1:], atol=1e-4, rtol=1e-4, msg=f"prompt {i}")


def _run_forced(model, policy, ids, forced):
    """A prompt alone, then `forced` tokens: the prefill's logits and every step's."""
    cache = H2OCache.for_model(model, policy)
    engine = Engine(model, cache, "eager")
    out = [engine.prefill(ids, None, 8)[0].clone()]
    for token in forced:
        out.append(engine.decode(token[None])[0][0].clone())
    return torch.stack(out)


def _wide_heads_model(seed: int):
    """A tiny llama with heads of 32 channels, so that the first pass's coordinates are fewer than a key's. The
    tests that compare a batch row with the same prompt alone run it in float64: float32 products round a
    little differently with two rows than with one, which is harmless until a stored key's 8-bit rounding or a
    ranking between near-equal entries flips, after which the two runs hold different tokens."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from h2o_chat.engine.step.attention import prepare_model

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=256, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, initializer_range=0.2,
    )  # fmt: skip
    return prepare_model(AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval())


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_the_store_lives_on_the_gpu_and_its_steps_are_one_captured_graph():
    """On a GPU the store is allocated beside the slots, on the GPU, once: the recall step is captured as a CUDA
    graph like h2o's, GPU memory stays flat once the store is full, and the graph's tokens are the eager ones."""
    model = tiny_model("llama", seed=4).cuda()
    ids = torch.randint(4, 200, (1, 256), device="cuda")
    runs = {}
    for mode in ("eager", "graph"):
        cache = H2OCache.for_model(model, make_policy("recall", 64, store=256))
        engine = Engine(model, cache, mode)
        tokens = engine.first_tokens(engine.prefill(ids))
        out = torch.empty(600, dtype=torch.long, device="cuda")  # (a list of 600 clones grew by 512 bytes each)
        for step in range(600):
            tokens = engine.decode(tokens)[1]
            out[step] = tokens[0]
            if step == 400:
                torch.cuda.synchronize()
                at_400 = torch.cuda.memory_allocated()
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() <= at_400 and cache.store.keys.device.type == "cuda"
        assert cache.stats().store_dropped > 0
        runs[mode] = (out.cpu(), engine)
    assert runs["graph"][1].mode == "graph" and runs["graph"][1].captures == 1
    assert torch.equal(runs["graph"][0], runs["eager"][0])


def test_counting_recalls_for_the_chat_keeps_the_marks_the_drop_rule_ranks_by(single_thread):
    """The chat asks each turn which messages were recalled (`take_counts`). That used to zero the marks, so the
    default drop rule (the least recalled first) only ever saw one turn's recalls; now each call reports what is
    new since the last one and the marks keep counting."""
    model = tiny_model("llama", seed=5)
    cache = H2OCache.for_model(model, make_policy("recall", 24, recalled=4, store=64))
    engine = Engine(model, cache, "eager")
    tokens = engine.first_tokens(
        engine.prefill(torch.randint(4, 200, (1, 60), generator=torch.Generator().manual_seed(5)))
    )
    for _ in range(8):
        tokens = engine.decode(tokens)[1]
    store, n = cache.store, cache.store.capacity
    before = store.marks[..., :n].clone()
    assert int(store.take_counts().sum()) == int(before.sum()) > 0
    assert torch.equal(store.marks[..., :n], before) and int(store.take_counts().sum()) == 0  # kept; nothing new
    for _ in range(4):
        tokens = engine.decode(tokens)[1]
    assert float(store.dropped()[0]) == 0  # no entry replaced: the marks only grew
    grown = int(store.marks[..., :n].sum()) - int(before.sum())
    assert int(store.take_counts().sum()) == grown > 0
