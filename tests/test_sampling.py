"""Sampling on the device: temperature, top-k, top-p, min-p and the repetition penalty, reproducible from a seed."""

from __future__ import annotations

import pytest
import torch

from h2o_chat.engine.step.sampling import PENALTY_WINDOW, Sampler
from h2o_chat.errors import ConfigError, SettingError

P = torch.tensor([0.5, 0.3, 0.2])


def draws(sampler: Sampler, logits: torch.Tensor, n: int) -> torch.Tensor:
    rows = sampler.for_batch(logits.shape[0], logits.device, logits.shape[-1])
    return torch.stack([rows(logits) for _ in range(n)])  # (n, B)


def test_samples_follow_the_distribution():
    got = draws(Sampler(temperature=1.0, seed=3), P.log()[None], 4000)[:, 0]
    freq = torch.bincount(got, minlength=3).float() / len(got)
    torch.testing.assert_close(freq, P, atol=0.03, rtol=0)


def test_the_same_seed_gives_the_same_tokens_and_another_seed_others():
    logits = torch.randn(2, 50)
    a = draws(Sampler(temperature=1.0, seed=11), logits, 64)
    assert torch.equal(a, draws(Sampler(temperature=1.0, seed=11), logits, 64))
    assert not torch.equal(a, draws(Sampler(temperature=1.0, seed=12), logits, 64))
    assert not torch.equal(a[:, 0], a[:, 1])  # the same seed in both rows: each draws from its own logits


def test_top_p_keeps_the_smallest_nucleus():
    logits = P.log()[None]
    assert set(draws(Sampler(temperature=1.0, top_p=0.6, seed=1), logits, 400)[:, 0].tolist()) == {0, 1}
    assert set(draws(Sampler(temperature=1.0, top_p=0.45, seed=1), logits, 100)[:, 0].tolist()) == {0}


def test_the_penalty_reaches_back_256_tokens():
    """Issue 48.13: with llama.cpp's and ollama's 64 tokens a 2,000-token story looped (a paragraph 16 times). At the
    chat's sampling, 12 long stories each (docs/experiments.md): 64 tokens looped once (a paragraph 7 times) and
    repeated 9.6% of their first 500 tokens' 4-grams; 256 looped never and repeated 1.4%. A token 200 draws ago
    is still held back; one 256 draws ago is free again."""
    assert PENALTY_WINDOW == 256
    rows = Sampler(repetition_penalty=2.0).for_batch(1, torch.device("cpu"), 4)
    rows.observe(torch.tensor([[0]]))
    for _ in range(200):
        rows(torch.tensor([[0.0, 0.0, 9.0, 0.0]]))  # token 2, over and over
    assert rows(torch.tensor([[1.5, 1.0, 0.0, 0.0]])).item() == 1  # token 0, read 200 tokens back, still penalized
    for _ in range(PENALTY_WINDOW):
        rows(torch.tensor([[0.0, 0.0, 9.0, 0.0]]))
    assert rows(torch.tensor([[1.5, 1.0, 0.0, 0.0]])).item() == 0


def test_greedy_and_sampling_rows_side_by_side():
    logits = torch.tensor([[0.0, 0.1, 0.0], [0.0, 0.1, 0.0]])
    rows = Sampler(temperature=1.0, seed=5).for_batch(2, torch.device("cpu"), 3, temperature=[0.0, 1.0])
    got = torch.stack([rows(logits) for _ in range(200)])
    assert (got[:, 0] == 1).all() and len(set(got[:, 1].tolist())) == 3


def test_repetition_penalty_steers_away_from_recent_tokens():
    rows = Sampler(repetition_penalty=2.0).for_batch(1, torch.device("cpu"), 4)
    rows.observe(torch.tensor([[0, 3]]))  # the prompt's tokens count as recent
    logits = torch.tensor([[2.0, 1.5, -1.0, 1.8]])
    assert rows(logits).item() == 1  # 2.0 / 2 and 1.8 / 2 fall below 1.5
    assert rows(torch.tensor([[1.0, 1.9, 1.0, 1.0]])).item() == 2  # the sampled 1 is recent now: 0.95 < 1.0
    fresh = Sampler(repetition_penalty=2.0).for_batch(1, torch.device("cpu"), 4)
    fresh.observe(torch.tensor([[0, 3]]))
    assert fresh(torch.tensor([[-1.0, -1.2, -3.0, -9.0]])).item() == 1  # negative logits are multiplied: -2 < -1.2
    for _ in range(PENALTY_WINDOW):  # the window moves on: old tokens are free again
        rows(torch.tensor([[0.0, 0.0, 9.0, 0.0]]))
    assert rows(logits).item() == 0
    plain = Sampler().for_batch(1, torch.device("cpu"), 4)
    plain.observe(torch.tensor([[0, 3]]))
    assert plain(logits).item() == 0  # penalty 1: nothing changes


