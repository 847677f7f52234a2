"""The recall policy: every evicted token kept off the accelerator at its true position, each decode step's
query bringing back the tokens it attends to most, the budget still the memory held, and the user told."""

from __future__ import annotations

import io
import random

import pytest
import torch
from rich.console import Console
from test_recall import talk, tiny_loaded, words

from conftest import tiny_model
from h2o_chat.app import ui
from h2o_chat.app.conversation import ChatSettings, Conversation
from h2o_chat.engine.cache import H2OCache
from h2o_chat.engine.decode import Engine, left_pad
from h2o_chat.engine.generate import Sampler
from h2o_chat.engine.policies import make_policy, with_budget
from h2o_chat.engine.recall_rank import CANDIDATES, RANK_DIM
from h2o_chat.engine.store import Store
from h2o_chat.errors import ConfigError


def _run(model, policy, ids, mask=None, chunk=8, steps=30, seed=0):
    """Prefill ids (B, T) in chunks, then teacher-force `steps` random tokens; every step's logits."""
    cache = H2OCache.for_model(model, policy)
    engine = Engine(model, cache, "eager")
    out = [engine.prefill(ids, mask, chunk).clone()]
    forced = torch.randint(4, 200, (ids.shape[0], steps), generator=torch.Generator().manual_seed(seed))
    for t in range(steps):
        out.append(engine.decode(forced[:, t])[0].clone())
    return torch.stack(out, 1), cache


def test_recalling_every_evicted_token_reproduces_the_full_cache(single_thread):
    """A prompt that fits, then steps that evict: when a step may recall as many tokens as were evicted, it
    attends to every token at its true position exactly once, so its logits are the full cache's. A store that
    lost a token, kept one twice or rotated one at another position would differ."""
    model = tiny_model("llama", seed=1)
    ids = torch.randint(4, 200, (2, 12), generator=torch.Generator().manual_seed(1))
    policy = make_policy("recall", 48, recalled=32)  # 16 held, 32 recalled
    assert policy.capacity == 16
    full, _ = _run(model, make_policy("full"), ids)
    recall, cache = _run(model, policy, ids)
    assert cache.store.tokens() == 12 + 30 - 16  # every evicted token is kept
    torch.testing.assert_close(recall, full, atol=2e-4, rtol=1e-4)
    plain, _ = _run(model, make_policy("snap", 16), ids)  # the same held set without recall
    assert not torch.allclose(plain[:, -1], full[:, -1], atol=1e-3)


