"""The snap policy: a prompt over budget keeps the tokens its final queries attend to, in bounded memory."""

from __future__ import annotations

import pytest
import torch
from transformers import AttentionInterface, DynamicCache

from conftest import cached, tiny_model
from h2o_chat.engine import layer as layer_module
from h2o_chat.engine.cache import H2OCache
from h2o_chat.engine.policies import make_policy, pool_logits
from h2o_chat.engine.policies import snap as snap_module
from h2o_chat.engine.step.decode import Engine
from h2o_chat.errors import ConfigError


def prefill(model, cache, ids, chunk_size=512, progress=None):
    return Engine(model, cache, "eager").prefill(ids, chunk_size=chunk_size, progress=progress)


class CaptureQueries:
    """Full attention (SDPA-equivalent eager) that records each layer's scaled queries and keys."""

    def __init__(self):
        self.q, self.k = {}, {}

    def __call__(self, module, q, k, v, attention_mask, scaling=None, **kwargs):
        self.q[module.layer_idx], self.k[module.layer_idx] = q * scaling, k
        G = q.shape[1] // k.shape[1]
        T, S = q.shape[2], k.shape[2]
        logits = (q * scaling) @ k.repeat_interleave(G, 1).transpose(-1, -2)
        logits = logits.masked_fill(~torch.ones(T, S, dtype=torch.bool).tril(S - T), -torch.inf)
        return (logits.softmax(-1) @ v.repeat_interleave(G, 1)).transpose(1, 2), None


def observation_mass(q, k, window: int, kernel: int) -> torch.Tensor:
    """Per KV head and prompt token: softmax mass from the last `window` queries (causal, over the whole
    prompt), logits max-pooled over `kernel` neighbours, summed over those queries and the group: (H, L)."""
    _, Hq, L, D = q.shape
    H = k.shape[1]
    G = Hq // H
    qg = q[:, :, -window:].reshape(1, H, G * window, D)
    logits = (qg @ k.transpose(-1, -2)).float()  # (1, H, G*W, L)
    rows = torch.arange(L - window, L).repeat(G)  # causal: observation query at position p sees keys <= p
    logits = logits.masked_fill(torch.arange(L)[None, :] > rows[:, None], -torch.inf)
    return (pool_logits(logits, kernel) - logits.logsumexp(-1, keepdim=True)).exp().sum(-2)[0]


@pytest.mark.parametrize("family", ["llama", "gpt_neox"])
@pytest.mark.parametrize("kernel", [1, 5])
def test_kept_tokens_are_those_the_final_queries_attend_to_most(family, kernel):
    budget, window, length = 24, 6, 80
    model = tiny_model(family, seed=21)
    ids = torch.randint(0, 256, (1, length))
    capture = CaptureQueries()
    AttentionInterface.register("capture_queries", capture)
    model.set_attn_implementation("capture_queries")
    with torch.inference_mode():
        model(input_ids=ids, **cached(model, DynamicCache(config=model.config)))
    model.set_attn_implementation("h2o")

    cache = H2OCache.for_model(model, make_policy("snap", budget, window=window, kernel=kernel))
    prefill(model, cache, ids, chunk_size=length)  # one chunk: the probe sees the full-context queries
    for layer in range(2):
        mass = observation_mass(capture.q[layer], capture.k[layer], window, kernel)
        for head, pos in enumerate(cache.layers[layer].pos[0]):
            kept = set(pos[pos >= 0].tolist())
            assert len(kept) == budget and set(range(length - window, length)) <= kept  # the window stays
            chosen = torch.tensor(sorted(kept - set(range(length - window, length))))
            dropped = torch.tensor(sorted(set(range(length)) - kept))
            # the kept tokens are those the final queries attend to most (pooling makes ties: allow them)
            assert mass[head, chosen].min() >= mass[head, dropped].max() - 1e-5


def test_prompt_ten_times_the_budget_stays_bounded(monkeypatch):
    budget, chunk, length = 64, 64, 640
    shapes, scored, masses = [], [], []
    real_attention, real_score = layer_module.attention_with_mass, snap_module.Observation.score_chunk

    def spy_attention(query, keys, values, mask, scaling, mass=True, fused=False):
        shapes.append(keys.shape[2])
        masses.append(mass)
        return real_attention(query, keys, values, mask, scaling, mass, fused)

    def spy_score(self, i, key, fwd):
        scored.append(key.shape[2])
        real_score(self, i, key, fwd)
        assert self.cache.slots.extra[0].shape[3] == budget + 1  # observation logits beside the slots only

    monkeypatch.setattr(layer_module, "attention_with_mass", spy_attention)
    monkeypatch.setattr(snap_module.Observation, "score_chunk", spy_score)
    model = tiny_model("llama", seed=22)
    cache = H2OCache.for_model(model, make_policy("snap", budget, window=8))
    engine = Engine(model, cache, "eager")
    engine.prefill(torch.randint(0, 256, (1, length)), chunk_size=chunk)
    per_pass = 2 * length // chunk  # two layers, every chunk
    assert len(shapes) == 2 * per_pass  # the probe reads the whole prompt, then the prompt is read again
    assert max(shapes) <= budget + chunk and max(scored) <= chunk  # the budget and one chunk
    # the second read tracks no attention mass: the observation's mass replaces it when the prompt ends
    assert all(masses[:per_pass]) and not any(masses[per_pass:])
    assert cache.slots.capacity == budget and cache.observation is None and not cache.slots.extra
    stats = cache.stats()
    assert stats.seen == length and stats.kept == budget  # the probe's tokens were not counted twice
    engine.decode(torch.tensor([1]))  # generation goes on with h2o eviction
    assert cache.stats().kept == budget