def test_top_k_keeps_the_k_most_likely_tokens():
    logits = torch.tensor([[3.0, 2.9, 2.8, 2.7, 0.0]])
    assert set(draws(Sampler(temperature=1.0, top_k=2, seed=1), logits, 300)[:, 0].tolist()) == {0, 1}
    assert draws(Sampler(temperature=5.0, top_k=1, seed=1), logits, 50).unique().tolist() == [0]
    assert set(draws(Sampler(temperature=1.0, seed=1), logits, 300)[:, 0].tolist()) == {0, 1, 2, 3, 4}


def test_min_p_drops_tokens_far_below_the_most_likely():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])  # relative to 0.5: 0.6, 0.3, 0.1
    got = set(draws(Sampler(temperature=1.0, min_p=0.2, seed=2), probs.log(), 400)[:, 0].tolist())
    assert got == {0, 1, 2}
    got = set(draws(Sampler(temperature=1.0, min_p=0.5, seed=2), probs.log(), 400)[:, 0].tolist())
    assert got == {0, 1}


def test_filters_are_per_row_and_combine_with_top_p():
    logits = torch.zeros(2, 8)  # uniform: every filter decides alone
    rows = Sampler(temperature=1.0, top_p=0.99, seed=4).for_batch(2, torch.device("cpu"), 8, top_k=[3, 0])
    got = torch.stack([rows(logits) for _ in range(300)])
    assert len(set(got[:, 0].tolist())) == 3  # ties: any three, always the same three
    assert len(set(got[:, 1].tolist())) == 8  # the other row keeps every token
    assert rows.filtered and rows.top_k.tolist() == [3, 8]


def test_a_top_k_above_the_nucleus_cap_ranks_that_many():
    from h2o_chat.engine.step.sampling import NUCLEUS_CAP

    rows = Sampler(temperature=1.0, top_k=NUCLEUS_CAP + 100, seed=1).for_batch(1, torch.device("cpu"), 2000)
    assert rows.cut == NUCLEUS_CAP + 100
    assert rows(torch.zeros(1, 2000)).shape == (1,)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(temperature=-1), r"temperature must be between 0 \(greedy\) and 10, got -1$"),
        (dict(temperature=float("nan")), r"temperature must be between 0 \(greedy\) and 10, got nan$"),
        (dict(temperature=float("inf")), r"temperature must be between 0 \(greedy\) and 10, got inf$"),
        (dict(temperature=1e9), r"temperature must be between 0 \(greedy\) and 10, got 1e\+09$"),
        (dict(top_p=0.0), "top_p must be above 0 and at most 1, got 0$"),
        (dict(top_p=1.5), "top_p must be above 0 and at most 1, got 1.5$"),
        (dict(top_p=float("nan")), "top_p must be above 0 and at most 1, got nan$"),
        (dict(repetition_penalty=0), r"repetition_penalty must be above 0 and at most 10 \(1 = off\), got 0$"),
        (dict(repetition_penalty=float("inf")), r"repetition_penalty .* got inf$"),
        (dict(top_k=-1), r"top_k must be a whole number >= 0 \(0 = off\), got -1$"),
        (dict(top_k=2.5), r"top_k must be a whole number >= 0 \(0 = off\), got 2.5$"),
        (dict(min_p=1.0), r"min_p must be at least 0 \(off\) and below 1, got 1$"),
        (dict(min_p=float("nan")), r"min_p must be at least 0 \(off\) and below 1, got nan$"),
    ],
)
def test_bad_settings_say_which_value_is_wrong(kwargs, message):
    """Issue 48.19: the library names a setting by its keyword, never by a front end's option (it said --top-p to a
    server's client); the error carries the keyword, the rule and the value for each front end to word."""
    with pytest.raises(SettingError, match="^" + message) as raised:
        Sampler(**kwargs)
    (name, value), e = next(iter(kwargs.items())), raised.value
    assert isinstance(e, ConfigError) and "--" not in str(e)  # existing handlers of ConfigError still catch it
    assert e.name == name and (e.value == value or value != value)  # NaN is not equal to itself
    flag = "--" + name.replace("_", "-")
    assert e.worded(flag) == str(e).replace(name, flag, 1) and e.worded(flag).startswith(f"{flag} {e.rule}, got ")