def test_prompt_chunks_recall_what_earlier_chunks_evicted(single_thread, monkeypatch):
    """A prompt longer than the held slots, read in chunks with a left-padded row: each chunk's queries recall
    the evicted tokens too (once for the chunk), so when everything evicted can come back, the chunks' keys and
    values, and so the last position's and every later step's logits, are the full cache's. Without recall in
    the chunks (steps only) the keys read after the first eviction differ and so do the logits."""
    model = tiny_model("llama", seed=4)
    ids = torch.randint(4, 200, (2, 40), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    policy = make_policy("recall", 64, recalled=48, window=4)  # 16 held: chunks of 8 evict from the third on
    full, _ = _run(model, make_policy("full"), ids, mask, chunk=8, steps=10)
    recall, cache = _run(model, policy, ids, mask, chunk=8, steps=10)
    assert cache.store.tokens() == 40 + 10 - 16
    torch.testing.assert_close(recall, full, atol=2e-4, rtol=1e-4)
    real = Store.recall

    def steps_only(self, i, query, real_queries=None):
        return None if real_queries is not None else real(self, i, query)

    monkeypatch.setattr(Store, "recall", steps_only)
    stepping, _ = _run(model, policy, ids, mask, chunk=8, steps=10)
    assert not torch.allclose(stepping[:, 0], full[:, 0], atol=1e-3)


def test_the_store_holds_exactly_the_evicted_tokens_at_their_true_positions(single_thread):
    """Long prompts (compressed by snap, padded rows) and steps: per layer, row and head the held and the stored
    positions are disjoint and cover everything seen; layer 0's stored keys (which depend only on the token and
    its position) equal the full cache's at the same positions."""
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
                kept = store.pos[i, r, h, : store.count]
                stored = kept[kept >= 0].tolist()
                assert not set(held) & set(stored)
                assert sorted(held + stored) == list(range(real))
        fp = full.slots.pos[0, r, 0]
        slot_of = {int(p): k for k, p in enumerate(fp.tolist()) if p >= 0}
        for h in range(H):
            kept = store.pos[0, r, h, : store.count]
            for k in torch.nonzero(kept >= 0).flatten().tolist():
                want = full.slots.keys[0, r, h, slot_of[int(kept[k])]]
                torch.testing.assert_close(store.keys[0, r, h, k], want, atol=1e-5, rtol=1e-5)


def test_the_memory_held_is_the_budget_and_the_store_stays_off_the_accelerator(single_thread):
    model = tiny_model("llama", seed=3)
    ids = torch.randint(4, 200, (1, 64), generator=torch.Generator().manual_seed(3))
    policy = make_policy("recall", 32)
    assert policy.recalled == 8 and policy.capacity == 24 and sum(policy.split().values()) == 32
    _, cache = _run(model, policy, ids, steps=40)
    assert cache.slots.capacity == 24 and cache.stats().kept == 24  # held slots; 8 more per step, one layer at a time
    assert cache.store.keys.device.type == "cpu" and cache.store.tokens() == 64 + 40 - 24
    assert "8 recalled per step" in policy.describe()
    assert with_budget(policy, 64).recalled == 16  # the default share follows the budget
    # the panel says what the store holds off the accelerator, beside the budget's KV bytes
    stats = cache.stats()
    assert stats.store_bytes == cache.store.nbytes() >= cache.store.keys.numel() * 2 * 4  # keys and values
    assert f"evicted tokens kept for recall {ui.human_bytes(stats.store_bytes)} (host memory)" in ui.describe_kv(stats)
    _, plain = _run(model, make_policy("snap", 32), ids, steps=4)
    assert plain.stats().store_bytes == 0 and "recall" not in ui.describe_kv(plain.stats())


@pytest.mark.cuda
def test_cuda_memory_held_stays_flat_while_the_store_grows():
    model = tiny_model("llama", seed=4).cuda()
    cache = H2OCache.for_model(model, make_policy("recall", 64))
    engine = Engine(model, cache, "auto")
    tokens = engine.first_tokens(engine.prefill(torch.randint(4, 200, (1, 256), device="cuda")))
    for _ in range(50):
        tokens = engine.decode(tokens)[1]
    torch.cuda.synchronize()
    at_50 = torch.cuda.memory_allocated()
    for _ in range(400):
        tokens = engine.decode(tokens)[1]
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() <= at_50 and cache.store.keys.device.type == "cpu"
    assert engine.mode == "eager" and cache.store.tokens() > 400


def test_snapshot_and_restore_forget_what_was_stored_after_the_snapshot(single_thread):
    model = tiny_model("llama", seed=5)
    cache = H2OCache.for_model(model, make_policy("recall", 24, recalled=8))
    engine = Engine(model, cache, "eager")
    tokens = engine.first_tokens(engine.prefill(torch.randint(4, 200, (1, 40))))
    saved, count, stored = cache.snapshot(), cache.store.count, cache.store.tokens()
    for _ in range(10):
        tokens = engine.decode(tokens)[1]
    assert cache.store.tokens() == stored + 10
    cache.restore(saved)
    assert cache.store.count == count and cache.store.tokens() == stored
    cache.clear()
    assert cache.store.tokens() == 0


def test_recall_refuses_what_it_cannot_do_in_one_clear_line():
    with pytest.raises(ConfigError, match="at least"):
        make_policy("recall", 20, recalled=20)
    with pytest.raises(TypeError):  # Quest's blocks are gone: every evicted key is ranked by its own logit
        make_policy("recall", 64, block=4)
    template = torch.zeros(1, 2, 1, 8)
    with pytest.raises(ConfigError, match="block"):
        Store(2, template, template, [8], 4)


def test_the_chat_says_which_messages_a_reply_recalled(single_thread):
    loaded, rng = tiny_loaded(seed=2), random.Random(2)
    settings = ChatSettings(max_new_tokens=6, sampler=Sampler(temperature=0), chunk_size=8)
    conv = Conversation(loaded, make_policy("recall", 24, recalled=8, window=4), settings)
    said = []  # the note each turn leaves (None: nothing new to say)
    for text in (words(rng, 12), words(rng, 12), words(rng, 6)):
        talk(conv, [text])
        said.append(conv.recall_note)
    assert conv.recalled and sum(conv.recalled.values()) <= 1 + 1e-6
    reports = {r.index: r for r in conv.evictions()}
    assert all(reports[i].recalled == conv.recalled[i] for i in conv.recalled)
    top, share = max(conv.recalled.items(), key=lambda kv: kv[1])
    if share >= 0.05 and said[-1] is not None:  # a note names the top message (said only when it is news)
        assert f"{100 * share:.0f}% from message {top}" in said[-1]
    assert any(note and "from message" in note for note in said)  # and some turn said which
    console = Console(file=io.StringIO(), width=140, no_color=True)
    console.print(ui.eviction_table(list(reports.values())))
    assert "recalled" in console.file.getvalue().splitlines()[0]


def test_a_store_the_host_cannot_hold_stops_growing_and_says_so_once(single_thread, monkeypatch):
    """The store lives in host memory and grows with the chat: when growing would leave the host less than
    `HOST_RESERVE`, later evictions are not kept (generation goes on, as snap with the same slots) and the cache
    says so once."""
    from h2o_chat.engine import store as st

    model = tiny_model("llama", seed=7)
    ids = torch.randint(4, 200, (1, 40), generator=torch.Generator().manual_seed(7))
    policy = make_policy("recall", 16)
    _, cache = _run(model, policy, ids, steps=10)
    assert not cache.store.full and cache.store.tokens() == 40 + 10 - cache.slots.capacity
    assert not any("stopped growing" in n for n in cache.pop_notices())
    room = cache.store.nbytes()  # what the first allocation took: enough for it, not for the doubling after it
    monkeypatch.setattr(st, "host_available", lambda: st.HOST_RESERVE + room)
    _, cache = _run(model, policy, ids, steps=10)
    assert cache.store.tokens() == 40 + 10 - cache.slots.capacity and not cache.store.full  # the first buffer
    forced = torch.randint(4, 200, (1, 1100), generator=torch.Generator().manual_seed(8))
    engine = Engine(model, cache, "eager")
    notes = []
    for t in range(forced.shape[1]):
        engine.decode(forced[:, t])
        notes += cache.pop_notices()
    assert cache.store.full and cache.store.count == cache.store.capacity  # it filled, then stopped
    assert [n for n in notes if "stopped growing" in n] == [notes[0]] and "cannot be recalled" in notes[0]
    assert cache.stats().kept == cache.slots.capacity  # the held slots go on as before


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_large_store_is_ranked_in_two_passes_that_recall_what_exact_ranking_does(single_thread, dtype):
    """Once the store holds many times what a step recalls, a step ranks it by the keys' coordinates in their
    principal directions, then exactly among the best `candidates` times what it recalls. Keys lying in as many
    directions as the basis keeps are ranked by the first pass without error, so the step recalls exactly the
    exact ranking's tokens (for every row and head: a wrong offset or index mapping would not); entries appended
    later are projected on the basis, which is fitted again when the store has doubled. Coordinates are kept in
    bf16 (whatever the store's dtype: their rounding moves scores far less than the margin four times as many
    candidates leave); a half-precision store (the model's dtype on CUDA) ranks its candidates in fp32."""
    gen = torch.Generator().manual_seed(0)
    L, B, H, D, G, R = 2, 2, 2, 32, 2, 8
    store = Store(L, torch.zeros(B, H, 1, D, dtype=dtype), torch.zeros(B, H, 1, D, dtype=dtype), [R] * B, 1)
    assert (store.rank_dim, store.ranking.candidates) == (RANK_DIM, CANDIDATES) and RANK_DIM < D
    span = torch.randn(L, B, H, RANK_DIM, D, generator=gen)  # every (layer, row, head) its own subspace

    def add(n, start):
        keys = torch.randn(L, B, H, n, RANK_DIM, generator=gen) @ span
        values = torch.randn(L, B, H, n, D, generator=gen)
        store.append(keys, values, torch.arange(start, start + n).expand(L, B, H, n))

    add(50, 0)
    assert store.ranking.basis is None  # small: one exact pass
    add(150, 50)  # past TWO_PASS_FROM x the candidates: the basis is fitted
    assert store.ranking.basis is not None and store.ranking.fitted.tolist() == [200] * B
    add(50, 200)  # projected on the basis as it comes
    assert store.low.dtype == torch.bfloat16 and store.ranking.basis.dtype == torch.float32
    projected = store.keys[:, :, :, 200:250].float() @ store.ranking.basis
    torch.testing.assert_close(store.low[..., 200:250].mT.float(), projected, rtol=2**-8, atol=1e-5)  # bf16's rounding
    assert store.ranking.fitted.tolist() == [200] * B
    for i in range(L):
        q = torch.randn(B, H * G, 1, D, generator=gen)
        two = store.recall(i, q)
        store.ranking.two = None  # every key ranked exactly
        exact = store.recall(i, q)
        store.ranking.set_two()
        logits = q.to(dtype).float().view(B, H, G, D) @ store.keys[i, :, :, :250].float().mT
        best = logits.amax(2).topk(R, dim=-1).indices.sort(-1).values
        for got in (two, exact) if dtype == torch.float32 else (two,):  # half products round ties
            assert got.valid is None and got.keys is None  # no holes: every recalled entry is a token
            values = store.values[i, :, :, None, :250]
            entry = (got.values[..., None, :] == values).all(-1).int().argmax(-1)  # (B, H, R): values are unique
            assert torch.equal(entry.sort(-1).values, best)
            # the logits the step attends with are the recalled keys' own under each query head
            want = logits.gather(3, entry[:, :, None, :].expand(B, H, G, R))
            torch.testing.assert_close(got.logits, want, atol=1e-4, rtol=1e-4)
    add(250, 250)  # doubled: fitted again on every stored key
    assert store.ranking.fitted.tolist() == [500] * B


def test_empty_columns_are_not_stored_so_a_single_row_is_ranked_without_masks(single_thread):
    """A prompt chunk's losers include the empty slots it lost (sorted first); columns empty in every layer and
    head are dropped, so a single row's store holds only tokens and its steps rank without masks (validity
    None). A left-padded batch row keeps empty entries, which are masked and never recalled."""
    model = tiny_model("llama", seed=1)
    ids = torch.randint(4, 200, (2, 50), generator=torch.Generator().manual_seed(1))
    policy = make_policy("recall", 24, recalled=8)
    _, cache = _run(model, policy, ids[:1], chunk=8, steps=10)
    store = cache.store
    assert store.count == store.tokens() == 50 + 10 - cache.slots.capacity and not store.holes
    got = store.recall(0, torch.randn(1, model.config.num_attention_heads, 1, store.D))
    assert got.valid is None and got.logits.shape[-1] == 8
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    _, cache = _run(model, policy, ids, mask, chunk=8, steps=10)
    store = cache.store
    assert store.holes and store.count == store.tokens() and bool((store.pos[:, 1, :, : store.count] < 0).any())
    got = store.recall(0, torch.randn(2, model.config.num_attention_heads, 1, store.D))
    pos = store.pos[0].gather(2, (got.values[..., None, :] == store.values[0][:, :, None]).all(-1).int().argmax(-1))
    assert got.valid is not None and bool((pos[got.valid] >= 0).all())


def test_a_row_recalls_as_it_would_alone_beside_rows_of_other_budgets(single_thread):
    """Evaluations compare budgets as rows of one batch, which share one store: each row must rank in two passes
    from its own size on, with its own number of candidates and its own basis, so that its figures do not move
    with its neighbour's budget (they did: a 10% row's perplexity was 27.10 beside a 20% row, 26.72 alone).
    Heads of 32 channels, so that a large store is ranked in two passes; both rows pass their thresholds at
    different times."""
    model = _wide_heads_model(seed=3)
    ids = torch.randint(4, 200, (1, 40), generator=torch.Generator().manual_seed(3))
    small, large = make_policy("recall", 24, recalled=6), make_policy("recall", 64, recalled=16)
    for first, other in ((small, large), (large, small)):  # each policy the first row (the same forced tokens)
        alone, _ = _run(model, first, ids, steps=300)
        both, cache = _run(model, [first, other], ids.expand(2, -1), steps=300)
        assert cache.store.ranking.two is True  # both rows past their own thresholds by the end
        assert cache.store.ranking.fitted[0] != cache.store.ranking.fitted[1]  # each fitted on its own schedule
        torch.testing.assert_close(both[:1], alone, atol=1e-4, rtol=1e-4)


def test_a_refilled_batch_row_recalls_only_its_own_prompt_and_the_store_stays_bounded(single_thread):
    """Continuous batching with recall: ten prompts pass through two rows, each row refilled when its prompt's
    steps are done. Every step's logits of a refilled row equal its prompt's alone (what the prompt evicted went
    to its row of the store, nothing of the row's earlier prompts is recalled); after all of them, each row's
    store holds exactly what its current prompt evicted, at its true positions, and the entries that finished
    prompts left were reclaimed (the count stays within twice the busiest row's, where the run appended many
    times that). Heads of 32 channels, so that the larger stores are ranked in two passes."""
    model = _wide_heads_model(seed=5)
    policy = make_policy("recall", 24, recalled=6)
    gen = torch.Generator().manual_seed(5)
    # the first row's prompt outlasts the second's and its successor's start, so that when it ends the second
    # row holds a gap (its prompt's entries first, then its steps' after the count): the move is of a fitted row
    prompts = [torch.randint(4, 200, (1, n), generator=gen) for n in (40, 20, 60, 20, 30, 25, 90, 45, 30, 20)]
    steps = [200, 150, 100, 30, 40, 20, 60, 45, 80, 35]
    forced = [torch.randint(4, 200, (s,), generator=gen) for s in steps]
    alone = [_run_forced(model, policy, p, f) for p, f in zip(prompts, forced, strict=True)]

    cache = H2OCache.for_model(model, policy)
    engine = Engine(model, cache, "eager")
    engine.prefill(*left_pad([p[0].tolist() for p in prompts[:2]], 0), 8)
    item, t, waiting, appended = [0, 1], [0, 0], list(range(2, len(prompts))), 0
    last, fed = list(item), [0, 0]  # each row's latest prompt, and the steps fed since (idle rows step too)
    got: dict[int, list[torch.Tensor]] = {0: [], 1: []}
    while any(i is not None for i in item):
        before = cache.store.count
        feed = torch.stack([forced[i][t[r]] if i is not None else torch.tensor(4) for r, i in enumerate(item)])
        logits = engine.decode(feed)[0]
        appended += max(0, cache.store.count - before)
        fed = [f + 1 for f in fed]
        for r, i in enumerate(item):
            if i is None:
                continue
            got[i].append(logits[r].clone())
            t[r] += 1
            if t[r] == steps[i]:  # done: the next prompt takes the row
                item[r], t[r] = (waiting.pop(0), 0) if waiting else (None, 0)
                if item[r] is not None:
                    got[item[r]], last[r], fed[r] = [], item[r], 0
                    engine.refill(r, prompts[item[r]], 8)
    for i in range(len(prompts)):
        torch.testing.assert_close(torch.stack(got[i]), alone[i][1:], atol=1e-4, rtol=1e-4, msg=f"prompt {i}")
    store, s = cache.store, cache.slots
    assert store.shape[1] == 2 and store.ranking.two is not None  # a row past its two-pass threshold
    for r, i in enumerate(last):
        seen = prompts[i].shape[1] + fed[r]
        for layer in range(s.pos.shape[0]):
            for h in range(s.pos.shape[2]):
                held = s.pos[layer, r, h][s.pos[layer, r, h] >= 0].tolist()
                kept = store.pos[layer, r, h, : store.count]
                assert sorted(held + kept[kept >= 0].tolist()) == list(range(seen))
        if store.ranking.fitted[r] > 0:  # its coordinates moved with its keys
            n, used = store.count, ~store.empty[:, r, :, : store.count, None]
            want = (store.ranking.basis[:, r].mT @ store.keys[:, r, :, :n].float().mT).mT * used
            torch.testing.assert_close(store.low[:, r, :, :, :n].float().mT * used, want, atol=0.05, rtol=0.02)
    assert int(store.ranking.fitted.max()) > 0
    busiest = int(store.row_tokens.max())
    assert store.count <= 2 * busiest < appended


def _run_forced(model, policy, ids, forced):
    """A prompt alone, then `forced` tokens: the prefill's logits and every step's."""
    cache = H2OCache.for_model(model, policy)
    engine = Engine(model, cache, "eager")
    out = [engine.prefill(ids, None, 8)[0].clone()]
    for token in forced:
        out.append(engine.decode(token[None])[0][0].clone())
    return torch.stack(out)


def _wide_heads_model(seed: int):
    """A tiny llama with heads of 32 channels, so that a large store is ranked in two passes."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from h2o_chat.engine.attention import prepare_model

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=256, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, initializer_range=0.2,
    )  # fmt: skip
    return prepare_model(AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval())


def test_a_dropped_store_frees_its_host_memory_at_once():
    """The ranking reads its store through a weak proxy: no reference cycle keeps the host buffers (gigabytes on
    a long chat) alive until a garbage collection after the cache drops the store (a reset, a new conversation)."""
    import gc
    import weakref

    template = torch.zeros(1, 2, 1, 32)
    store = Store(2, template, template, [8], 1)
    store.append(torch.randn(2, 1, 2, 300, 32), torch.randn(2, 1, 2, 300, 32), torch.arange(300).expand(2, 1, 2, 300))
    assert store.recall(0, torch.randn(1, 4, 1, 32)).values.shape == (1, 2, 8, 32)
    gone = weakref.ref(store)
    gc.disable()
    try:
        del store
        assert gone() is None
    finally:
        gc.enable()