def test_a_prompt_that_fits_is_plain_h2o():
    model = tiny_model("llama", seed=23)
    ids = torch.randint(0, 256, (1, 40))
    caches = [H2OCache.for_model(model, make_policy(name, 64)) for name in ("h2o", "snap")]
    logits = [prefill(model, c, ids) for c in caches]
    torch.testing.assert_close(logits[0], logits[1])
    torch.testing.assert_close(caches[0].layers[1].score, caches[1].layers[1].score)


def test_scores_hand_over_to_h2o_and_renumbered_positions_work():
    model = tiny_model("llama", seed=24, max_positions=64)
    cache = H2OCache.for_model(model, make_policy("snap", 32, window=4), "auto")
    engine = Engine(model, cache, "eager")
    engine.prefill(torch.randint(0, 256, (1, 100)), chunk_size=16)  # past the context: renumbered
    assert cache.rolling
    layer = cache.layers[0]
    total = layer.score[0].sum(-1)  # observation mass: 4 queries x 2 query heads, pooled over up to 7 tokens
    assert torch.all(total <= 7 * 8 + 1e-3) and torch.all(total > 1)
    for t in range(5):
        engine.decode(torch.tensor([t]))
    assert cache.stats().kept == 32


def test_snap_settings_are_validated():
    with pytest.raises(ConfigError, match="window"):
        make_policy("snap", 16, window=16)
    with pytest.raises(ConfigError, match="odd"):
        make_policy("snap", 64, kernel=4)
    assert "last 16 queries" in make_policy("snap", 512).describe()


@pytest.mark.parametrize(
    "positions, policies",
    [
        ("absolute", [("h2o", 24), ("snap", 24)]),
        ("auto", [("h2o", 24), ("snap", 24)]),
        ("absolute", [("snap", 24), ("snap", 48)]),
        ("absolute", [("h2o", 48), ("snap", 24)]),
    ],
)
def test_snap_rows_beside_other_policies_compress_like_a_snap_cache(positions, policies):
    """Rows of one cache follow their own policies: a snap row next to an h2o row keeps what it keeps alone
    (also after positions were renumbered, when scoring rotates keys back to their true positions), and so does
    a snap row beside a row of a larger budget (evaluations compare budgets as rows of one batch: such a row
    used to fill the storage beyond its own budget, and its probe read the larger budget's tail)."""
    model = tiny_model("llama", seed=25, max_positions=64)
    ids = torch.randint(0, 256, (1, 90))
    policies = [make_policy(name, budget, window=6 if name == "snap" else None) for name, budget in policies]
    together_cache = H2OCache.for_model(model, policies, positions, rows=[1, 1])
    together = prefill(model, together_cache, ids.expand(2, -1), chunk_size=30)
    for row, policy in enumerate(policies):
        alone = H2OCache.for_model(model, policy, positions)
        expected = prefill(model, alone, ids, chunk_size=30)
        torch.testing.assert_close(together[row], expected[0], atol=1e-5, rtol=1e-5)
        for layer in range(2):
            both, one = together_cache.layers[layer].pos[row], alone.layers[layer].pos[0]
            assert [set(p[p >= 0].tolist()) for p in both] == [set(p[p >= 0].tolist()) for p in one]
    assert together_cache.seq.renumbered == (positions == "auto")


def test_prefill_reports_progress_after_each_chunk_and_snap_reads_twice():
    model = tiny_model("llama", seed=4)
    ids = torch.randint(4, 256, (1, 50))
    calls = []
    prefill(model, H2OCache.for_model(model, make_policy("h2o", 16)), ids, chunk_size=16, progress=calls_to(calls))
    # prompt tokens read, after each chunk; chunks end where the prompt ends, so the short one comes first
    assert calls == [(2, 50), (18, 50), (34, 50), (50, 50)]
    calls.clear()
    prefill(model, H2OCache.for_model(model, make_policy("snap", 16)), ids, chunk_size=16, progress=calls_to(calls))
    # snap: the probe reads the prompt, then it is read again: one bar for both
    assert calls == [(2, 100), (18, 100), (34, 100), (50, 100), (52, 100), (68, 100), (84, 100), (100, 100)]
    calls.clear()
    prefill(model, H2OCache.for_model(model, make_policy("snap", 64)), ids, chunk_size=16, progress=calls_to(calls))
    assert calls[-1] == (50, 50)  # a prompt that fits the budget is read once


def calls_to(calls: list):
    return lambda done, total: calls.append((done, total))


def test_the_probe_queries_see_the_whole_prompt(monkeypatch):
    """Issue 41.7: the probe's final queries must come from a read of the whole prompt, as SnapKV's come from the
    full prompt. A probe that read only the prompt's last chunk (the rest skipped) gave the same queries whatever
    the prompt's beginning said, and lost a needle the question's queries find once they have read the text."""
    budget, chunk, length = 32, 32, 320
    captured = []
    real_init = snap_module.Observation.__init__

    def spy(self, probe, *args, **kwargs):
        captured.append([q.clone() for q in probe.q])
        real_init(self, probe, *args, **kwargs)

    monkeypatch.setattr(snap_module.Observation, "__init__", spy)
    model = tiny_model("llama", seed=24)
    ids = torch.randint(4, 256, (1, length), generator=torch.Generator().manual_seed(24))
    other = ids.clone()
    other[:, :chunk] = torch.randint(4, 256, (1, chunk), generator=torch.Generator().manual_seed(25))
    for prompt in (ids, other):
        prefill(model, H2OCache.for_model(model, make_policy("snap", budget, window=4)), prompt, chunk_size=chunk)
    (first, second) = captured
    assert torch.equal(first[0], second[0])  # layer 0's queries are the last tokens' own embeddings
    assert not torch.allclose(first[-1], second[-1], atol=1e-4)  # above it they have read the first chunk