def test_a_refilled_rows_first_token_and_its_next_step_draw_different_noise():
    """Issue 41.2: a row that takes a new prompt draws its first token (first_of_row), then the next step's, with
    noise of its own for each draw: from a flat distribution over 64 tokens the two agree about 1 time in 64
    (with shared noise they agreed every time)."""
    V, trials = 64, 400
    flat = torch.zeros(2, V)
    same = 0
    for seed in range(trials):
        rows = Sampler(temperature=1.0, seed=seed).for_batch(2, torch.device("cpu"), V)
        rows.observe(torch.ones(2, 3, dtype=torch.long))
        rows(flat)  # a step of the whole batch, then row 1 takes a new prompt
        rows.start_row(1, torch.ones(1, 5, dtype=torch.long))
        first = rows.first_of_row(1, flat[1])
        same += int(first == rows(flat)[1])
    assert same < trials // 10, f"{same} of {trials} first tokens equal the next step's"


@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_a_rows_first_token_is_drawn_from_that_row_alone_as_the_batch_would_draw_it(top_p):
    """first_of_row draws row r alone (its settings, window, seed and draws: 1/B of the work): the token the
    whole batch's draw gives row r, for rows of every kind (greedy, hot, top-k, min-p, penalized), and every
    other row's state untouched."""
    V, B = 300, 4
    g = torch.Generator().manual_seed(7)
    for trial in range(12):
        rows = Sampler(top_p=top_p, seed=trial).for_batch(
            B,
            torch.device("cpu"),
            V,
            temperature=[0.0, 0.7, 1.3, 1.0],
            repetition_penalty=[1.0, 1.2, 1.0, 1.5],
            top_k=[0, 0, 17, 0],
            min_p=[0.0, 0.0, 0.0, 0.05],
        )
        rows.observe(torch.randint(0, V, (B, 40), generator=g))
        rows(torch.randn(B, V, generator=g) * 3)  # a step: the rows' draws and windows move on
        logits = torch.randn(V, generator=g) * 3
        for r in range(B):
            before = {name: t.clone() for name, t in rows.tensors().items()}
            expected = rows._draw(logits.reshape(1, -1).expand(B, -1))[r]
            assert rows.first_of_row(r, logits) == expected, (trial, r)
            after = rows.tensors()
            for name, t in before.items():
                if name in ("draws", "recent"):  # the row's own draw is counted and recorded
                    keep = [i for i in range(B) if i != r]
                    assert torch.equal(after[name][keep], t[keep]), name
                else:
                    assert torch.equal(after[name], t), name
            assert after["draws"][r] == before["draws"][r] + 1


def test_rows_with_their_own_top_p_and_seed_draw_as_each_would_alone():
    """A row's own top-p and seed (set when the sampler is built, or when the row starts: `set_row`,
    `start_row`) make its draws those of a one-row sampler with them, step after step; a top-p that would change
    which operations the step runs (1 in a sampler whose top-p cuts, or below 1 in one whose does not) is refused."""
    V, B, steps = 300, 3, 6
    g = torch.Generator().manual_seed(3)
    own = [(0.8, 11), (0.95, 12), (0.6, None)]  # the last takes the sampler's seed (5)
    rows = Sampler(temperature=1.0, top_p=0.9, seed=5).for_batch(
        B, torch.device("cpu"), V, top_p=[p for p, _ in own], seed=[s for _, s in own]
    )
    alone = [Sampler(temperature=1.0, top_p=p, seed=5 if s is None else s).for_batch(1, torch.device("cpu"), V)
             for p, s in own]  # fmt: skip
    for _ in range(steps):
        logits = torch.randn(B, V, generator=g) * 2
        together = rows(logits)
        assert together.tolist() == [one(logits[r : r + 1])[0].item() for r, one in enumerate(alone)]
    # row 1 starts again with top-p 0.7 and seed 40: as a new sampler of one row with them
    rows.set_row(1, 1.0, 1.0, top_p=0.7)
    rows.start_row(1, torch.ones(1, 4, dtype=torch.long), seed=40)
    fresh = Sampler(temperature=1.0, top_p=0.7, seed=40).for_batch(1, torch.device("cpu"), V)
    for _ in range(steps):
        logits = torch.randn(B, V, generator=g) * 2
        assert rows(logits)[1] == fresh(logits[1:2])[0]
    with pytest.raises(ValueError, match="top_p 1.0 in a sampler whose top-p cuts"):
        rows.set_row(0, 1.0, 1.0, top_p=1.0)
    whole = Sampler(temperature=1.0).for_batch(2, torch.device("cpu"), V)
    with pytest.raises(ValueError, match="top_p 0.5 in a sampler whose top-p does not cut"):
        whole.set_row(0, 1.0, 1.0, top_p=0.5)


def test_a_seeded_batch_gives_each_row_its_prompts_text_alone_refills_included():
    """Issue 41.2: sampling at temperature > 0 with a seed, each row's noise follows the row (its own seed and
    count of draws), not its slot: six prompts through two rows -- four read into rows others left, the idle
    row leaving at the end -- give every prompt the text it gives alone with that seed."""
    from conftest import tiny_model, tiny_tokenizer
    from h2o_chat.app.batch.run import Item, generate_batch
    from h2o_chat.engine.policies import make_policy
    from h2o_chat.models.loading import Loaded
    from h2o_chat.models.registry import ModelSpec

    model = tiny_model("llama", seed=23)
    loaded = Loaded(model, tiny_tokenizer(), ModelSpec("tiny", "tiny"), torch.device("cpu"), torch.float32, "none")
    g = torch.Generator().manual_seed(23)
    items = [
        Item(str(i), i, torch.randint(4, 256, (n,), generator=g).tolist(), steps, 1.0, None, penalty, top_k)
        for i, (n, steps, penalty, top_k) in enumerate(
            [(9, 6, 1.0, 0), (21, 14, 1.3, 0), (5, 9, 1.0, 20), (30, 5, 1.0, 0), (12, 11, 1.2, 0), (17, 8, 1.0, 0)]
        )
    ]
    policy = make_policy("h2o", 16)
    together = {r["id"]: r["text"] for r in generate_batch(loaded, items, policy, seed=5, rows=2)}
    assert len(together) == len(items)
    for item in items:
        alone = next(generate_batch(loaded, [item], policy, seed=5))
        assert alone["text"] == together[item.id], item.id


def test_the_penalty_window_sees_what_the_cache_read_before_the_prompt():
    """A conversation continued from its cache reads only its new turn: the repetition window held that turn
    alone, where the same conversation read whole (another request, a restart) holds its last 256 tokens, so the
    same request's reply depended on whether its cache was kept (the audit: another reply at turn 2, greedy).
    `history` (the tokens read before) fills the window as the whole conversation would."""
    history, prompt = list(range(100, 400)), torch.arange(500, 520)[None]
    whole, split = (Sampler(0.7, repetition_penalty=1.3).for_batch(1, torch.device("cpu"), 1024) for _ in range(2))
    whole.observe(torch.cat([torch.tensor(history)[None], prompt], 1))
    split.observe(prompt, history=history)
    assert torch.equal(whole.recent, split.recent) and int(split.recent[0, 0]) == 100 + 300 + 20 - PENALTY_WINDOW
    row = Sampler(0.7, repetition_penalty=1.3).for_batch(2, torch.device("cpu"), 1024)
    row.start_row(1, prompt, seed=5, history=history)
    assert torch.equal(row.recent[1], whole.recent[0])
    short = Sampler(0.7, repetition_penalty=1.3).for_batch(1, torch.device("cpu"), 1024)
    short.observe(prompt, history=[7, 8])
    assert short.recent[0, -22:].tolist() == [7, 8, *range(500, 520)] and int(short.recent[0, 0]) == -1
